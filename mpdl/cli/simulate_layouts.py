"""`mpdl simulate` for transformer layouts: memory per GPU and step time of dp × pp × cp × tp × ep
with ZeRO, recomputation and precision, `--search` for the fastest layout that fits, `--published`
for the papers' figures.

    mpdl simulate --model-shape megatron-8.3b --dp 64 --tp 8 --recompute full --network dgx2h --gpu v100-32gb
    mpdl simulate --model-shape llama3-405b --seq 131072 --tp 8 --cp 16 --pp 16 --dp 8 --sp \
        --recompute selective --gpu h100-80gb
    mpdl simulate --model-shape mixtral-8x7b --dp 8 --ep 8 --tp 2 --moe-capacity-factor 1.25
    mpdl simulate --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --gpus 64 --search
    mpdl simulate --published --json published.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import replace
from typing import Any

from mpdl.cli import UsageError, check_choice
from mpdl.cli.output import is_rank0, write_json_lines
from mpdl.parallel.pipeline.schedule import KINDS, V_KINDS
from mpdl.perf import compute as C
from mpdl.perf import goodput as G
from mpdl.perf import layouts as L
from mpdl.perf import published as P
from mpdl.perf import simulate as S
from mpdl.perf.units import parse_count

SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "vocab")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("a transformer's shape and layout (instead of --profile)")
    g.add_argument("--model-shape", metavar="NAME",
                   help=f"a published GPT shape: {', '.join(L.SHAPES)}")
    g.add_argument("--layers", type=int, help="transformer layers L")
    g.add_argument("--hidden", type=int, help="hidden size d")
    g.add_argument("--heads", type=int, help="attention heads a")
    g.add_argument("--seq", type=int, help="sequence length T")
    g.add_argument("--vocab", type=int, help="vocabulary size V")
    g.add_argument("--microbatch-size", type=int, help="sequences per micro-batch b (default 1)")
    g.add_argument("--ffn", type=int, help="the MLP's hidden width (default 4 x hidden)")
    g.add_argument("--kv-heads", type=int, help="key/value heads, grouped-query attention "
                   "(default: --heads)")
    g.add_argument("--gated", action="store_true", help="a gated (SwiGLU) MLP: three matrices")
    g.add_argument("--family", choices=L.FAMILIES,
                   help="gpt: biases, LayerNorm, learned positions, tied output (default); "
                        "llama: none of these")
    g.add_argument("--moe-experts", type=int, metavar="E",
                   help="mixture of experts: E expert MLPs in every --moe-every-th block")
    g.add_argument("--moe-top-k", type=int, metavar="K", help="experts per token (default 1)")
    g.add_argument("--moe-every", type=int, metavar="N", help="every N-th block is a MoE block "
                   "(default 1)")
    g.add_argument("--moe-capacity-factor", type=float, default=1.0, metavar="CF",
                   help="expert capacity over the even share; 0: dropless (default 1.0)")
    g.add_argument("--dp", type=int, help="data-parallel degree (default: GPUs / (pp·tp))")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    g.add_argument("--cp", type=int, default=1, help="context-parallel degree: the sequence "
                   "split over cp ranks (default 1)")
    g.add_argument("--cp-mode", default="ring", help=f"{', '.join(L.CP_MODES)} (default ring)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel degree, carved out of dp "
                   "(default 1)")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (with --tp)")
    g.add_argument("--tp-overlap", action="store_true",
                   help="tensor-parallel collectives pipelined with their GEMMs (Megatron-Core's "
                        "--tp-comm-overlap, PyTorch's async TP)")
    g.add_argument("--gather-overlap", action="store_true",
                   help="ZeRO's parameter all-gather prefetched behind the forward (Megatron-Core's "
                        "--overlap-param-gather, FSDP)")
    g.add_argument("--comm-sms", type=int, default=0, metavar="N",
                   help="SMs a GPU keeps for communication kernels, away from compute "
                        "(DeepSeek-V3: 20 of the H800's 132; default 0)")
    g.add_argument("--recompute-up", action="store_true",
                   help="recompute the norms and the attention's up-projections in backward, "
                        "keeping only their inputs (DeepSeek-V3)")
    g.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="interleaved pipeline: model chunks per GPU (default 1)")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0 (DDP), 1, 2 or 3 (default 0)")
    g.add_argument("--zero-group", type=int,
                   help="hybrid sharding: ZeRO shards over groups of this many dp ranks")
    g.add_argument("--microbatches", type=int,
                   help="micro-batches per step m (default 1, or from --global-batch)")
    g.add_argument("--schedule", default="1f1b",
                   help="pipeline schedule: afab, 1f1b (default), interleaved, zb-h1, zb-v or "
                        "dualpipev (zb-v, dualpipev: two chunks per GPU in a V); with --search a "
                        "comma-separated list, or all, to try each")
    g.add_argument("--recompute", nargs="?", const="full", default="none",
                   help=f"activation recomputation: {', '.join(L.RECOMPUTE)} (default none; "
                        f"--recompute alone: full)")
    g.add_argument("--precision", default="bf16",
                   help="bf16 or fp16 (16-bit compute, float32 master weights and Adam, K=12; "
                        "default bf16) or fp32 (float32 Adam), as mpdl train --precision; or "
                        "fp8: the weight GEMMs in FP8, the rest as bf16; mxfp8; deepseek-fp8: "
                        "DeepSeek-V3's recipe (FP8 dispatch, bf16 combine and Adam moments)")
    g.add_argument("--gpu", default="a100-80gb", help=f"{', '.join(L.GPUS)} (default a100-80gb)")
    g.add_argument("--gpu-memory", metavar="SIZE",
                   help="memory per GPU, e.g. 40GB (default: the GPU's); layouts above it are "
                        "marked as not fitting")
    g.add_argument("--gpus", type=int, help="GPUs for --search (default: --nodes × --per-node)")
    g.add_argument("--tokens", metavar="COUNT", help="tokens to train on, e.g. 300B: time and cost")
    g.add_argument("--failure-rate", type=float, default=G.LLAMA3_RATE, metavar="RATE",
                   help="interruptions per GPU-hour (default Llama 3's: 419 in 54 days on "
                        "16,384 GPUs, 1.97e-5); 0: none")
    g.add_argument("--restart-time", type=float, default=G.Failures.restart_s, metavar="S",
                   help="seconds to restart from the last checkpoint (default 600, assumed)")
    g.add_argument("--checkpoint-bandwidth", type=float, default=2000.0, metavar="GB/S",
                   help="the storage's write bandwidth for the whole job (default 2000: Llama 3)")
    g.add_argument("--search", action="store_true",
                   help="the fastest layouts of --gpus GPUs that fit, for --global-batch sequences "
                        "(every dp, pp, cp, tp, ep, ZeRO stage, recomputation, sp and "
                        "interleaving depth)")
    g.add_argument("--top", type=int, default=5, help="layouts --search prints (default 5)")
    g.add_argument("--published", action="store_true",
                   help="every published figure beside its prediction (with --json PATH: lines)")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.published or args.search or args.model_shape
                or any(getattr(args, k) is not None for k in SHAPE_FLAGS))


#: the flags of a shape's optional fields
OPTIONAL_SHAPE_FLAGS = {"microbatch_size": "microbatch", "ffn": "ffn", "kv_heads": "kv_heads",
                        "family": "family", "moe_experts": "experts", "moe_top_k": "top_k",
                        "moe_every": "moe_every"}
#: the flag of a Shape field, for errors
SHAPE_FIELD_FLAGS = {"microbatch": "--microbatch-size", "kv_heads": "--kv-heads",
                     "experts": "--moe-experts", "top_k": "--moe-top-k",
                     "moe_every": "--moe-every"}


def _shape(args: argparse.Namespace) -> L.Shape:
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    given.update({field: getattr(args, flag) for flag, field in OPTIONAL_SHAPE_FLAGS.items()
                  if getattr(args, flag) is not None})
    if args.gated:
        given["gated"] = True
    if args.model_shape:
        check_choice("--model-shape", args.model_shape, L.SHAPES)
        known = L.SHAPES[args.model_shape]
        fields = {f.name: getattr(known, f.name) for f in dataclasses.fields(known)
                  if f.name != "name"}
        name = args.model_shape
    else:
        missing = [f"--{k}" for k in SHAPE_FLAGS if k not in given]
        if missing:
            raise UsageError(f"a transformer shape needs {', '.join(missing)} (or --model-shape)")
        fields, name = {"microbatch": 1}, "gpt"
    fields.update(given)
    try:
        return L.Shape(**fields, name=name)
    except ValueError as exc:
        message = str(exc)
        key = message.split(":")[0].split(" ")[0]
        flag = SHAPE_FIELD_FLAGS.get(key, f"--{key}")
        raise UsageError(f"{flag}: {message.removeprefix(f'{key}: ')}") from None


def _setup(args: argparse.Namespace):
    check_choice("--recompute", args.recompute, L.RECOMPUTE)
    check_choice("--precision", args.precision, L.PRECISIONS)
    check_choice("--gpu", args.gpu, L.GPUS)
    gpu = L.GPUS[args.gpu]
    if args.gpu_memory is not None:
        gpu = replace(gpu, memory=parse_memory(args.gpu_memory))
    networks = {**S.NETWORKS, **P.NETWORKS}
    name = args.network or P.GPU_NETWORK.get(args.gpu, "selene")
    check_choice("--network", name, networks)
    net = networks[name]
    per_node = args.per_node or net.per_node
    try:
        L.check_precision(L.PRECISIONS[args.precision], gpu)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return L.PRECISIONS[args.precision], gpu, net, per_node


def _peaks(gpu: L.Gpu, precision: L.Precision) -> str:
    """The peaks the GEMMs run at: the 16-bit one, and with FP8 GEMMs the FP8 one first."""
    bf16 = (f"{gpu.peak_flops / 1e12:.0f} TFLOP/s 16-bit peak, full GEMM tiles at "
            f"{gpu.gemm_efficiency:.0%} of it")
    if not precision.fp8_gemms:
        return bf16
    fp8 = C.fp8_view(gpu)
    return (f"{fp8.peak_flops / 1e12:.0f} TFLOP/s FP8 peak, FP8 GEMM tiles at "
            f"{fp8.gemm_efficiency:.0%} of it; {bf16}, MFU against it")


def _gb(x: float) -> str:
    return f"{x / L.GB:.2f}"


def _failures(args: argparse.Namespace) -> G.Failures:
    for flag, value in (("--failure-rate", args.failure_rate), ("--restart-time",
                                                                args.restart_time)):
        if not value >= 0:
            raise UsageError(f"{flag}: expected a non-negative number, got {value}")
    if not args.checkpoint_bandwidth > 0:
        raise UsageError(f"--checkpoint-bandwidth: expected a positive GB/s, got "
                         f"{args.checkpoint_bandwidth}")
    return G.Failures(args.failure_rate, args.restart_time, args.checkpoint_bandwidth * 1e9)


def _schedules(text: str) -> tuple[str, ...]:
    """The schedules --search tries: a comma-separated list of kinds, or all."""
    kinds = KINDS if text.lower() == "all" else tuple(k.strip().lower() for k in text.split(","))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"--schedule: expected all or a comma-separated list of "
                         f"{', '.join(KINDS)}, got {text!r}")
    return kinds


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    print(title)
    print(f"{'layout':<42} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total GB':>8} "
          f"{'fits':>4} {'step_s':>9} {'bubble':>6} {'tokens/s':>10} {'MFU':>5} {'goodput':>7}"
          f"{'  train time':>12}  slower by")
    for r in rows:
        train = duration(r["time_to_train_s"]) if "time_to_train_s" in r else "-"
        print(f"{r['layout']:<42} {_gb(r['params_bytes']):>7} {_gb(r['grads_bytes']):>7} "
              f"{_gb(r['optimizer_bytes']):>7} {_gb(r['activation_bytes']):>7} "
              f"{_gb(r['total_bytes']):>8} {'yes' if r['fits'] else 'NO':>4} "
              f"{r['step_s']:>9.3f} {r['bubble_share']:>6.1%} {r['tokens_per_s']:>10.0f} "
              f"{r['mfu']:>5.1%} {r['goodput']:>7.1%} {train:>12}  {r.get('slower_by', '')}")


def duration(seconds: float) -> str:
    """Seconds as s, min, h or d."""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def parse_memory(text: str) -> float:
    """'80GB' (1e9 bytes, as data sheets), '80GiB', '512MB', or a bare number of GB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|MB|MiB|TB)?\s*", text, re.IGNORECASE)
    if not match:
        raise UsageError(f"--gpu-memory: expected a size like 80GB or 40GiB, got {text!r}")
    unit = (match.group(2) or "GB").lower()
    scale = {"gb": 1e9, "gib": 1 << 30, "mb": 1e6, "mib": 1 << 20, "tb": 1e12}[unit]
    size = float(match.group(1)) * scale
    if not size > 0:
        raise UsageError("--gpu-memory: expected a positive size")
    return size


def print_list() -> None:
    """Every network, GPU, model shape and precision the flags accept, with its source."""
    for name, n in {**S.NETWORKS, **P.NETWORKS}.items():
        print(f"network {name:<20} {n.per_node} per node; {n.source}")
    for name, gpu in L.GPUS.items():
        print(f"gpu     {name:<20} {gpu.memory / L.GB:.0f} GB, {gpu.sms} SMs; {gpu.source}")
    for name, shape in L.SHAPES.items():
        print(f"shape   {name:<20} {shape.params / 1e9:.3f}B parameters, L={shape.layers} "
              f"d={shape.hidden} T={shape.seq}")
    for name, precision in L.PRECISIONS.items():
        print(f"precision {name:<18} {precision.name}")


def run_published(args: argparse.Namespace) -> int:
    rows = P.rows()
    if not is_rank0():
        return 0
    print(f"{'published figure':<54} {'published':>10} {'predicted':>10} {'ratio':>6} "
          f"{'band':>6} ok   unit")
    for r in rows:
        # a floor ("over 90%") passes from ratio 1 up: its band is printed +x%
        band = f"+{r['band']:.0%}" if r.get("bound") == "lower" else f"{r['band']:.0%}"
        print(f"{r['name']:<54} {r['published']:>10.4g} {r['predicted']:>10.4g} "
              f"{r['ratio']:>6.3f} {band:>6} {'yes' if r['ok'] else 'NO ':<4} {r['unit']}")
    if args.json:
        write_json_lines(args.json, rows)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.published:
        return run_published(args)
    shape = _shape(args)
    precision, gpu, net, per_node = _setup(args)
    tokens = None
    if args.tokens is not None:
        try:
            tokens = float(parse_count(args.tokens))
        except ValueError as exc:
            raise UsageError(f"--tokens: {exc}") from None
        if not tokens > 0:
            raise UsageError("--tokens: expected a positive count")
    for flag, value in (("--pp", args.pp), ("--tp", args.tp), ("--dp", args.dp),
                        ("--cp", args.cp), ("--ep", args.ep),
                        ("--virtual-stages", args.virtual_stages),
                        ("--microbatches", args.microbatches), ("--gpus", args.gpus),
                        ("--top", args.top)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected a positive integer, got {value}")
    try:  # here, not per layout: a search drops the layouts check_layout refuses, silently
        C.with_reserved_sms(gpu, args.comm_sms)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    failures = _failures(args)
    gpus = args.gpus or (args.nodes or 1) * per_node
    shared = f" + {shape.shared_experts} shared" if shape.shared_experts else ""
    moe = (f", {shape.experts} experts top-{shape.top_k}{shared} ({shape.active_params / 1e9:.3f}B "
           f"active)" if shape.experts else "")
    head = (f"# mpdl simulate: {shape.name}, L={shape.layers} d={shape.hidden} a={shape.heads} "
            f"T={shape.seq} V={shape.vocab} b={shape.microbatch}: {shape.params / 1e9:.3f}B "
            f"parameters{moe}, {shape.flops_per_token / 1e9:.2f} GFLOP per token; "
            f"{precision.name}; "
            f"{gpu.name} ({gpu.memory / L.GB:.0f} GB, {_peaks(gpu, precision)}, "
            f"{gpu.memory_bandwidth / 1e9:.0f} GB/s); network {net.name}, {per_node} per node")
    if args.search:
        batch = args.global_batch or gpus * shape.microbatch
        check_choice("--cp-mode", args.cp_mode, L.CP_MODES)
        kinds = _schedules(args.schedule)
        try:
            report = L.search_report(shape, gpus, batch, precision, gpu, net.params, per_node,
                                     kinds, top=args.top, failures=failures, cp_mode=args.cp_mode,
                                     capacity_factor=args.moe_capacity_factor,
                                     tp_overlap=args.tp_overlap,
                                     gather_overlap=args.gather_overlap,
                                     comm_sms=args.comm_sms, recompute_up=args.recompute_up)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        rows = report["rows"]
        if tokens:
            rows = [L.evaluate(shape, _layout_of(r), precision, gpu, net.params, per_node,
                               tokens, args.price_per_hour, failures=failures) for r in rows]
        if not is_rank0():
            return 0
        print(head)
        small = report["smallest_too_big"]
        print(f"# {report['tried']} layouts tried: {report['fit']} fit, {report['too_big']} do "
              f"not" + (f" (the smallest of those, {small['layout']}, needs "
                        f"{small['total_bytes'] / L.GB:.1f} GB)" if small else ""))
        if not rows:
            print(f"# no layout of {gpus} GPUs fits in {gpu.memory / L.GB:.1f} GB")
        else:
            print_rows(rows, f"# the fastest layouts of {gpus} GPUs that fit, global batch "
                             f"{batch} sequences (first: the answer; the others: the part of "
                             f"their step that costs the most over it)")
        if args.json:
            write_json_lines(args.json, rows)
        return 0
    dp = args.dp or max(1, gpus // (args.pp * args.tp))
    m = args.microbatches
    if args.global_batch is not None:
        if m is not None:
            raise UsageError("give --microbatches or --global-batch, not both")
        if args.global_batch % (dp * shape.microbatch):
            raise UsageError(f"--global-batch: {args.global_batch} is not a multiple of dp × "
                             f"micro-batch = {dp * shape.microbatch}")
        m = args.global_batch // (dp * shape.microbatch)
    # flags one layout cannot use (a search takes each where it applies)
    if args.gather_overlap and not args.zero:
        raise UsageError("--gather-overlap: it hides ZeRO's parameter all-gather; add --zero 1, "
                         "2 or 3")
    if args.recompute_up and args.recompute == "full":
        raise UsageError("--recompute-up: --recompute full recomputes the whole forward already")
    kind = args.schedule.lower()
    virtual = 2 if kind in V_KINDS and args.virtual_stages == 1 else args.virtual_stages
    layout = L.Layout(dp, args.pp, args.tp, args.zero, m or 1, kind,
                      args.recompute, args.zero_group, args.cp, args.ep, args.sp,
                      args.cp_mode, args.moe_capacity_factor, virtual, args.tp_overlap,
                      args.gather_overlap, args.comm_sms, args.recompute_up)
    try:
        L.check_layout(shape, layout, per_node)
        row = L.evaluate(shape, layout, precision, gpu, net.params, per_node, tokens,
                         args.price_per_hour, failures=failures)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not is_rank0():
        return 0
    print(head)
    print_rows([row], f"# {layout.gpus} GPUs; step: compute {row['compute_s']:.3f} s, tensor "
                      f"parallel {row['tp_comm_s']:.3f} s ({row['tp_exposed_s']:.3f} s exposed), "
                      f"pipeline sends {row['pp_comm_s']:.3f} s, "
                      f"context parallel {row['cp_comm_s']:.3f} s ({row['cp_exposed_s']:.3f} s "
                      f"exposed), experts' all-to-all {row['ep_comm_s']:.3f} s, bubble "
                      f"{row['bubble_s']:.3f} s, data parallel {row['dp_comm_s']:.3f} s "
                      f"({row['dp_exposed_s']:.3f} s exposed)")
    print(f"# failures: the job is interrupted every {duration(row['mtbf_s'])} at "
          f"{failures.rate_per_gpu_hour:.3g} per GPU-hour; a checkpoint takes "
          f"{duration(row['checkpoint_write_s'])} every {duration(row['checkpoint_interval_s'])} "
          f"(Young/Daly), a restart {duration(row['restart_s'])}: goodput {row['goodput']:.1%}"
          + (f"; {row['gpu_hours']:.4g} GPU-hours to train" if "gpu_hours" in row else "")
          + (f", cost {row['cost']:.4g}" if "cost" in row else ""))
    if args.json:
        write_json_lines(args.json, [row])
    return 0


def _layout_of(row: dict[str, Any]) -> L.Layout:
    return L.Layout(row["dp"], row["pp"], row["tp"], row["zero"], row["microbatches"],
                    row["schedule"], row["recompute"], row["zero_group"], row["cp"], row["ep"],
                    row["sp"], row["cp_mode"], row["capacity_factor"], row["virtual"],
                    row["tp_overlap"], row["gather_overlap"], row["comm_sms"],
                    row["recompute_up"])

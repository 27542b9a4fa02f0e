"""`mpdl simulate` for transformer layouts: memory per GPU and step time of dp × pp × tp with ZeRO,
`--search` for the fastest layout that fits, `--published` for the papers' figures.

    mpdl simulate --model-shape megatron-8.3b --dp 64 --tp 8 --recompute --network dgx2h --gpu v100-32gb
    mpdl simulate --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 51200 --gpus 64 --search
    mpdl simulate --published --json published.jsonl
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from typing import Any

from mpdl.cli import UsageError
from mpdl.cli.output import is_rank0, write_json_lines
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
    g.add_argument("--dp", type=int, help="data-parallel degree (default: GPUs / (pp·tp))")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0 (DDP), 1, 2 or 3 (default 0)")
    g.add_argument("--zero-group", type=int,
                   help="hybrid sharding: ZeRO shards over groups of this many dp ranks")
    g.add_argument("--microbatches", type=int,
                   help="micro-batches per step m (default 1, or from --global-batch)")
    g.add_argument("--schedule", default="1f1b", help="pipeline schedule afab or 1f1b (default)")
    g.add_argument("--recompute", action="store_true", help="full activation recomputation")
    g.add_argument("--precision", default="mixed",
                   help="mixed (mixed-precision Adam, K=12; default) or fp32 (float32 Adam)")
    g.add_argument("--gpu", default="a100-80gb", help=f"{', '.join(L.GPUS)} (default a100-80gb)")
    g.add_argument("--gpu-memory", metavar="SIZE",
                   help="memory per GPU, e.g. 40GB (default: the GPU's); layouts above it are "
                        "marked as not fitting")
    g.add_argument("--gpus", type=int, help="GPUs for --search (default: --nodes × --per-node)")
    g.add_argument("--tokens", metavar="COUNT", help="tokens to train on, e.g. 300B: time and cost")
    g.add_argument("--search", action="store_true",
                   help="the fastest layouts of --gpus GPUs that fit, for --global-batch sequences")
    g.add_argument("--top", type=int, default=5, help="layouts --search prints (default 5)")
    g.add_argument("--published", action="store_true",
                   help="every published figure beside its prediction (with --json PATH: lines)")


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.published or args.search or args.model_shape
                or any(getattr(args, k) is not None for k in SHAPE_FLAGS))


def _shape(args: argparse.Namespace) -> L.Shape:
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.microbatch_size is not None:
        given["microbatch"] = args.microbatch_size
    if args.model_shape:
        if args.model_shape not in L.SHAPES:
            raise UsageError(f"--model-shape: expected one of {', '.join(L.SHAPES)}, got "
                             f"{args.model_shape!r}")
        fields = {k: getattr(L.SHAPES[args.model_shape], k) for k in (*SHAPE_FLAGS, "microbatch")}
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
        key = str(exc).split(":")[0].split(" ")[0]
        flag = "--microbatch-size" if key == "microbatch" else f"--{key}"
        raise UsageError(f"{flag}: {exc}") from None


def _setup(args: argparse.Namespace):
    if args.precision not in L.PRECISIONS:
        raise UsageError(f"--precision: expected one of {', '.join(L.PRECISIONS)}, got "
                         f"{args.precision!r}")
    if args.gpu not in L.GPUS:
        raise UsageError(f"--gpu: expected one of {', '.join(L.GPUS)}, got {args.gpu!r}")
    gpu = L.GPUS[args.gpu]
    if args.gpu_memory is not None:
        gpu = replace(gpu, memory=parse_memory(args.gpu_memory))
    networks = {**S.NETWORKS, **P.NETWORKS}
    name = args.network or "selene"
    if name not in networks:
        raise UsageError(f"--network: expected one of {', '.join(networks)}, got {name!r}")
    net = networks[name]
    per_node = args.per_node or net.per_node
    return L.PRECISIONS[args.precision], gpu, net, per_node


def _gb(x: float) -> str:
    return f"{x / L.GB:.2f}"


def print_rows(rows: list[dict[str, Any]], title: str) -> None:
    print(title)
    print(f"{'layout':<42} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'total GB':>8} "
          f"{'fits':>4} {'step_s':>9} {'bubble':>6} {'tokens/s':>10} {'MFU':>5}"
          f"{'  train time':>12}")
    for r in rows:
        train = duration(r["time_to_train_s"]) if "time_to_train_s" in r else "-"
        print(f"{r['layout']:<42} {_gb(r['params_bytes']):>7} {_gb(r['grads_bytes']):>7} "
              f"{_gb(r['optimizer_bytes']):>7} {_gb(r['activation_bytes']):>7} "
              f"{_gb(r['total_bytes']):>8} {'yes' if r['fits'] else 'NO':>4} "
              f"{r['step_s']:>9.3f} {r['bubble_share']:>6.1%} {r['tokens_per_s']:>10.0f} "
              f"{r['mfu']:>5.1%} {train:>12}")


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


def run_published(args: argparse.Namespace) -> int:
    rows = P.rows()
    if not is_rank0():
        return 0
    print(f"{'published figure':<52} {'published':>10} {'predicted':>10} {'ratio':>6} "
          f"{'band':>6} ok   unit")
    for r in rows:
        print(f"{r['name']:<52} {r['published']:>10.4g} {r['predicted']:>10.4g} "
              f"{r['ratio']:>6.3f} {r['band']:>6.0%} {'yes' if r['ok'] else 'NO ':<4} {r['unit']}")
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
                        ("--microbatches", args.microbatches), ("--gpus", args.gpus),
                        ("--top", args.top)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected a positive integer, got {value}")
    gpus = args.gpus or (args.nodes or 1) * per_node
    head = (f"# mpdl simulate: {shape.name}, L={shape.layers} d={shape.hidden} a={shape.heads} "
            f"T={shape.seq} V={shape.vocab} b={shape.microbatch}: {shape.params / 1e9:.3f}B "
            f"parameters, {shape.flops_per_token / 1e9:.2f} GFLOP per token; {precision.name}; "
            f"{gpu.name} ({gpu.memory / L.GB:.0f} GB, {gpu.sustained_flops / 1e12:.0f} of "
            f"{gpu.peak_flops / 1e12:.0f} TFLOP/s); network {net.name}, {per_node} per node")
    if args.search:
        batch = args.global_batch or gpus * shape.microbatch
        try:
            rows = L.search(shape, gpus, batch, precision, gpu, net.params, per_node,
                            args.schedule, top=args.top)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if tokens:
            rows = [L.evaluate(shape, _layout_of(r), precision, gpu, net.params, per_node,
                               tokens, args.price_per_hour) for r in rows]
        if not is_rank0():
            return 0
        print(head)
        if not rows:
            print(f"# no layout of {gpus} GPUs fits in {gpu.memory / L.GB:.1f} GB")
        else:
            print_rows(rows, f"# the fastest layouts of {gpus} GPUs that fit, global batch "
                             f"{batch} sequences (first: the answer)")
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
    layout = L.Layout(dp, args.pp, args.tp, args.zero, m or 1, args.schedule.lower(),
                      args.recompute, args.zero_group)
    try:
        L.check_layout(shape, layout, per_node)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    row = L.evaluate(shape, layout, precision, gpu, net.params, per_node, tokens,
                     args.price_per_hour)
    if not is_rank0():
        return 0
    print(head)
    print_rows([row], f"# {layout.gpus} GPUs; step: compute {row['compute_s']:.3f} s, tensor "
                      f"parallel {row['tp_comm_s']:.3f} s, pipeline sends {row['pp_comm_s']:.3f} s, "
                      f"bubble {row['bubble_s']:.3f} s, data parallel {row['dp_comm_s']:.3f} s "
                      f"({row['dp_exposed_s']:.3f} s exposed)")
    if args.json:
        write_json_lines(args.json, [row])
    return 0


def _layout_of(row: dict[str, Any]) -> L.Layout:
    return L.Layout(row["dp"], row["pp"], row["tp"], row["zero"], row["microbatches"],
                    row["schedule"], row["recompute"], row["zero_group"])

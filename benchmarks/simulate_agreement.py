"""Does `mpdl simulate` predict this machine? Each round calibrates at p (`mpdl calibrate`), then
compares the model's predictions with measurements taken right after:

* ring   - `mpdl bench` of the ring all-reduce at 512 KiB, 1 MiB and 2 MiB against the calibrated
           cost model (the median over the three sizes);
* lenet  - `mpdl train` of LeNet (32 samples per rank, data parallel) against `mpiexec -n p mpdl
           simulate --measure lenet` (every rank measures at once);
* zero   - `mpdl train --zero S --optimizer adam` of LeNet at each stage: its step against the
           compute measured with Adam plus, per ZeRO unit, the calibrated ring reduce-scatter and
           all-gather (two all-gathers at stage 3), all exposed, each with the calibrated
           handoff to the communication thread, and ZeRO's own work (a step of ZeRO less one
           of plain training, both on one rank, in turns), or, with more ranks than
           cores, every rank's compute (timed with no more ranks than cores at once), own work,
           collectives and handoffs and what their waits take from the cores, spread over the
           cores, if that is longer;
           and its measured
           `model_state_bytes` against `mpdl.perf.layouts`' memory per GPU (float32 Adam sharded
           over p, plus the largest unit held whole: its gradient at stage 2, its gradient and
           gathered weights at stage 3; the unit sizes are the ones the run reports);
* pp     - `mpdl train --pp 2 --microbatches 4` of LeNet (32 samples per pipeline; dp = p/2)
           against the pipeline model: each stage's forward + backward of one microbatch (timed
           on p/pp ranks at once, the pieces cut as the pipeline cuts them), one microbatch
           through all stages and the other m-1 paced by the slowest stage (equal stages give
           the bubble (pp-1)/(m+pp-1)) or, with more ranks than cores, all ranks' compute
           and what their waits take from the cores (the calibrated `wait_cpu` and
           `wait_share`) spread over the cores if that is longer, an activation and a gradient
           message per stage boundary on that path, the slowest stage's optimizer step and,
           with dp > 1, the calibrated ring all-reduce of the largest stage's gradient;
* recompute, moe, cp - `mpdl train --model gpt` (2 blocks, width 64, sequence 64) with each
           `--recompute`, with experts at each `--ep`, and with `--cp p` in each `--cp-mode`,
           against `mpdl.perf.agreement`'s models built from pieces timed on every rank at once
           without a message (the model as the run builds it, each cp mode's own attention
           compute), the calibrated collectives, and the wait for the slowest rank after a
           block's compute (`sync_s`, measured each round); each round prints its figures and
           the cp model's terms.

    flock /tmp/mpdl-bench.lock python benchmarks/simulate_agreement.py            # everything
    python benchmarks/simulate_agreement.py --checks ring lenet --ranks 2 3 4 --rounds 5
    python benchmarks/simulate_agreement.py --checks zero pp --ranks 2 4 --zero 1 2 3
    python benchmarks/simulate_agreement.py --checks recompute moe cp --moe-ranks 2 4 --rounds 3

Each round calibrates again, because this machine's speed drifts within minutes; the verdict is
on the median over rounds (±25% for times, ±10% for memory), and every round is printed. Ends
with one summary line per check. Exits 1 when a median lies outside its band. It is a benchmark,
not a unit test: timings on a shared machine are noisy, so it is run by hand and its figures
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpdl.mpi_runtime import usable_cores
from mpdl.perf import layouts as L
from mpdl.perf import simulate as S
from mpdl.perf.agreement import (
    MEMORY_TOLERANCE,
    TOLERANCE,
    context_step,
    expert_step,
    pipeline_step,
    recompute_step,
    verdict,
    zero_step,
)
from mpdl.tuning import costmodel as cm

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")

CHECKS = ("ring", "lenet", "zero", "pp", "recompute", "moe", "cp")
#: the pipeline check: stages, microbatches, samples per pipeline
PP, MICROBATCHES, PP_BATCH = 2, 4, 32
#: the transformer checks' GPT (mpdl train --model gpt --dataset text): blocks, heads, width,
#: sequence, sequences per data-parallel rank, characters of the generated text; MoE: experts,
#: top-k (dropless)
GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64}
GPT_SEQ, GPT_BATCH, GPT_TEXT = 64, 16, 24000
EXPERTS, TOP_K = 4, 2
RECOMPUTE_MODES = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses", "allgather")


def _run(n: int, argv: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run(["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), *argv],
                         capture_output=True, text=True, timeout=timeout + 10, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out


def _mpirun(n: int, args: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return _run(n, [MPDL, *args], env, timeout)


def _environment(tmp_path: Path) -> dict:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load > 1:
        print(f"warning: load average {load:.1f} per core: timings are unreliable now")
    env = {**os.environ, "MPDL_COST_MODEL": str(tmp_path / "model.json"), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    for var in ("MPDL_EMULATE", "MPDL_RANKS_PER_NODE", "MPDL_SEGMENT_BYTES"):
        env.pop(var, None)
    return env


def _calibrate(p: int, env: dict) -> None:
    _mpirun(p, ["calibrate", "-n", "30"], env, 180)


def _params(env: dict, p: int) -> cm.Params:
    return cm.read_file(env["MPDL_COST_MODEL"])[p]


def _train(p: int, args: list[str], env: dict, path: Path, batch_per_rank: int = 32
           ) -> tuple[float, dict]:
    """(median step of epochs 2-3, the summary row) of `mpdl train --model lenet` on synthetic
    MNIST-shaped data."""
    _mpirun(p, ["train", "--model", "lenet", "--dataset", "synthetic", "--synthetic-samples",
                str(2048 * p), "--global-batch-size", str(batch_per_rank * p), "--epochs", "3",
                "--algorithm", "ring", "--no-progress", "--json", str(path), *args], env, 300)
    rows = [json.loads(x) for x in path.read_text().splitlines()][1:]  # after the configuration
    epochs = rows[1:-1]  # the first epoch pays for compiling kernels
    return statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in epochs), rows[-1]


def predicted_lenet_step(p: int, env: dict, tmp_path: Path, tag: str,
                         optimizer: str = "sgd") -> dict:
    """`mpiexec -n p mpdl simulate --measure lenet`'s row at p workers (every rank measures)."""
    sim_path = tmp_path / f"sim.{tag}.jsonl"
    _mpirun(p, ["simulate", "--measure", "lenet", "--measure-input", "mnist",
                "--measure-optimizer", optimizer, "--network", "calibrated", "--nodes", "1",
                "--per-node", str(p), "--max-workers", str(p), "--batch-per-worker", "32",
                "--algorithms", "ring", "--json", str(sim_path)], env, 120)
    return next(row for row in map(json.loads, sim_path.read_text().splitlines())
                if row.get("workers") == p)


def lenet_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """predicted/measured data-parallel LeNet step at p ranks, 32 samples per rank."""
    predicted = predicted_lenet_step(p, env, tmp_path, f"dp{p}.{round_}")["step_s"]
    measured, _ = _train(p, [], env, tmp_path / f"train{p}.{round_}.jsonl")
    return predicted / measured


def own_work_times(repeats: int = 50, warmup: int = 10) -> dict[int, float]:
    """ZeRO's own work at each stage: the seconds a step of `ZeroStrategy` takes beyond one of
    plain data parallel training (`AllReduceStrategy`), LeNet, 32 samples, Adam, on a world of
    one rank, where nothing moves (gathering into and freeing flat buffers, the hooks, the
    optimizer on pieces); the four take turns step by step, medians, at least 0."""
    from mpdl.autograd import optim
    from mpdl.comm import as_communicator
    from mpdl.models.zoo import build_model
    from mpdl.parallel.data_parallel import AllReduceStrategy
    from mpdl.parallel.strategy import Batch
    from mpdl.parallel.zero import ZeroStrategy

    comm = as_communicator(None)
    shape = S.INPUT_SHAPES["mnist"]
    rng = np.random.default_rng(0)
    batch = Batch(rng.standard_normal((32, *shape)).astype(np.float32),
                  rng.integers(0, 10, 32), 32, 1e-3)
    strategies = {0: AllReduceStrategy(comm, algorithm="ring"),
                  **{stage: ZeroStrategy(comm, stage=stage, algorithm="ring")
                     for stage in (1, 2, 3)}}
    for strategy in strategies.values():
        strategy.setup(build_model("lenet", shape, 10, seed=0),
                       lambda ps: optim.Adam(ps, lr=1e-3))
    times: dict[int, list[float]] = {k: [] for k in strategies}
    for i in range(warmup + repeats):
        for k, strategy in strategies.items():
            t0 = time.perf_counter()
            strategy.step(batch)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    plain = statistics.median(times[0])
    return {stage: max(0.0, statistics.median(times[stage]) - plain) for stage in (1, 2, 3)}


def _own_worker(argv: list[str]) -> int:
    """Under mpiexec -n 1: writes `own_work_times()` (stage -> seconds) to argv[0]."""
    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does
    Path(argv[0]).write_text(json.dumps(own_work_times()))
    return 0


def zero_own_work(env: dict, tmp_path: Path, tag: str) -> dict[int, float]:
    """`own_work_times()` measured in a process of its own (one rank)."""
    path = tmp_path / f"own.{tag}.json"
    _run(1, [sys.executable, __file__, "--own-worker", str(path)], env, 120)
    return {int(stage): t for stage, t in json.loads(path.read_text()).items()}


def zero_ratios(p: int, stage: int, predicted: dict, pure_s: float, own_s: float, env: dict,
                tmp_path: Path, round_: int) -> tuple[float, float]:
    """(predicted/measured step time, predicted/measured model_state_bytes) of `mpdl train
    --zero stage` (LeNet, 32 samples per rank, float32 Adam)."""
    measured_step, summary = _train(p, ["--optimizer", "adam", "--zero", str(stage)], env,
                                    tmp_path / f"zero{stage}.{p}.{round_}.jsonl")
    units = [b // 4 for b in summary["unit_bytes"]]
    step = zero_step(predicted["compute_s"], pure_s, own_s, summary["unit_bytes"], stage, p,
                     _params(env, p), usable_cores())
    fp32 = L.PRECISIONS["fp32"]
    memory = (L.model_states(sum(units), fp32, stage, p)["model_state_bytes"]
              + L.zero_working_bytes(max(units), fp32, stage))
    return step / measured_step, memory / summary["model_state_bytes"]


def _compute_worker(argv: list[str]) -> int:
    """Under mpiexec -n n: every rank times LeNet's step (forward and backward of 32 samples and
    an Adam step, `simulate.measure_workload`) at once; rank 0 writes the slowest rank's seconds."""
    (out,) = argv
    from mpi4py import MPI

    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does
    work = S.measure_workload("lenet", "mnist", batch=32, optimizer="adam")
    slowest = MPI.COMM_WORLD.reduce(work.sample_s * 32 + work.step_s, op=MPI.MAX, root=0)
    if MPI.COMM_WORLD.rank == 0:
        Path(out).write_text(json.dumps(slowest))
    return 0


def pure_compute(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """LeNet's Adam step (32 samples) timed by min(p, cores) ranks at once: the compute of one rank
    when no more ranks than cores run."""
    path = tmp_path / f"compute{p}.{round_}.json"
    _run(min(p, usable_cores()), [sys.executable, __file__, "--compute-worker", str(path)], env,
         120)
    return float(json.loads(path.read_text()))


# -- the pipeline ----------------------------------------------------------------------------------
def stage_times(model: str, shape: str, microbatch: int, pp: int, repeats: int = 60,
                seed: int = 0) -> dict:
    """Per stage of `model` cut as `mpdl train --pp` cuts it (`pipeline.model_pieces`, balanced by
    `pipeline.partition_by_weight`): the median seconds of forward (the last stage with its loss),
    backward and the SGD step (momentum 0.9, as mpdl train) of one microbatch, and the bytes of
    each stage's output and gradient."""
    from mpdl.autograd import functional as F
    from mpdl.autograd import optim
    from mpdl.autograd.tensor import Tensor
    from mpdl.models.zoo import build_model
    from mpdl.parallel.pipeline import model_pieces, partition_by_weight

    net = build_model(model, S.INPUT_SHAPES[shape], 10, seed=seed)
    pieces = model_pieces(net)
    bounds = partition_by_weight([w for _, w in pieces], pp)
    stages = [[piece for piece, _ in pieces[bounds[s]:bounds[s + 1]]] for s in range(pp)]
    params = [[q for piece in st for q in piece.parameters()] for st in stages]
    opts = [optim.SGD(ps, lr=0.01, momentum=0.9) for ps in params]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((microbatch, *S.INPUT_SHAPES[shape])).astype(np.float32)
    y = rng.integers(0, 10, microbatch)
    times = np.zeros((repeats, pp, 3))
    out_bytes = [0] * pp
    warmup = 20
    for it in range(repeats + warmup):
        h, inputs, outputs = x, [], []
        for s, stage in enumerate(stages):
            t0 = time.perf_counter()
            inp = Tensor(h, requires_grad=s > 0)
            out = inp
            for piece in stage:
                out = piece(out)
            if s == pp - 1:
                out = F.cross_entropy(out, y) * (1.0 / microbatch)
                float(out.item())
            else:
                h = np.ascontiguousarray(out.data)
                out_bytes[s] = h.nbytes
            inputs.append(inp)
            outputs.append(out)
            if it >= warmup:
                times[it - warmup, s, 0] = time.perf_counter() - t0
        grad = None
        for s in reversed(range(pp)):
            t0 = time.perf_counter()
            if s == pp - 1:
                outputs[s].backward()
            else:
                outputs[s].backward(grad)
            if s > 0:
                grad = np.ascontiguousarray(inputs[s].grad)
            if it >= warmup:
                times[it - warmup, s, 1] = time.perf_counter() - t0
        for s, opt in enumerate(opts):
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if it >= warmup:
                times[it - warmup, s, 2] = time.perf_counter() - t0
    med = np.median(times, axis=0)
    return {"forward": med[:, 0].tolist(), "backward": med[:, 1].tolist(),
            "optimizer": med[:, 2].tolist(), "output_bytes": out_bytes,
            "grad_bytes": [4 * sum(q.size for q in ps) for ps in params]}


def _stage_worker(argv: list[str]) -> int:
    """Under mpiexec -n p: the stages are timed by p/pp ranks at once (one per pipeline, as many
    as compute at once when the slowest stage paces the pipeline and the others wait for it), the
    other ranks sleeping; rank 0 writes the slowest measuring rank's figures."""
    model, shape, microbatch, pp, out = argv
    from mpi4py import MPI

    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does (its command line keeps glibc's heap between steps)

    from mpdl.perf.calibrate import quiet_barrier

    world = MPI.COMM_WORLD
    measuring = world.rank < world.size // int(pp)
    quiet_barrier(world)
    mine = stage_times(model, shape, int(microbatch), int(pp)) if measuring else None
    everyone = [r for r in world.gather(mine, root=0) or [] if r is not None]
    quiet_barrier(world)
    if world.rank == 0:
        worst = {k: [max(r[k][s] for r in everyone) for s in range(int(pp))] for k in everyone[0]}
        Path(out).write_text(json.dumps(worst))
    return 0


def pipeline_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """predicted/measured step of `mpdl train --pp 2 --microbatches 4` (LeNet, dp = p/2)."""
    dp = p // PP
    path = tmp_path / f"stages{p}.{round_}.json"
    _run(p, [sys.executable, __file__, "--stage-worker", "lenet", "mnist",
             str(PP_BATCH // MICROBATCHES), str(PP), str(path)], env, 120)
    predicted = pipeline_step(json.loads(path.read_text()), MICROBATCHES, dp, _params(env, p),
                              usable_cores())
    measured, _ = _train(p, ["--pp", str(PP), "--microbatches", str(MICROBATCHES),
                             "--schedule", "1f1b"], env, tmp_path / f"pp{p}.{round_}.jsonl",
                         batch_per_rank=PP_BATCH // PP)
    return predicted["step_s"] / measured


# -- the transformer's axes ------------------------------------------------------------------------
def gpt_text(tmp_path: Path) -> Path:
    """A generated text of GPT_TEXT characters from 16 letters and the space (vocabulary 17)."""
    path = tmp_path / "text.txt"
    if not path.exists():
        rng = np.random.default_rng(0)
        letters = np.array(list("abcdefghijklmnop "))
        path.write_text("".join(rng.choice(letters, GPT_TEXT)))
    return path


def _synchronised(segment, comm, repeats: int = 200, warmup: int = 10) -> float:
    """Every rank at once: `segment()` then an all-reduce of one float64 over `comm`, again and
    again: the mean seconds of the all-reduce after the segment (its message and the wait for
    the slowest rank), the mean as a step's average takes it."""
    from mpdl.collectives import allreduce

    token = np.zeros(1)
    waits = []
    allreduce(token, op="sum", algorithm="ring", comm=comm)
    for i in range(warmup + repeats):
        segment()
        t0 = time.perf_counter()
        allreduce(token, op="sum", algorithm="ring", comm=comm)
        if i >= warmup:
            waits.append(time.perf_counter() - t0)
    return statistics.fmean(waits)


def gpt_pieces(spec: dict, repeats: int = 30, warmup: int = 3, sync_repeats: int = 200) -> dict:
    """Mean seconds (as a step's average takes them) of a GPT's forward (with the loss),
    backward and Adam step on `spec`'s batch of random tokens (with experts, every expert on
    this rank, its rows dispatched as `--ep` dispatches them, over a one-rank group), without
    recomputation, the blocks' share of the forward (`blocks_forward_s`), the attention cores'
    forward (`core_forward_s`: the GPT's causal attention on its packed Q, K, V, once per
    block), and the all-reduce of one number after one block's forward (`synchronised_s`, over
    every rank, `_synchronised`)."""
    from mpi4py import MPI

    from mpdl.autograd import Tensor, optim
    from mpdl.autograd import functional as F
    from mpdl.comm import as_communicator
    from mpdl.models.gpt import causal_attention
    from mpdl.models.moe import MoE, MoESettings
    from mpdl.models.zoo import build_model
    from mpdl.parallel.expert import ExpertGroups

    moe = MoESettings(spec["experts"], TOP_K, 0.0, 0.0, 1) if spec["experts"] else None
    net = build_model("gpt", (spec["seq"],), spec["vocab"], moe=moe, **GPT)
    if moe:  # the rows travel as under --ep, here to the experts of a one-rank group
        ExpertGroups([m for _, m in net.named_modules() if isinstance(m, MoE)],
                     as_communicator(MPI.COMM_SELF), 1).install()
    opt = optim.Adam(net.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    b, t, v = spec["batch"], spec["seq"], spec["vocab"]
    idx, target = rng.integers(0, v, (b, t)), rng.integers(0, v, b * t)
    hd = GPT["n_embd"] // GPT["n_head"]
    qkv = Tensor(rng.standard_normal((b, t, 3, GPT["n_head"], hd)).astype(np.float32),
                 requires_grad=True)
    keys = ("forward_s", "backward_s", "optimizer_s", "blocks_forward_s", "core_forward_s")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        x = net.token_embedding(idx) + net.position_embedding(np.arange(t))
        blocks = 0.0
        for block in net.blocks:
            t1 = time.perf_counter()
            x = block(x)
            blocks += time.perf_counter() - t1
        logits = F.linear(net.ln_f(x), net.token_embedding.weight)
        loss = F.cross_entropy(logits.reshape(b * t, v), target)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t4 = time.perf_counter()
        for _ in net.blocks:
            causal_attention(qkv)
        t5 = time.perf_counter()
        if i >= warmup:
            for key, value in zip(keys, (t2 - t0, t3 - t2, t4 - t3, blocks, t5 - t4),
                                  strict=True):
                times[key].append(value)
    pieces = {key: statistics.fmean(values) for key, values in times.items()}
    hidden = net.token_embedding(idx) + net.position_embedding(np.arange(t))
    return {**pieces, "synchronised_s": _synchronised(lambda: net.blocks[0](hidden),
                                                      as_communicator(MPI.COMM_WORLD),
                                                      sync_repeats)}


def context_pieces(spec: dict, repeats: int = 30, warmup: int = 3,
                   sync_repeats: int = 200) -> dict:
    """The pieces of the context-parallel step's prediction on this rank of cp (every rank at
    once), none with a message: the mean seconds (as a step's average takes them) of forward
    (with the loss as a cp rank takes it, summed over its positions), backward and Adam step of
    the GPT as the cp run builds it (`TensorParallelGPT`, here over a one-rank communicator) at
    the T/cp positions a rank holds, its attention local (causal over those positions); that
    local attention's forward and backward over all blocks (`local_attention_s`); the attention
    compute of each mode on a rank, forward and backward over all blocks
    (`blocked_attention_s`: this rank's chunks against every rank's K/V chunks, merged by their
    log-sum-exp, as ring and allgather attend; `ulysses_attention_s`: the whole sequence for
    H/cp heads, as ulysses attends), by `mpdl.parallel.context`'s own block functions; and the
    all-reduce of one number after one block's forward (`synchronised_s`, `_synchronised`)."""
    from mpi4py import MPI

    from mpdl.autograd import Tensor, optim
    from mpdl.autograd import functional as F
    from mpdl.comm import as_communicator
    from mpdl.models.zoo import build_model
    from mpdl.parallel import context as C
    from mpdl.parallel.tensor_parallel import TensorParallelGPT, causal_attention

    world = as_communicator(MPI.COMM_WORLD)
    cp, rank = world.size, world.rank
    b, t, v, whole = spec["batch"], spec["seq"] // cp, spec["vocab"], spec["seq"]
    net = TensorParallelGPT(build_model("gpt", (whole,), v, **GPT),
                            as_communicator(MPI.COMM_SELF), "ring")
    opt = optim.Adam(net.parameters(), lr=1e-3)
    rng = np.random.default_rng(rank)
    idx, target = rng.integers(0, v, (b, t)), rng.integers(0, v, b * t)
    heads, hd = GPT["n_head"], GPT["n_embd"] // GPT["n_head"]
    scale = 1.0 / np.sqrt(hd)

    def qkv(h: int, n: int) -> list[np.ndarray]:
        return [rng.standard_normal((b, h, n, hd)).astype(np.float32) for _ in range(3)]

    local, split, spread = qkv(heads, t), qkv(heads, t), qkv(heads // cp, whole)
    mine = C.chunks_of(rank, cp, "zigzag")
    order = np.concatenate([C.positions(r, cp, whole, "zigzag") for r in range(cp)])
    mask = order[None, :] > order[:, None]

    def local_attention() -> None:
        q, k, w = (Tensor(a, requires_grad=True) for a in local)
        out = causal_attention(q, k, w)
        out.backward(np.ones_like(local[0]))

    def blocked_attention() -> None:
        q, k, w = split
        kv = C._pack(k, w)
        out, lse = np.zeros_like(q), np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
        for step in range(cp):
            C._attend(q, kv[0], kv[1], mine, C.chunks_of((rank - step) % cp, cp, "zigzag"),
                      True, scale, out, lse)
        delta, dq = (out * out).sum(axis=-1), np.zeros_like(q)
        for step in range(cp):
            dkv = np.zeros_like(kv)
            C._attend_backward(q, kv[0], kv[1], out, delta, lse, mine,
                               C.chunks_of((rank - step) % cp, cp, "zigzag"), True, scale, dq,
                               dkv[0], dkv[1])

    def ulysses_attention() -> None:
        q, k, w = spread
        out, lse = C._block_forward(q, k, w, mask, scale)
        C._block_backward(q, k, w, out, (out * out).sum(axis=-1), lse, mask, scale)

    keys = ("forward_s", "backward_s", "optimizer_s", "local_attention_s", "blocked_attention_s",
            "ulysses_attention_s")
    times: dict[str, list[float]] = {k: [] for k in keys}
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        loss = F.cross_entropy(net(idx).reshape(b * t, v), target, reduction="sum") * (1 / b / t)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        marks = [time.perf_counter()]
        for attention in (local_attention, blocked_attention, ulysses_attention):
            for _ in net.blocks:
                attention()
            marks.append(time.perf_counter())
        if i >= warmup:
            spans = (t1 - t0, t2 - t1, marks[0] - t2,
                     *(marks[j + 1] - marks[j] for j in range(3)))
            for key, value in zip(keys, spans, strict=True):
                times[key].append(value)
    pieces = {key: statistics.fmean(values) for key, values in times.items()}
    hidden = net.token_embedding(idx) + net.position_embedding(np.arange(t))
    return {**pieces, "synchronised_s": _synchronised(lambda: net.blocks[0](hidden), world,
                                                      sync_repeats)}


def _gpt_worker(argv: list[str]) -> int:
    """Under mpiexec -n p: every rank times `gpt_pieces` (or with spec["cp"], `context_pieces`)
    at once; rank 0 writes the slowest rank's figure of each piece."""
    spec, out = json.loads(argv[0]), argv[1]
    from mpi4py import MPI

    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does
    mine = context_pieces(spec) if spec.get("cp") else gpt_pieces(spec)
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if MPI.COMM_WORLD.rank == 0:
        Path(out).write_text(json.dumps({k: max(r[k] for r in everyone) for k in mine}))
    return 0


def measure_gpt(p: int, spec: dict, env: dict, tmp_path: Path, tag: str) -> dict:
    """`gpt_pieces` (or `context_pieces`) timed by p ranks at once (the slowest rank's), with
    `sync_s`: what a synchronisation after one block's forward costs beyond the calibrated
    message (at least 0)."""
    path = tmp_path / f"gpt.{tag}.json"
    _run(p, [sys.executable, __file__, "--gpt-worker", json.dumps(spec), str(path)], env, 180)
    pieces = json.loads(path.read_text())
    message = cm.predict("allreduce", "ring", 8, p, 1, _params(env, p)) if p > 1 else 0.0
    pieces["sync_s"] = max(0.0, pieces["synchronised_s"] - message)
    return pieces


def _gpt_args(tmp_path: Path, *extra: str) -> list[str]:
    args = ["--model", "gpt", "--dataset", "text", "--data", str(gpt_text(tmp_path)),
            "--block-size", str(GPT_SEQ), "--optimizer", "adam"]
    for key, value in GPT.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args + list(extra)


def _train_gpt(p: int, batch: int, args: list[str], env: dict, path: Path) -> tuple[float, dict]:
    """(median step of epochs 2-3, the summary row) of `mpdl train --model gpt` at `batch`
    sequences a step."""
    _mpirun(p, ["train", "--global-batch-size", str(batch), "--epochs", "3", "--algorithm",
                "ring", "--no-progress", "--json", str(path), *args], env, 300)
    rows = [json.loads(x) for x in path.read_text().splitlines()][1:]
    return statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in rows[1:-1]), rows[-1]


def _gpt_grad_bytes(experts: int = 0) -> tuple[int, int]:
    """(dense, expert) gradient bytes of the checks' GPT (float32)."""
    from mpdl.models.moe import MoESettings
    from mpdl.models.zoo import build_model

    moe = MoESettings(experts, TOP_K, 0.0, 0.0, 1) if experts else None
    net = build_model("gpt", (GPT_SEQ,), 17, moe=moe, **GPT)
    dense = expert = 0
    for name, q in net.named_parameters():
        if ".experts." in name:
            expert += 4 * q.size
        else:
            dense += 4 * q.size
    return dense, expert


def _detail(p: int, round_: int, what: str, predicted: float, measured: float,
            terms: dict | None = None) -> None:
    """One line of a round's figures: predicted and measured step in ms, their ratio, the load
    average of the last minute, and the prediction's terms when given."""
    parts = "".join(f" {k.removesuffix('_s')} {v * 1e3:.2f}" for k, v in (terms or {}).items())
    print(f"    p={p} round {round_ + 1} {what}: predicted {predicted * 1e3:.2f} ms, measured "
          f"{measured * 1e3:.2f} ms, ratio {predicted / measured:.2f}, load "
          f"{os.getloadavg()[0]:.1f}" + (f";{parts}" if parts else ""), flush=True)


def recompute_ratios(p: int, env: dict, tmp_path: Path, round_: int) -> dict[str, float]:
    """predicted/measured step of `mpdl train --model gpt --recompute MODE` (data parallel over p,
    GPT_BATCH sequences a rank) for each mode, the prediction from pieces timed without
    recomputation."""
    spec = {"seq": GPT_SEQ, "vocab": 17, "batch": GPT_BATCH, "experts": 0}
    pieces = measure_gpt(p, spec, env, tmp_path, f"r{p}.{round_}")
    dense, _ = _gpt_grad_bytes()
    out = {}
    for mode in RECOMPUTE_MODES:
        measured, _ = _train_gpt(p, GPT_BATCH * p, _gpt_args(tmp_path, "--recompute", mode), env,
                                 tmp_path / f"rec{mode}.{p}.{round_}.jsonl")
        predicted = recompute_step(pieces, mode, p, dense, _params(env, p), usable_cores())
        _detail(p, round_, f"recompute={mode}", predicted, measured, {"sync": pieces["sync_s"]})
        out[mode] = predicted / measured
    return out


def expert_ratios(p: int, env: dict, tmp_path: Path, round_: int) -> dict[int, float]:
    """predicted/measured step of `mpdl train --model gpt --moe-experts 4 --ep EP` (top-2,
    dropless, data parallel over p, GPT_BATCH sequences a rank) for each ep dividing p and 4."""
    spec = {"seq": GPT_SEQ, "vocab": 17, "batch": GPT_BATCH, "experts": EXPERTS}
    pieces = measure_gpt(p, spec, env, tmp_path, f"m{p}.{round_}")
    dense, expert = _gpt_grad_bytes(EXPERTS)
    rows = GPT_BATCH * GPT_SEQ * TOP_K * GPT["n_embd"] * 4
    out = {}
    for ep in (e for e in range(1, p + 1) if p % e == 0 and EXPERTS % e == 0):
        measured, _ = _train_gpt(p, GPT_BATCH * p, _gpt_args(
            tmp_path, "--moe-experts", str(EXPERTS), "--moe-top-k", str(TOP_K), "--ep", str(ep)),
            env, tmp_path / f"moe{ep}.{p}.{round_}.jsonl")
        predicted = expert_step(pieces, p, ep, GPT["n_layer"], rows, dense, expert, EXPERTS,
                                _params(env, p), usable_cores())
        _detail(p, round_, f"moe ep={ep}", predicted, measured, {"sync": pieces["sync_s"]})
        out[ep] = predicted / measured
    return out


def context_ratios(p: int, env: dict, tmp_path: Path, round_: int) -> dict[str, float]:
    """predicted/measured step of `mpdl train --model gpt --cp p --cp-mode MODE` (GPT_BATCH
    sequences a step shared by the p ranks) for each mode, the prediction from `context_pieces`
    (the model as the cp run builds it at the T/p positions a rank holds, each mode's attention
    compute without its messages)."""
    spec = {"seq": GPT_SEQ, "cp": p, "vocab": 17, "batch": GPT_BATCH, "experts": 0}
    pieces = measure_gpt(p, spec, env, tmp_path, f"c{p}.{round_}")
    dense, _ = _gpt_grad_bytes()
    kv = 2 * GPT_BATCH * GPT_SEQ * GPT["n_embd"] * 4
    out = {}
    for mode in CP_MODES:
        measured, _ = _train_gpt(p, GPT_BATCH, _gpt_args(
            tmp_path, "--cp", str(p), "--cp-mode", mode), env,
            tmp_path / f"cp{mode}.{p}.{round_}.jsonl")
        predicted = context_step(pieces, p, mode, GPT["n_layer"], kv, dense, _params(env, p),
                                 usable_cores())
        _detail(p, round_, f"cp {mode}", predicted["step_s"], measured,
                {k: v for k, v in predicted.items() if k != "step_s"})
        out[mode] = predicted["step_s"] / measured
    return out


def allreduce_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """The median over 512 KiB, 1 MiB and 2 MiB of predicted/measured time of the ring all-reduce
    at p ranks, benched just after calibrating."""
    params = _params(env, p)
    path = tmp_path / f"bench{p}.{round_}.jsonl"
    _mpirun(p, ["bench", "-b", "512K", "-e", "2M", "-n", "40", "-w", "2", "--algorithms", "ring",
                "--json", str(path)], env, 120)
    return statistics.median(
        S.allreduce_seconds("ring", r["bytes"], p, 1, params) / (r["time_us"] * 1e-6)
        for r in map(json.loads, path.read_text().splitlines()) if r["algorithm"] == "ring")


def main() -> int:
    if sys.argv[1:2] == ["--stage-worker"]:
        return _stage_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--compute-worker"]:
        return _compute_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--own-worker"]:
        return _own_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--gpt-worker"]:
        return _gpt_worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS,
                        help="what to compare (default: all)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4],
                        help="world sizes of the ring and lenet checks (default 2 3 4)")
    parser.add_argument("--zero-ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes of the zero check (default 2 4)")
    parser.add_argument("--pp-ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes of the pipeline check, even (default 2 4)")
    parser.add_argument("--recompute-ranks", type=int, nargs="+", default=[2],
                        help="world sizes of the recompute check (default 2)")
    parser.add_argument("--moe-ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes of the moe check, each ep dividing it (default 2 4)")
    parser.add_argument("--cp-ranks", type=int, nargs="+", default=[2],
                        help="world sizes (= cp) of the cp check (default 2)")
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3], metavar="STAGE",
                        help="ZeRO stages of the zero check (default 1 2 3)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of calibrate and measure per world size (default 5)")
    args = parser.parse_args()
    if any(stage not in (1, 2, 3) for stage in args.zero):
        parser.error(f"--zero: expected stages 1, 2 or 3, got {args.zero}")
    if any(p < 2 or p % PP for p in args.pp_ranks):
        parser.error(f"--pp-ranks: expected even world sizes, got {args.pp_ranks}")
    if any(p < 2 for p in args.ranks + args.zero_ranks) or args.rounds < 1:
        parser.error("--ranks, --zero-ranks: expected at least 2; --rounds at least 1")
    if any(p < 1 for p in args.recompute_ranks + args.moe_ranks) or any(
            p < 2 or GPT_SEQ % (2 * p) or GPT["n_head"] % p for p in args.cp_ranks):
        parser.error(f"--recompute-ranks, --moe-ranks: expected at least 1; --cp-ranks: at least "
                     f"2, dividing {GPT['n_head']} heads and {GPT_SEQ // 2} (zigzag halves)")
    checks = set(args.checks)
    sizes = sorted({*(args.ranks if checks & {"ring", "lenet"} else []),
                    *(args.zero_ranks if "zero" in checks else []),
                    *(args.pp_ranks if "pp" in checks else []),
                    *(args.recompute_ranks if "recompute" in checks else []),
                    *(args.moe_ranks if "moe" in checks else []),
                    *(args.cp_ranks if "cp" in checks else [])})
    ok, summary = True, []
    print(f"{'p':>2}  {'what':<28} {'predicted/measured':>18}  {'each round':<36} verdict")
    with tempfile.TemporaryDirectory() as tmp:
        env = _environment(Path(tmp))
        for p in sizes:
            results: dict[str, tuple[list[float], float]] = {}

            def add(what: str, ratio: float, tolerance: float = TOLERANCE,
                    results: dict = results) -> None:
                results.setdefault(what, ([], tolerance))[0].append(ratio)

            for round_ in range(args.rounds):
                _calibrate(p, env)  # again each round: the machine's speed drifts within minutes
                if "ring" in checks and p in args.ranks:
                    add("ring all-reduce, bench", allreduce_ratio(p, env, Path(tmp), round_))
                if "lenet" in checks and p in args.ranks:
                    add("LeNet step, train", lenet_ratio(p, env, Path(tmp), round_))
                if "zero" in checks and p in args.zero_ranks:
                    predicted = predicted_lenet_step(p, env, Path(tmp), f"z{p}.{round_}", "adam")
                    pure = (pure_compute(p, env, Path(tmp), round_) if p > usable_cores()
                            else predicted["compute_s"])
                    own = zero_own_work(env, Path(tmp), f"{p}.{round_}")
                    for stage in args.zero:
                        step, memory = zero_ratios(p, stage, predicted, pure, own[stage], env,
                                                   Path(tmp), round_)
                        add(f"ZeRO {stage} step, train", step)
                        add(f"ZeRO {stage} model state", memory, MEMORY_TOLERANCE)
                if "pp" in checks and p in args.pp_ranks:
                    add(f"pp={PP} m={MICROBATCHES} step, train",
                        pipeline_ratio(p, env, Path(tmp), round_))
                if "recompute" in checks and p in args.recompute_ranks:
                    for mode, ratio in recompute_ratios(p, env, Path(tmp), round_).items():
                        add(f"gpt recompute={mode} step", ratio)
                if "moe" in checks and p in args.moe_ranks:
                    for ep, ratio in expert_ratios(p, env, Path(tmp), round_).items():
                        add(f"gpt moe ep={ep} step", ratio)
                if "cp" in checks and p in args.cp_ranks:
                    for mode, ratio in context_ratios(p, env, Path(tmp), round_).items():
                        add(f"gpt cp {mode} step", ratio)
            for what, (ratios, tolerance) in results.items():
                ratio, agrees = verdict(ratios, tolerance)
                ok &= agrees
                each = ", ".join(f"{r:.2f}" for r in ratios)
                line = (f"{p:>2}  {what:<28} {ratio:>18.2f}  {each:<36} "
                        f"{'ok' if agrees else f'outside ±{tolerance:.0%}'}")
                summary.append(line)
                print(line, flush=True)
    passed = sum(1 for line in summary if line.endswith(" ok"))
    print(f"\nsummary: {passed} of {len(summary)} checks within their bands")
    for line in summary:
        print("  " + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

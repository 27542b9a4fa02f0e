"""Pipeline bubble measured against (p−1)/(m+p−1), and a tensor-parallel step against one rank,
side by side in one run.

    mpiexec -n 4 python benchmarks/bench_pipeline.py [--steps 8] [--json PATH]

Bubble: for pp = 2 and 4 (those that divide the world size; dp = world / pp) and m = 1, 2, 4, 8
microbatches of 32 samples each, an MLP of equal Linear layers (so that the stages balance) trains
under AFAB and 1F1B. Three measurements of the idle share of a stage's step, mean over stages,
median over steps, beside the formula:

- slots: the executed op orders replayed on a clock where every forward and backward takes one
  slot (`slot_bubble`); what the schedule itself gives, exactly the formula.
- CPU replay: the same orders replayed with each op's measured thread CPU time (its stage's
  pieces, the last stage's loss, the start of its send; `timed_bubble`), as if every stage had a
  core of its own and messages took no time. CPU time does not count the time a rank waits for a
  core, so this is the bubble of the measured stage times (uneven stages, a backward longer than
  a forward, the last stage's loss) without the machine's time-sharing.
- wall clock: 1 − the stage's wall time in forwards and backwards over the pipeline's span of
  them (the first start to the last end over its stages: the ranks of one machine share the
  monotonic clock), from the step's timeline spans. With more ranks than cores, a stage that
  waits gives its core to the others and a stage that computes may wait for a core: then 'idle'
  is not idle, and this column measures the machine's scheduling as much as the schedule (the
  header says how many cores this process may use).

Memory: per-rank bytes of parameters and of model state (parameters, gradients, Adam's state)
after one step of a GPT of 8 blocks at pp = 1, 2, 4, tp = 2 and dp 2 × pp 2 with and without
ZeRO-1, on the in-process world (a stage keeps only its own parameters).

Tensor parallelism: a GPT step (forward, backward, update) with tp = the world size against the
same step of the whole model on rank 0 alone, in turns; the step's time is the slowest rank's,
median over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from mpdl.autograd import nn, optim
from mpdl.comm import as_communicator
from mpdl.parallel.pipeline import PipelineStrategy, bubble_formula, slot_bubble, timed_bubble
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import run_world
from mpdl.training.gpt import GPT

MICRO = 32  # samples per microbatch
MIB = 1 << 20


def deep_mlp(width: int = 512, layers: int = 8) -> nn.Module:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width, seed=i), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def bubble(comm, pp: int, m: int, schedule: str, steps: int) -> dict[str, float]:
    """The median over steps of the mean over stages of the three bubble measurements, and
    the ratio of the slowest stage's CPU time to the fastest's."""
    dp = comm.size // pp
    strategy = PipelineStrategy(comm, dp, pp, microbatches=m, schedule=schedule)
    model = deep_mlp()
    strategy.setup(model, lambda p: optim.SGD(p, lr=1e-3))
    rng = np.random.default_rng(0)
    n = MICRO * m
    x = rng.standard_normal((n, 512)).astype(np.float32)
    y = rng.integers(0, 512, n)
    wall, cpu = [], []
    for step in range(steps + 1):
        comm.barrier()
        r = strategy.step(Batch(x, y, n * dp, 1e-3))
        spans = [s for s in r.spans if s.name.split()[0] in ("recv", "forward", "backward")]
        busy = sum(s.end - s.start for s in spans if not s.name.startswith("recv"))
        ends = strategy.grid.pp_comm.allgather_object((min(s.start for s in spans),
                                                       max(s.end for s in spans)))
        ops = {("F" if s.name.startswith("forward") else "B", s.args["microbatch"]):
               s.args["cpu_s"] for s in spans if "cpu_s" in s.args}
        if step:  # the first step finds the shapes
            # idle: the pipeline's span of forwards and backwards (first start to last end over
            # its stages; one monotonic clock on one machine) less this stage's compute
            wall.append(1 - busy / (max(e for _, e in ends) - min(b for b, _ in ends)))
            cpu.append(ops)
    # every stage's orders and op times, along the pipeline of dp rank 0
    pipeline = strategy.grid.pp_comm.allgather_object((strategy.last_order, cpu))
    orders = [order for order, _ in pipeline]
    length, idle = slot_bubble(orders)
    replayed, imbalance = [], []
    for k in range(steps):
        durations = [times[k] for _, times in pipeline]
        span, idle_s = timed_bubble(orders, durations)
        replayed.append(float(np.mean(idle_s)) / span)
        busy = [sum(d.values()) for d in durations]
        imbalance.append(max(busy) / min(busy))
    everyone = np.array(comm.allgather_object(wall))  # (ranks, steps)
    return {"slots": float(np.mean(idle)) / length, "cpu": float(np.median(replayed)),
            "wall": float(np.median(everyone.mean(axis=0))),
            "imbalance": float(np.median(imbalance))}


def memory() -> list[dict]:
    """Per-rank parameter and model-state bytes (parameters, gradients, Adam's state) after one
    step of a GPT of 8 blocks, on the in-process world (deterministic: no timing)."""
    x = np.random.default_rng(0).integers(0, 96, (8, 64))
    rows = []
    for dp, pp, tp, zero in [(1, 1, 1, 0), (1, 2, 1, 0), (1, 4, 1, 0), (1, 1, 2, 0), (1, 2, 2, 0),
                             (2, 2, 1, 0), (2, 2, 1, 1)]:
        def body(c, dp=dp, pp=pp, tp=tp, zero=zero):
            s = PipelineStrategy(c, dp, pp, tp, microbatches=2, zero=zero)
            s.setup(GPT(96, 64, 8, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
            lo, hi = np.linspace(0, 8, dp + 1).astype(int)[s.grid.d:s.grid.d + 2]
            s.step(Batch(x[lo:hi], np.roll(x, -1, axis=1)[lo:hi], 8, 1e-3))
            return s.rank_parameter_bytes, s.rank_state_bytes
        out = run_world(dp * pp * tp, body)
        rows.append({"dp": dp, "pp": pp, "tp": tp, "zero": zero,
                     "parameter_bytes": [o[0] for o in out],
                     "model_state_bytes": [o[1] for o in out]})
    return rows


def tensor_step(comm, steps: int) -> tuple[float, float]:
    x = np.random.default_rng(0).integers(0, 96, (16, 64))
    batch = Batch(x, np.roll(x, -1, axis=1), 16, 1e-3)
    tp = PipelineStrategy(comm, 1, 1, comm.size)
    tp.setup(GPT(96, 64, 4, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
    one = PipelineStrategy(comm.sub([0]), 1, 1, 1) if comm.rank == 0 else None
    if one is not None:
        one.setup(GPT(96, 64, 4, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
    times: dict[str, list[float]] = {"tp": [], "one": []}
    for step in range(steps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        tp.step(batch)
        t = comm.allgather_object(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        if one is not None:
            one.step(batch)
        s = time.perf_counter() - t0
        if step:
            times["tp"].append(max(t))
            times["one"].append(s)
    return float(np.median(times["one"])), float(np.median(times["tp"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    comm = as_communicator(MPI.COMM_WORLD)
    rows = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if comm.rank == 0:
        print(f"# pipeline bubble, {comm.size} ranks on {cores} cores, MLP 8 x Linear(512, 512), "
              f"{MICRO} samples per microbatch; idle share of a stage's step, mean over stages, "
              f"median of {args.steps} steps")
        print("# slots: the executed orders on a unit-time clock; cpu: the same orders replayed "
              "with each op's measured CPU time (a core per stage, free messages); wall: 1 - the "
              "stage's compute time over the pipeline's step"
              + (" (more ranks than cores: stages time-share the cores, so this counts "
                 "scheduling too)" if comm.size > cores else ""))
        print(f"{'pp':>3} {'dp':>3} {'m':>3} {'formula':>8} | {'slots':>6} {'cpu':>6} "
              f"{'wall':>6} {'imbal':>6} (afab) | {'slots':>6} {'cpu':>6} {'wall':>6} "
              f"{'imbal':>6} (1f1b)")
    for pp in (2, 4):
        if comm.size % pp:
            continue
        for m in (1, 2, 4, 8):
            measured = {s: bubble(comm, pp, m, s, args.steps) for s in ("afab", "1f1b")}
            row = {"pp": pp, "dp": comm.size // pp, "m": m, "formula": bubble_formula(pp, m),
                   "ranks": comm.size, "cores": cores,
                   **{f"{s}_{k}": v for s, f in measured.items() for k, v in f.items()}}
            rows.append(row)
            if comm.rank == 0:
                cols = " | ".join(" ".join(f"{measured[s][k]:>6.1%}" for k in ("slots", "cpu",
                                                                                "wall")) +
                                  f" {measured[s]['imbalance']:>6.2f}       " for s in
                                  ("afab", "1f1b"))
                print(f"{pp:>3} {row['dp']:>3} {m:>3} {row['formula']:>8.1%} | {cols}")
    if comm.rank == 0:
        mem = memory()
        base = max(mem[0]["model_state_bytes"])
        print("# memory per rank after one step, GPT 8 blocks, width 128, Adam (in-process "
              "world): parameters / model state (parameters, gradients, optimizer) in MiB, "
              "the most of any rank against one rank")
        for r in mem:
            print(f"dp {r['dp']} pp {r['pp']} tp {r['tp']} zero {r['zero']}: parameters "
                  f"{max(r['parameter_bytes']) / MIB:.3f} MiB, model state "
                  f"{max(r['model_state_bytes']) / MIB:.3f} MiB (per rank: "
                  f"{', '.join(f'{b / MIB:.2f}' for b in r['model_state_bytes'])}; "
                  f"{max(r['model_state_bytes']) / base:.2f} of one rank)")
        rows += mem
    if comm.size > 1 and 4 % comm.size == 0:
        one, tp = tensor_step(comm, args.steps)
        rows.append({"tp": comm.size, "one_rank_s": one, "tp_s": tp})
        if comm.rank == 0:
            print(f"# tensor parallel GPT (4 layers, 4 heads, width 128, 16 x 64 tokens): one "
                  f"rank {one * 1e3:.1f} ms, tp = {comm.size} {tp * 1e3:.1f} ms per step "
                  f"(speedup {one / tp:.2f})")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

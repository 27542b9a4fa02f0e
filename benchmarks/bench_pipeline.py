"""Pipeline bubble measured against (p−1)/(m+p−1), and a tensor-parallel step against one rank,
side by side in one run.

    mpiexec -n 4 python benchmarks/bench_pipeline.py [--steps 8] [--json PATH]

Bubble: for pp = 2 and 4 (those that divide the world size; dp = world / pp) and m = 1, 2, 4, 8
microbatches of 16 samples each, an MLP of equal Linear layers (so that the stages balance) trains
under AFAB and 1F1B. A stage's measured bubble is the share of its step spent waiting for a
receive (activation or gradient) from a neighbour, over the span of its forwards and backwards (the
gradient all-reduce and the optimizer step left out), read from the step's timeline spans; the
table shows the median over steps of the mean over stages, beside the formula. The formula
assumes equal stages, a backward as long as a forward on every stage and messages that take no
time; with more ranks than cores, a stage that waits gives its core to the others.

Tensor parallelism: a GPT step (forward, backward, update) with tp = the world size against the
same step of the whole model on rank 0 alone, in turns; the step's time is the slowest rank's,
median over steps.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from mpdl.autograd import nn, optim
from mpdl.comm import as_communicator
from mpdl.parallel.pipeline import PipelineStrategy, bubble_formula
from mpdl.parallel.strategy import Batch
from mpdl.training.gpt import GPT

MICRO = 32  # samples per microbatch


def deep_mlp(width: int = 512, layers: int = 8) -> nn.Module:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width, seed=i), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


def bubble(comm, pp: int, m: int, schedule: str, steps: int) -> float:
    dp = comm.size // pp
    strategy = PipelineStrategy(comm, dp, pp, microbatches=m, schedule=schedule)
    model = deep_mlp()
    strategy.setup(model, lambda p: optim.SGD(p, lr=1e-3))
    rng = np.random.default_rng(0)
    n = MICRO * m
    x = rng.standard_normal((n, 512)).astype(np.float32)
    y = rng.integers(0, 512, n)
    shares = []
    for step in range(steps + 1):
        comm.barrier()
        r = strategy.step(Batch(x, y, n * dp, 1e-3))
        spans = [s for s in r.spans if s.name.split()[0] in ("recv", "forward", "backward")]
        waited = sum(s.end - s.start for s in spans if s.name.startswith("recv"))
        total = max(s.end for s in spans) - min(s.start for s in spans)
        if step:  # the first step finds the shapes
            shares.append(waited / total)
    everyone = np.array(comm.allgather_object(shares))  # (ranks, steps)
    return float(np.median(everyone.mean(axis=0)))


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
    if comm.rank == 0:
        print(f"# pipeline bubble, {comm.size} ranks, MLP 8 x Linear(512, 512), {MICRO} samples "
              f"per microbatch; median of {args.steps} steps, mean over stages")
        print(f"{'pp':>3} {'dp':>3} {'m':>3} {'formula':>8} {'afab':>8} {'1f1b':>8}")
    for pp in (2, 4):
        if comm.size % pp:
            continue
        for m in (1, 2, 4, 8):
            measured = {s: bubble(comm, pp, m, s, args.steps) for s in ("afab", "1f1b")}
            row = {"pp": pp, "dp": comm.size // pp, "m": m, "formula": bubble_formula(pp, m),
                   **measured}
            rows.append(row)
            if comm.rank == 0:
                print(f"{pp:>3} {row['dp']:>3} {m:>3} {row['formula']:>8.1%} "
                      f"{measured['afab']:>8.1%} {measured['1f1b']:>8.1%}")
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

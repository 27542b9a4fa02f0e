"""Muon against AdamW, side by side in one run: the optimizer step's share of the step time and the
bytes each rank sends, under DDP (Muon replicated) and ZeRO-1 (each matrix on its owner).

    mpiexec -n 2 python benchmarks/bench_muon.py [--batch 32] [--steps 12] [--json PATH]

Four runs (ddp and zero1, each with adamw and muon) train their own copy of the same GPT (4 blocks
of width 128, block 64, vocabulary 65: 0.8 M parameters, float32) on the same global batch; they
take turns (rounds of A A A B B B ..., one untimed step first in each turn). A step's time and
its optimizer step's time (the "optimizer step" span: for zero1 with muon it holds the two
all-to-alls) are the slowest rank's, medians over steps; bytes are those a rank sends in one
step, counted by the communicator's message log (largest over ranks).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from mpdl.autograd import optim
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel import split_bounds
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy
from mpdl.perf.bench import turns

RUNS = [("ddp", "adamw"), ("ddp", "muon"), ("zero1", "adamw"), ("zero1", "muon")]
OPTIMIZERS = {"adamw": lambda ps: optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1),
              "muon": lambda ps: optim.Muon(ps, lr=1e-3, weight_decay=0.1)}
BLOCK = 64


def make_model() -> GPT:
    return GPT(vocab_size=65, block_size=BLOCK, n_layer=4, n_head=4, n_embd=128, seed=0)


def make_strategy(kind: str, comm):
    common = dict(algorithm="ring", bucket_mb=1.0, first_bucket_mb=0.25)
    return AllReduceStrategy(comm, **common) if kind == "ddp" else ZeroStrategy(comm, 1, **common)


def counted_step(strategy, batch: Batch) -> int:
    """Bytes this rank sends in one more step of strategy, from the communicator's message log."""
    comm = strategy.comm
    comm.message_log = []
    strategy.step(batch)
    sent = sum(e[4] for e in comm.message_log if e[1] != "barrier")
    comm.message_log = None
    return sent


def optimizer_seconds(result) -> float:
    return sum(s.end - s.start for s in result.spans if s.name == "optimizer step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--json", metavar="PATH", help="one JSON line per run")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = as_communicator(world)
    p, rank = comm.size, comm.rank
    bounds = split_bounds(args.batch, p)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 65, (args.batch, BLOCK)), rng.integers(0, 65, (args.batch, BLOCK))
    mine = slice(bounds[rank], bounds[rank + 1])
    batch = Batch(x[mine], y[mine], args.batch, 1e-3)
    runs = {}
    for kind, opt in RUNS:
        runs[kind, opt] = make_strategy(kind, comm)
        runs[kind, opt].setup(make_model(), OPTIMIZERS[opt])
    psi = sum(q.data.size for q in make_model().parameters())
    step_s = {k: np.empty(args.steps) for k in RUNS}
    opt_s = {k: np.empty(args.steps) for k in RUNS}
    for turn in turns(args.steps):
        for key in RUNS:
            for rep in (None, *turn):
                world.Barrier()
                r = runs[key].step(batch)
                if rep is not None:
                    step_s[key][rep] = r.compute_s + r.exposed_s
                    opt_s[key][rep] = optimizer_seconds(r)
    rows = []
    if rank == 0:
        print(f"# Muon vs AdamW, {p} rank(s), GPT {psi:,} parameters, global batch {args.batch} x "
              f"{BLOCK} tokens, float32; median of {args.steps} steps taken in turns, slowest rank")
        print(f"{'strategy':>8} {'optimizer':>9} {'step_ms':>8} {'opt_ms':>7} {'opt_share':>9} "
              f"{'sent_MiB':>9} {'bytes_vs_adamw':>14}")
    sent = {}
    for key in RUNS:
        world.Allreduce(MPI.IN_PLACE, step_s[key], op=MPI.MAX)
        world.Allreduce(MPI.IN_PLACE, opt_s[key], op=MPI.MAX)
        sent[key] = world.allreduce(counted_step(runs[key], batch), op=MPI.MAX)
    for kind, opt in RUNS:
        step, spent = float(np.median(step_s[kind, opt])), float(np.median(opt_s[kind, opt]))
        ratio = sent[kind, opt] / sent[kind, "adamw"] if sent[kind, "adamw"] else float("nan")
        row = {"ranks": p, "strategy": kind, "optimizer": opt, "parameters": psi,
               "global_batch": args.batch, "step_ms": step * 1e3, "optimizer_ms": spent * 1e3,
               "optimizer_share": spent / step, "sent_bytes_per_step": sent[kind, opt],
               "bytes_vs_adamw": ratio}
        rows.append(row)
        if rank == 0:
            print(f"{kind:>8} {opt:>9} {row['step_ms']:>8.1f} {row['optimizer_ms']:>7.1f} "
                  f"{row['optimizer_share']:>9.3f} {sent[kind, opt] / 2**20:>9.2f} "
                  f"{ratio:>14.2f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()

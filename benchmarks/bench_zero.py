"""ZeRO stages 1-3 against DDP, side by side in one run: step time, model state, bytes sent.

    mpiexec -n 4 python benchmarks/bench_zero.py [--models mlp,gpt] [--steps 30] [--json PATH]

Per model, each strategy (DDP, ZeRO-1, ZeRO-2, ZeRO-3, ZeRO-3 without prefetch) trains its own
copy of the same model (Adam, float32, the same global batch) with the same collective algorithm
(ring); they take turns (four rounds of A A A B B B ..., one untimed step first in each turn). A
step's time is the slowest rank's; the table shows the median, the ratio to DDP, the model state
per rank (max over ranks; DDP: parameters, gradients, buckets and Adam's moments it holds), the
bytes each rank sends per step (counted by the communicator's message log), and for stage 3 the
share of all-gather time hidden behind compute (1 - main-thread wait for gathers / all-gather
time, at least 0; the wait also covers reduce-scatters queued before a gather; median over steps,
smallest over ranks).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from mpdl.autograd import optim
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.models.zoo import mlp
from mpdl.parallel import split_bounds
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy
from mpdl.perf.bench import turns

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3-noprefetch")


def make_model(name: str):
    if name == "gpt":  # 4 blocks of width 128: 0.8 M parameters
        return GPT(vocab_size=96, block_size=32, n_layer=4, n_head=4, n_embd=128, seed=0)
    return mlp((1, 28, 28), 10, np.random.default_rng(0), hidden=(512, 512, 256))


def make_data(name: str, batch: int):
    rng = np.random.default_rng(0)
    if name == "gpt":
        return rng.integers(0, 96, (batch, 32)), rng.integers(0, 96, (batch, 32))
    return (rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
            rng.integers(0, 10, batch))


def make_strategy(kind: str, comm):
    common = dict(algorithm="ring", bucket_mb=1.0, first_bucket_mb=0.25)
    if kind == "ddp":
        return AllReduceStrategy(comm, **common)
    stage = int(kind[4])
    return ZeroStrategy(comm, stage, prefetch=not kind.endswith("noprefetch"), **common)


def ddp_state_bytes(strategy) -> int:
    """What mpdl's DDP holds: parameters, the buckets (which hold the gradients) and the
    optimizer state."""
    return strategy.ddp.model_state_bytes(strategy.optimizer)


def counted_step(strategy, batch: Batch) -> int:
    """Bytes this rank sends in one more step of strategy, from the communicator's message log."""
    comm = strategy.comm
    own = comm.message_log is None
    if own:
        comm.message_log = []
    first = len(comm.message_log)
    strategy.step(batch)
    sent = sum(e[4] for e in comm.message_log[first:] if e[1] != "barrier")
    if own:
        comm.message_log = None
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per strategy")
    parser.add_argument("--batch", type=int, default=64, help="global batch (sequences for gpt)")
    parser.add_argument("--json", metavar="PATH", help="one JSON line per (model, strategy)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = as_communicator(world)
    p, rank = comm.size, comm.rank
    bounds = split_bounds(args.batch, p)
    rows = []
    if rank == 0:
        print(f"# ZeRO vs DDP, {p} ranks, Adam float32, ring, global batch {args.batch}; median "
              f"of {args.steps} steps taken in turns, step time = slowest rank")
        print(f"{'model':>5} {'strategy':>17} {'params':>9} {'step_ms':>8} {'vs_ddp':>7} "
              f"{'state_MiB':>10} {'formula':>8} {'sent_MiB':>9} {'hidden':>7}")
    for name in args.models.split(","):
        x, y = make_data(name, args.batch)
        mine = slice(bounds[rank], bounds[rank + 1])
        batch = Batch(x[mine], y[mine], args.batch, 1e-3)
        runs = {}
        for kind in STRATEGIES:
            s = make_strategy(kind, comm)
            s.setup(make_model(name), lambda ps: optim.Adam(ps, lr=1e-3))
            runs[kind] = s
        psi = sum(q.data.size for q in make_model(name).parameters())
        times = {k: np.empty(args.steps) for k in STRATEGIES}
        hidden = {k: [] for k in STRATEGIES}
        for turn in turns(args.steps):
            for kind in STRATEGIES:
                for rep in (None, *turn):
                    world.Barrier()
                    r = runs[kind].step(batch)
                    elapsed = r.compute_s + r.exposed_s
                    if rep is not None:
                        times[kind][rep] = elapsed
                        s = runs[kind]
                        if getattr(s, "stage", 0) == 3 and s.last_gather_s > 0:
                            waited = min(s.last_gather_wait_s, s.last_gather_s)
                            hidden[kind].append(1 - waited / s.last_gather_s)
        for kind in STRATEGIES:
            world.Allreduce(MPI.IN_PLACE, times[kind], op=MPI.MAX)
        formulas = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / p,
                    "zero2": 4 * psi + 12 * psi / p, "zero3": 16 * psi / p,
                    "zero3-noprefetch": 16 * psi / p}
        for kind in STRATEGIES:
            s = runs[kind]
            with s.gathered():
                pass
            if kind == "ddp":
                state = world.allreduce(ddp_state_bytes(s), op=MPI.MAX)
                sent = world.allreduce(counted_step(s, batch), op=MPI.MAX)
            else:
                state, sent = s.model_state_bytes, s.sent_bytes_per_step
            share = world.allreduce(float(np.median(hidden[kind])) if hidden[kind] else -1.0,
                                    op=MPI.MIN)
            median = float(np.median(times[kind]))
            row = {"model": name, "strategy": kind, "ranks": p, "parameters": psi,
                   "step_ms": median * 1e3,
                   "vs_ddp": median / float(np.median(times["ddp"])),
                   "model_state_bytes": int(state), "formula_bytes": formulas[kind],
                   "sent_bytes_per_step": float(sent),
                   "gather_hidden": share if share >= 0 else None}
            rows.append(row)
            if rank == 0:
                hid = f"{share:7.2f}" if share >= 0 else f"{'-':>7}"
                print(f"{name:>5} {kind:>17} {psi:>9} {row['step_ms']:>8.2f} "
                      f"{row['vs_ddp']:>7.2f} {state / 2**20:>10.2f} "
                      f"{formulas[kind] / 2**20:>8.2f} {sent / 2**20:>9.2f} {hid}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()

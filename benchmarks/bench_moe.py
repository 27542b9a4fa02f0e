"""The dense GPT against mixtures of experts (E = 4, k = 2) at ep = 1, 2, 4, side by side in one run.

    flock /tmp/mpdl-bench.lock mpiexec -n 4 python benchmarks/bench_moe.py [--steps 20]
        [--batch 128] [--reps 15] [--microbatches 4] [--json PATH]

Each configuration trains its own copy of the same GPT shape (the addition task's: 2 blocks of
width 64, 4 heads, 11 tokens, Adam, float32) on the same global batch: the dense GPT under DDP,
then the GPT with a MoE layer of 4 experts (top-2, dropless) in every block under
`ExpertParallelStrategy` at each ep dividing the ranks, and on the grids dp × pp 2 and
dp × tp 2 (`ExpertPipelineStrategy`, `--microbatches` on the pipeline, one on tp) at ep 1 and
at each ep > 1 dividing dp. They take turns (rounds of A A A B B B ..., one untimed step first
in each turn). A step's time is the slowest rank's; the table gives the median, the ratio to
the dense step, and the all-to-all share of the step (the dispatch, combine and count
exchanges, forward and backward, over the step; median over steps, largest over ranks).

Then, per ep > 1, every all-to-all algorithm against `mpi` at the sizes the run sends: the
dispatch's `alltoallv` of this rank's rows with the counts of the last step (each rank's own),
over the expert-parallel group (as an MPI communicator of its own: `mpi` runs on nothing else),
in turns, slowest rank, median.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl.autograd import optim
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.models.moe import MoESettings
from mpdl.parallel import split_bounds
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.expert import ExpertParallelStrategy
from mpdl.parallel.expert_pipeline import ExpertPipelineStrategy
from mpdl.parallel.strategy import Batch
from mpdl.perf.bench import turns

VOCAB, BLOCK = 14, 11


def make_model(moe: bool) -> GPT:
    return GPT(VOCAB, BLOCK, n_layer=2, n_head=4, n_embd=64, seed=0,
               moe=MoESettings(experts=4, top_k=2) if moe else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--batch", type=int, default=128, help="global batch (sequences)")
    parser.add_argument("--reps", type=int, default=15, help="timed all-to-alls per algorithm")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="microbatches of the pipeline configurations")
    parser.add_argument("--json", metavar="PATH", help="one JSON line per row")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = as_communicator(world)
    p, rank = comm.size, comm.rank
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, VOCAB, (args.batch, BLOCK)), rng.integers(0, VOCAB, (args.batch, BLOCK))
    configs: dict[str, Any] = {"dense": AllReduceStrategy(comm)}
    for ep in (1, 2, 4):
        if p % ep == 0:
            configs[f"moe ep={ep}"] = ExpertParallelStrategy(comm, ep=ep)
    for axis, (pp, tp) in (("pp", (2, 1)), ("tp", (1, 2))):
        dp = p // 2
        for ep in (1, 2, 4):
            if p % 2 == 0 and dp % ep == 0 and (ep == 1 or dp > 1):
                configs[f"moe ep={ep} {axis}=2"] = ExpertPipelineStrategy(
                    comm, dp, pp, tp, ep=ep, microbatches=args.microbatches if pp > 1 else 1)
    batches = {}
    for name, s in configs.items():
        s.setup(make_model(name != "dense"), lambda ps: optim.Adam(ps, lr=1e-3))
        bounds = split_bounds(args.batch, s.data_comm.size)
        mine = slice(bounds[s.data_comm.rank], bounds[s.data_comm.rank + 1])
        batches[name] = Batch(x[mine], y[mine], args.batch, 1e-3)
    times = {k: np.empty(args.steps) for k in configs}
    shares = {k: np.zeros(args.steps) for k in configs}
    for turn in turns(args.steps):
        for name, s in configs.items():
            for rep in (None, *turn):
                world.Barrier()
                r = s.step(batches[name])
                if rep is not None:
                    times[name][rep] = r.compute_s + r.exposed_s
                    a2a = sum(sp.end - sp.start for sp in r.spans
                              if sp.name.startswith(("dispatch", "combine")))
                    shares[name][rep] = a2a / times[name][rep] if name != "dense" else 0.0
    rows = []
    if rank == 0:
        print(f"# dense GPT vs MoE (E = 4, k = 2, dropless), {p} ranks, global batch "
              f"{args.batch} x {BLOCK} tokens, Adam float32; median of {args.steps} steps in "
              f"turns, step time = slowest rank")
        print(f"{'config':>15} {'step_ms':>8} {'vs_dense':>9} {'a2a_share':>10}")
    dense = None
    for name in configs:
        world.Allreduce(MPI.IN_PLACE, times[name], op=MPI.MAX)
        world.Allreduce(MPI.IN_PLACE, shares[name], op=MPI.MAX)
        median = float(np.median(times[name]))
        dense = median if dense is None else dense
        row = {"config": name, "ranks": p, "step_ms": median * 1e3, "vs_dense": median / dense,
               "alltoall_share": float(np.median(shares[name]))}
        rows.append(row)
        if rank == 0:
            print(f"{name:>15} {row['step_ms']:>8.2f} {row['vs_dense']:>9.2f} "
                  f"{row['alltoall_share']:>10.1%}", flush=True)
    for s in configs.values():
        if not isinstance(s, ExpertParallelStrategy) or s.ep == 1:
            continue
        rows += time_algorithms(s, args.reps, world)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def time_algorithms(strategy: ExpertParallelStrategy, reps: int, world: MPI.Comm) -> list[dict]:
    """Every all-to-all algorithm and mpi on the dispatch of the strategy's last step."""
    dispatcher = strategy.dispatchers[0]
    send = dispatcher.last_send_counts
    rows_out = np.random.default_rng(world.Get_rank()).standard_normal(
        (int(sum(send)), strategy.moes[0].n_embd)).astype(np.float32)
    # the same ranks as strategy.ep_comm, as an MPI communicator of their own (`mpi` needs one)
    comm = as_communicator(world.Split(world.Get_rank() // strategy.ep, world.Get_rank()))
    names = C.algorithms("alltoall")
    times = {a: np.empty(reps) for a in names}
    for turn in turns(reps):
        for a in names:
            for rep in (None, *turn):
                world.Barrier()
                start = MPI.Wtime()
                C.alltoallv(rows_out, send, comm=comm, algorithm=a)
                if rep is not None:
                    times[a][rep] = MPI.Wtime() - start
    sizes = world.allgather(rows_out.nbytes / comm.size)
    out = []
    if world.Get_rank() == 0:
        print(f"# ep={strategy.ep}: dispatch alltoallv over {comm.size} ranks, "
              f"{np.mean(sizes):.0f} B per destination on average (the last step's counts); "
              f"median of {reps}, slowest rank")
        print(f"{'algorithm':>13} {'us':>9} {'vs_mpi':>7}")
    for a in names:
        world.Allreduce(MPI.IN_PLACE, times[a], op=MPI.MAX)
    base = float(np.median(times["mpi"]))
    for a in names:
        median = float(np.median(times[a]))
        out.append({"ep": strategy.ep, "algorithm": a, "bytes_per_destination": float(
            np.mean(sizes)), "us": median * 1e6, "vs_mpi": median / base})
        if world.Get_rank() == 0:
            print(f"{a:>13} {median * 1e6:>9.1f} {median / base:>7.2f}", flush=True)
    return out


if __name__ == "__main__":
    main()

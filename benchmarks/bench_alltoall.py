"""All-to-all: every hand-written algorithm, auto and the MPI library's own, side by side in one run.

    flock /tmp/mpdl-bench.lock mpiexec -n 4 python benchmarks/bench_alltoall.py \\
        [--sizes 8,64,512,4K,32K,256K,2M,16M] [--reps 15] [--loop 1]

Sizes are bytes per destination (each rank sends p times that). Per size, the algorithms take
turns as in `mpdl bench` (rounds of A A A B B B ..., each turn after one untimed call, so every
timed call follows a call of the same algorithm); a repetition times `--loop` calls back to back
after a barrier (time per call) and takes the slowest rank's time; the table shows the median,
busbw (nccl-tests: bytes sent per rank / time · (p-1)/p) and the ratio to `mpi`.
`hierarchical@2` is the hierarchical algorithm over emulated nodes of 2 ranks
(MPDL_RANKS_PER_NODE=2, on a second communicator), timed in the same turns.

`auto` has no turns of its own: it is timed in the turns of the algorithm it chooses, call for
call in turn with it and with mpi (chosen, auto, mpi, auto, mpi, chosen, mpi, chosen, auto, ...:
each goes first in a third of the trios), `--pair-reps` times as many repetitions as the others,
so the three are measured in the same moments of a shared machine. The summary gives, per size,
the best hand-written algorithm's time over mpi's (medians of their turns), auto's time over the
best's as the product of two factors: auto / its choice, the median of the trios' ratios (what
the call through `auto` adds), and its choice / the best, their medians (what the choice loses; 1
where auto chose the best); and auto's choice / mpi as the median of the trios' ratios, the
closer comparison where the choice is the best (a ratio of medians taken in different turns
moves with the scheduler's drift between turns at 4-5 ranks on 2 cores).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import settings
from mpdl.comm import as_communicator, polling
from mpdl.comm.mpi import MPIComm
from mpdl.perf.bench import turns
from mpdl.perf.units import parse_size
from mpdl.tuning import auto

NODES_OF_2 = "hierarchical@2"
#: mpi's calls in the turns of auto's choice (timed apart from mpi's own turns)
PAIRED_MPI = "mpi (paired)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,64,512,4K,32K,256K,2M,16M",
                        help="comma list of bytes per destination (8, 4K, 16M)")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per algorithm")
    parser.add_argument("--large-reps", type=int, default=5,
                        help="timed repetitions from 1 MiB per destination on")
    parser.add_argument("--loop", type=int, default=1, help="calls per repetition")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pair-reps", type=int, default=3,
                        help="repetitions of auto and its choice per repetition of the others")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    comm = as_communicator(None)
    polling.load()  # the plans' compiled waits, loaded before any timing
    settings.update(ranks_per_node=2)
    pairs = MPIComm(world.Dup())
    settings.use(None)
    names = [*C.algorithms("alltoall"), NODES_OF_2, "auto"]
    nodes = len(comm.node_groups())  # (collective the first time: every rank asks)
    if rank == 0:
        where = "one node" if nodes == 1 else f"{nodes} nodes"
        print(f"# all-to-all, {p} ranks, {where} ({NODES_OF_2}: emulated nodes of 2); median of "
              f"the repetitions taken in turns, {args.loop} call(s) each, time = slowest rank")
        print(f"{'B/dest':>9} {'algorithm':>16} {'time(us)':>11} {'busbw(GB/s)':>12} {'mpi/this':>9}")
    summary = []
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(1, size // 4)
        x = np.random.default_rng(rank).standard_normal((p, count)).astype(np.float32)
        out = np.empty_like(x)
        reps = args.reps if size < 1 << 20 else args.large_reps
        calls = {n: _call(n, x, out, pairs if n == NODES_OF_2 else comm) for n in names}
        calls[PAIRED_MPI] = calls["mpi"]
        times: dict = {n: [] for n in [*names, PAIRED_MPI]}
        for _ in range(args.warmup):
            for name in names:
                calls[name]()
        chosen = auto.algorithm_for("alltoall", x.nbytes, comm).name
        for turn in turns(reps):
            for name in names[:-1]:  # auto runs in its choice's turns
                if name == chosen:  # its calls, auto's and mpi's in turn, each first in a third
                    trio = (name, "auto", PAIRED_MPI)
                    order = [trio[k % 3:] + trio[:k % 3] for k in range(len(turn) * args.pair_reps)]
                else:
                    order = [(name,)] * len(turn)
                for untimed in order[0]:  # the turn's first call of each
                    world.Barrier()
                    calls[untimed]()
                for group in order:
                    for timed in group:
                        world.Barrier()
                        t0 = time.perf_counter()
                        for _ in range(args.loop):
                            calls[timed]()
                        times[timed].append((time.perf_counter() - t0) / args.loop)
        for name in times:
            times[name] = np.array(times[name])
            world.Allreduce(MPI.IN_PLACE, times[name], op=MPI.MAX)
        if rank == 0:
            medians = {n: float(np.median(times[n])) for n in names}
            for name in names:
                busbw = x.nbytes / medians[name] * (p - 1) / p / 1e9
                label = f"auto→{chosen}" if name == "auto" else name
                print(f"{count * 4:>9} {label:>16} {medians[name] * 1e6:>11.1f} {busbw:>12.3f} "
                      f"{medians['mpi'] / medians[name]:>8.2f}x", flush=True)
            ours = [n for n in names if n not in ("mpi", "auto", NODES_OF_2)]
            best = min(ours, key=medians.get)
            overhead = float(np.median(times["auto"] / times[chosen]))
            choice = medians[chosen] / medians[best]
            paired = float(np.median(times[chosen] / times[PAIRED_MPI]))
            summary.append((count * 4, best, medians[best] / medians["mpi"], chosen,
                            overhead * choice, overhead, choice, paired,
                            medians[NODES_OF_2] / medians["mpi"]))
    if rank == 0:
        print(f"\n# per size: best hand-written / mpi, auto / best (goals <= 1.10) = auto / its "
              f"choice (paired) x choice / best, auto's choice / mpi (paired), {NODES_OF_2} / mpi")
        for size, best, vs_mpi, chosen, vs_best, overhead, choice, paired, nodes in summary:
            print(f"{size:>9}  best {best:<12} {vs_mpi:5.2f}x mpi   auto→{chosen:<12} "
                  f"{vs_best:5.2f}x best ({overhead:4.2f} x {choice:4.2f})   "
                  f"{chosen} {paired:4.2f}x mpi (paired)   {NODES_OF_2} {nodes:5.2f}x mpi")


def _call(name: str, x: np.ndarray, out: np.ndarray, comm):
    algorithm = "hierarchical" if name == NODES_OF_2 else name
    return lambda: C.alltoall(x, comm=comm, algorithm=algorithm, out=out)


if __name__ == "__main__":
    main()

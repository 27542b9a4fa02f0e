"""All-reduce: every hand-written algorithm against the MPI library's own, side by side in one run.

    mpiexec -n 4 python benchmarks/bench_allreduce.py [--sizes 1K,16M] [--reps 30]

Per size, the algorithms take turns as in `mpdl bench` (four rounds of A A A B B B C C C, each
turn after one untimed call, so every timed call follows a call of the same algorithm); each
repetition's time is the slowest rank's; the table shows the median, busbw (nccl-tests:
algbw·2(p-1)/p) and the ratio to `mpi`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl.perf.bench import turns
from mpdl.perf.units import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1K,16M", help="comma list of message sizes in bytes (1K, 16M)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--algorithms", default="all")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    names = C.algorithms("allreduce") if args.algorithms == "all" else args.algorithms.split(",")
    if rank == 0:
        print(f"# all-reduce, float32, sum, {p} ranks; median of {args.reps} repetitions taken in "
              f"turns, time = slowest rank")
        print(f"{'size(B)':>10} {'algorithm':>18} {'time(us)':>10} {'busbw(GB/s)':>12} {'vs mpi':>8}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        x = np.random.default_rng(rank).standard_normal(size // 4).astype(np.float32)
        out = np.empty_like(x)
        times = {n: np.empty(args.reps) for n in names}
        for _ in range(args.warmup):
            for name in names:
                C.allreduce(x, algorithm=name, out=out)
        for turn in turns(args.reps):
            for name in names:
                for rep in (None, *turn):  # None: the turn's untimed first call
                    comm.Barrier()
                    t0 = time.perf_counter()
                    C.allreduce(x, algorithm=name, out=out)
                    if rep is not None:
                        times[name][rep] = time.perf_counter() - t0
        for name in names:
            comm.Allreduce(MPI.IN_PLACE, times[name], op=MPI.MAX)
        if rank == 0:
            medians = {n: float(np.median(times[n])) for n in names}
            for name in names:
                busbw = x.nbytes / medians[name] * 2 * (p - 1) / p / 1e9
                ratio = medians["mpi"] / medians[name] if "mpi" in medians else float("nan")
                print(f"{x.nbytes:>10} {name:>18} {medians[name] * 1e6:>10.1f} {busbw:>12.2f} {ratio:>7.2f}x")


if __name__ == "__main__":
    main()

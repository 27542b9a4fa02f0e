"""Small-message latency: tight loops of every all-reduce path against the MPI library's own call.

    mpiexec -n 2 python benchmarks/bench_latency.py [--rounds 11] [--sizes 8,64,1K,...]

For each size (float32, sum), in one run and interleaved (the order rotates every round), a turn
is one barrier and then a tight loop of calls (no barrier between calls, `out=` preallocated,
OSU-style) of:
  raw           `comm.Allreduce(x, out)` through mpi4py (the reference)
  ALGORITHM     `mpdl.collectives.allreduce(x, algorithm=ALGORITHM, out=out)` (its cached plan)
  plan:ALGO     a persistent plan `h = allreduce_init(...)` run as `h()`
A turn's time per call is the slowest rank's; the table shows the median over rounds (us) and
its ratio to raw. The summary checks issue #21's targets: 8 B `mpi` / raw <= 1.3, 1 KiB best
hand-written / raw <= 1.6, 1 MiB and 16 MiB best / raw <= 0.6.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import tuning as T
from mpdl.comm import as_communicator
from mpdl.perf.units import parse_size

SIZES = "8,64,512,1K,4K,16K,64K,1M,16M"
ALGORITHMS = "mpi,recursive_doubling,ring,rabenseifner,tree,shm"
PLANS = "mpi,recursive_doubling,ring,shm"


def calls_for(nbytes: int) -> int:
    """Calls per turn: a few milliseconds of work at any size."""
    return max(3, min(400, (4 << 20) // max(nbytes, 1) // 8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=SIZES, help=f"message sizes ({SIZES})")
    parser.add_argument("--algorithms", default=ALGORITHMS, help=f"ordinary calls ({ALGORITHMS})")
    parser.add_argument("--plans", default=PLANS, help=f"persistent plans ({PLANS})")
    parser.add_argument("--rounds", type=int, default=11, help="turns of each (11)")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    comm = as_communicator(None)
    algorithms = [a for a in args.algorithms.split(",") if a]
    planned = [a for a in args.plans.split(",") if a]
    summary: dict[int, dict[str, float]] = {}
    if comm.rank == 0:
        print(f"# all-reduce latency, float32 sum, {comm.size} ranks, tight loops, "
              f"{args.rounds} interleaved rounds; median us per call (slowest rank), ratio to raw")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        x = np.ones(max(size // 4, 1), np.float32)
        out = np.empty_like(x)
        variants = {"raw": lambda x=x, out=out: world.Allreduce(x, out, op=MPI.SUM)}
        for a in algorithms:
            variants[a] = lambda a=a, x=x, out=out: C.allreduce(x, algorithm=a, comm=comm, out=out)
        for a in planned:
            h = T.allreduce_init(x, algorithm=a, comm=comm, out=np.empty_like(x))
            variants[f"plan:{a}"] = h
        calls = calls_for(x.nbytes)
        names = list(variants)
        times: dict[str, list[float]] = {n: [] for n in names}
        for f in variants.values():  # warm up: plans made, windows mapped, caches filled
            f()
        for turn in range(args.rounds):
            shift = turn % len(names)
            for name in names[shift:] + names[:shift]:
                f = variants[name]
                world.Barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    f()
                per_call = (time.perf_counter() - start) / calls
                times[name].append(world.allreduce(per_call, op=MPI.MAX))
        medians = {n: float(np.median(t)) for n, t in times.items()}
        summary[x.nbytes] = medians
        if comm.rank == 0:
            raw = medians["raw"]
            print(f"\n## {x.nbytes} B ({calls} calls per turn)")
            for n in names:
                print(f"{n:24s} {medians[n] * 1e6:10.2f} us  {medians[n] / raw:6.2f} x raw")
    if comm.rank == 0:
        print("\n# targets (issue #21)")
        for nbytes, medians in summary.items():
            raw = medians["raw"]
            ours = {n: t for n, t in medians.items() if n != "raw"}
            best = min(ours, key=ours.get)
            hand = {n: t for n, t in ours.items() if not n.endswith("mpi")}
            line = f"{nbytes:>9d} B  best {best} {ours[best] / raw:5.2f} x raw"
            if hand:
                hbest = min(hand, key=hand.get)
                line += f";  best hand-written {hbest} {hand[hbest] / raw:5.2f} x raw"
            if "mpi" in medians:
                line += f";  mpi {medians['mpi'] / raw:5.2f} x raw"
            if "plan:mpi" in medians:
                line += f";  plan:mpi {medians['plan:mpi'] / raw:5.2f} x raw"
            print(line)


if __name__ == "__main__":
    main()

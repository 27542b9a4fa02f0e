"""Per-call time of a small planned all-reduce: the Python a plan runs per call, measured.

    mpiexec -n 2 python benchmarks/bench_plan_call.py [--count 8] [--calls 20000] [--batches 5]

Times `--calls` calls of `allreduce(x, out=out)` (its cached plan), of a plan's `h()`, float32,
recursive doubling, and of MPI's own `MPI_Allreduce` on the same arrays, after a barrier,
`--batches` times each, in turns; rank 0 prints the medians in µs per call and h()'s ratio to
MPI's. `MPDL_FLIGHT_RECORDS=0` times the plans bare, the default with the flight recorder's
wrapper. To compare two trees, run it with each on PYTHONPATH in turns.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mpdl import collectives as C
from mpdl.comm import as_communicator
from mpdl.tuning import allreduce_init


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8, help="float32 elements (8)")
    parser.add_argument("--calls", type=int, default=20000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=5)
    args = parser.parse_args()
    comm = as_communicator(None)
    world = comm.mpi
    x = np.ones(args.count, np.float32)
    out = np.empty_like(x)
    h = allreduce_init(x, algorithm="recursive_doubling", out=np.empty_like(x))

    def cached() -> None:
        C.allreduce(x, algorithm="recursive_doubling", out=out)

    def mpi() -> None:
        world.Allreduce(x, out)

    def batch(call) -> float:
        comm.barrier()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        return (time.perf_counter() - start) / args.calls * 1e6

    kinds = {"allreduce(out=)": cached, "h()": h, "MPI_Allreduce": mpi}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for call in kinds.values():
        batch(call)
    for _ in range(args.batches):
        for name, call in kinds.items():
            times[name].append(batch(call))
    medians = {name: statistics.median(t) for name, t in times.items()}
    if comm.rank == 0:
        print(f"{comm.size} ranks, {x.nbytes} B, flight recorder "
              f"{'on' if comm.flight is not None else 'off'}: " +
              ", ".join(f"{name} {us:.3f} us" for name, us in medians.items()) +
              f"; h() / MPI_Allreduce {medians['h()'] / medians['MPI_Allreduce']:.2f}")


if __name__ == "__main__":
    main()

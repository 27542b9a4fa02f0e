"""What rounding a 16- or 8-bit sum once costs: the public all-reduce (float32 partials, rounded
once) against the same algorithm run straight on the narrow array (rounded at every hop) and a
float32 all-reduce of the same count, side by side in one run.

    mpiexec -n 4 python benchmarks/bench_narrow_sum.py [--counts 1K,256K,4M] [--reps 20]

Per count and algorithm the three take turns (once, per hop, float32, once, ...), each after one
untimed call; each repetition's time is the slowest rank's; the table shows the medians and the
ratio of rounded-once to per-hop.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import backend
from mpdl import collectives as C
from mpdl.collectives import registry
from mpdl.comm import as_communicator
from mpdl.perf.units import parse_size


def variants(x: np.ndarray, name: str, comm) -> dict:
    """The three all-reduces of x compared (see the module's docstring)."""
    algorithm = registry.resolve("allreduce", name)
    x32, work = x.astype(np.float32), np.empty_like(x)

    def per_hop() -> None:
        np.copyto(work, x)
        algorithm.run(comm, work, "sum")

    return {"once": lambda: C.allreduce(x, algorithm=name), "hop": per_hop,
            "fp32": lambda: C.allreduce(x32, algorithm=name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1K,256K,4M", help="comma list of element counts")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--algorithms", default="ring,recursive_doubling,tree")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    world, comm = MPI.COMM_WORLD, as_communicator(None)
    dtype = backend.check_dtype(args.dtype)
    if world.rank == 0:
        print(f"# all-reduce sum of {args.dtype}, {world.size} ranks, median ms of {args.reps} "
              f"(slowest rank)\n| count | algorithm | rounded once | per hop | float32 | once/per hop |"
              f"\n|---|---|---|---|---|---|")
    for count in (int(parse_size(c)) for c in args.counts.split(",")):
        x = np.random.default_rng(world.rank).standard_normal(count).astype(dtype)
        for name in args.algorithms.split(","):
            runs = variants(x, name, comm)
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.reps):
                for key, run in runs.items():
                    run()
                    world.Barrier()
                    start = time.perf_counter()
                    run()
                    times[key].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
            if world.rank == 0:
                ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
                print(f"| {count} | {name} | {ms['once']:.3f} | {ms['hop']:.3f} | "
                      f"{ms['fp32']:.3f} | {ms['once'] / ms['hop']:.2f} |")


if __name__ == "__main__":
    main()

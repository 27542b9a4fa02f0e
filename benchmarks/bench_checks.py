"""What the mismatch checks and the non-finite guard cost: a 1 KiB ring all-reduce with the
argument check (MPDL_CHECK) off and on, the guard's per-step check, and creating a plan (with its
signature check), in turns.

    mpiexec -n 2 python -m mpi4py benchmarks/bench_checks.py [--rounds 5] [--calls 300]

Each round runs every kind after a barrier; prints rank 0's median time per call of each kind.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.training.guard import Guard
from mpdl.tuning import allreduce_init


class Param:
    """A parameter of 16 KiB of float32 weights with a gradient of the same size."""

    def __init__(self) -> None:
        self.data = np.ones(4096, np.float32)
        self.grad = np.ones(4096, np.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    comm = as_communicator(None)
    x = np.ones(256, np.float32)
    params = [Param() for _ in range(4)]
    guard = Guard(comm, 1, "fp32")
    kinds = {"check off": lambda: allreduce(x, algorithm="ring"),
             "check on": lambda: allreduce(x, algorithm="ring"),
             "guard step check": lambda: guard.after_step(1, 1.0, 4, params, None, 0.1),
             "plan creation": lambda: allreduce_init(np.ones(256, np.float32), algorithm="ring")}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, run in kinds.items():
            comm.check = kind == "check on"
            calls = max(1, args.calls // 15) if kind == "plan creation" else args.calls
            comm.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[kind].append((time.perf_counter() - start) / calls)
    comm.check = False
    if comm.rank == 0:
        for kind, seconds in times.items():
            print(f"{kind:>18}: {np.median(seconds) * 1e6:9.1f} us per call")


if __name__ == "__main__":
    main()

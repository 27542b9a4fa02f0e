"""What online verification costs: the per-run times of `auto` all-reduce plans while they verify.

    MPDL_VERIFY_RUNS=3 mpiexec -n 2 python benchmarks/bench_verify.py

For each size, a persistent all-reduce plan made with auto runs 2K + 20 times (K: MPDL_VERIFY_RUNS),
each run after a barrier, timed on every rank; per run the slowest rank's time. It prints the
trial's two algorithms and the verdict, the first 2K runs' total, the median of the steady runs
after them, and the difference (the first 2K runs include both algorithms' first-run setup).
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from mpdl import settings
from mpdl import tuning as T
from mpdl.comm import MPIComm

SIZES = (1 << 16, 1 << 20, 1 << 22)
STEADY_RUNS = 20


def main() -> None:
    comm = MPIComm(MPI.COMM_WORLD)
    trial_runs = 2 * settings.current().verify_runs
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, np.float32)
        plan = T.allreduce_init(x, algorithm="auto", comm=comm)
        names = plan.trial.names if plan.trial is not None else (plan.algorithm,)
        times = []
        for _ in range(trial_runs + STEADY_RUNS):
            comm.barrier()
            t0 = time.perf_counter()
            plan()
            times.append(time.perf_counter() - t0)
        slowest = np.max(comm.allgather_object(times), axis=0)
        steady = float(np.median(slowest[trial_runs:]))
        first = float(np.sum(slowest[:trial_runs]))
        if comm.rank == 0:
            print(f"{nbytes:>9} B  trial {'/'.join(names)} -> {plan.algorithm}: first "
                  f"{trial_runs} runs {first * 1e3:.2f} ms, steady {steady * 1e3:.3f} ms/run, "
                  f"extra {(first - trial_runs * steady) * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()

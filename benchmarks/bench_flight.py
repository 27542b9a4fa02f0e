"""What the flight recorder costs: a tight loop of small all-reduces with the recorder on and off.

    mpiexec -n 2 python benchmarks/bench_flight.py [--size 1K] [--calls 2000] [--rounds 15] [--plan]

The two take turns (on, off, off, on, on, off, ...), each turn one barrier and then `--calls` all-reduces
of `--size` bytes (float32, sum, `--algorithm`; with `--plan`, a persistent plan's `h()` instead of
`allreduce(..., out=)`); a turn's time per call is the slowest rank's.
Prints the median per call of each and their ratio (the target: on / off <= 1.05 at 1 KiB).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import tuning as T
from mpdl.comm import as_communicator, flight
from mpdl.perf.units import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1K", help="message size in bytes (1K)")
    parser.add_argument("--calls", type=int, default=2000, help="all-reduces per turn")
    parser.add_argument("--rounds", type=int, default=15, help="turns of each")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--plan", action="store_true", help="run a persistent plan (allreduce_init)")
    args = parser.parse_args()
    comm = as_communicator(None)
    recorder = flight.recorder()
    if recorder is None:
        raise SystemExit("the flight recorder is off (MPDL_FLIGHT_RECORDS=0)")
    x = np.ones(parse_size(args.size) // 4, np.float32)
    out = np.empty_like(x)
    calls = {}
    for mode in ("off", "on"):  # a plan made while the recorder is off runs bare
        comm.flight = recorder if mode == "on" else None
        if args.plan:
            calls[mode] = T.allreduce_init(x, algorithm=args.algorithm, comm=comm, out=out)
        else:
            def call() -> None:
                C.allreduce(x, algorithm=args.algorithm, comm=comm, out=out)
            calls[mode] = call
    times: dict[str, list[float]] = {"on": [], "off": []}
    for turn in range(args.rounds):
        for mode in (("on", "off") if turn % 2 == 0 else ("off", "on")):
            comm.flight = recorder if mode == "on" else None
            call = calls[mode]
            comm.barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            per_call = (time.perf_counter() - start) / args.calls
            times[mode].append(MPI.COMM_WORLD.allreduce(per_call, op=MPI.MAX))
    comm.flight = recorder
    if comm.rank == 0:
        on, off = (float(np.median(times[m])) for m in ("on", "off"))
        how = "plan" if args.plan else "allreduce(out=)"
        print(f"# all-reduce {args.algorithm} ({how}), {x.nbytes} B, {comm.size} ranks, {args.calls} calls "
              f"x {args.rounds} turns each, interleaved; median per call, slowest rank")
        print(f"recorder on  {on * 1e6:8.2f} us")
        print(f"recorder off {off * 1e6:8.2f} us")
        print(f"on / off     {on / off:8.3f}")


if __name__ == "__main__":
    main()

"""What one all-to-all call costs its last rank, with no peer to wait for: MPI_Alltoall, a minimal
mpi4py point-to-point all-to-all (no mpdl code), and mpdl's calls.

    flock /tmp/mpdl-bench.lock mpiexec -n 4 python benchmarks/bench_alltoall_overhead.py \\
        [--sizes 8,512,4K] [--reps 60] [--algorithm scattered]

Each repetition: a barrier; every rank but the last calls at once, the last one sleeps 3 ms first,
so the messages for it have arrived and its peers' receives are posted when it calls. Its call
time is then the call's own work (Python, posting, matching, copying), without the scheduling of
peers that dominates an oversubscribed node's all-to-all. Rows (median over the repetitions, the
last rank's time, and its ratio to MPI_Alltoall's):

  mpi           MPI_Alltoall through mpi4py
  p2p           persistent Recv_init/Send_init to every peer, Startall, own block, Waitall
  p2p-fresh     the same with Irecv/Isend made afresh for every call
  plan          mpdl: alltoall_init(x, out=out) made once, plan() per call
  cached        mpdl: alltoall(x, out=out) (the ordinary call, which keeps a plan of these arrays)
  one-shot      mpdl: alltoall(x) (a new result array each call: checks, layout, messages)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpdl import collectives as C
from mpdl.comm import as_communicator
from mpdl.perf.units import parse_size
from mpdl.tuning.plan import alltoall_init

#: how long the last rank lets its peers go ahead
HEAD_START_S = 3e-3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,512,4K", help="bytes per destination (8, 4K)")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--algorithm", default="scattered", help="mpdl's algorithm for its rows")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    p, rank = world.Get_size(), world.Get_rank()
    last = p - 1
    raw = world.Dup()
    comm = as_communicator(None)
    if rank == last:
        print(f"# all-to-all, {p} ranks: the last rank's call time (us), median of {args.reps}, "
              f"and x mpi; mpdl rows use {args.algorithm}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(1, size // 4)
        x = np.random.default_rng(rank).standard_normal((p, count)).astype(np.float32)
        out = np.empty_like(x)
        calls, persistent = _calls(raw, comm, x, out, args.algorithm)
        for call in calls.values():
            for _ in range(3):
                call()
        times: dict = {name: [] for name in calls}
        for _ in range(args.reps):
            for name, call in calls.items():
                world.Barrier()
                if rank == last:
                    time.sleep(HEAD_START_S)
                    t0 = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - t0)
                else:
                    call()
        if rank == last:
            medians = {name: float(np.median(t)) for name, t in times.items()}
            print(f"{count * 4:>8} B  " + "  ".join(
                f"{name} {m * 1e6:.1f} ({m / medians['mpi']:.1f}x)" for name, m in medians.items()),
                flush=True)
        for request in persistent:
            request.Free()
        calls["plan"].free()


def _calls(raw, comm, x: np.ndarray, out: np.ndarray, algorithm: str) -> tuple[dict, list]:
    """(the calls by row name, the persistent requests of the p2p row)."""
    p, r = raw.Get_size(), raw.Get_rank()
    B = MPI.BYTE
    send, recv = x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
    nb = send.size // p
    own_in, own_out = send[r * nb:(r + 1) * nb], recv[r * nb:(r + 1) * nb]
    peers = [q for q in range(p) if q != r]
    persistent = ([raw.Recv_init([recv[q * nb:(q + 1) * nb], B], q, 1) for q in peers]
                  + [raw.Send_init([send[q * nb:(q + 1) * nb], B], q, 1) for q in peers])
    startall, waitall = MPI.Prequest.Startall, MPI.Request.Waitall

    def p2p() -> None:
        startall(persistent)
        np.copyto(own_out, own_in)
        waitall(persistent)

    def p2p_fresh() -> None:
        requests = ([raw.Irecv([recv[q * nb:(q + 1) * nb], B], q, 2) for q in peers]
                    + [raw.Isend([send[q * nb:(q + 1) * nb], B], q, 2) for q in peers])
        np.copyto(own_out, own_in)
        waitall(requests)

    plan = alltoall_init(x, comm, algorithm, out)
    return {"mpi": lambda: raw.Alltoall([x, B], [out, B]), "p2p": p2p, "p2p-fresh": p2p_fresh,
            "plan": plan, "cached": lambda: C.alltoall(x, comm, algorithm, out),
            "one-shot": lambda: C.alltoall(x, comm, algorithm)}, persistent


if __name__ == "__main__":
    main()

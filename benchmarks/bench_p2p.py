"""Ordinary against persistent point-to-point messages, as a pipeline stage sends and receives
them, side by side in one run.

    mpiexec -n 2 python benchmarks/bench_p2p.py [--rounds 11] [--iters 200] [--json PATH]

A ping-pong between ranks 0 and 1 (float32, sizes of a microbatch's activations), every way
taking turns in each round; the time per round trip is rank 0's, median over rounds:

- ordinary: `isend` of the array to send (the stage output), `recv` into a new array;
- recv_init: `isend` as above, the receive a persistent request into a buffer kept between calls
  (what `PipelineStrategy` does);
- both: the array copied into a buffer kept between calls and sent by a persistent request, the
  receive persistent too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

from mpdl.comm import as_communicator

SIZES = [1 << 10, 8 << 10, 64 << 10, 512 << 10, 4 << 20]
WAYS = ("ordinary", "recv_init", "both")


def make_way(comm, way: str, nbytes: int):
    """A function doing one round trip of nbytes (rank 0: send, then receive; rank 1: the
    reverse)."""
    n = nbytes // 4
    data = np.ones(n, np.float32)  # what the stage computed and sends
    peer = 1 - comm.rank
    kept = np.empty(n, np.float32)
    recv = comm.recv_init(kept, peer, "pong") if way != "ordinary" else None
    out = np.empty(n, np.float32)
    send = comm.send_init(out, peer, "ping") if way == "both" else None

    def send_it() -> None:
        if send is None:
            comm.waitall([comm.isend(data, peer, "ping")])
        else:
            np.copyto(out, data)
            comm.waitall([send.start()])

    def recv_it() -> None:
        if recv is None:
            comm.recv(np.empty(n, np.float32), peer, "pong")
        else:
            comm.waitall([recv.start()])

    def round_trip() -> None:
        if comm.rank == 0:
            send_it()
            recv_it()
        else:
            recv_it()
            send_it()

    return round_trip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    world = as_communicator(None)
    if world.size < 2:
        raise SystemExit("bench_p2p: run it under mpiexec -n 2 (or more: ranks 2+ idle)")
    comm = world.sub([0, 1]) if world.rank < 2 else None
    results: dict[int, dict[str, float]] = {}
    for nbytes in SIZES:
        iters = max(10, args.iters * (64 << 10) // max(nbytes, 64 << 10))
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        ways = {w: make_way(comm, w, nbytes) for w in WAYS} if comm is not None else {}
        for _ in range(args.rounds):
            for w in WAYS:
                MPI.COMM_WORLD.Barrier()
                if comm is None:
                    continue
                ways[w]()  # one untimed round trip
                start = time.perf_counter()
                for _ in range(iters):
                    ways[w]()
                times[w].append((time.perf_counter() - start) / iters)
        if world.rank == 0:
            results[nbytes] = {w: statistics.median(t) for w, t in times.items()}
    if world.rank == 0:
        print("| size | ordinary µs | recv_init µs (×) | both µs (×) |")
        print("|---|---|---|---|")
        for nbytes, r in results.items():
            base = r["ordinary"]
            print(f"| {nbytes >> 10} KiB | {base * 1e6:.1f} | {r['recv_init'] * 1e6:.1f} "
                  f"({r['recv_init'] / base:.2f}) | {r['both'] * 1e6:.1f} "
                  f"({r['both'] / base:.2f}) |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()

"""Measure α, β and γ on this machine and fit the cost model's parameters (`mpdl calibrate`).

Every rank takes part at once, as in a collective. For α and β, neighbouring ranks of a node
exchange messages in pairs. With two or more ranks on a node they also pass them round a ring
(each sends to the next and receives from the previous, 2(p-1) steps in a row, each forwarding
what the step before brought, as in the ring algorithms), which with more ranks than cores is
slower, since every rank must be scheduled, and slower still when each step waits on the one
before instead of starting after a barrier; and they take the ring reduce-scatter's steps the
same way, each adding the block it received into the next (so the reduction is timed at the rate
it runs at, on a block just received). With several nodes, equal local ranks of paired nodes
exchange messages. Each exchange is timed as `mpdl bench` times a call (barrier, one call, slowest
rank). Every rank reduces arrays for γ (per dtype) and copies them, on arrays not in cache; copies
one pair of buffers call after call at each size (the API's input copy, as repeated calls meet
it); and copies a window chunk that stays in cache (the shm algorithm's). The barrier shm takes
twice per call is measured inside an 8-byte shm all-reduce. On one node, the API's fixed cost
per call is an 8-byte ring all-reduce less its 2(p-1) steps, every rank calling at once, and the
handoff what the same call costs more when handed to the communication thread. Odd ranks wait
for a message while even ranks compute, for 1 and 8 ms: what a wait takes from the cores (CPU
seconds per wait, share of a core per second of it) is the line through the two. A collective's
time is set by its slowest rank, so each figure is the maximum over ranks. Last, every rank times
float32 512×512 GEMMs at once (`mpdl.training.throughput.gemm_flops`), and the best rank's FLOP/s
is the per-core peak `mpdl train` reports model-FLOPs utilisation against. Then every all-reduce
algorithm `auto` may pick is timed at a few sizes (`firstuse.allreduce_table`, as `auto`'s
first-use calibration does): for this world shape the model interpolates those times. `calibrate`
stores the parameters under this world size in the cost model's file ($MPDL_COST_MODEL, or
~/.cache/mpdl/costmodel.json; XDG_CACHE_HOME is honoured); `auto` and `mpdl bench` read them from
there.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import time
from typing import Any

import numpy as np

from mpdl import collectives, emulation
from mpdl.collectives import auto, costmodel, firstuse
from mpdl.collectives.costmodel import Params
from mpdl.collectives.firstuse import exchange_buffers
from mpdl.collectives.firstuse import monotone as _monotone
from mpdl.collectives.firstuse import pairs as _pairs
from mpdl.collectives.firstuse import shifts as _shifts
from mpdl.collectives.shm import WINDOW_BYTES
from mpdl.threadworld import ThreadWorld
from mpdl.training.throughput import gemm_flops

#: message sizes of the ping-pong; α comes from the smallest, β from the slope of the others
SMALL_BYTES = 8
LARGE_BYTES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
REDUCE_BYTES = 1 << 22
#: pairs of REDUCE_BYTES arrays the rate measurements rotate through (32 MiB): far more than a
#: core's private caches hold, as with a collective's buffers, which other cores wrote last
STREAM_PAIRS = 4
#: how long the computing ranks keep a waiting rank waiting (see _wait_cost)
WAIT_SECONDS = (1e-3, 8e-3)
#: sweeps over the message sizes (see _exchange_times)
SWEEPS = 3
#: the most memory the blocks of one size's chain of ring steps take (see _ring_chain)
CHAIN_BYTES = 64 << 20
GAMMA_DTYPES = ("float16", "float32", "float64", "int32", "int64")


def quiet_barrier(mpi: Any) -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to the measured ones."""
    request = mpi.Ibarrier()
    while not request.Test():
        time.sleep(1e-4)


def _median_time(fn, iters: int, batch: int = 1) -> float:
    """The median over `iters` timings of `batch` calls of fn, per call."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def _stream_time(fn, dtype: np.dtype, iters: int) -> float:
    """Seconds per call of fn(a, b) on REDUCE_BYTES arrays, taking the next of STREAM_PAIRS pairs
    each time, so the data do not come from a core's private cache that a repeated call on one
    pair keeps warm (a collective reduces and copies what other cores or MPI wrote last). Each of
    `iters` blocks times a pass over all pairs twice and keeps the mean (with more ranks than
    cores, the time slices a rank waits for are part of the rate: every rank runs this at the
    same time); the median over blocks drops the blocks a slow spell of the machine hit."""
    pairs = [(np.ones(REDUCE_BYTES // dtype.itemsize, dtype),
              np.ones(REDUCE_BYTES // dtype.itemsize, dtype)) for _ in range(STREAM_PAIRS)]
    for a, b in pairs:
        fn(a, b)
    calls = 2 * STREAM_PAIRS
    blocks = []
    for _ in range(max(1, iters)):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*pairs[i % STREAM_PAIRS])
        blocks.append((time.perf_counter() - t0) / calls)
    return float(np.median(blocks))


def _bench_time(comm: Any, fn, reps: int) -> float:
    """Seconds of fn timed as `mpdl bench` times a collective: MPI barrier, one call, slowest
    rank; the median over reps (collective: every rank calls it, fn may be None on some)."""
    times = np.zeros(reps)
    for i in range(reps):
        comm.mpi.Barrier()
        t0 = time.perf_counter()
        if fn is not None:
            fn()
            times[i] = time.perf_counter() - t0
    comm.mpi.Allreduce(comm.MPI.IN_PLACE, times, op=comm.MPI.MAX)
    return float(np.median(times))


def _exchange_times(comm: Any, peers: tuple[int, int] | None, iters: int,
                    ring_steps: int = 1, reduce: bool = False) -> list[float]:
    """Seconds per sendrecv (to peers[0], from peers[1]) at SMALL_BYTES and each of LARGE_BYTES,
    timed as bench times a call (see _bench_time; 0 where no rank had peers). With ring_steps > 1,
    one timed call is that many steps in a row, each forwarding the block received in the step
    before (as the steps of a ring all-reduce follow each other), and the time is per step (with
    `reduce`, steps of the ring reduce-scatter, each adding the block it received). Each
    size is repeated back to back, as bench repeats a call (its buffers stay as warm as bench's),
    in SWEEPS sweeps over the sizes; the median over sweeps drops a sweep that a slow spell of the
    machine fell on."""
    exchanges = []
    for nbytes in (SMALL_BYTES, *LARGE_BYTES):
        exchange = None
        if peers is not None and ring_steps > 1:
            exchange = _ring_chain(comm, peers, nbytes, ring_steps, reduce)
        elif peers is not None:
            send, recv = exchange_buffers(nbytes)
            exchange = functools.partial(comm.sendrecv, send, peers[0], recv, peers[1], "calibrate")
        exchanges.append((nbytes, exchange))
    sweeps = np.zeros((SWEEPS, len(exchanges)))
    for sweep in range(SWEEPS):
        for j, (nbytes, exchange) in enumerate(exchanges):
            if exchange is not None:
                exchange()  # warm up the path and the buffers
            reps = iters if nbytes < (1 << 20) else max(3, iters // 4)
            sweeps[sweep, j] = _bench_time(comm, exchange, reps) / ring_steps
    return np.median(sweeps, axis=0).tolist()


def _ring_chain(comm: Any, peers: tuple[int, int], nbytes: int, steps: int,
                reduce: bool = False):
    """A call of `steps` ring steps in a row over blocks of nbytes: each step sends the block the
    step before received to peers[0] and receives the next block from peers[1]. The blocks lie
    one after another in one buffer, as a ring all-reduce's blocks do; beyond CHAIN_BYTES they
    are reused in turn (at least three, so a step never receives into the block it sends). With
    `reduce`, each step is a step of the ring reduce-scatter instead: the block arrives in a
    separate buffer and is added (float32) into the next block, which the next step sends."""
    if reduce:
        nbytes = max(4, nbytes - nbytes % 4)  # whole float32 elements
    count = min(steps + 1, max(3, CHAIN_BYTES // max(nbytes, 1)))
    blocks = exchange_buffers(nbytes * count)[0].reshape(count, nbytes)
    if not reduce:
        def run() -> None:
            for s in range(steps):
                comm.sendrecv(blocks[s % count], peers[0], blocks[(s + 1) % count], peers[1],
                              "calibrate")

        return run
    values = blocks.view(np.float32)
    values[:] = 1.0
    incoming = exchange_buffers(nbytes)[1].view(np.float32)

    def run_reducing() -> None:
        for s in range(steps):
            acc = values[(s + 1) % count]
            recv = comm.irecv(incoming, peers[1], "calibrate")
            send = comm.isend(values[s % count], peers[0], "calibrate")
            comm.waitall((recv,))
            np.add(incoming, acc, out=acc)
            comm.waitall((send,))

    return run_reducing


def _copy_times(iters: int) -> list[float]:
    """Seconds of np.copyto at SMALL_BYTES and each of LARGE_BYTES on one pair of buffers copied
    call after call, as the API copies a collective's input into its result when the same arrays
    come back step after step (what fits in the caches stays there); every rank at once, median
    over SWEEPS sweeps of the medians of back-to-back calls."""
    pairs = [(np.ones(n, np.uint8), np.empty(n, np.uint8)) for n in (SMALL_BYTES, *LARGE_BYTES)]
    sweeps = np.zeros((SWEEPS, len(pairs)))
    for sweep in range(SWEEPS):
        for j, (src, dst) in enumerate(pairs):
            np.copyto(dst, src)
            reps = iters if src.nbytes < (1 << 20) else max(3, iters // 4)
            sweeps[sweep, j] = _median_time(functools.partial(np.copyto, dst, src), reps)
    return np.median(sweeps, axis=0).tolist()


def _wait_cost(comm: Any, iters: int) -> tuple[float, float]:
    """(CPU seconds of one wait, share of a core per second of waiting) of a rank that waits for a
    message while the others compute: even ranks compute for WAIT_SECONDS each (a loop of small
    in-cache additions, timed by the wall clock; the lengths take turns) and then send to the
    next rank, which waits for it under the communicator's wait policy; the line through the
    waits' (wall, CPU) means at the two lengths, averaged over the waiting ranks (the span of
    oversubscribed ranks adds their CPU up, and a wait's CPU depends on which rank it shares a
    core with). The same figures on every rank (collective)."""
    waiting = comm.rank % 2 == 1
    a, b = np.ones(4096, np.float32), np.ones(4096, np.float32)
    one = np.zeros(1, np.float32)
    samples: list[list[tuple[float, float]]] = [[] for _ in WAIT_SECONDS]
    for _ in range(max(5, iters)):
        for i, seconds in enumerate(WAIT_SECONDS):
            quiet_barrier(comm.mpi)
            if waiting:
                t0, c0 = time.perf_counter(), time.thread_time()
                comm.recv(one, comm.rank - 1, "calibrate")
                samples[i].append((time.perf_counter() - t0, time.thread_time() - c0))
                continue
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                np.add(a, b, out=a)
            if comm.rank + 1 < comm.size:
                comm.send(one, comm.rank + 1, "calibrate")
    mine = [np.mean(np.array(s), axis=0) for s in samples] if waiting else None
    points = [m for m in comm.mpi.allgather(mine) if m is not None]
    if not points:
        return 0.0, 0.0
    (w1, c1), (w2, c2) = np.mean(np.array(points), axis=0)
    share = min(1.0, max(0.0, (c2 - c1) / (w2 - w1))) if w2 > w1 else 0.0
    return float(max(0.0, c1 - share * w1)), float(share)


def _fit(times: list[float]) -> tuple[float, float]:
    """(α, β): α the small-message time, β the least-squares slope over the large messages."""
    x = np.array(LARGE_BYTES, dtype=np.float64)
    y = np.array(times[1:])
    beta = float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else float(y[0] / x[0])
    return max(times[0], 1e-9), max(beta, 1e-13)


def measure(comm: Any, iters: int) -> dict[str, Any]:
    """Every parameter of the cost model, as the maximum over ranks (collective over comm)."""
    mpi = comm.mpi
    groups = comm.node_groups()
    figures: dict[str, float] = {}

    def pairwise(partner: int | None) -> list[float]:
        return _exchange_times(comm, None if partner is None else (partner, partner), iters)

    shifts = _shifts(groups).get(comm.rank)
    ring_steps = 2 * (max(map(len, groups)) - 1)
    curves = {"intra": pairwise(_pairs(groups, False).get(comm.rank)),
              # round a ring of a node's ranks (of two ranks: a pair, in a chain of steps), plain
              # as the all-gather's steps and reducing as the reduce-scatter's
              "ring": _exchange_times(comm, shifts, iters, ring_steps=ring_steps)
              if max(map(len, groups)) > 1 else None,
              "ring_reduce": _exchange_times(comm, shifts, iters, ring_steps=ring_steps,
                                             reduce=True)
              if max(map(len, groups)) > 1 else None,
              "inter": pairwise(_pairs(groups, True).get(comm.rank)) if len(groups) > 1 else None}

    # The MPI library's own latency, with no Python between the messages.
    partner = _pairs(groups, False).get(comm.rank, _pairs(groups, True).get(comm.rank))
    quiet_barrier(mpi)
    figures["alpha_native"] = 0.0  # the rank left without a partner (odd p) adds nothing to the max
    if partner is not None:
        one, got = np.ones(1, np.float64), np.empty(1, np.float64)
        exchange = lambda: mpi.Sendrecv(one, partner, recvbuf=got, source=partner)  # noqa: E731
        exchange()
        figures["alpha_native"] = _median_time(exchange, iters, batch=50)

    # Reduction and copy rates, all ranks at once, on arrays that are not in cache (see _stream_time).
    quiet_barrier(mpi)
    for dtype in GAMMA_DTYPES:
        figures[f"gamma:{dtype}"] = _stream_time(
            lambda a, b: np.add(a, b, out=a), np.dtype(dtype), max(3, iters // 4)) / REDUCE_BYTES
    figures["copy"] = _stream_time(np.copyto, np.dtype(np.uint8), max(3, iters // 4)) / REDUCE_BYTES
    src, dst = np.ones(WINDOW_BYTES, np.uint8), np.empty(WINDOW_BYTES, np.uint8)
    figures["copy_cached"] = _median_time(lambda: np.copyto(dst, src), iters, batch=4) / WINDOW_BYTES
    quiet_barrier(mpi)
    curves["copy_curve"] = _copy_times(iters)

    # The API's fixed cost, and the barrier the shm algorithm takes twice per call: half of what
    # an 8-byte shm all-reduce takes beyond that cost (the node barriers of a shared window, with
    # the ranks as out of step as a real call leaves them).
    alone = ThreadWorld(1).comm(0)  # a world of one: the call does everything but send
    one = np.ones(1, np.float32)
    alone_call = _median_time(lambda: collectives.allreduce(one, algorithm="ring", comm=alone),
                              iters, batch=20)
    small = np.ones(SMALL_BYTES // 4, np.float32)
    shm_call = _bench_time(comm, lambda: collectives.allreduce(small, algorithm="shm", comm=comm),
                           iters)
    figures["barrier"] = max(shm_call - alone_call, 1e-7) / 2
    figures["call"] = alone_call
    if len(groups) == 1:
        # On all p ranks the call costs more than alone (checks, allocation, the flight recorder,
        # and each rank's share of the cores): an 8-byte ring all-reduce, less its 2(p-1) steps
        # timed as one chain right after it, both as bench times a call.
        quiet_barrier(mpi)
        steps = comm.size - 1
        reducing = _ring_chain(comm, shifts, SMALL_BYTES, steps, reduce=True)
        plain = _ring_chain(comm, shifts, SMALL_BYTES, steps)
        whole = lambda: collectives.allreduce(small, algorithm="ring", comm=comm)  # noqa: E731
        chain = lambda: (reducing(), plain())  # noqa: E731
        whole(), chain()
        # ... and the same all-reduce handed to the communication thread and waited for (DDP's
        # buckets, ZeRO's units): what waking the thread and handing the result back add
        handed = lambda: collectives.allreduce_async(  # noqa: E731
            small, algorithm="ring", comm=comm).wait()
        handed()
        samples = [(_bench_time(comm, whole, max(3, iters // 2)),
                    _bench_time(comm, chain, max(3, iters // 2)),
                    _bench_time(comm, handed, max(3, iters // 2))) for _ in range(SWEEPS)]
        figures["call"] = max(alone_call, float(np.median([w - c for w, c, _ in samples])))
        figures["handoff"] = max(0.0, float(np.median([h - w for w, _, h in samples])))
    # What a waiting rank takes from the cores (see oversubscription.span).
    figures["wait_cpu"], figures["wait_share"] = _wait_cost(comm, iters)
    quiet_barrier(mpi)

    keys = sorted(figures)
    measured = [name for name, curve in curves.items() if curve is not None]
    local = np.array([figures[k] for k in keys] + [t for name in measured for t in curves[name]],
                     dtype=np.float64)
    worst = np.empty_like(local)
    mpi.Allreduce(local, worst, op=comm.MPI.MAX)
    merged: dict[str, Any] = dict(zip(keys, worst[:len(keys)].tolist(), strict=True))
    width = 1 + len(LARGE_BYTES)
    for i, name in enumerate(measured):
        merged[name] = worst[len(keys) + i * width:len(keys) + (i + 1) * width].tolist()
    return {"ring": None, "ring_reduce": None, "inter": None, "copy_curve": None, **merged}


def to_params(measured: dict[str, Any], ranks: int, nodes: int, host: str) -> Params:
    """The cost model's parameters fitted to what `measure` returned."""
    intra_pairs = max(measured["intra"]) > 0
    sizes = (SMALL_BYTES, *LARGE_BYTES)
    alpha, beta = _fit(measured["intra"] if intra_pairs else measured["inter"])
    alpha_inter = beta_inter = None
    if measured["inter"] is not None:
        alpha_inter, beta_inter = _fit(measured["inter"])
    gammas = tuple(sorted((d, measured[f"gamma:{d}"]) for d in GAMMA_DTYPES))
    return Params(alpha=alpha, beta=beta, gamma=dict(gammas)["float32"], alpha_inter=alpha_inter,
                  beta_inter=beta_inter, copy=measured["copy"], copy_cached=measured["copy_cached"],
                  barrier=measured["barrier"],
                  call=measured["call"], handoff=measured.get("handoff", 0.0),
                  wait_cpu=measured.get("wait_cpu", 0.0),
                  wait_share=measured.get("wait_share", 0.0),
                  alpha_native=measured.get("alpha_native") or alpha,
                  gammas=gammas, ranks=ranks,
                  exchange=_monotone(sizes, measured["intra"]) if intra_pairs else (),
                  ring_exchange=_monotone(sizes, measured["ring"]) if measured["ring"] else (),
                  ring_reduce_exchange=_monotone(sizes, measured["ring_reduce"])
                  if measured.get("ring_reduce") else (),
                  copy_curve=_monotone(sizes, measured["copy_curve"])
                  if measured.get("copy_curve") else (),
                  source=f"mpdl calibrate on {host}, {ranks} ranks, {nodes} node(s), "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}")


def calibrate(comm: Any, iters: int = 20, path: str | None = None) -> Params:
    """Measure this machine's links and rates with every rank of comm (an MPIComm of at least two
    ranks; collective) and fit the parameters (the same figures on every rank). The links are measured as
    they are: an emulation installed on comm is removed (the model adds emulated links itself).
    With `path`, rank 0 saves them there and every rank returns once the file is complete."""
    if comm.size < 2:
        raise ValueError(f"calibrate needs at least 2 ranks to measure links, got {comm.size}")
    if iters < 1:
        raise ValueError(f"iters: expected a positive count, got {iters}")
    emulation.install(comm, None)
    nodes = len(comm.node_groups())
    params = to_params(measure(comm, iters), comm.size, nodes, socket.gethostname())
    params = dataclasses.replace(params, gemm_flops=max(comm.allgather_object(gemm_flops())),
                                 allreduce_times=firstuse.allreduce_table(comm), nodes=nodes)
    if path is not None:
        if comm.rank == 0:
            costmodel.save(path, params)  # and forgets the loaded model
        quiet_barrier(comm.mpi)  # nobody reads the file before it is complete
        if comm.rank != 0:
            auto.forget()  # every rank forgets (auto looks again, collectively, on every rank)
    return params

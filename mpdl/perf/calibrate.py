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
algorithm `auto` may pick is timed at a few sizes (`measuring.allreduce_table`, as `auto`'s
first-use calibration does): for this world shape the model interpolates those times. The
probes are `mpdl.tuning.measuring`'s, at its thorough effort; a calibration taken on a busy
machine is provisional (saved with the reason, never replacing a quiet one). `calibrate`
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
from mpdl.threadworld import ThreadWorld
from mpdl.training.throughput import gemm_flops
from mpdl.tuning import auto, costmodel, measuring
from mpdl.tuning.costmodel import Params
from mpdl.tuning.measuring import (
    Effort,
    bench_time,
    fit,
    median_time,
    monotone,
    pairs,
    ring_chain,
    shifts,
    thorough,
)

#: how long the computing ranks keep a waiting rank waiting (see _wait_cost)
WAIT_SECONDS = (1e-3, 8e-3)


def quiet_barrier(mpi: Any) -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to the measured ones."""
    request = mpi.Ibarrier()
    while not request.Test():
        time.sleep(1e-4)


def _copy_times(effort: Effort) -> list[float]:
    """Seconds of np.copyto at each of the effort's sizes on one pair of buffers copied call after
    call, as the API copies a collective's input into its result when the same arrays come back
    step after step (what fits in the caches stays there); every rank at once, median over the
    effort's sweeps of the medians of back-to-back calls."""
    buffers = [(np.ones(n, np.uint8), np.empty(n, np.uint8)) for n in effort.sizes]
    sweeps = np.zeros((effort.sweeps, len(buffers)))
    for sweep in range(effort.sweeps):
        for j, ((src, dst), reps) in enumerate(zip(buffers, effort.reps, strict=True)):
            np.copyto(dst, src)
            sweeps[sweep, j] = median_time(functools.partial(np.copyto, dst, src), reps)
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


def measure_thorough(comm: Any, iters: int) -> dict[str, Any]:
    """Every parameter of the cost model, as the maximum over ranks (collective over comm)."""
    mpi = comm.mpi
    effort = thorough(iters)
    groups = comm.node_groups()
    figures: dict[str, float] = {}
    # round a ring of a node's ranks (of two ranks: a pair, in a chain of steps), plain as the
    # all-gather's steps and reducing as the reduce-scatter's
    curves: dict[str, list[float] | None] = dict(measuring.link_curves(comm, effort))

    # The MPI library's own latency, with no Python between the messages.
    partner = pairs(groups, False).get(comm.rank, pairs(groups, True).get(comm.rank))
    quiet_barrier(mpi)
    figures["alpha_native"] = 0.0  # the rank left without a partner (odd p) adds nothing to the max
    if partner is not None:
        one, got = np.ones(1, np.float64), np.empty(1, np.float64)
        exchange = lambda: mpi.Sendrecv(one, partner, recvbuf=got, source=partner)  # noqa: E731
        exchange()
        figures["alpha_native"] = median_time(exchange, iters, batch=50)

    # Reduction and copy rates, all ranks at once, on arrays that are not in cache.
    quiet_barrier(mpi)
    figures.update(measuring.rates(effort))
    quiet_barrier(mpi)
    curves["copy_curve"] = _copy_times(effort)

    # The API's fixed cost, and the barrier the shm algorithm takes twice per call: half of what
    # an 8-byte shm all-reduce takes beyond that cost (the node barriers of a shared window, with
    # the ranks as out of step as a real call leaves them).
    alone = ThreadWorld(1).comm(0)  # a world of one: the call does everything but send
    one = np.ones(1, np.float32)
    alone_call = median_time(lambda: collectives.allreduce(one, algorithm="ring", comm=alone),
                             iters, batch=20)
    small = np.ones(effort.sizes[0] // 4, np.float32)
    shm_call = bench_time(comm, lambda: collectives.allreduce(small, algorithm="shm", comm=comm),
                          iters, mpi_barrier=True)
    figures["barrier"] = max(shm_call - alone_call, 1e-7) / 2
    figures["call"] = alone_call
    if len(groups) == 1:
        # On all p ranks the call costs more than alone (checks, allocation, the flight recorder,
        # and each rank's share of the cores): an 8-byte ring all-reduce, less its 2(p-1) steps
        # timed as one chain right after it, both as bench times a call.
        quiet_barrier(mpi)
        steps, peers = comm.size - 1, shifts(groups).get(comm.rank)
        reducing = ring_chain(comm, peers, effort.sizes[0], steps, reduce=True)
        plain = ring_chain(comm, peers, effort.sizes[0], steps)
        whole = lambda: collectives.allreduce(small, algorithm="ring", comm=comm)  # noqa: E731
        chain = lambda: (reducing(), plain())  # noqa: E731
        whole(), chain()
        # ... and the same all-reduce handed to the communication thread and waited for (DDP's
        # buckets, ZeRO's units): what waking the thread and handing the result back add
        handed = lambda: collectives.allreduce_async(  # noqa: E731
            small, algorithm="ring", comm=comm).wait()
        handed()
        reps = max(3, iters // 2)
        samples = [tuple(bench_time(comm, fn, reps, mpi_barrier=True)
                         for fn in (whole, chain, handed)) for _ in range(effort.sweeps)]
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
    width = len(effort.sizes)
    for i, name in enumerate(measured):
        merged[name] = worst[len(keys) + i * width:len(keys) + (i + 1) * width].tolist()
    return {**curves, **merged, "sizes": effort.sizes}


def to_params(measured: dict[str, Any], ranks: int, nodes: int, host: str) -> Params:
    """The cost model's parameters fitted to what `measure_thorough` returned."""
    intra_pairs = max(measured["intra"]) > 0
    sizes = measured["sizes"]
    alpha, beta = fit(sizes, measured["intra"] if intra_pairs else measured["inter"])
    alpha_inter = beta_inter = None
    if measured["inter"] is not None:
        alpha_inter, beta_inter = fit(sizes, measured["inter"])
    gammas = tuple(sorted((d, measured[f"gamma:{d}"]) for d in measuring.GAMMA_DTYPES))
    return Params(alpha=alpha, beta=beta, gamma=dict(gammas)["float32"], alpha_inter=alpha_inter,
                  beta_inter=beta_inter, copy=measured["copy"], copy_cached=measured["copy_cached"],
                  barrier=measured["barrier"],
                  call=measured["call"], handoff=measured.get("handoff", 0.0),
                  wait_cpu=measured.get("wait_cpu", 0.0),
                  wait_share=measured.get("wait_share", 0.0),
                  alpha_native=measured.get("alpha_native") or alpha,
                  gammas=gammas, ranks=ranks,
                  exchange=monotone(sizes, measured["intra"]) if intra_pairs else (),
                  ring_exchange=monotone(sizes, measured["ring"]) if measured["ring"] else (),
                  ring_reduce_exchange=monotone(sizes, measured["ring_reduce"])
                  if measured.get("ring_reduce") else (),
                  copy_curve=monotone(sizes, measured["copy_curve"])
                  if measured.get("copy_curve") else (),
                  source=f"mpdl calibrate on {host}, {ranks} ranks, {nodes} node(s), "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}")


def calibrate(comm: Any, iters: int = 20, path: str | None = None) -> Params:
    """Measure this machine's links and rates with every rank of comm (an MPIComm of at least two
    ranks; collective) and fit the parameters (the same figures on every rank). The links are
    measured as they are: an emulation installed on comm is removed (the model adds emulated
    links itself). On a busy machine the parameters are provisional (`Params.provisional` says
    why). With `path`, rank 0 saves them there (a provisional calibration does not replace a
    quiet one) and every rank returns once the file is complete."""
    if comm.size < 2:
        raise ValueError(f"calibrate needs at least 2 ranks to measure links, got {comm.size}")
    if iters < 1:
        raise ValueError(f"iters: expected a positive count, got {iters}")
    emulation.install(comm, None)
    groups = comm.node_groups()
    here = len(next(g for g in groups if comm.rank in g))
    load_before, since = measuring.load_per_core(here), measuring.clocks()
    params = to_params(measure_thorough(comm, iters), comm.size, len(groups), socket.gethostname())
    table = measuring.allreduce_table(comm)
    busy = measuring.busy_check(comm, load_before, measuring.load_per_core(here), table.spread,
                                measuring.core_share(since))
    params = dataclasses.replace(params, gemm_flops=max(comm.allgather_object(gemm_flops())),
                                 allreduce_times=table.rows, nodes=len(groups),
                                 provisional=busy.why)
    if path is not None:
        if comm.rank == 0:
            costmodel.save(path, params)  # and forgets the loaded model
        quiet_barrier(comm.mpi)  # nobody reads the file before it is complete
        if comm.rank != 0:
            auto.forget()  # every rank forgets (auto looks again, collectively, on every rank)
    return params

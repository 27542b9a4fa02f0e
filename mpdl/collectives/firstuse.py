"""`auto`'s first-use calibration: a short measurement of the cost model's parameters, cached per
machine and world shape, for when nobody has run `mpdl calibrate`.

`measure(comm)` is a cut-down `mpdl calibrate` (`mpdl.perf.calibrate`) written against the
Communicator interface, so that it runs on any MPI-backed communicator (the world, a split, a
sub-communicator of a process grid): one sweep over five message sizes instead of three over six,
fewer repetitions, and no GEMM peak or MPI-library latency. Then it times every all-reduce
algorithm `auto` may pick at eight sizes from 8 B to 8 MiB (`allreduce_table`, which `mpdl
calibrate` runs too): the cost model interpolates these for this world shape instead of its
formulas, which miss effects such as caches and cores shared by more ranks than they can run.
Everything is timed as `mpdl bench` times a call (a barrier, one call, the slowest rank, the
median over repetitions); the slowest rank is found with all-gathers, so every rank fits the same
parameters from the same numbers. It takes about half a second for 2 ranks on 2 cores, one and a
half for 4 (docs/results.md).

The result is kept in one JSON file per key (`cache_key`: host, MPI library, world size, ranks per
node, and the communicator's own shape when it is a part of the world) in the settings' `auto_cache`
folder (MPDL_AUTO_CACHE; $XDG_CACHE_HOME/mpdl by default), written atomically. `mpdl.collectives.auto`
decides when to read, measure and write (rank 0 decides, every rank follows).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from typing import Any

import numpy as np

from mpdl import backend
from mpdl.collectives import registry
from mpdl.collectives.costmodel import ModelUnavailable, Params, candidates
from mpdl.collectives.ops import check_array, check_op
from mpdl.collectives.shm import WINDOW_BYTES
from mpdl.fileio import atomic_open
from mpdl.threadworld import ThreadWorld

FORMAT_VERSION = 1
#: message sizes of the exchanges: α from the first, β from the slope of the others
SIZES = (8, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
#: timed repetitions of an exchange of each size (the median is kept)
REPS = (10, 8, 6, 4, 3)
#: the rate measurements' arrays: pairs of STREAM_BYTES, 32 MiB in all (more than a core's caches)
STREAM_BYTES = 1 << 22
STREAM_PAIRS = 4
GAMMA_DTYPES = ("float16", "float32", "float64", "int32", "int64")
#: sizes at which every all-reduce candidate is timed (float32); beyond the last, its slope
TUNE_SIZES = (8, 1 << 10, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23)
#: rounds over the algorithms at each size (a slow spell of the machine then hits all alike), and
#: timed calls of an algorithm per round, after an untimed one, below and from 1 MiB
TUNE_ROUNDS = 2
TUNE_REPS = (8, 3)


# -- helpers shared with `mpdl calibrate` ------------------------------------------------------
def exchange_buffers(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(send, receive) byte arrays at the same offset in a 4 KiB page. Heap arrays allocated one
    after another lie 16 bytes apart modulo 4 KiB; a copy from a peer's send buffer into this
    rank's receive buffer then runs 3-4x slower (4K aliasing), and a calibration would measure
    that instead of the link (the collectives place their buffers to avoid it)."""
    send = backend.empty_half_page_in(nbytes, np.uint8, np)
    send[:] = 1
    return send, backend.empty_half_page_in(nbytes, np.uint8, np)


def pairs(groups: list[list[int]], inter: bool) -> dict[int, int]:
    """rank -> partner: neighbours inside a node, or equal local ranks of nodes 2j and 2j+1."""
    partner: dict[int, int] = {}
    if not inter:
        for g in groups:
            for i in range(0, len(g) - 1, 2):
                partner[g[i]], partner[g[i + 1]] = g[i + 1], g[i]
        return partner
    for j in range(0, len(groups) - 1, 2):
        for a, b in zip(groups[j], groups[j + 1], strict=False):
            partner[a], partner[b] = b, a
    return partner


def shifts(groups: list[list[int]]) -> dict[int, tuple[int, int]]:
    """rank -> (send to, receive from): the next and previous rank of its node, as in a ring step."""
    return {g[i]: (g[(i + 1) % len(g)], g[i - 1]) for g in groups if len(g) > 1
            for i in range(len(g))}


def monotone(sizes: tuple[int, ...], times: list[float]) -> tuple[tuple[float, float], ...]:
    """(bytes, seconds) pairs where a larger message never takes less time than a smaller one
    (a noisy small measurement is capped by the larger ones)."""
    capped = np.minimum.accumulate(np.array(times, dtype=np.float64)[::-1])[::-1]
    return tuple((float(b), float(t)) for b, t in zip(sizes, capped, strict=True))


def fit(sizes: tuple[int, ...], times: list[float]) -> tuple[float, float]:
    """(α, β): α the first (small) message's time, β the least-squares slope over the others."""
    x = np.array(sizes[1:], dtype=np.float64)
    y = np.array(times[1:], dtype=np.float64)
    beta = float(np.polyfit(x, y, 1)[0]) if len(x) > 1 else float(y[0] / x[0])
    return max(times[0], 1e-9), max(beta, 1e-13)


# -- the measurement ---------------------------------------------------------------------------
def _root(comm: Any) -> Any:
    while getattr(comm, "parent", None) is not None:
        comm = comm.parent
    return comm


def _timed(comm: Any, fn, reps: int) -> list[float]:
    """This rank's seconds of `reps` calls of fn, each started after a barrier of comm, as bench
    times a call (fn None: this rank only takes part in the barriers; its times are 0)."""
    times = []
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        if fn is not None:
            fn()
        times.append(time.perf_counter() - t0 if fn is not None else 0.0)
    return times


def _exchanges(comm: Any, peers: tuple[int, int] | None, steps: int = 1) -> list[list[float]]:
    """Per size of SIZES, this rank's times of one exchange (to peers[0], from peers[1]; None: no
    partner), per step of a chain of `steps` steps each forwarding the block the step before
    received (a ring all-reduce's steps)."""
    out = []
    for nbytes, reps in zip(SIZES, REPS, strict=True):
        fn = None
        if peers is not None:
            if steps == 1:
                send, recv = exchange_buffers(nbytes)

                def fn(send=send, recv=recv) -> None:
                    comm.sendrecv(send, peers[0], recv, peers[1], "first-use calibration")
            else:  # blocks in one buffer, reused in turn beyond 64 MiB (at least three)
                count = min(steps + 1, max(3, (64 << 20) // nbytes))
                blocks = exchange_buffers(nbytes * count)[0].reshape(count, nbytes)

                def fn(blocks=blocks, count=count) -> None:
                    for s in range(steps):
                        comm.sendrecv(blocks[s % count], peers[0], blocks[(s + 1) % count],
                                      peers[1], "first-use calibration")
            fn()  # warm up the path and the buffers
        out.append([t / steps for t in _timed(comm, fn, reps)])
    return out


def _stream(fn, arrays: list[np.ndarray], dtype: np.dtype, blocks: int = 3) -> float:
    """Seconds per byte of fn(a, b) on the STREAM_BYTES arrays (viewed as dtype), taking the next
    pair each call, so the data do not come from a core's caches (a collective reduces and copies
    what other cores or MPI wrote last); the median of `blocks` passes over all pairs."""
    views = [a.view(dtype) for a in arrays]
    pairs_ = [(views[i], views[i + 1]) for i in range(0, len(views), 2)]
    fn(*pairs_[0])
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for a, b in pairs_:
            fn(a, b)
        times.append((time.perf_counter() - t0) / len(pairs_))
    return float(np.median(times)) / STREAM_BYTES


def _median(fn, reps: int, batch: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def _allreduce_times(comm: Any) -> dict[str, list[list[float]]]:
    """Per all-reduce candidate `auto` may pick, per size of TUNE_SIZES: this rank's times of its
    calls (TUNE_ROUNDS turns of TUNE_REPS calls, each after a barrier, the algorithms taking turns
    as in `mpdl bench`), with the input copy the public call makes (the algorithms that read their
    input directly get it as `src`)."""
    names = candidates("allreduce", comm.has_shared_memory)
    out: dict[str, list[list[float]]] = {name: [] for name in names}
    for nbytes in TUNE_SIZES:
        x = np.ones(max(1, nbytes // 4), np.float32)
        work = backend.empty_like_page_offset(x)
        calls = {}
        for name in names:
            algo = registry.REGISTRY["allreduce"][name]

            def call(algo=algo, x=x, work=work) -> None:
                if algo.reads_input:
                    algo.run(comm, work, "sum", src=x)
                else:
                    np.copyto(work, x)
                    algo.run(comm, work, "sum")

            calls[name] = call
            out[name].append([])
        for _ in range(TUNE_ROUNDS):
            for name, call in calls.items():
                comm.barrier()
                call()  # untimed: each turn starts as bench's turns do
                out[name][-1] += _timed(comm, call, TUNE_REPS[nbytes >= (1 << 20)])
    return out


def allreduce_table(comm: Any) -> tuple[tuple[str, tuple[tuple[float, float], ...]], ...]:
    """`Params.allreduce_times` of comm: every all-reduce candidate timed at TUNE_SIZES, per size
    the median over calls of the slowest rank's time, made non-decreasing in size (a noisy small
    size is capped by the larger ones). Collective over comm; the same table on every rank."""
    mine = _allreduce_times(comm)
    everyone = comm.allgather_object(mine)
    table = []
    for name in mine:
        times = [float(np.median(np.max([np.asarray(r[name][i]) for r in everyone], axis=0)))
                 for i in range(len(TUNE_SIZES))]
        table.append((name, monotone(TUNE_SIZES, times)))
    return tuple(table)


def _call_overhead() -> float:
    """The public API's fixed cost, near enough: what an all-reduce call of one element does on a
    world of one (check the arguments, allocate and copy the result, run the algorithm). It adds
    the same to every algorithm, so it moves no choice, only `mpdl bench`'s predictions."""
    alone, one = ThreadWorld(1).comm(0), np.ones(1, np.float32)
    ring = registry.REGISTRY["allreduce"]["ring"].run

    def call() -> None:
        check_array(one)
        check_op("sum", one.dtype)
        out = backend.empty_like_page_offset(one)
        np.copyto(out, one)
        ring(alone, out, "sum")

    return _median(call, 5, 20)


def measure(comm: Any) -> Params:
    """The cost model's parameters of comm's ranks and links, measured now (collective over comm,
    an MPI-backed communicator of at least two ranks; the same Params on every rank). Emulated
    link delays are lifted while it measures: the model adds them itself."""
    t_start = time.perf_counter()
    root = _root(comm)
    delay = getattr(root, "link_delay", None)
    previous = comm.collective
    root.link_delay, comm.collective = None, "auto first-use calibration"
    try:
        groups = comm.node_groups()
        widest = max(map(len, groups))
        local: dict[str, list] = {
            "intra": _exchanges(comm, (lambda q: None if q is None else (q, q))(
                pairs(groups, False).get(comm.rank))),
        }
        if widest > 2:  # a ring of two is a pair
            local["ring"] = _exchanges(comm, shifts(groups).get(comm.rank), 2 * (widest - 1))
        if len(groups) > 1:
            partner = pairs(groups, True).get(comm.rank)
            local["inter"] = _exchanges(comm, None if partner is None else (partner, partner))
        if comm.has_shared_memory:
            # the node barrier the shm algorithm takes twice per call: half an 8-byte shm run
            shm, small = registry.REGISTRY["allreduce"]["shm"].run, np.ones(2, np.float32)
            shm(comm, small, "sum")
            local["shm"] = [_timed(comm, lambda: shm(comm, small, "sum"), 10)]
        comm.barrier()
        arrays = [np.ones(STREAM_BYTES, np.uint8) for _ in range(2 * STREAM_PAIRS)]
        rates = {f"gamma:{d}": _stream(lambda a, b: np.add(a, b, out=a), arrays, np.dtype(d))
                 for d in GAMMA_DTYPES}
        rates["copy"] = _stream(np.copyto, arrays, np.dtype(np.uint8))
        del arrays
        src, dst = np.ones(WINDOW_BYTES, np.uint8), np.empty(WINDOW_BYTES, np.uint8)
        rates["copy_cached"] = _median(lambda: np.copyto(dst, src), 10, 4) / WINDOW_BYTES
        rates["call"] = _call_overhead()
        table = allreduce_table(comm)
        stamp = (socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"),
                 time.perf_counter() - t_start)
        everyone = comm.allgather_object((local, rates, stamp))
    finally:
        root.link_delay, comm.collective = delay, previous

    def slowest(name: str) -> list[float]:
        """Per size: the median over repetitions of the slowest rank's time."""
        per_rank = [r[0][name] for r in everyone]
        return [float(np.median(np.max([np.asarray(a[i]) for a in per_rank], axis=0)))
                for i in range(len(per_rank[0]))]

    worst = {k: max(r[1][k] for r in everyone) for k in rates}
    intra = slowest("intra")
    have_pairs = max(intra) > 0
    inter = slowest("inter") if "inter" in local else None
    alpha, beta = fit(SIZES, intra if have_pairs or inter is None else inter)
    alpha_inter = beta_inter = None
    if inter is not None:
        alpha_inter, beta_inter = fit(SIZES, inter)
    gammas = tuple(sorted((d, worst[f"gamma:{d}"]) for d in GAMMA_DTYPES))
    barrier = Params().barrier
    if "shm" in local:
        barrier = max(slowest("shm")[0], 1e-7) / 2
    host, when, seconds = everyone[0][2]  # rank 0's, so that every rank has the same Params
    return Params(alpha=alpha, beta=beta, gamma=dict(gammas)["float32"], alpha_inter=alpha_inter,
                  beta_inter=beta_inter, copy=worst["copy"], copy_cached=worst["copy_cached"],
                  barrier=barrier, call=worst["call"], alpha_native=min(alpha, Params().alpha_native),
                  gammas=gammas, ranks=comm.size,
                  exchange=monotone(SIZES, intra) if have_pairs else (),
                  ring_exchange=monotone(SIZES, slowest("ring")) if "ring" in local else (),
                  allreduce_times=table, nodes=len(groups),
                  source=f"first-use calibration on {host}, {comm.size} ranks, {len(groups)} "
                         f"node(s), {when}, {seconds:.2f} s")


# -- the cache ---------------------------------------------------------------------------------
def cache_key(comm: Any, host: str | None = None, mpi_library: str | None = None) -> dict:
    """What a first-use calibration is valid for: this host, this MPI library, the world's size
    and ranks per node, and comm's own size and ranks per node when comm is a part of the world."""
    root = _root(comm)
    if mpi_library is None:
        MPI = getattr(root, "MPI", None)
        if MPI is not None:
            from mpdl.mpi_runtime import library_version  # noqa: PLC0415

            mpi_library = library_version(MPI)
        else:
            mpi_library = "none"
    key = {"host": host or socket.gethostname(), "mpi_library": mpi_library,
           "world_size": root.size, "ranks_per_node": [len(g) for g in root.node_groups()]}
    if comm is not root:
        key["comm_size"] = comm.size
        key["comm_ranks_per_node"] = [len(g) for g in comm.node_groups()]
    return key


def cache_path(folder: str, key: dict) -> str:
    """The file of `key` in folder: auto-HOST-pP-NODES[-in-WORLD]-HASH.json."""
    def shape(sizes: list[int]) -> str:
        return "+".join(map(str, sizes)) if len(set(sizes)) > 1 else f"{len(sizes)}x{sizes[0]}"

    host = re.sub(r"[^A-Za-z0-9.-]", "_", key["host"])[:40]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    name = f"auto-{host}-p{key['world_size']}-{shape(key['ranks_per_node'])}"
    if "comm_size" in key:
        name += f"-sub{key['comm_size']}-{shape(key['comm_ranks_per_node'])}"
    return os.path.join(folder, f"{name}-{digest}.json")


def read(path: str, key: dict) -> Params | None:
    """The cached parameters of key in path; None when there is no such file. ModelUnavailable,
    with what is wrong, for a file that is not a first-use calibration of this key."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, expected {FORMAT_VERSION}")
        if data.get("key") != key:
            raise ValueError(f"made for {data.get('key')}, not {key}")
        return Params.from_json(data["params"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ModelUnavailable) as exc:
        raise ModelUnavailable(f"{path}: not a usable first-use calibration ({exc})") from None


def write(path: str, key: dict, params: Params) -> None:
    """Store params for key in path, atomically (a reader sees the old file or the whole new one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_open(path) as f:
        json.dump({"version": FORMAT_VERSION, "key": key, "params": params.to_json()}, f, indent=1)
        f.write("\n")

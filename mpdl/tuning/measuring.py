"""Measuring this machine's links, rates and all-reduce algorithms: the one set of probes behind
`auto`'s first-use calibration (`mpdl.tuning.firstuse`, effort QUICK) and `mpdl calibrate`
(`mpdl.perf.calibrate`, effort `thorough(iters)`).

Every probe runs on all ranks of a communicator at once, as a collective. An exchange is timed as
`mpdl bench` times a call (a barrier, one call, the slowest rank; the median over repetitions),
at every size of the effort's sweep, in `sweeps` sweeps over the sizes (the median over sweeps
drops a sweep that a slow spell of the machine fell on). Rates (reductions per dtype, copies) are
timed on arrays larger than a core's caches, every rank at once. Every all-reduce candidate of
`auto` is timed at TUNE_SIZES with the algorithms taking turns (`allreduce_table`).

A calibration is only as good as the machine was quiet while it ran. `Busy` says whether it was:
the load average per core (beyond the measuring ranks themselves) before and after, the share of
a core each rank had while it measured, and the spread between the rounds of identical all-reduce
calls; every rank judges the worst figures over ranks (one all-gather), so all ranks reach the
same verdict. A calibration taken on a busy
machine is kept as provisional (`Params.provisional` holds why).

Where a node runs more ranks than cores (`crowded`), waiting for a core is part of every call,
and the fastest of a few repetitions is a lucky schedule, not the typical one: there the typical
repetition counts (`typical`), where elsewhere the fastest does.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpdl import backend, mpi_runtime
from mpdl.collectives import registry
from mpdl.collectives.shm import WINDOW_BYTES
from mpdl.tuning.costmodel import candidates

GAMMA_DTYPES = ("float16", "float32", "float64", "int32", "int64")
#: the rate measurements' arrays: pairs of STREAM_BYTES, 32 MiB in all (more than a core's caches)
STREAM_BYTES = 1 << 22
STREAM_PAIRS = 4
#: the most memory the blocks of one size's chain of ring steps take (see ring_chain)
CHAIN_BYTES = 64 << 20
#: sizes at which every all-reduce candidate is timed (float32); beyond the last, the time per
#: byte measured there. The last three lie beyond a core's caches, 64 MiB beyond the machine's
#: (docs/results/auto.md#the-calibration-tables-sizes)
TUNE_SIZES = (8, 1 << 10, 1 << 13, 1 << 15, 1 << 17, 1 << 19, 1 << 21, 1 << 23, 1 << 24, 1 << 26)
#: the order (indices into TUNE_SIZES) in which a calibration with a time limit times them: coarse
#: (8 B, 32 KiB, 2 MiB, 64 MiB) then fine, so that a table the limit cuts still spans the sizes
TUNE_ORDER = (0, 3, 6, 9, 5, 2, 8, 1, 4, 7)
#: from this size a candidate is timed in TUNE_ROUNDS // 2 rounds of one call, with an untimed
#: call before it in the first round only (its workspace's first use): a call takes milliseconds
TUNE_HUGE = 1 << 25
#: rounds over the algorithms at each size (a slow spell of the machine then hits all alike), and
#: timed calls of an algorithm per round, after an untimed one, below and from 1 MiB. Short turns
#: in many rounds: a slow spell (another process's time slice, milliseconds) then spoils a few
#: rounds of an algorithm, not all its calls
TUNE_ROUNDS = 4
TUNE_REPS = (4, 1)
#: a machine is busy when other work keeps more than this many runnable processes per core
#: beyond the measuring ranks, or when the rounds of identical calls differ by more than this
#: factor (the median over algorithms and sizes of the median round over the fastest)
BUSY_LOAD_PER_CORE = 0.5
BUSY_SPREAD = 1.5
#: ... or when a machine's measuring ranks had less than this share of the core time they have with
#: it to themselves (`machine_share`): the load average lags a minute behind work that starts
#: with the calibration, the share does not (docs/results/auto.md, "A poisoned calibration seen by
#: the ranks' core time")
BUSY_SHARE = 0.85
#: a stretch shorter than this is not judged by its share
SHARE_MIN_SECONDS = 0.5


@dataclass(frozen=True)
class Effort:
    """How hard to measure: the exchange sizes and repetitions per size, the sweeps over them, and
    what else to time."""

    name: str
    #: message sizes of the exchanges: α from the first, β from the slope of the others
    sizes: tuple[int, ...]
    #: timed repetitions of each size (the median of the slowest rank's times is kept)
    reps: tuple[int, ...]
    sweeps: int
    #: time a ring chain on a node of two ranks too (otherwise a ring of two is taken as a pair)
    ring_of_two: bool
    #: time the ring reduce-scatter's steps, each adding the block it received
    reducing_ring: bool
    #: timed passes over the rate arrays (the median is kept), and calls per pair in each
    stream_blocks: int
    stream_passes: int
    #: repetitions of the cached copy
    cached_reps: int
    #: barrier before each timed call: the MPI library's own (blocking) or the communicator's
    mpi_barrier: bool


#: auto's first use: one sweep over five sizes, few repetitions (about a second for 4 ranks)
QUICK = Effort("quick", sizes=(8, 1 << 16, 1 << 18, 1 << 20, 1 << 22), reps=(10, 8, 6, 4, 3),
               sweeps=1, ring_of_two=False, reducing_ring=False, stream_blocks=3,
               stream_passes=1, cached_reps=10, mpi_barrier=False)


def thorough(iters: int) -> Effort:
    """`mpdl calibrate`'s effort: three sweeps over six sizes up to 16 MiB, `iters` repetitions of
    a small size (a quarter, at least three, from 1 MiB)."""
    sizes = (8, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
    return Effort("thorough", sizes=sizes,
                  reps=tuple(iters if n < (1 << 20) else max(3, iters // 4) for n in sizes),
                  sweeps=3, ring_of_two=True, reducing_ring=True,
                  stream_blocks=max(3, iters // 4), stream_passes=2, cached_reps=iters,
                  mpi_barrier=True)


# -- buffers and partners ----------------------------------------------------------------------
def exchange_buffers(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(send, receive) byte arrays at the same offset in a 4 KiB page. Heap arrays allocated one
    after another lie 16 bytes apart modulo 4 KiB; a copy from a peer's send buffer into this
    rank's receive buffer then runs several times slower (4K aliasing,
    docs/results/simulate.md#earlier-stages), and a calibration would measure that instead of
    the link (the collectives place their buffers to avoid it)."""
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


# -- fitting -----------------------------------------------------------------------------------
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


# -- timing ------------------------------------------------------------------------------------
def median_time(fn, reps: int, batch: int = 1) -> float:
    """The median over `reps` timings of `batch` calls of fn, per call (this rank alone)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def timed(comm: Any, fn, reps: int, mpi_barrier: bool = False) -> list[float]:
    """This rank's seconds of `reps` calls of fn, each started after a barrier of comm (fn None:
    this rank only takes part in the barriers; its times are 0)."""
    barrier = comm.mpi.Barrier if mpi_barrier else comm.barrier
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        if fn is not None:
            fn()
        times.append(time.perf_counter() - t0 if fn is not None else 0.0)
    return times


def slowest(everyone: list[list[float]]) -> float:
    """The median over repetitions of the slowest rank's time (every rank's times, in order)."""
    return float(np.median(np.max(np.array(everyone, dtype=np.float64), axis=0)))


def bench_time(comm: Any, fn, reps: int, mpi_barrier: bool = False) -> float:
    """Seconds of fn timed as `mpdl bench` times a collective: barrier, one call, slowest rank;
    the median over reps (collective: every rank calls it, fn may be None on some)."""
    return slowest(comm.allgather_object(timed(comm, fn, reps, mpi_barrier)))


def ring_chain(comm: Any, peers: tuple[int, int], nbytes: int, steps: int, reduce: bool = False):
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


def exchange_times(comm: Any, peers: tuple[int, int] | None, effort: Effort, steps: int = 1,
                   reduce: bool = False) -> list[float]:
    """Seconds per sendrecv (to peers[0], from peers[1]; None: no partner) at each of the effort's
    sizes, timed as bench times a call (see bench_time; 0 where no rank had peers). With steps > 1,
    one timed call is that many ring steps in a row (ring_chain) and the time is per step. Each
    size is repeated back to back, as bench repeats a call, in the effort's sweeps over the
    sizes; the median over sweeps drops a sweep that a slow spell of the machine fell on."""
    exchanges = []
    for nbytes in effort.sizes:
        exchange = None
        if peers is not None and steps > 1:
            exchange = ring_chain(comm, peers, nbytes, steps, reduce)
        elif peers is not None:
            send, recv = exchange_buffers(nbytes)
            exchange = functools.partial(comm.sendrecv, send, peers[0], recv, peers[1], "calibrate")
        exchanges.append(exchange)
    sweeps = np.zeros((effort.sweeps, len(exchanges)))
    for sweep in range(effort.sweeps):
        for j, (exchange, reps) in enumerate(zip(exchanges, effort.reps, strict=True)):
            if exchange is not None:
                exchange()  # warm up the path and the buffers
            sweeps[sweep, j] = bench_time(comm, exchange, reps, effort.mpi_barrier) / steps
    return np.median(sweeps, axis=0).tolist()


def link_curves(comm: Any, effort: Effort) -> dict[str, list[float] | None]:
    """Per size of the effort: the exchange between neighbours of a node ("intra"), a step round a
    ring of a node's ranks ("ring", and "ring_reduce" with the effort's reducing ring), and the
    exchange between equal local ranks of paired nodes ("inter"); None where not measured. The
    same curves on every rank (collective)."""
    groups = comm.node_groups()
    widest = max(map(len, groups))
    shift = shifts(groups).get(comm.rank)
    steps = 2 * (widest - 1)
    mine = pairs(groups, False).get(comm.rank)
    curves: dict[str, list[float] | None] = {
        "intra": exchange_times(comm, None if mine is None else (mine, mine), effort),
        "ring": None, "ring_reduce": None, "inter": None}
    if widest > 2 or (effort.ring_of_two and widest > 1):
        curves["ring"] = exchange_times(comm, shift, effort, steps)
        if effort.reducing_ring:
            curves["ring_reduce"] = exchange_times(comm, shift, effort, steps, reduce=True)
    if len(groups) > 1:
        partner = pairs(groups, True).get(comm.rank)
        curves["inter"] = exchange_times(comm, None if partner is None else (partner, partner),
                                         effort)
    return curves


def stream_time(fn, dtype: np.dtype, effort: Effort) -> float:
    """Seconds per byte of fn(a, b) on STREAM_BYTES arrays of dtype, taking the next of
    STREAM_PAIRS pairs each call, so the data do not come from a core's caches (a collective
    reduces and copies what other cores or MPI wrote last). Each of the effort's blocks times
    its passes over all pairs; the median over blocks drops the blocks a slow spell hit (with
    more ranks than cores, the time slices a rank waits for are part of the rate: every rank
    runs this at the same time)."""
    count = STREAM_BYTES // dtype.itemsize
    arrays = [(np.ones(count, dtype), np.ones(count, dtype)) for _ in range(STREAM_PAIRS)]
    for a, b in arrays:
        fn(a, b)
    calls = effort.stream_passes * STREAM_PAIRS
    blocks = []
    for _ in range(effort.stream_blocks):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(*arrays[i % STREAM_PAIRS])
        blocks.append((time.perf_counter() - t0) / calls)
    return float(np.median(blocks)) / STREAM_BYTES


def rates(effort: Effort) -> dict[str, float]:
    """This rank's seconds per byte of a reduction per dtype ("gamma:DTYPE") and of a copy
    ("copy") on arrays not in cache, and of a copy of a window chunk that stays in cache
    ("copy_cached", the shm algorithm's). Run it on every rank at once."""
    out = {f"gamma:{d}": stream_time(lambda a, b: np.add(a, b, out=a), np.dtype(d), effort)
           for d in GAMMA_DTYPES}
    out["copy"] = stream_time(np.copyto, np.dtype(np.uint8), effort)
    src, dst = np.ones(WINDOW_BYTES, np.uint8), np.empty(WINDOW_BYTES, np.uint8)
    out["copy_cached"] = median_time(lambda: np.copyto(dst, src), effort.cached_reps, 4) \
        / WINDOW_BYTES
    return out


# -- the all-reduce candidates -----------------------------------------------------------------
def _turns_growth(nbytes: int) -> float:
    """A size's timing relative to 8 B's: the same below 1 MiB (latency and time slices set it),
    in proportion to the bytes from 1 MiB, three quarters of that in half the rounds (TUNE_HUGE)."""
    return max(1.0, nbytes / (1 << 20)) * (0.75 if nbytes >= TUNE_HUGE else 1.0)


def next_size_seconds(last_seconds: float, last_bytes: int, nbytes: int) -> float:
    """What timing the table's size nbytes will take, from the last size timed (`_turns_growth`)."""
    return last_seconds * _turns_growth(nbytes) / _turns_growth(last_bytes)


def _allreduce_times(comm: Any, crowded_node: bool = False,
                     seconds: float | None = None) -> dict[str, list[list[list[float]]]]:
    """Per all-reduce candidate `auto` may pick, per size of TUNE_SIZES, per round: this rank's
    times of its calls (TUNE_ROUNDS turns of TUNE_REPS calls, each after a barrier, the
    algorithms taking turns as in `mpdl bench`), each call into a new result array with the input
    copy, as the one-shot public call makes them (the algorithms that read their input directly
    get it as `src`). The table predicts one-shot calls (plans verify their own rhythm), and a new
    array ranks the algorithms otherwise than a reused one.

    Where a node runs more ranks than cores (`crowded_node`, every rank's view combined), the
    barrier is MPI_Barrier, as `mpdl bench` times calls; elsewhere mpdl's own barrier, which did
    better there (docs/results/auto.md#new-arrays-and-the-barrier-of-the-table).

    With `seconds`, the sizes are timed coarse to fine (TUNE_ORDER, the first always), and rank 0
    leaves out each size it expects to end past that many seconds from the start
    (`next_size_seconds`), telling every rank: a size left out has no rounds ([]), the same on
    every rank."""
    names = candidates("allreduce", comm.has_shared_memory)
    out: dict[str, list[list[list[float]]]] = {name: [[] for _ in TUNE_SIZES] for name in names}
    # (a part of the world, which has no MPI communicator of its own, keeps mpdl's barrier)
    mpi_barrier = crowded_node and getattr(comm, "mpi", None) is not None
    start = time.perf_counter()
    last: tuple[float, int] | None = None  # the last size timed: its seconds and bytes
    every = range(len(TUNE_SIZES))
    order = [i for i in TUNE_ORDER if i in every] + [i for i in every if i not in TUNE_ORDER]
    for i in (order if seconds is not None else every):
        nbytes = TUNE_SIZES[i]
        began = time.perf_counter()
        if seconds is not None and last is not None:
            expected = began - start + next_size_seconds(*last, nbytes)
            if comm.allgather_object(expected > seconds)[0]:  # rank 0 decides for all
                continue
        x = np.ones(max(1, nbytes // 4), np.float32)
        calls = {}
        for name in names:
            algo = registry.REGISTRY["allreduce"][name]

            def call(algo=algo, x=x) -> None:
                work = backend.empty_like_page_offset(x)  # the call's new result array
                if algo.reads_input:
                    algo.run(comm, work, "sum", src=x)
                else:
                    np.copyto(work, x)
                    algo.run(comm, work, "sum")

            calls[name] = call
        huge = nbytes >= TUNE_HUGE
        for k in range(TUNE_ROUNDS // 2 if huge else TUNE_ROUNDS):
            for name, call in calls.items():
                comm.barrier()
                if k == 0 or not huge:
                    call()  # untimed: each turn starts as bench's turns do
                out[name][i].append(timed(comm, call, TUNE_REPS[nbytes >= (1 << 20)],
                                          mpi_barrier=mpi_barrier))
        last = time.perf_counter() - began, nbytes
    return out


def crowded(comm: Any) -> bool:
    """Does this rank's node run more ranks than this process may use cores (as comm's node
    groups or the launcher say)? This rank's view: combine every rank's (`allreduce_table` and
    `verify.Trial` take the verdict of any rank)."""
    here = next((len(g) for g in comm.node_groups() if comm.rank in g), 1)
    return here > mpi_runtime.usable_cores() or mpi_runtime.oversubscribed()


def typical(times: list[float], crowded_node: bool) -> float:
    """What repetitions of one call say of it: the fastest (other work only ever adds time, so a
    repetition a slow spell fell on says nothing of the algorithm), or on a crowded node the
    median (the waits among the algorithm's own ranks for a core are part of every call, and the
    fastest of a few is a schedule the next calls will not see again)."""
    return float(np.median(times)) if crowded_node else float(min(times))


@dataclass(frozen=True)
class Table:
    """`Params.allreduce_times` (every candidate's (bytes, seconds) per size: the typical round's
    median of the slowest rank's time, non-decreasing in size), `spread`: the median over
    candidates and sizes of the median round over the fastest (1 on a quiet machine), whether a
    node ran more ranks than cores (then the median round counts, else the fastest), and whether
    the time given ran out before the last of TUNE_SIZES (`partial`)."""

    rows: tuple[tuple[str, tuple[tuple[float, float], ...]], ...]
    spread: float
    crowded: bool = False
    partial: bool = False


def allreduce_table(comm: Any, seconds: float | None = None) -> Table:
    """Every all-reduce candidate timed at TUNE_SIZES, the algorithms taking turns. Per candidate
    and size, the fastest round counts, or the median round where a node runs more ranks than
    cores (`typical`), where the fastest round is a lucky one
    (docs/results/auto.md#the-fastest-round-or-the-median). With `seconds`, the sizes that
    would end past that many seconds are left out (`_allreduce_times`): the table interpolates
    between those timed. Collective over comm; the same table on every rank."""
    crowded_node = any(comm.allgather_object(crowded(comm)))
    everyone = comm.allgather_object(_allreduce_times(comm, crowded_node, seconds))
    rows, ratios = [], []
    kept = [i for i in range(len(TUNE_SIZES)) if all(t[i] for t in everyone[0].values())]
    sizes = tuple(TUNE_SIZES[i] for i in kept)
    for name in everyone[0]:
        times = []
        for i in kept:
            rounds = sorted(slowest([r[name][i][k] for r in everyone])
                            for k in range(len(everyone[0][name][i])))
            times.append(typical(rounds, crowded_node))
            ratios.append(float(np.median(rounds)) / max(rounds[0], 1e-12))
        rows.append((name, monotone(sizes, times)))
    return Table(tuple(rows), float(np.median(ratios)), crowded_node, len(sizes) < len(TUNE_SIZES))


# -- was the machine quiet? --------------------------------------------------------------------
def load_per_core(ranks_here: int) -> float:
    """Runnable processes per core beyond this node's `ranks_here` measuring ranks: the smaller
    of the 1-minute load average (os.getloadavg) and the processes runnable at this moment
    (`runnable_now`), less the measuring ranks, over the cores; 0 where unknown. The average
    alone lags by a minute: a run that just ended would still count as other work."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    return max(0.0, min(load, runnable_now()) - ranks_here) / (os.cpu_count() or 1)


def runnable_now() -> float:
    """Processes runnable on this machine at this moment, the caller included (the kernel's count
    in /proc/loadavg); infinity where the system does not say."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return math.inf


def clocks() -> tuple[float, float]:
    """The wall clock and this process's CPU clock, now: the start of a `core_share` stretch."""
    return time.perf_counter(), time.process_time()


def core_share(since: tuple[float, float]) -> float:
    """This rank's CPU time since `since` (`clocks()`) over the wall time: its share of a core. A
    measuring rank never sleeps (MPI's and mpdl's waits poll), so this is its time on a core:
    about 1 on a quiet node with a core for each rank, cores/ranks when there are more ranks, less
    where other work took the rank's turns. 1.0 for a stretch shorter than SHARE_MIN_SECONDS."""
    wall = time.perf_counter() - since[0]
    return 1.0 if wall < SHARE_MIN_SECONDS else (time.process_time() - since[1]) / wall


def machine_share(shares: list[float], cores: int) -> float:
    """A machine's core time over what its ranks have with it to themselves, from its ranks'
    `core_share`s: the smallest where each rank has a core (the slowest rank sets a collective's
    time), their sum over the cores where ranks share them (3 ranks on 2 cores split them
    unevenly, 0.56, 0.65 and 0.57 when quiet)."""
    return min(shares) if len(shares) <= cores else sum(shares) / cores


@dataclass(frozen=True)
class Busy:
    """The busy-machine check of one calibration: the largest load per core over ranks, before and
    after, the spread of the tuning rounds, and the smallest share of core time over machines
    (`machine_share`). `why` is "" on a quiet machine."""

    load_before: float
    load_after: float
    spread: float
    share: float = 1.0

    @property
    def why(self) -> str:
        reasons = []
        load = max(self.load_before, self.load_after)
        if load > BUSY_LOAD_PER_CORE:
            reasons.append(f"load {load:.2f} per core beyond the measuring ranks "
                           f"(before {self.load_before:.2f}, after {self.load_after:.2f})")
        if self.share < BUSY_SHARE:
            reasons.append(f"the measuring ranks had {self.share:.2f} of the core time they "
                           f"have alone")
        if self.spread > BUSY_SPREAD:
            reasons.append(f"repeated identical calls differed {self.spread:.2f}x")
        return "busy machine: " + ", ".join(reasons) if reasons else ""


def machine_id() -> str:
    """What tells this machine's kernel from another's: its boot id where Linux has one (the same
    for every network namespace and container on it, which share its cores), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def busy_check(comm: Any, load_before: float, load_after: float, spread: float,
               share: float = 1.0) -> Busy:
    """The verdict on the largest loads over ranks and the smallest `machine_share` over machines
    (ranks on one kernel share its cores, even as MPI nodes of their own: network namespaces,
    emulated nodes) from each rank's `core_share`, the same on every rank (collective over comm;
    `spread` is the same on every rank already)."""
    everyone = comm.allgather_object(
        (load_before, load_after, share, os.cpu_count() or 1, machine_id()))
    machines: dict[str, list[float]] = {}
    for r in everyone:
        machines.setdefault(r[4], []).append(r[2])
    cores = {r[4]: r[3] for r in everyone}
    shares = min(machine_share(s, cores[m]) for m, s in machines.items())
    return Busy(max(r[0] for r in everyone), max(r[1] for r in everyone), spread, shares)

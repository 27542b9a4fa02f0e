"""The timing loop of `mpdl bench`: collective algorithms side by side, in the style of nccl-tests.

Per message size, the algorithms take turns in rounds (A A A B B B C C C, A A A B B B ...), so a
noisy machine that drifts treats them alike, while each call follows a call of the same algorithm,
as in nccl-tests' loops: a call that follows another algorithm's runs slower (its buffers and
messages left the caches and the scheduler in another state; docs/results/collectives.md). Each
turn starts with one untimed call. One iteration is: MPI barrier, start the clock, call, stop the
clock; with `loop` > 1 (`mpdl bench --loop`), the clock runs over that many calls back to back
with no barrier between them, OSU-style, and the time is per call (the output array is then
allocated once, so repeated calls run through their cached plan, as a training loop's do).
A collective's time is the slowest rank's (one MAX all-reduce of all the timings after the loop),
and a row reports the median over iterations with min and max. Bandwidths follow nccl-tests:
algbw = bytes / time, busbw = algbw × 2(p-1)/p (allreduce), × (p-1)/p (reduce_scatter, allgather,
alltoall), × 1 (broadcast, reduce); bytes is the whole array (the result, for allgather; what each
rank sends in all, for alltoall: bytes/p per destination).
Beside each measurement is the cost model's prediction (`mpdl calibrate` sets its parameters).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpdl import backend
from mpdl import collectives as C
from mpdl import emulation as _emulation
from mpdl.comm import polling
from mpdl.emulation import Emulation
from mpdl.perf import mpi_variants
from mpdl.tuning import auto, costmodel, verify

#: the fields of a row, in the order of the CSV columns
FIELDS = ["collective", "algorithm", "chosen", "ranks", "nodes", "bytes", "count", "dtype", "op",
          "time_us", "time_us_min", "time_us_max", "algbw_gbs", "busbw_gbs", "wrong",
          "predicted_us", "emulated", "loop"]
_TOLERANCE = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12, "bfloat16": 2e-2,
              "float8_e4m3fn": 0.25, "float8_e5m2": 0.5}
#: rounds the timed iterations of one size are split into (see the module docstring)
ROUNDS = 4


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw ratio."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("reduce_scatter", "allgather", "alltoall"):
        return (p - 1) / p
    return 1.0


def turns(iters: int) -> list[range]:
    """The iterations each algorithm times back to back in each of ROUNDS rounds (fewer rounds
    when there are fewer iterations), as even as they come."""
    rounds = max(1, min(ROUNDS, iters))
    edges = [iters * k // rounds for k in range(rounds + 1)]
    return [range(edges[k], edges[k + 1]) for k in range(rounds)]


def sizes(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min_bytes, then × factor (at least one more byte each step) while at most max_bytes."""
    out = []
    size = min_bytes
    while size <= max_bytes:
        out.append(size)
        size = max(size + 1, int(round(size * factor)))
    return out


def algorithm_names(collective: str, chosen: Sequence[str] | None = None) -> list[str]:
    """The algorithms a run times: every registered one and auto (chosen None), or the chosen
    ones in their order, without repeats, with the mpi baseline every ratio refers to added.
    ValueError names the unknown ones."""
    known = C.algorithms(collective)
    if chosen is None:
        return [*known, "auto"]
    names = list(dict.fromkeys(chosen))
    unknown = [a for a in names if a not in (*known, "auto")]
    if unknown or not names:
        raise ValueError(f"unknown {', '.join(map(repr, unknown)) or 'empty list'} for "
                         f"{collective}; expected all or a comma list of "
                         f"{', '.join([*known, 'auto'])}")
    return names if "mpi" in names else [*names, "mpi"]


@dataclass(frozen=True)
class Config:
    """What one run of bench times, every field checked by the caller (`mpdl bench` checks its
    flags); `algorithms` includes the mpi baseline when `check` compares with it."""

    collective: str = "allreduce"
    algorithms: Sequence[str] = ()
    sizes: Sequence[int] = (8,)
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    #: the reduction (None for allgather and broadcast)
    op: str | None = "sum"
    iters: int = 20
    warmup: int = 3
    root: int = 0
    inplace: bool = False
    #: compare every result with the mpi baseline (the rows' `wrong`)
    check: bool = False
    device: str = "cpu"
    #: the links of this run (None: not slowed)
    emulation: Emulation | None = None
    #: calls timed back to back per iteration (1: one barrier before every call)
    loop: int = 1
    #: also time the MPI library's own algorithms by name (`mpi_variants`), rows `mpi:NAME`
    mpi_variants: bool = False


class Unusable(ValueError):
    """The configuration cannot run on this communicator (a root outside it, no GPU on a rank);
    raised on every rank alike before anything is timed."""


@dataclass
class Result:
    """A run's rows (complete on rank 0, empty elsewhere) and what they were measured on."""

    rows: list[dict[str, Any]]
    ranks: int
    nodes: int
    #: the cost model's parameters behind `predicted_us`
    params: costmodel.Params
    #: why the predictions use the defaults, when the calibrated parameters are unavailable
    note: str | None = None
    #: where auto's model comes from (`auto.Model.describe`)
    model: str = ""
    #: every algorithm label a row of the run may have (auto's as `auto→NAME`, each NAME it may
    #: choose), for the table's column width
    labels: tuple[str, ...] = ()


# -- the measurement ---------------------------------------------------------------------------
class Case:
    """One (size, algorithm): how to call it, and what it produced on this rank. A variant of
    the MPI library's (`mpi_variants.Variant`) runs mpdl's "mpi" on the variant's communicator,
    between its enter() and leave()."""

    def __init__(self, collective: str, algorithm: str, x: Any, op: str | None, root: int,
                 inplace: bool, comm: Any, loop: int = 1, variant: Any = None):
        self.label = algorithm if variant is None else variant.name
        self.variant = variant
        if variant is not None:
            algorithm, comm = "mpi", variant.comm
        self.algorithm = algorithm
        self.result = None
        #: restores the input before an iteration (in-place runs overwrite it); outside the clock
        self.reset = None
        if collective == "allreduce":
            if inplace:
                original = x.copy()
                self.reset = lambda: x.__setitem__(Ellipsis, original)
                self.call = lambda: C.allreduce(x, op=op, algorithm=algorithm, comm=comm, out=x)
            elif loop > 1:
                out = x.copy()
                self.call = lambda: C.allreduce(x, op=op, algorithm=algorithm, comm=comm, out=out)
            else:
                self.call = lambda: C.allreduce(x, op=op, algorithm=algorithm, comm=comm)
        elif collective == "alltoall":
            if inplace:
                original = x.copy()
                self.reset = lambda: x.__setitem__(Ellipsis, original)
                self.call = lambda: C.alltoall(x, comm=comm, algorithm=algorithm, out=x)
            else:
                out = x.copy()
                self.call = lambda: C.alltoall(x, comm=comm, algorithm=algorithm, out=out)
        elif collective == "reduce_scatter":
            self.call = lambda: C.reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
        elif collective == "allgather" and loop > 1:
            whole = backend.get_array_module(x).empty(x.size * comm.size, dtype=x.dtype)
            self.call = lambda: C.allgather(x, algorithm=algorithm, comm=comm, out=whole)
        elif collective == "allgather":
            self.call = lambda: C.allgather(x, algorithm=algorithm, comm=comm)
        elif collective == "broadcast":
            self.call = lambda: C.broadcast(x, root=root, algorithm=algorithm, comm=comm)
        else:
            self.call = lambda: C.reduce(x, root=root, op=op, algorithm=algorithm, comm=comm)


def _input(collective: str, nbytes: int, dtype: np.dtype, p: int, rank: int, xp: Any) -> tuple:
    """(this rank's input array, the size in bytes the row reports, its element count)."""
    count = nbytes // dtype.itemsize
    if collective in ("allgather", "alltoall"):
        count -= count % p  # every rank contributes (allgather), sends (alltoall) count/p elements
    local = count // p if collective == "allgather" else count
    values = ((np.arange(local, dtype=np.int64) + rank) % 3 + 1).astype(dtype)
    if collective == "alltoall":  # block j goes to rank j; its values say from whom and where to
        values = (np.arange(local, dtype=np.int64) * (p + 1) + rank).astype(dtype).reshape(p, -1)
    return xp.asarray(values) if xp is not np else values, count * dtype.itemsize, count


def _turn(case: Case, work: Callable[[], Any], world: Any) -> Any:
    """Run work (a case's calls) with its variant selected, if any; a barrier first when
    `world` is given."""
    if case.reset is not None and world is not None:
        case.reset()
    if case.variant is not None:
        case.variant.enter()
    try:
        if world is not None:
            world.Barrier()
        return work()
    finally:
        if case.variant is not None:
            case.variant.leave()


def _wrong(result: Any, reference: Any, dtype: np.dtype) -> int:
    """How many elements differ from the baseline (with a tolerance for float sums)."""
    if result is None and reference is None:
        return 0
    if result is None or reference is None:
        return max(getattr(result, "size", 0), getattr(reference, "size", 0), 1)
    a, b = backend.to_host(result).reshape(-1), backend.to_host(reference).reshape(-1)
    if a.shape != b.shape:
        return max(a.size, b.size)
    if backend.is_floating(dtype):
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        tol = _TOLERANCE[dtype.name]
        close = np.isclose(a64, b64, rtol=tol, atol=tol, equal_nan=True) | (a64 == b64)
        return int(np.count_nonzero(~close))
    return int(np.count_nonzero(a != b))


def array_module(comm: Any, device: str) -> Any:
    """NumPy for device "cpu"; CuPy for "gpu" when every rank has it (collective over comm),
    Unusable otherwise."""
    if device != "gpu":
        return np
    cupy = backend.cupy_module()
    if not all(comm.allgather_object(cupy is not None)):
        raise Unusable("device gpu: CuPy with a visible GPU is needed on every rank")
    return cupy


def run(config: Config, comm: Any, progress: Callable[[Result], None] | None = None) -> Result:
    """Time config's algorithms at each of its sizes on comm (an MPIComm; collective). For the
    run, comm's links and `auto`'s cost model are those of config.emulation; both are restored
    after. `progress` is called after each size with a Result of that size's rows (complete on
    rank 0, empty elsewhere), so that they can be shown as they are measured."""
    p = comm.size
    if not 0 <= config.root < p:
        raise Unusable(f"root: expected a rank in [0, {p}), got {config.root}")
    xp = array_module(comm, config.device)
    restore = _emulation.apply(comm, config.emulation)
    try:
        return _measure_all(config, comm, xp, progress)
    finally:
        restore()


def _measure_all(config: Config, comm: Any, xp: Any, progress: Callable[[Result], None] | None
                 ) -> Result:
    p, rank = comm.size, comm.rank
    nodes = len(comm.node_groups())
    # the model auto chooses with (collective: it may calibrate on first use, before any timing)
    model = auto.model_for(comm)
    note = None if model.params is not None else model.describe()
    polling.load()  # the plans' compiled wait, loaded once before any timing
    params = (model.params or costmodel.Params()).emulated(config.emulation)

    found = mpi_variants.variants(comm, config.collective) if config.mpi_variants else []
    described = model.describe()
    labels = tuple(name for name in config.algorithms if name != "auto") \
        + tuple(v.name for v in found) \
        + (tuple(f"auto→{name}" for name in C.algorithms(config.collective))
           if "auto" in config.algorithms else ())
    rows: list[dict[str, Any]] = []
    chosen_everywhere: list[tuple[int, str]] = []
    for size in config.sizes:
        size_rows, auto_choice = measure_size(config, comm, size, xp, params, nodes,
                                              comm.has_shared_memory, found)
        rows.extend(size_rows)
        if auto_choice is not None:
            chosen_everywhere.append((size, auto_choice))
        if progress is not None:
            progress(Result(size_rows, p, nodes, params, note, described, labels))

    # auto must pick the same algorithm on every rank: check it, loudly.
    everyone = comm.allgather_object(chosen_everywhere)
    if any(c != everyone[0] for c in everyone):
        raise RuntimeError(f"auto chose differently on different ranks: {everyone}")
    return Result(rows if rank == 0 else [], p, nodes, params, note, described, labels)


def _applicable(comm: Any, case: Case) -> bool:
    """Whether the library runs a variant's forced algorithm for these arguments (MPICH raises
    when it does not: COLLECTIVE_FALLBACK=error); every rank agrees. Two calls: a call with out=
    makes a plan first and runs the plan's own call from the second on."""
    case.variant.enter()
    try:
        case.call()
        case.call()
        ok = True
    except comm.MPI.Exception:
        ok = False
    finally:
        case.variant.leave()
    return all(comm.allgather_object(ok))


def measure_size(config: Config, comm: Any, size: int, xp: Any, params: costmodel.Params,
                 nodes: int, shared: bool, variants: Sequence[Any] = ()
                 ) -> tuple[list[dict[str, Any]], str | None]:
    """Time every algorithm (and every variant of the MPI library's, `mpi_variants.Variant`)
    at one size, in turns: (the rows, complete on rank 0, empty elsewhere; the algorithm auto
    chose, None when auto is not timed). A variant that does not apply to the size gets no row."""
    p, rank, collective = comm.size, comm.rank, config.collective
    names, dtype, op = list(config.algorithms), config.dtype, config.op
    x, nbytes, count = _input(collective, size, dtype, p, rank, xp)
    cases = [Case(collective, a, x.copy() if config.inplace else x, op, config.root,
                  config.inplace, comm, config.loop) for a in names]
    for variant in variants:  # each beside mpdl's algorithm of its name, if timed
        case = Case(collective, "mpi", x.copy() if config.inplace else x, op, config.root,
                    config.inplace, comm, config.loop, variant)
        if _applicable(comm, case):
            after = [i for i, c in enumerate(cases) if c.label == variant.counterpart
                     or c.variant is not None and c.variant.counterpart == variant.counterpart
                     and variant.counterpart is not None]
            cases.insert(after[-1] + 1 if after else len(cases), case)
    calls = range(config.loop)
    chosen = {c.label: c.algorithm if c.variant is None else c.variant.library_name
              for c in cases}
    if "auto" in names:
        chosen["auto"] = auto.algorithm_for(collective, nbytes, comm).name
    world, MPI = comm.mpi, comm.MPI
    for _ in range(config.warmup):
        for case in cases:
            _turn(case, lambda case=case: case.call(), world)
    times = np.zeros((len(cases), config.iters), dtype=np.float64)
    for turn in turns(config.iters):
        for i, case in enumerate(cases):
            def timed(case=case, i=i, turn=turn) -> Any:
                result = None
                for it in (None, *turn):  # None: the turn's untimed first call
                    if case.reset is not None:
                        case.reset()
                    world.Barrier()
                    call = case.call
                    t0 = time.perf_counter()
                    for _ in calls:
                        result = call()
                    if it is not None:
                        times[i, it] = (time.perf_counter() - t0) / config.loop
                return result

            result = _turn(case, timed, None)
            if config.check:  # keep results only when they are compared
                case.result = result
    if "auto" in names and config.loop > 1 and collective in verify.VERIFIED:
        # what auto ran: repeated calls with out= run through a plan, which may have verified
        chosen["auto"] = auto.plan_choice(collective, nbytes, comm).name
    slowest = np.empty_like(times)
    world.Allreduce(times, slowest, op=MPI.MAX)

    wrong = np.zeros(len(cases), dtype=np.int64)
    if config.check:
        reference = next(c for c in cases if c.label == "mpi").result
        for i, case in enumerate(cases):
            wrong[i] = _wrong(case.result, reference, dtype)
        world.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
    auto_choice = chosen.get("auto") if "auto" in names else None
    if rank != 0:
        return [], auto_choice
    emulated = config.emulation.describe() if config.emulation else ""
    rows = []
    for i, case in enumerate(cases):
        median = float(np.median(slowest[i]))
        algbw = nbytes / median / 1e9 if median > 0 else 0.0
        modelled = chosen[case.label]
        if case.variant is not None:  # the library's algorithm, predicted as mpdl's of its name
            modelled = case.variant.counterpart or "mpi"
        predicted = costmodel.predict(collective, modelled, nbytes, p, nodes, params,
                                      dtype.name)
        rows.append({"collective": collective, "algorithm": case.label,
                     "chosen": chosen[case.label], "ranks": p, "nodes": nodes,
                     "bytes": nbytes, "count": count, "dtype": dtype.name, "op": op or "none",
                     "time_us": median * 1e6, "time_us_min": float(slowest[i].min()) * 1e6,
                     "time_us_max": float(slowest[i].max()) * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * bus_factor(collective, p),
                     "wrong": int(wrong[i]) if config.check else None,
                     "predicted_us": predicted * 1e6, "emulated": emulated,
                     "loop": config.loop})
    return rows, auto_choice

"""The argument checks and the algorithm choice every public collective and plan shares.

`allreduce_call`, `reduce_scatter_call`, `allgather_call` and `alltoall_call` are the one place
where a call of those collectives is checked and its algorithm chosen: the one-shot calls, their
asynchronous forms, the plan cache of the ordinary calls and the persistent plans (`*_init`) all
start from the `Call` they return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mpdl import backend
from mpdl.collectives import blocks, hook, registry
from mpdl.collectives.ops import block_bounds, check_array, check_op, reduced_bytes
from mpdl.comm import CollectiveMismatch, Communicator, as_communicator
from mpdl.comm.calls import PRECHECK_TAG, CallName, call_name, tagged

#: the algorithms whose messages carry no tag of ours (MPI's own collectives, shared memory): a
#: call of one compares its signature across the ranks first (`precheck`)
UNTAGGED = frozenset({"mpi", "shm"})


@dataclass(frozen=True)
class Call:
    """A collective call checked identically on every rank before any message, its algorithm
    chosen ("auto" resolved): what to run, and on which arrays."""

    comm: Communicator
    algorithm: registry.Algorithm
    #: what MPDL_CHECK compares across ranks: (collective, algorithm, shape, dtype, op, root)
    signature: tuple
    #: the array module of x (NumPy or CuPy)
    xp: Any
    x: Any
    #: where the result goes: out, or an array made for it (allreduce, alltoall: x's shape;
    #: allgather: the whole 1-D result); reduce_scatter: None (its result is a block of the work)
    out: Any
    op: str | None = None
    #: the block bounds (reduce_scatter, allgather) or the all-to-all's `blocks.Blocks`
    layout: Any = None


def allreduce_call(x: Any, op: Any, algorithm: Any, comm: Any, out: Any,
                   plan: bool = False, shared: bool = False) -> Call:
    """The checked `allreduce(x, op, algorithm, comm, out)`; out is made when None. For a
    persistent plan (`plan`), "auto" is the tuner's (`hook.choose`): what a plan of
    this size (of an array in shared memory with `shared`) verified."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    if plan:  # once per plan, always, and before auto's choice (which may set up groups)
        agree(c, "allreduce plan", algorithm, x.shape, dtype, op, None, always=True)
    algo = pick("allreduce", algorithm, c, reduced_bytes(x, op), plan, shared)
    if out is None:
        out = backend.empty_like_page_offset(x)
    else:
        check_out(out, x, xp)
    signature = ("allreduce", algo.name, x.shape, dtype, op, None)
    agree(c, *signature)
    return Call(c, algo, signature, xp, x, out, op)


def reduce_scatter_call(x: Any, op: Any, algorithm: Any, comm: Any, in_place: bool,
                        plan: bool = False) -> Call:
    """The checked `reduce_scatter(x, op, algorithm, comm, in_place)`; for a persistent plan
    (`plan`), "auto" is the tuner's (`hook.choose`)."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    if in_place and (x.ndim != 1 or not x.flags["C_CONTIGUOUS"]):
        raise ValueError("x: in_place needs a 1-D C-contiguous array")
    if plan:
        agree(c, "reduce_scatter plan", algorithm, x.shape, dtype, op, None, always=True)
    algo = pick("reduce_scatter", algorithm, c, reduced_bytes(x, op), plan)
    signature = ("reduce_scatter", algo.name, x.shape, dtype, op, None)
    agree(c, *signature)
    return Call(c, algo, signature, xp, x, None, op, block_bounds(x.size, c.size))


def allgather_call(x: Any, algorithm: Any, comm: Any, count: Any, out: Any,
                   plan: bool = False) -> Call:
    """The checked `allgather(x, algorithm, comm, count, out)`; out is made when None; for a
    persistent plan (`plan`), "auto" is the tuner's (`hook.choose`)."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    bounds, total = allgather_bounds(x, c, count)
    check_allgather_out(out, xp, dtype, total)
    if plan:
        agree(c, "allgather plan", algorithm, x.shape if count is None else (count,), dtype,
              None, None, always=True)
    algo = pick("allgather", algorithm, c, total * x.itemsize, plan)
    signature = ("allgather", algo.name, x.shape if count is None else (count,), dtype, None,
                 None)
    agree(c, *signature)
    result = xp.empty(total, dtype=dtype) if out is None else out
    return Call(c, algo, signature, xp, x, result, None, bounds)


def alltoall_call(x: Any, algorithm: Any, comm: Any, out: Any) -> Call:
    """The checked `alltoall(x, comm, algorithm, out)`; out is made when None."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    block = check_blocks(x, c.size)
    algo = pick("alltoall", algorithm, c, x.nbytes)
    if out is None:
        out = xp.empty(x.shape, dtype=dtype)
    else:
        check_out(out, x, xp)
    signature = ("alltoall", algo.name, x.shape, dtype, None, None)
    agree(c, *signature)
    return Call(c, algo, signature, xp, x, out, None, blocks.uniform(c.size, block))


def pick(collective: str, algorithm: str, comm: Communicator, nbytes: int,
         plan: bool = False, shared: bool = False) -> registry.Algorithm:
    """The registered algorithm of the call: by name, or auto's (for a persistent plan with
    `plan`: the tuner's (`hook.choose`), what a plan of the size, of an array in shared memory with
    `shared`, verified)."""
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected a name, got {type(algorithm).__name__}")
    if algorithm == "auto":
        return hook.choose(collective, nbytes, comm, plan, shared)
    return registry.resolve(collective, algorithm)


def agree(comm: Communicator, *signature: Any, always: bool = False) -> None:
    """With MPDL_CHECK=1 (`comm.check`) or `always`, make sure every rank called the same
    collective with the same arguments. Costs one small all-gather of Python objects per call
    (tens of microseconds)."""
    if not (comm.check or always) or comm.size == 1:
        return
    group = comm.flight_group()
    position = comm.flight.next_seq(group) if comm.flight is not None else None
    previous, comm.collective = comm.collective, call_name(signature).before(group, position)
    try:
        everyone = comm.allgather_object(signature)
    finally:
        comm.collective = previous
    if any(s != everyone[0] for s in everyone):
        lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
        seq = f" #{comm.flight.next_seq(comm.flight_group())}" if comm.flight is not None else ""
        raise CollectiveMismatch(f"{signature[0]}{seq}: ranks disagree on the call "
                                 f"(collective, algorithm, shape, dtype, op, root): {lines}")


def precheck(comm: Communicator, name: CallName) -> None:
    """Before a call whose messages carry no tag of ours (`UNTAGGED`), make sure every rank makes
    the same call: the maximum of (hash, -hash) of its signature over the ranks, by recursive
    doubling under a tag of its own (lg p exchanges of 16 bytes). Where the hashes differ, every
    rank raises CollectiveMismatch naming each rank's call."""
    if comm.size == 1:
        return
    word = comm.workspace("precheck", 2, np.int64, np)
    word[0], word[1] = name.digest, -name.digest
    with tagged(PRECHECK_TAG):
        _PRECHECK.run(comm, word, "max")
    if word[0] == -word[1]:
        return
    everyone = comm.allgather_object(name.describe())
    seq = f" #{comm.flight.next_seq(comm.flight_group()) - 1}" if comm.flight is not None else ""
    lines = "; ".join(f"rank {comm.world_rank(r)}: {s}" for r, s in enumerate(everyone))
    raise CollectiveMismatch(f"{name}{seq}: the ranks called different collectives: {lines}")


_PRECHECK = registry.resolve("allreduce", "recursive_doubling")


def check_out(out: Any, x: Any, xp: Any) -> None:
    if backend.get_array_module(out) is not xp:
        raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out: expected shape {x.shape} and dtype {x.dtype}, "
                         f"got {out.shape} and {out.dtype}")
    if not out.flags["C_CONTIGUOUS"]:
        raise ValueError("out: expected a C-contiguous array")


def check_blocks(x: Any, p: int) -> int:
    """Elements per block of an all-to-all of x over p ranks (x's first axis must be p)."""
    if x.ndim == 0 or x.shape[0] != p:
        raise ValueError(f"x: expected a first axis of length {p} (one block per rank), got shape "
                         f"{tuple(x.shape)}")
    return x.size // p


def allgather_bounds(x: Any, c: Communicator, count: Any) -> tuple[list[int], int]:
    """(block bounds, total elements) of an all-gather of x (see `allgather`'s count)."""
    if count is None:
        bounds = [i * x.size for i in range(c.size + 1)]
    else:
        if not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(f"count: expected a number of elements >= 0, got {count!r}")
        bounds = block_bounds(int(count), c.size)
        if x.size != bounds[c.rank + 1] - bounds[c.rank]:
            raise ValueError(f"x: expected block {c.rank} of {count} elements over {c.size} "
                             f"ranks ({bounds[c.rank + 1] - bounds[c.rank]} elements), got "
                             f"{x.size}")
    return bounds, bounds[-1]


def check_allgather_out(out: Any, xp: Any, dtype: Any, total: int) -> None:
    if out is not None:
        if backend.get_array_module(out) is not xp:
            raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
        if out.shape != (total,) or out.dtype != dtype or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"out: expected a C-contiguous 1-D array of {total} {dtype}, got "
                             f"shape {out.shape} and {out.dtype}")

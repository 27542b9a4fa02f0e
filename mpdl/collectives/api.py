"""The public collectives: allreduce, reduce_scatter, allgather, broadcast, reduce (and async).

Each call checks its arguments on every rank before any message is sent, copies the input into a
flat result buffer, and hands that buffer to the chosen algorithm, which works in place.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl import backend, faults
from mpdl.collectives import auto, registry
from mpdl.collectives.handles import Handle, engine_for, run_in_order
from mpdl.collectives.ops import block_bounds, check_array, check_op
from mpdl.comm import CollectiveMismatch, Communicator, as_communicator


def _pick(collective: str, algorithm: str, comm: Communicator, nbytes: int) -> registry.Algorithm:
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected a name, got {type(algorithm).__name__}")
    if algorithm == "auto":
        return auto.algorithm_for(collective, nbytes, comm)
    return registry.resolve(collective, algorithm)


def _check_root(root: Any, comm: Communicator) -> int:
    if not isinstance(root, int | np.integer) or not 0 <= root < comm.size:
        raise ValueError(f"root: expected a rank in [0, {comm.size}), got {root!r}")
    return int(root)


def _agree(comm: Communicator, *signature: Any) -> None:
    """With MPDL_CHECK=1 (`comm.check`), make sure every rank called the same collective with the
    same arguments. Costs one small all-gather of Python objects per call (tens of microseconds)."""
    if not comm.check:
        return
    everyone = comm.allgather_object(signature)
    if any(s != everyone[0] for s in everyone):
        lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
        seq = f" #{comm.flight.next_seq(comm.flight_group())}" if comm.flight is not None else ""
        raise CollectiveMismatch(f"{signature[0]}{seq}: ranks disagree on the call "
                                 f"(collective, algorithm, shape, dtype, op, root): {lines}")


def _flat_copy(x: Any, xp: Any, into: Any) -> Any:
    flat = into.reshape(-1)
    if into is not x:
        xp.copyto(flat, x.reshape(-1))
    return flat


def _run(comm, algorithm: registry.Algorithm, collective: str, buf: Any, *args, **kwargs) -> None:
    """Run the algorithm in issue order, named for timeouts and recorded by the flight recorder
    (one entry: sequence number, collective, algorithm, bytes, dtype, op, ranks, times, state)."""
    def work() -> None:
        previous, comm.collective = comm.collective, f"{collective}/{algorithm.name}"
        flight, entry = comm.flight, None
        if flight is not None:
            group = comm.flight_group()
            if comm.settings.fault is not None and faults.skips(comm.world_rank(comm.rank),
                                                                flight.next_seq(group)):
                comm.collective = previous
                return
            op = args[0] if args and isinstance(args[0], str) else None
            entry = flight.begin(group, collective, algorithm.name, buf.nbytes, buf.dtype, op,
                                 group)
        try:
            algorithm.run(comm, buf, *args, **kwargs)
        except BaseException:
            if entry is not None:
                flight.end(entry, "failed")
            raise
        finally:
            comm.collective = previous
        if entry is not None:
            flight.end(entry)

    run_in_order(comm, work)


def allreduce(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
              out: Any = None) -> Any:
    """Reduce x elementwise over all ranks; every rank gets the result (x's kind, shape, dtype).

    x is left untouched unless `out is x`. Results are bit-identical on every rank.
    """
    return _prepare_allreduce(x, op, algorithm, comm, out)[1]()


def allreduce_async(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                    out: Any = None) -> Handle:
    """Start an all-reduce on the communicator's communication thread; return a handle whose
    `.wait()` gives the result and `.test()` says whether it is done. Handles complete in the
    order issued; x must not change until the handle is done."""
    c, work = _prepare_allreduce(x, op, algorithm, comm, out)
    return engine_for(c).submit(work)


def _prepare_allreduce(x: Any, op: str, algorithm: str, comm: Any, out: Any):
    """Check the arguments (every rank, before any message) and return (communicator, work), where
    work() runs the all-reduce and returns the result array."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    algo = _pick("allreduce", algorithm, c, x.nbytes)
    if out is None:
        out = backend.empty_like_page_offset(x)
    else:
        _check_out(out, x, xp)
    _agree(c, "allreduce", algo.name, x.shape, dtype, op, None)
    if algo.reads_input and out is not x:
        flat, source = out.reshape(-1), {"src": x.reshape(-1)}
    else:
        flat, source = _flat_copy(x, xp, out), {}

    def work() -> Any:
        _run(c, algo, "allreduce", flat, op, **source)
        if op == "avg":
            xp.true_divide(flat, c.size, out=flat)
        return out

    return c, work


def _check_out(out: Any, x: Any, xp: Any) -> None:
    if backend.get_array_module(out) is not xp:
        raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out: expected shape {x.shape} and dtype {x.dtype}, "
                         f"got {out.shape} and {out.dtype}")
    if not out.flags["C_CONTIGUOUS"]:
        raise ValueError("out: expected a C-contiguous array")


def reduce_scatter(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                   in_place: bool = False) -> Any:
    """Reduce x over all ranks and return this rank's block of the flattened result.

    Blocks follow numpy.array_split: the first count % p blocks are one element longer. With
    `in_place`, x (1-D, C-contiguous) is the work buffer and the result is a view of its block
    (the rest of x is left undefined); otherwise x is untouched and the result a new array.
    """
    return _prepare_reduce_scatter(x, op, algorithm, comm, in_place)[1]()


def reduce_scatter_async(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                         in_place: bool = False) -> Handle:
    """`reduce_scatter` on the communicator's communication thread (see `allreduce_async`): the
    handle's `.wait()` gives this rank's block; x must not change until the handle is done."""
    c, work = _prepare_reduce_scatter(x, op, algorithm, comm, in_place)
    return engine_for(c).submit(work)


def _prepare_reduce_scatter(x: Any, op: str, algorithm: str, comm: Any, in_place: bool):
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    if in_place and (x.ndim != 1 or not x.flags["C_CONTIGUOUS"]):
        raise ValueError("x: in_place needs a 1-D C-contiguous array")
    algo = _pick("reduce_scatter", algorithm, c, x.nbytes)
    _agree(c, "reduce_scatter", algo.name, x.shape, dtype, op, None)
    bounds = block_bounds(x.size, c.size)

    def work() -> Any:
        if in_place:
            buf = x
        else:
            buf = c.workspace("api.reduce_scatter", x.size, dtype, xp)
            xp.copyto(buf, x.reshape(-1))
        _run(c, algo, "reduce_scatter", buf, op, bounds)
        mine = buf[bounds[c.rank]:bounds[c.rank + 1]]
        if not in_place:
            mine = mine.copy()
        if op == "avg":
            xp.true_divide(mine, c.size, out=mine)
        return mine

    return c, work


def allgather(x: Any, algorithm: str = "auto", comm: Any = None, count: int | None = None,
              out: Any = None) -> Any:
    """Every rank's x, flattened and concatenated in rank order (all ranks pass the same shape).

    With `count`, the ranks hold the blocks of a count-element array split like
    `reduce_scatter`'s (block_bounds: the first count % p blocks one element longer; x.size is
    this rank's block size) and the result is that array. `out` (1-D, the result's size and
    dtype) receives the result; this rank's block may already be in place (x a view of it).
    """
    return _prepare_allgather(x, algorithm, comm, count, out)[1]()


def allgather_async(x: Any, algorithm: str = "auto", comm: Any = None, count: int | None = None,
                    out: Any = None) -> Handle:
    """`allgather` on the communicator's communication thread (see `allreduce_async`)."""
    c, work = _prepare_allgather(x, algorithm, comm, count, out)
    return engine_for(c).submit(work)


def _prepare_allgather(x: Any, algorithm: str, comm: Any, count: int | None, out: Any):
    c = as_communicator(comm)
    xp, dtype = check_array(x)
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
    total = bounds[-1]
    if out is not None:
        if backend.get_array_module(out) is not xp:
            raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
        if out.shape != (total,) or out.dtype != dtype or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"out: expected a C-contiguous 1-D array of {total} {dtype}, got "
                             f"shape {out.shape} and {out.dtype}")
    algo = _pick("allgather", algorithm, c, total * x.itemsize)
    _agree(c, "allgather", algo.name, x.shape if count is None else (count,), dtype, None, None)
    result = xp.empty(total, dtype=dtype) if out is None else out

    def work() -> Any:
        xp.copyto(result[bounds[c.rank]:bounds[c.rank + 1]], x.reshape(-1))
        _run(c, algo, "allgather", result, bounds)
        return result

    return c, work


def broadcast(x: Any, root: int = 0, algorithm: str = "auto", comm: Any = None) -> Any:
    """Root's x on every rank (every rank passes an array of the same shape and dtype)."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    root = _check_root(root, c)
    algo = _pick("broadcast", algorithm, c, x.nbytes)
    _agree(c, "broadcast", algo.name, x.shape, dtype, None, root)
    result = xp.empty(x.shape, dtype=dtype)
    flat = result.reshape(-1)
    if c.rank == root:
        xp.copyto(flat, x.reshape(-1))
    _run(c, algo, "broadcast", flat, root)
    return result


def reduce(x: Any, root: int = 0, op: str = "sum", algorithm: str = "auto",
           comm: Any = None) -> Any:
    """The elementwise reduction of x over all ranks on root; None on the other ranks."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    root = _check_root(root, c)
    algo = _pick("reduce", algorithm, c, x.nbytes)
    _agree(c, "reduce", algo.name, x.shape, dtype, op, root)
    if c.rank == root:
        result = xp.empty(x.shape, dtype=dtype)
        flat = result.reshape(-1)
    else:
        result = None
        flat = c.workspace("api.reduce", x.size, dtype, xp)
    xp.copyto(flat, x.reshape(-1))
    _run(c, algo, "reduce", flat, op, root)
    if result is not None and op == "avg":
        xp.true_divide(flat, c.size, out=flat)
    return result

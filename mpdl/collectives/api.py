"""The public collectives: allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall and
alltoallv (and async).

Each call checks its arguments on every rank before any message is sent, copies the input into a
flat result buffer, and hands that buffer to the chosen algorithm, which works in place.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdl import faults
from mpdl.collectives import blocks as _blocks
from mpdl.collectives import checks as _checks
from mpdl.collectives import counts as _counts
from mpdl.collectives import hook as _hook
from mpdl.collectives import registry
from mpdl.collectives.checks import agree as _agree
from mpdl.collectives.checks import pick as _pick
from mpdl.collectives.ops import check_array, check_op, in_float32, reduced_bytes, reduces_wide
from mpdl.comm import Communicator, as_communicator
from mpdl.comm.calls import call_name, call_state
from mpdl.comm.handles import Handle, comm_thread_for, run_in_order


def _check_root(root: Any, comm: Communicator) -> int:
    if not isinstance(root, int | np.integer) or not 0 <= root < comm.size:
        raise ValueError(f"root: expected a rank in [0, {comm.size}), got {root!r}")
    return int(root)


def _flat_copy(x: Any, xp: Any, into: Any) -> Any:
    flat = into.reshape(-1)
    if into is not x:
        xp.copyto(flat, x.reshape(-1))
    return flat


def _run(comm, algorithm: registry.Algorithm, signature: tuple, buf: Any, *args,
         called: Any = None, **kwargs) -> None:
    """Run the algorithm in issue order, named for timeouts and recorded by the flight recorder
    (one entry: sequence number, collective, algorithm, bytes, dtype, op, ranks, times, state;
    the bytes and dtype of `called`, the caller's array, where buf is its float32 copy).

    Its messages travel under the tag of its signature (collective, algorithm, shape, dtype, op,
    root), so that a rank making another call never matches them; MPI's own and the shared-memory
    algorithms, whose messages carry no tag of ours, and broadcasts (ranks that each take
    themselves for the root only send: nothing would wait) first compare the signature's hash
    across the ranks (`checks.precheck`)."""
    collective = signature[0]
    name = call_name(signature)

    def work() -> None:
        previous, comm.collective = comm.collective, name
        flight, entry = comm.flight, None
        if flight is not None:
            group = comm.flight_group()
            if comm.settings.fault is not None and faults.skips(comm.world_rank(comm.rank),
                                                                flight.next_seq(group)):
                comm.collective = previous
                return
            op = args[0] if args and isinstance(args[0], str) else None
            named = buf if called is None else called
            entry = flight.begin(group, collective, algorithm.name, named.nbytes, named.dtype, op,
                                 group)
        tag, call_state.tag = call_state.tag, name.tag
        try:
            if algorithm.name in _checks.UNTAGGED or collective == "broadcast":
                _checks.precheck(comm, name)
            algorithm.run(comm, buf, *args, **kwargs)
        except BaseException:
            if entry is not None:
                flight.end(entry, "failed")
            raise
        finally:
            comm.collective, call_state.tag = previous, tag
        if entry is not None:
            flight.end(entry)

    run_in_order(comm, work)


def allreduce(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
              out: Any = None) -> Any:
    """Reduce x elementwise over all ranks; every rank gets the result (x's kind, shape, dtype).

    x is left untouched unless `out is x`. Results are bit-identical on every rank. With `out`,
    the call runs through a cached plan (`mpdl.tuning.plan`, through `hook`) of these arrays.
    """
    tuner = _hook.tuner
    if out is not None and tuner is not None:
        try:  # the plan cache's hit, in line (plan.allreduce_key): cheaper than a call
            plan = tuner.cache.get((id(x), id(out), id(comm), op, algorithm))
        except TypeError:  # op or algorithm unhashable: the checks below say which
            plan = None
        if plan is not None and x.dtype is plan.dtype and x.shape == plan.shape \
                and plan.flight is plan.comm.flight:
            return plan()
        if type(op) is str and type(algorithm) is str:
            plan = tuner.cached_allreduce(x, op, algorithm, comm, out)
            if plan is not None:
                return plan()
    return _prepare_allreduce(x, op, algorithm, comm, out)[1]()


def allreduce_async(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                    out: Any = None) -> Handle:
    """Start an all-reduce on the communicator's communication thread; return a handle whose
    `.wait()` gives the result and `.test()` says whether it is done. Handles complete in the
    order issued; x must not change until the handle is done."""
    c, work = _prepare_allreduce(x, op, algorithm, comm, out)
    return comm_thread_for(c).submit(work)


def _prepare_allreduce(x: Any, op: str, algorithm: str, comm: Any, out: Any):
    """Check the arguments (every rank, before any message) and return (communicator, work), where
    work() runs the all-reduce and returns the result array."""
    call = _checks.allreduce_call(x, op, algorithm, comm, out)
    c, algo, xp, out = call.comm, call.algorithm, call.xp, call.out
    if reduces_wide(x.dtype, op):
        def rounded_once() -> Any:
            wide = in_float32(c, x.reshape(-1), xp, op,
                              lambda w: _run(c, algo, call.signature, w, op, called=x))
            out.reshape(-1)[...] = wide
            return out

        return c, rounded_once
    if algo.reads_input and out is not x:
        flat, source = out.reshape(-1), {"src": x.reshape(-1)}
    else:
        flat, source = _flat_copy(x, xp, out), {}

    def work() -> Any:
        _run(c, algo, call.signature, flat, op, **source)
        if op == "avg":
            xp.true_divide(flat, c.size, out=flat)
        return out

    return c, work


def reduce_scatter(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                   in_place: bool = False) -> Any:
    """Reduce x over all ranks and return this rank's block of the flattened result.

    Blocks follow numpy.array_split: the first count % p blocks are one element longer. With
    `in_place`, x (1-D, C-contiguous) is the work buffer and the result is a view of its block
    (the rest of x is left undefined); otherwise x is untouched and the result a new array.
    Runs through a cached plan (`mpdl.tuning.plan`, through `hook`) of x.
    """
    tuner = _hook.tuner
    if tuner is not None and type(op) is str and type(algorithm) is str:
        plan = tuner.cached_reduce_scatter(x, op, algorithm, comm, in_place)
        if plan is not None:
            return plan()
    return _prepare_reduce_scatter(x, op, algorithm, comm, in_place)[1]()


def reduce_scatter_async(x: Any, op: str = "sum", algorithm: str = "auto", comm: Any = None,
                         in_place: bool = False) -> Handle:
    """`reduce_scatter` on the communicator's communication thread (see `allreduce_async`): the
    handle's `.wait()` gives this rank's block; x must not change until the handle is done."""
    c, work = _prepare_reduce_scatter(x, op, algorithm, comm, in_place)
    return comm_thread_for(c).submit(work)


def _prepare_reduce_scatter(x: Any, op: str, algorithm: str, comm: Any, in_place: bool):
    call = _checks.reduce_scatter_call(x, op, algorithm, comm, in_place)
    c, algo, xp, bounds, dtype = call.comm, call.algorithm, call.xp, call.layout, x.dtype

    def work() -> Any:
        if reduces_wide(dtype, op):
            wide = in_float32(c, x.reshape(-1), xp, op,
                              lambda w: _run(c, algo, call.signature, w, op, bounds, called=x))
            mine = wide[bounds[c.rank]:bounds[c.rank + 1]]
            if not in_place:
                return mine.astype(dtype)
            x[bounds[c.rank]:bounds[c.rank + 1]] = mine
            return x[bounds[c.rank]:bounds[c.rank + 1]]
        if in_place:
            buf = x
        else:
            buf = c.workspace("api.reduce_scatter", x.size, dtype, xp)
            xp.copyto(buf, x.reshape(-1))
        _run(c, algo, call.signature, buf, op, bounds)
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
    With `out`, the call runs through a cached plan (`mpdl.tuning.plan`, through `hook`) of these arrays.
    """
    tuner = _hook.tuner
    if (tuner is not None and out is not None and type(algorithm) is str
            and (count is None or type(count) is int)):
        plan = tuner.cached_allgather(x, algorithm, comm, count, out)
        if plan is not None:
            return plan()
    return _prepare_allgather(x, algorithm, comm, count, out)[1]()


def allgather_async(x: Any, algorithm: str = "auto", comm: Any = None, count: int | None = None,
                    out: Any = None) -> Handle:
    """`allgather` on the communicator's communication thread (see `allreduce_async`)."""
    c, work = _prepare_allgather(x, algorithm, comm, count, out)
    return comm_thread_for(c).submit(work)


def _prepare_allgather(x: Any, algorithm: str, comm: Any, count: int | None, out: Any):
    call = _checks.allgather_call(x, algorithm, comm, count, out)
    c, algo, xp, bounds, result = call.comm, call.algorithm, call.xp, call.layout, call.out

    def work() -> Any:
        xp.copyto(result[bounds[c.rank]:bounds[c.rank + 1]], x.reshape(-1))
        _run(c, algo, call.signature, result, bounds)
        return result

    return c, work


def broadcast(x: Any, root: int = 0, algorithm: str = "auto", comm: Any = None) -> Any:
    """Root's x on every rank (every rank passes an array of the same shape and dtype)."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    root = _check_root(root, c)
    algo = _pick("broadcast", algorithm, c, x.nbytes)
    signature = ("broadcast", algo.name, x.shape, dtype, None, root)
    _agree(c, *signature)
    result = xp.empty(x.shape, dtype=dtype)
    flat = result.reshape(-1)
    if c.rank == root:
        xp.copyto(flat, x.reshape(-1))
    _run(c, algo, signature, flat, root)
    return result


def reduce(x: Any, root: int = 0, op: str = "sum", algorithm: str = "auto",
           comm: Any = None) -> Any:
    """The elementwise reduction of x over all ranks on root; None on the other ranks."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    check_op(op, dtype)
    root = _check_root(root, c)
    algo = _pick("reduce", algorithm, c, reduced_bytes(x, op))
    signature = ("reduce", algo.name, x.shape, dtype, op, root)
    _agree(c, *signature)
    if reduces_wide(dtype, op):
        wide = in_float32(c, x.reshape(-1), xp, op,
                          lambda w: _run(c, algo, signature, w, op, root, called=x))
        return wide.reshape(x.shape).astype(dtype) if c.rank == root else None
    if c.rank == root:
        result = xp.empty(x.shape, dtype=dtype)
        flat = result.reshape(-1)
    else:
        result = None
        flat = c.workspace("api.reduce", x.size, dtype, xp)
    xp.copyto(flat, x.reshape(-1))
    _run(c, algo, signature, flat, op, root)
    if result is not None and op == "avg":
        xp.true_divide(flat, c.size, out=flat)
    return result


def alltoall(x: Any, comm: Any = None, algorithm: str = "auto", out: Any = None) -> Any:
    """Block j of x (x[j], its first axis of length p) goes to rank j; block i of the result came
    from rank i. The result has x's shape and dtype; `out` (of that shape and dtype) receives it,
    and `out is x` exchanges in place. x is left untouched otherwise. With `out`, the call runs
    through a cached plan (`mpdl.tuning.plan`, through `hook`) of these arrays; without, small NumPy inputs
    run through a plan kept for their shape (`plan.shaped_alltoall`)."""
    tuner = _hook.tuner
    if tuner is not None and out is None:
        result = tuner.shaped_alltoall(x, comm, algorithm)
        if result is not None:
            return result
    elif tuner is not None and type(algorithm) is str:
        plan = tuner.cache.get(("alltoall", id(x), id(out), id(comm), algorithm))
        if plan is not None and x.dtype is plan.dtype and x.shape == plan.shape \
                and plan.flight is plan.comm.flight:
            return plan()  # the plan cache's hit in line, as allreduce's (plan.cached_alltoall)
        plan = tuner.cached_alltoall(x, algorithm, comm, out)
        if plan is not None:
            return plan()
    return _prepare_alltoall(x, comm, algorithm, out)[1]()


def alltoall_async(x: Any, comm: Any = None, algorithm: str = "auto", out: Any = None) -> Handle:
    """`alltoall` on the communicator's communication thread (see `allreduce_async`): the
    handle's `.wait()` gives the result; x must not change until the handle is done."""
    c, work = _prepare_alltoall(x, comm, algorithm, out)
    return comm_thread_for(c).submit(work)


def _prepare_alltoall(x: Any, comm: Any, algorithm: str, out: Any):
    call = _checks.alltoall_call(x, algorithm, comm, out)
    c, algo, out, layout = call.comm, call.algorithm, call.out, call.layout
    flat = out.reshape(-1)
    send = flat if out is x else x.reshape(-1)
    if not send.flags.c_contiguous:  # a strided view of x: the messages need whole blocks
        send = send.copy()

    def work() -> Any:
        _run(c, algo, call.signature, flat, send, layout)
        return out

    return c, work


def alltoallv(x: Any, send_counts: Any, comm: Any = None, algorithm: str = "auto",
              recv_counts: Any = None) -> tuple[Any, list[int]]:
    """Send the first send_counts[0] rows of x (its first axis) to rank 0, the next
    send_counts[1] to rank 1, and so on (counts may be 0); return (the rows received, in rank
    order, as one array of x's row shape and dtype; how many came from each rank).

    The counts each rank receives are exchanged first (an all-to-all of the counts), unless
    `recv_counts` gives them; "auto" and the algorithms that forward other ranks' blocks (Bruck,
    hierarchical) gather every rank's counts instead (an all-gather of p counts per rank), which
    gives every rank the same size to choose by. Counts that do not fit x raise ValueError on
    every rank that exchanges counts, before any row is sent."""
    c = as_communicator(comm)
    xp, dtype = check_array(x)
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected a name, got {type(algorithm).__name__}")
    named = None if algorithm == "auto" else registry.resolve("alltoall", algorithm)
    sends, exchanged, matrix = _alltoallv_counts(c, named, x, send_counts, recv_counts)
    row = math.prod(x.shape[1:])
    if named is None:
        mean_bytes = sum(map(sum, matrix)) * row * x.itemsize // c.size
        algo = _pick("alltoall", "auto", c, mean_bytes)
    else:
        algo = named
    signature = ("alltoallv", algo.name, x.shape[1:], dtype, None, None)
    _agree(c, *signature)
    layout = _blocks.varying([n * row for n in sends], [n * row for n in exchanged],
                             None if matrix is None else [[n * row for n in r] for r in matrix])
    out = xp.empty((sum(exchanged), *x.shape[1:]), dtype=dtype)
    _run(c, algo, signature, out.reshape(-1), x.reshape(-1), layout)
    return out, exchanged


def _alltoallv_counts(c: Communicator, named: registry.Algorithm | None, x: Any, send_counts: Any,
                      recv_counts: Any) -> tuple[list[int], list[int], list[list[int]] | None]:
    """(this rank's send counts, its receive counts, every rank's send counts or None), exchanged
    as the algorithm needs (see `alltoallv`). A rank whose counts are wrong sends -1s in the
    exchange and raises its own error; the others raise one naming it."""
    p = c.size
    sends: list[int] | None = None
    recvs: list[int] | None = None
    problem: ValueError | None = None
    try:
        sends = _counts.check_send(x, send_counts, p)
        if recv_counts is not None:
            recvs = _counts.check_counts(recv_counts, p, "recv_counts")
    except ValueError as exc:
        sends, problem = None, exc
    matrix = None
    if named is None or named.needs_matrix:
        exchange_with = "mpi" if named is not None and named.name == "mpi" else "auto"
        matrix = _counts.exchange_matrix(
            sends, problem, p, lambda row: allgather(row, algorithm=exchange_with, comm=c))
        exchanged = [row[c.rank] for row in matrix]
    elif recvs is None or c.check:
        exchanged = _counts.exchange(
            sends, problem, p, lambda row: alltoall(row, comm=c, algorithm=named.name))
    elif problem is not None:
        raise problem
    else:
        return sends or [], recvs, None  # nothing exchanged: nothing to compare
    if recvs is not None:  # compared on every rank, so that every rank raises alike
        fits = c.allgather_object(recvs == exchanged)
        if recvs != exchanged:
            raise ValueError(f"recv_counts: the ranks send this one {exchanged} rows, got "
                             f"recv_counts={recvs}")
        if not all(fits):
            raise ValueError(f"recv_counts: rank(s) {[r for r, ok in enumerate(fits) if not ok]} "
                             f"passed counts other than what the ranks send them; no rank sent "
                             f"any rows")
    return sends or [], exchanged, matrix

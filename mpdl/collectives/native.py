"""The MPI library's own collectives: the baseline every hand-written algorithm is measured against.

Not ours: these call MPI_Allreduce and friends through mpi4py. Device arrays are passed straight to
a CUDA-aware library, and otherwise copied to the host and back.

MPI 4.1 has no bfloat16 or 8-bit float type (MPI 5.0's MPI_BFLOAT16_T is a null datatype in
MPICH 5.0.2, and Python's buffer protocol cannot describe ml_dtypes' floats): such a reduction is
upcast to float32, reduced by the library in float32 and rounded back once. The result is the same
on every rank and at least as accurate as one in the narrow dtype; it moves more bytes. Arrays
that are only moved (all-gather, broadcast) travel as raw words. float16 goes to the library as it
is (mpi4py hands it over as MPI_FLOAT16_T); the public calls hand every 16- and 8-bit sum, avg
and prod to it already in float32 (`ops.reduces_wide`). MPI_SUM is not defined on MPI_C_BOOL:
bool reduces as bytes with MPI_MAX (sum and max: logical or) or MPI_MIN (logical and).

Each call is the library's nonblocking form (MPI_Iallreduce ...) waited for under the
communicator's wait policy, so that a peer that never comes (or calls another collective) ends the
wait after MPDL_TIMEOUT with `CollectiveTimeout` instead of blocking in MPI for ever.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl import backend

_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}
_BOOL_OPS = {"sum": "MAX", "max": "MAX", "min": "MIN"}


def _mpi_op(MPI, op: str, dtype: np.dtype):
    """The MPI reduction operator of op on dtype (bool: see the module's docstring)."""
    return getattr(MPI, (_BOOL_OPS if dtype.kind == "b" else _MPI_OPS)[op])


def _mpi(comm) -> tuple[Any, Any]:
    """(the mpi4py communicator, the mpi4py.MPI module) of an MPIComm."""
    mpi = getattr(comm, "mpi", None)
    if mpi is None:
        raise ValueError(f"algorithm: 'mpi' needs an MPI communicator, not {type(comm).__name__}")
    return mpi, comm.MPI


def _wait(comm, request: Any, call: str) -> None:
    """Wait for the MPI request of `call` under comm's wait policy (its timeout)."""
    wait = getattr(comm, "_wait_mpi", None)
    if wait is None:
        request.Wait()
    else:
        wait(request, call)


def _host(buf, comm):
    """(a buffer MPI can read, a function that writes it back into buf)."""
    xp = backend.get_array_module(buf)
    if xp is np:
        return buf, lambda: None
    backend.synchronize(xp)
    if xp is not backend.standin and comm.cuda_aware():
        return buf, lambda: None
    host = backend.to_host(buf)
    return host, lambda: backend.upload(buf, host)


def _reducible(host: np.ndarray, op: str):
    """(an array the MPI library can reduce, a function that writes it back into host):
    ml_dtypes' floats are upcast to float32 (MPI has no type for them), bool is viewed as bytes,
    and 8- and 16-bit integers are summed and multiplied in 32 bits, then wrapped back: Open
    MPI's vectorized sums saturate them (open-mpi/ompi#8045, closed as won't fix)."""
    dt = host.dtype
    if dt.kind == "b":
        return host.view(np.uint8), lambda: None
    if dt.kind in "iu" and dt.itemsize <= 2 and op in ("sum", "prod"):
        wide = host.astype(f"{dt.kind}4")
        return wide, lambda: np.copyto(host, wide, casting="unsafe")
    if not backend.is_ml_float(dt):
        return host, lambda: None
    wide = host.astype(np.float32)
    return wide, lambda: np.copyto(host, wide, casting="unsafe")


def mpi_allreduce(comm, buf, op: str) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host, op)
    _wait(comm, mpi.Iallreduce(MPI.IN_PLACE, wide, op=_mpi_op(MPI, op, buf.dtype)),
          "MPI_Iallreduce")
    narrow()
    back()


def mpi_reduce_scatter(comm, buf, op: str, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host, op)
    _reduce_scatter(mpi, MPI, comm, wide, _mpi_op(MPI, op, buf.dtype), bounds)
    narrow()
    back()


def _reduce_scatter(mpi, MPI, comm, host, mpi_op, bounds: list[int]) -> None:
    counts = [bounds[i + 1] - bounds[i] for i in range(comm.size)]
    mine = host[bounds[comm.rank]:bounds[comm.rank + 1]]
    source = host.copy()
    _wait(comm, mpi.Ireduce_scatter(source, mine, recvcounts=counts, op=mpi_op),
          "MPI_Ireduce_scatter")


def mpi_allgather(comm, buf, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    _wait(comm, mpi.Iallgather(MPI.IN_PLACE, backend.as_bytes(host)), "MPI_Iallgather")
    back()


def mpi_broadcast(comm, buf, root: int) -> None:
    mpi, _ = _mpi(comm)
    host, back = _host(buf, comm)
    _wait(comm, mpi.Ibcast(backend.as_bytes(host), root=root), "MPI_Ibcast")
    back()


def mpi_reduce(comm, buf, op: str, root: int) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host, op)
    mpi_op = _mpi_op(MPI, op, buf.dtype)
    if comm.rank == root:
        request = mpi.Ireduce(MPI.IN_PLACE, wide, op=mpi_op, root=root)
    else:
        request = mpi.Ireduce(wide, None, op=mpi_op, root=root)
    _wait(comm, request, "MPI_Ireduce")
    narrow()
    back()


def mpi_alltoall(comm, recv, send, blocks) -> None:
    """MPI_Alltoall for equal blocks, MPI_Alltoallv otherwise (counts in bytes: any dtype)."""
    mpi, MPI = _mpi(comm)
    host, back = _host(recv, comm)
    in_place = send is recv
    source = host if in_place else _host(send, comm)[0]
    size = recv.itemsize
    if blocks.block is not None:
        request = mpi.Ialltoall(MPI.IN_PLACE if in_place else [source, MPI.BYTE],
                                [host, MPI.BYTE])
    else:
        outgoing = [source, ([c * size for c in blocks.send_counts],
                             [o * size for o in blocks.send_offsets]), MPI.BYTE]
        incoming = [host, ([c * size for c in blocks.recv_counts],
                           [o * size for o in blocks.recv_offsets]), MPI.BYTE]
        request = mpi.Ialltoallv(MPI.IN_PLACE if in_place else outgoing, incoming)
    _wait(comm, request, "MPI_Ialltoall")
    back()

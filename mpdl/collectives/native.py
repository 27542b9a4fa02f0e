"""The MPI library's own collectives: the baseline every hand-written algorithm is measured against.

Not ours: these call MPI_Allreduce and friends through mpi4py. Device arrays are passed straight to
a CUDA-aware library, and otherwise copied to the host and back.

MPI 4.1 has no bfloat16 type (MPI 5.0's MPI_BFLOAT16_T is a null datatype in MPICH 5.0.2, and
Python's buffer protocol cannot describe ml_dtypes' bfloat16): a bfloat16 reduction is upcast to
float32, reduced by the library in float32 and rounded back once. The result is the same on every
rank and at least as accurate as a bfloat16 reduction; it moves twice the bytes of one. bfloat16
arrays that are only moved (all-gather, broadcast) travel as 16-bit words. float16 goes to the
library as it is (mpi4py hands it over as MPI_FLOAT16_T).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl import backend

_MPI_OPS = {"sum": "SUM", "avg": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN"}


def _mpi(comm) -> tuple[Any, Any]:
    """(the mpi4py communicator, the mpi4py.MPI module) of an MPIComm."""
    mpi = getattr(comm, "mpi", None)
    if mpi is None:
        raise ValueError(f"algorithm: 'mpi' needs an MPI communicator, not {type(comm).__name__}")
    return mpi, comm.MPI


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


def _reducible(host: np.ndarray):
    """(an array the MPI library can reduce, a function that writes it back into host):
    bfloat16 is upcast to float32 (MPI has no bfloat16)."""
    if not backend.is_bfloat16(host.dtype):
        return host, lambda: None
    wide = host.astype(np.float32)
    return wide, lambda: np.copyto(host, wide, casting="unsafe")


def mpi_allreduce(comm, buf, op: str) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host)
    mpi.Allreduce(MPI.IN_PLACE, wide, op=getattr(MPI, _MPI_OPS[op]))
    narrow()
    back()


def mpi_reduce_scatter(comm, buf, op: str, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host)
    _reduce_scatter(mpi, MPI, comm, wide, op, bounds)
    narrow()
    back()


def _reduce_scatter(mpi, MPI, comm, host, op: str, bounds: list[int]) -> None:
    counts = [bounds[i + 1] - bounds[i] for i in range(comm.size)]
    mine = host[bounds[comm.rank]:bounds[comm.rank + 1]]
    mpi.Reduce_scatter(host.copy(), mine, recvcounts=counts, op=getattr(MPI, _MPI_OPS[op]))


def mpi_allgather(comm, buf, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    mpi.Allgather(MPI.IN_PLACE, backend.as_bytes(host))
    back()


def mpi_broadcast(comm, buf, root: int) -> None:
    mpi, _ = _mpi(comm)
    host, back = _host(buf, comm)
    mpi.Bcast(backend.as_bytes(host), root=root)
    back()


def mpi_reduce(comm, buf, op: str, root: int) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    wide, narrow = _reducible(host)
    if comm.rank == root:
        mpi.Reduce(MPI.IN_PLACE, wide, op=getattr(MPI, _MPI_OPS[op]), root=root)
    else:
        mpi.Reduce(wide, None, op=getattr(MPI, _MPI_OPS[op]), root=root)
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
        mpi.Alltoall(MPI.IN_PLACE if in_place else [source, MPI.BYTE], [host, MPI.BYTE])
    else:
        outgoing = [source, ([c * size for c in blocks.send_counts],
                             [o * size for o in blocks.send_offsets]), MPI.BYTE]
        incoming = [host, ([c * size for c in blocks.recv_counts],
                           [o * size for o in blocks.recv_offsets]), MPI.BYTE]
        mpi.Alltoallv(MPI.IN_PLACE if in_place else outgoing, incoming)
    back()

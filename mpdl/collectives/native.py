"""The MPI library's own collectives: the baseline every hand-written algorithm is measured against.

Not ours: these call MPI_Allreduce and friends through mpi4py. Device arrays are passed straight to
a CUDA-aware library, and otherwise copied to the host and back.
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


def mpi_allreduce(comm, buf, op: str) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    mpi.Allreduce(MPI.IN_PLACE, host, op=getattr(MPI, _MPI_OPS[op]))
    back()


def mpi_reduce_scatter(comm, buf, op: str, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    counts = [bounds[i + 1] - bounds[i] for i in range(comm.size)]
    mine = host[bounds[comm.rank]:bounds[comm.rank + 1]]
    mpi.Reduce_scatter(host.copy(), mine, recvcounts=counts, op=getattr(MPI, _MPI_OPS[op]))
    back()


def mpi_allgather(comm, buf, bounds: list[int]) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    mpi.Allgather(MPI.IN_PLACE, host)
    back()


def mpi_broadcast(comm, buf, root: int) -> None:
    mpi, _ = _mpi(comm)
    host, back = _host(buf, comm)
    mpi.Bcast(host, root=root)
    back()


def mpi_reduce(comm, buf, op: str, root: int) -> None:
    mpi, MPI = _mpi(comm)
    host, back = _host(buf, comm)
    if comm.rank == root:
        mpi.Reduce(MPI.IN_PLACE, host, op=getattr(MPI, _MPI_OPS[op]), root=root)
    else:
        mpi.Reduce(host, None, op=getattr(MPI, _MPI_OPS[op]), root=root)
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

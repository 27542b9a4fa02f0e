"""Hand-written collectives over point-to-point messages: any p, any count, bit-identical results.

Public calls take NumPy or CuPy arrays and return the same kind. `comm` is an mpi4py communicator
(default MPI.COMM_WORLD) or an mpdl Communicator (for example one rank of the in-process world).
`alltoall` and `alltoallv` exchange blocks between every pair of ranks.
Persistent plans (`allreduce_init` and the others) are the tuning layer's: `mpdl.tuning`.
"""

from mpdl.collectives.api import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    alltoallv,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_async,
)
from mpdl.collectives.registry import COLLECTIVES, REGISTRY, algorithms
from mpdl.comm.handles import Handle

__all__ = ["allreduce", "allreduce_async", "reduce_scatter", "reduce_scatter_async",
           "allgather", "allgather_async", "broadcast", "reduce", "algorithms", "Handle",
           "COLLECTIVES", "REGISTRY", "alltoall", "alltoall_async", "alltoallv"]

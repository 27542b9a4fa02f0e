"""One thin communicator: rank and size, point-to-point on arrays, node layout, staging of GPU buffers.

Collective algorithms talk only to the `Communicator` interface (`mpdl.comm.base`). `MPIComm`
(`mpdl.comm.mpi`) implements it over mpi4py, with its wait policy, node discovery and shared
windows (`mpdl.comm.nodes`), host staging of device arrays (`mpdl.comm.staging`) and the
CUDA-awareness check (`mpdl.comm.cuda`); `mpdl.threadworld.ThreadComm` implements it over
in-process queues, and `SubComm` is a view of a subset of any communicator's ranks (used for
nodes, rows and columns).
"""

from mpdl.comm.base import (
    DEFAULT_TIMEOUT_S,
    CollectiveMismatch,
    CollectiveTimeout,
    Communicator,
    PersistentRequest,
    Request,
    SubComm,
    check_every_call,
    timeout_s,
)
from mpdl.comm.cuda import cuda_aware_mpi
from mpdl.comm.mpi import MPIComm, as_communicator
from mpdl.comm.nodes import ranks_per_node_override
from mpdl.comm.staging import StagingPool, staging_chunk_bytes

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveMismatch", "CollectiveTimeout", "Communicator",
           "MPIComm", "PersistentRequest", "Request", "StagingPool", "SubComm", "as_communicator",
           "check_every_call", "cuda_aware_mpi", "ranks_per_node_override", "staging_chunk_bytes",
           "timeout_s"]

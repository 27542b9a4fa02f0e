"""A wait that never completes raises a clear timeout instead of hanging."""

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import settings
from mpdl.comm import CollectiveTimeout, MPIComm

pytestmark = pytest.mark.mpi


@pytest.mark.skipif(MPI.COMM_WORLD.Get_size() == 1, reason="needs a peer")
def test_wait_timeout_names_collective_peer_and_step(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv("MPDL_TIMEOUT", "0.5")
    settings.use(None)
    ours = MPIComm(comm.Dup())
    ours.collective = "allreduce/ring"
    buf = np.empty(4, np.float32)
    peer = (ours.rank + 1) % ours.size
    request = ours.irecv(buf, peer, step=3)  # nobody sends: must time out
    with pytest.raises(CollectiveTimeout, match=rf"allreduce/ring.*rank {peer} at step 3"):
        ours.waitall([request])
    request.handle.Cancel()
    request.handle.Wait()
    ours.mpi.Free()

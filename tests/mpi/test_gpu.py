"""Collectives on real CuPy arrays (GPU machines only; CI has no GPU and skips with the reason)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import backend
from mpdl import collectives as C

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(backend.cupy_module() is None,
                                 reason="CuPy with a visible GPU is needed (pip install 'mpdl[gpu]')")]


@pytest.mark.parametrize("algorithm", C.algorithms("allreduce"))
def test_allreduce_cupy_matches_numpy(algorithm):
    cupy = backend.cupy_module()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    backend.use_local_gpu(rank, comm.Get_size())
    for count in (0, 1, 13, 2**20 + 3):
        host = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        expected = np.empty_like(host)
        comm.Allreduce(host, expected)
        result = C.allreduce(cupy.asarray(host), algorithm=algorithm)
        assert isinstance(result, cupy.ndarray)
        np.testing.assert_allclose(cupy.asnumpy(result), expected, rtol=1e-5, atol=1e-5 * comm.Get_size())

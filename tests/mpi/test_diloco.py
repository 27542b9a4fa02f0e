"""DiLoCo under real MPI at whatever size mpiexec gives: the outer steps against a NumPy
reference from every rank's locals, and every encoding and fragment count leaves the replicas
equal at the end."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import nn
from mpdl.parallel.diloco import DiLoCo

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def make_model():
    return nn.Sequential(nn.Linear(9, 13, seed=0), nn.ReLU(), nn.Linear(13, 3, seed=1))


def params(model):
    return np.concatenate([p.data.reshape(-1) for p in model.parameters()])


def inner_step(model, step):
    rng = np.random.default_rng(1000 * step + RANK)
    for p in model.parameters():
        p.data -= (0.01 * rng.standard_normal(p.data.shape)).astype(p.data.dtype)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "mpi"])
def test_outer_steps_match_numpy_from_every_ranks_locals(algorithm):
    h, lr, mu = 3, 0.7, 0.9
    model = make_model()
    diloco = DiLoCo(model, sync_every=h, outer_lr=lr, outer_momentum=mu, algorithm=algorithm)
    global_ = params(model).astype(np.float64)
    m = np.zeros_like(global_)
    for s in range(1, 10):
        inner_step(model, s)
        if s % h == 0:
            locals_ = COMM.allgather(params(model))
            delta = np.mean([global_ - loc for loc in locals_], axis=0)
            m = mu * m + delta
            global_ = global_ - lr * (delta + mu * m)
        diloco.step()
    np.testing.assert_allclose(params(model), global_, rtol=1e-5, atol=1e-6)
    assert all(np.array_equal(x, params(model)) for x in COMM.allgather(params(model)))


@pytest.mark.parametrize("fragments", [1, 2, 4])
@pytest.mark.parametrize("compress", ["none", "fp16", "int8", "int4"])
def test_replicas_equal_after_finish(fragments, compress):
    model = make_model()
    diloco = DiLoCo(model, sync_every=4, n_fragments=fragments, compress=compress)
    for s in range(1, 11):
        inner_step(model, s)
        diloco.step()
    diloco.finish()
    assert all(np.array_equal(x, params(model)) for x in COMM.allgather(params(model)))
    assert diloco.allreduce_bytes > 0 or P == 1

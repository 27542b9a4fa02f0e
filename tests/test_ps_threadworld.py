"""The parameter server on the in-process world: it is written on the Communicator interface, so
the same code that runs over MPI (tests/mpi/test_ps.py) runs on p threads."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.parallel.ps import ParameterServer
from mpdl.threadworld import run_world


def _job(mode: str, servers: int, staleness: int | None = None, steps: int = 4):
    def rank(comm):
        model = nn.Linear(4, 3, seed=comm.rank)  # 15 parameters; rank 0's win
        ps = ParameterServer(model, comm=comm, servers=servers, mode=mode, staleness=staleness)
        if ps.is_server:
            stats = ps.serve(lambda params: SGD(params, lr=0.1))
        else:
            for step in range(steps):
                for p in model.parameters():
                    p.grad = np.full(p.shape, float(comm.rank + step), p.data.dtype)
                ps.push_pull(0.1, weight=1.0 / ps.workers)
            stats = ps.close()
        return ps.bounds, np.concatenate([p.data.reshape(-1) for p in model.parameters()]), stats

    return run_world(4, rank)


@pytest.mark.parametrize("mode,staleness", [("sync", None), ("async", None), ("ssp", 0)])
def test_every_rank_ends_with_the_same_parameters(mode, staleness):
    results = _job(mode, servers=2, staleness=staleness)
    bounds, first, stats = results[0]
    assert bounds == [0, 8, 15]  # numpy.array_split's shards: the first is the longer
    assert all(np.array_equal(flat, first) for _, flat, _ in results)
    assert all(s == stats for _, _, s in results)
    assert stats["workers"] == 2 and stats["worker_steps"] == [4, 4]
    assert sum(stats["staleness"].values()) == 2 * 4 * 2  # every push, on both servers
    if mode == "sync":
        assert stats["updates"] == [4, 4] and set(stats["staleness"]) == {0}


def test_sync_mode_applies_the_weighted_sum_of_the_workers_gradients():
    initial = np.concatenate([p.data.reshape(-1) for p in nn.Linear(4, 3, seed=0).parameters()])
    _, flat, _ = _job("sync", servers=1, steps=1)[0]
    # workers 0..2 push rank + 0, each weighted 1/3: the mean is 1, one SGD step of lr 0.1
    np.testing.assert_allclose(flat, initial - 0.1 * 1.0, rtol=1e-6)


def test_shards_split_like_array_split():
    bounds = _job("sync", servers=3, steps=1)[0][0]
    assert np.diff(bounds).tolist() == [5, 5, 5]
    from mpdl.collectives.ops import block_bounds

    assert np.diff(block_bounds(10, 3)).tolist() == [4, 3, 3]

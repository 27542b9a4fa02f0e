"""The parameter server under real MPI, at whatever size mpiexec gives (the Makefile runs 1..5):
each sync mode converges on digits, workers end with identical parameters, the staleness
histogram accounts for every push, and shutdown leaves no rank behind. One rank: skipped (a
parameter server needs a server and a worker), after checking that the setup is refused."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.datasets import load_digits
from mpdl.parallel import DistributedSampler
from mpdl.parallel.ps import ParameterServer, check_config

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
DIGITS = load_digits(seed=0)
needs_two = pytest.mark.skipif(P < 2, reason="a parameter server needs at least 2 ranks")


def mlp(seed: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32, seed=seed), nn.ReLU(), nn.Linear(32, 10, seed=seed + 1))


def train(mode: str, servers: int, staleness: int | None = None, epochs: int = 6,
          batch: int = 64, lr: float = 0.2):
    xtr, ytr, xte, yte = DIGITS
    model = mlp(10 * RANK)  # rank 0's initial parameters must win
    ps = ParameterServer(model, servers=servers, mode=mode, staleness=staleness)
    if ps.is_server:
        stats = ps.serve(lambda params: SGD(params, lr=lr, momentum=0.9 if mode == "sync" else 0.5))
    else:
        sampler = DistributedSampler(len(xtr), batch, rank=RANK, num_replicas=ps.workers, seed=1)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for idx, global_batch in sampler:
                if len(idx):
                    F.cross_entropy(model(Tensor(xtr[idx])), ytr[idx]).backward()
                # async and ssp apply each worker's mean gradient as its own step: scale the
                # rate by the worker's share of the global batch. Staleness acts as extra
                # momentum (Mitliagkas et al. 2016), so the server runs less of its own.
                ps.push_pull(lr if mode == "sync" else 2 * lr * len(idx) / global_batch,
                             weight=len(idx) / global_batch)
                for p in model.parameters():
                    p.grad = None
        stats = ps.close()
    acc = float((model(Tensor(xte)).data.argmax(1) == yte).mean())
    flat = np.concatenate([p.data.reshape(-1) for p in model.parameters()])
    return acc, flat, stats


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        check_config(1, 1, "sync", None)
    with pytest.raises(ValueError, match="--servers"):
        check_config(3, 3, "sync", None)
    with pytest.raises(ValueError, match="--staleness only applies"):
        check_config(3, 1, "async", 2)
    with pytest.raises(ValueError, match="mode"):
        check_config(3, 1, "eventual", None)
    if P == 1:
        with pytest.raises(ValueError, match="at least 2 ranks"):
            ParameterServer(mlp(0))


@needs_two
@pytest.mark.parametrize("mode,staleness", [("sync", None), ("async", None), ("ssp", 1)])
def test_each_mode_converges_on_digits(mode, staleness):
    servers = 2 if P >= 4 else 1
    # stale gradients slow convergence, and how stale depends on timing: the asynchronous modes
    # get more epochs, so an unlucky interleaving does not decide the test
    acc, flat, stats = train(mode, servers, staleness, epochs=6 if mode == "sync" else 10)
    everyone = COMM.allgather((acc, flat))
    workers = P - servers
    assert all(np.array_equal(f, everyone[0][1]) for _, f in everyone), "ranks disagree at the end"
    # sync is deterministic; the stale modes reached 0.90-0.95 in 16 runs at p=3..5 and 0.8997 in
    # one CI run, so they get a margin (an untrained model scores about 0.1)
    assert acc >= (0.9 if mode == "sync" else 0.85), f"{mode}: test accuracy {acc:.3f}"
    assert stats["workers"] == workers and len(stats["updates"]) == servers
    pushes = sum(stats["worker_steps"]) * servers
    assert sum(stats["staleness"].values()) == pushes
    if mode == "sync":
        assert set(stats["staleness"]) == {0}
        assert stats["updates"] == [stats["worker_steps"][0]] * servers
    else:
        assert stats["updates"] == [sum(stats["worker_steps"])] * servers
    if mode == "ssp":
        # while a worker computes step c, each other worker pushes at most its steps c - s .. c + s
        assert max(stats["staleness"]) <= (workers - 1) * (2 * staleness + 1)


@needs_two
def test_shutdown_is_clean_with_unequal_work():
    """A worker that stops early (no pushes at all) must not hang the others or the servers."""
    model = mlp(0)
    ps = ParameterServer(model, servers=1, mode="ssp", staleness=0)
    if ps.is_server:
        stats = ps.serve(lambda params: SGD(params, lr=0.1))
    else:
        for _ in range(3 if RANK == 0 else 0):
            for p in model.parameters():
                p.grad = np.ones_like(p.data)
            ps.push_pull(0.1)
        stats = ps.close()
    assert stats["worker_steps"][0] == 3 and stats["updates"] == [3]
    COMM.Barrier()

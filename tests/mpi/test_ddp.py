"""Data-parallel training over real MPI, at whatever size mpiexec gives (the Makefile runs 1..5).

p ranks with global batch B must follow a single process with batch B (computed inside the
test), with every all-reduce algorithm; checkpoint + resume must be bit-identical.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import algorithms, allreduce
from mpdl.parallel import DistributedDataParallel, DistributedSampler

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
RNG = np.random.default_rng(7)
X = RNG.standard_normal((37, 5))
Y = RNG.integers(0, 4, 37)
B = 9  # not a multiple of 2, 4 or 5; the last batch of each epoch is short (37 = 4·9 + 1)
TOL = {"float32": 1e-5, "float64": 1e-10}


def model(dtype: str, seed: int) -> nn.Module:
    return nn.Sequential(nn.Linear(5, 16, seed=seed, dtype=dtype), nn.ReLU(),
                         nn.Linear(16, 16, seed=seed + 1, dtype=dtype), nn.ReLU(),
                         nn.Linear(16, 4, seed=seed + 2, dtype=dtype))


def run(dtype: str, algorithm: str | None, steps_epochs: int = 2) -> np.ndarray:
    """algorithm None: the single-process reference (no DDP, batch B)."""
    distributed = algorithm is not None
    m = model(dtype, 100 * RANK if distributed else 0)
    ddp = DistributedDataParallel(m, algorithm=algorithm, first_bucket_mb=2e-4, bucket_mb=1e-3) \
        if distributed else None
    opt = SGD(m.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(len(X), B, rank=RANK if distributed else 0,
                                 num_replicas=P if distributed else 1, seed=3)
    for epoch in range(steps_epochs):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            if ddp is not None:
                ddp.set_local_batch(len(idx), global_batch)
            if len(idx):
                F.cross_entropy(m(Tensor(X[idx].astype(dtype))), Y[idx]).backward()
            if ddp is not None:
                ddp.finish()
            opt.step()
            opt.zero_grad()
    return np.concatenate([p.data.ravel() for p in m.parameters()])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("algorithm", ["auto", *algorithms("allreduce")])
def test_p_ranks_follow_the_single_process_trajectory(dtype, algorithm):
    reference = run(dtype, None)
    ours = run(dtype, algorithm)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=TOL[dtype])
    everyone = COMM.allgather(ours)
    assert all(np.array_equal(e, everyone[0]) for e in everyone), "replicas drifted apart"


def shared_dir() -> str:
    path = tempfile.mkdtemp(prefix="mpdl-ddp-") if RANK == 0 else None
    return COMM.bcast(path, root=0)


def trainer(epochs: int, checkpoint: str | None, resume: bool = False):
    from mpdl.training.loop import TrainConfig, Trainer  # noqa: PLC0415

    config = TrainConfig.from_keys({
        "optim.epochs": epochs, "optim.global_batch_size": 128, "checkpoint.dir": checkpoint,
        "checkpoint.resume": resume, "output.progress": False, "optim.lr_schedule": "constant",
        "communication.algorithm": "ring"})
    t = Trainer(config, out=open("/dev/null", "w"))  # noqa: SIM115
    t.setup()
    t.run()
    return t.model.state_dict(), t.optimizer.state_dict()


def test_checkpoint_resume_is_bit_identical():
    straight, straight_opt = trainer(4, None)
    directory = shared_dir()
    trainer(2, directory)
    COMM.Barrier()
    resumed, resumed_opt = trainer(4, directory, resume=True)
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name
    for i, entries in straight_opt["state"].items():
        assert np.array_equal(entries["momentum_buffer"], resumed_opt["state"][i]["momentum_buffer"])
    if RANK == 0:
        from mpdl.training.checkpoint import load_checkpoint  # noqa: PLC0415

        model_state, _, state = load_checkpoint(directory)
        assert state["epoch"] == 4 and state["ranks"] == P
        assert all(np.array_equal(model_state[k], straight[k]) for k in straight)
        shutil.rmtree(directory)


#: a tiny GPT on 1-digit addition (90 training problems, 8 steps an epoch of 12 sequences)
GPT_RUN = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1,
           "model.n_layer": 1, "model.n_head": 2, "model.n_embd": 8,
           "optim.global_batch_size": 12, "optim.epochs": 1, "optim.optimizer": "adam",
           "output.progress": False}


def gpt_params(comm, changes: dict) -> np.ndarray:
    from mpdl.training.loop import TrainConfig, Trainer  # noqa: PLC0415

    t = Trainer(TrainConfig.from_keys({**GPT_RUN, **changes}), comm=comm, out=open("/dev/null", "w"))  # noqa: SIM115
    t.setup()
    t.run()
    return np.concatenate([p.data.ravel() for p in t.model.parameters()])


@pytest.mark.parametrize("dtype, algorithm", [("float32", "auto"), ("float64", "auto"),
                                              *(("float64", a) for a in algorithms("allreduce"))])
def test_gpt_on_p_ranks_follows_one_rank(dtype, algorithm):
    from mpdl.threadworld import ThreadWorld  # noqa: PLC0415

    reference = gpt_params(ThreadWorld(1).comm(0), {"model.dtype": dtype})
    ours = gpt_params(None, {"model.dtype": dtype, "communication.algorithm": algorithm})
    np.testing.assert_allclose(ours, reference, rtol=0, atol=TOL[dtype])
    everyone = COMM.allgather(ours)
    assert all(np.array_equal(e, everyone[0]) for e in everyone), "replicas drifted apart"


@pytest.mark.parametrize("algorithm", ["auto", *algorithms("allreduce")])
def test_each_bucket_plan_gives_the_one_shot_all_reduce_bit_for_bit(algorithm):
    """Every bucket is summed by its persistent plan, made once (in place on the bucket): after
    each of 3 steps its bytes are those of the one-shot `allreduce` of the same weighted local
    gradients, which a twin model (same weights, no DDP) computes beside it, by the algorithm the
    plan ran (with auto on a calibrated model, a plan verifying its choice runs its contenders
    in turn on its first runs)."""
    m = model("float64", 100 * RANK)
    ddp = DistributedDataParallel(m, algorithm=algorithm, first_bucket_mb=2e-4, bucket_mb=1e-3)
    assert len(ddp.buckets) > 2
    plans = [b.plan for b in ddp.buckets]
    for b in ddp.buckets:
        assert b.plan.x is b.buffer and b.plan.result is b.buffer
    assert ddp.bucket_algorithms() == [p.algorithm for p in plans]
    twin = model("float64", 0)
    twin_of = dict(zip(map(id, m.parameters()), twin.parameters(), strict=True))
    opt = SGD(m.parameters(), lr=0.05, momentum=0.9)
    weight = np.float64(ddp.grad_weight)
    for step in range(3):
        for a, b in zip(twin.parameters(), m.parameters(), strict=True):
            a.data[...] = b.data
            a.grad = None
        idx = np.arange(RANK + step, len(X), P + 1)
        F.cross_entropy(twin(Tensor(X[idx])), Y[idx]).backward()
        local = [np.concatenate([(twin_of[id(p)].grad * weight).ravel() for p in b.params])
                 for b in ddp.buckets]
        trial_runs = [len(b.plan.trial.times) if b.plan.trial else 0 for b in ddp.buckets]
        F.cross_entropy(m(Tensor(X[idx])), Y[idx]).backward()
        ddp.finish()
        ran = [b.plan.trial.current if b.plan.trial and len(b.plan.trial.times) > before
               else b.plan.algorithm for b, before in zip(ddp.buckets, trial_runs, strict=True)]
        expected = [allreduce(x, algorithm=name) for x, name in zip(local, ran, strict=True)]
        for b, e in zip(ddp.buckets, expected, strict=True):
            assert b.buffer.tobytes() == e.tobytes(), f"step {step} bucket {b.index}"
        assert [b.plan for b in ddp.buckets] == plans  # the same plans every step
        opt.step()
        opt.zero_grad()

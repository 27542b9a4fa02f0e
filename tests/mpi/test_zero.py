"""ZeRO stages 1-3 over real MPI, at whatever size mpiexec gives (the Makefile runs 1..5).

Each stage on p ranks must follow DDP on one rank (COMM_SELF) with the same global batch, for an
MLP, LeNet and the GPT, parameter counts that do not divide by p; a checkpoint written by ZeRO-3
on p ranks must continue on one rank under DDP and on p ranks under ZeRO-1 and end where the
uninterrupted run ends.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.autograd import nn, optim
from mpdl.comm import MPIComm, as_communicator
from mpdl.models.gpt import GPT
from mpdl.models.zoo import build_model
from mpdl.parallel import DistributedSampler
from mpdl.parallel.data_parallel import AllReduceStrategy
from mpdl.parallel.strategy import Batch
from mpdl.parallel.zero import ZeroStrategy

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
TOL = {"float32": 1e-5, "float64": 1e-10}
N, B = 19, 6  # the last batch has one sample: most ranks get none
OPTIMIZERS = {"sgd": lambda p: optim.SGD(p, lr=0.05, momentum=0.9),
              "adam": lambda p: optim.Adam(p, lr=1e-2)}


def make_model(name: str, dtype: str):
    if name == "gpt":
        return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=6, seed=0,
                   dtype=np.dtype(dtype))
    if name == "mlp":  # 293 parameters
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 9, seed=0, dtype=dtype), nn.ReLU(),
                             nn.Linear(9, 9, seed=1, dtype=dtype), nn.ReLU(),
                             nn.Linear(9, 7, seed=2, dtype=dtype))
    return build_model("lenet", (1, 28, 28), 10, seed=0, dtype=np.dtype(dtype))


def data(name: str, dtype: str):
    rng = np.random.default_rng(3)
    if name == "gpt":
        return rng.integers(0, 11, (N, 6)), rng.integers(0, 11, (N, 6))
    shape = (1, 28, 28) if name == "lenet" else (1, 3, 4)
    return rng.standard_normal((N, *shape)).astype(dtype), rng.integers(0, 7, N)


def train(comm, make, name: str, opt: str, dtype: str, epochs: int = 1) -> np.ndarray:
    model = make_model(name, dtype)
    x, y = data(name, dtype)
    strategy = make(comm)
    strategy.setup(model, OPTIMIZERS[opt])
    sampler = DistributedSampler(N, B, rank=comm.rank, num_replicas=comm.size, seed=2)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for idx, global_batch in sampler:
            strategy.step(Batch(x[idx], y[idx], global_batch, strategy.optimizer.lr))
    with strategy.gathered():
        return np.concatenate([p.data.ravel().copy() for p in model.parameters()])


def zero(stage: int):
    return lambda comm: ZeroStrategy(comm, stage, first_bucket_mb=5e-4, bucket_mb=1e-3)


@pytest.mark.parametrize("name, opt, dtype", [
    ("mlp", "sgd", "float64"), ("mlp", "adam", "float64"), ("mlp", "adam", "float32"),
    ("gpt", "sgd", "float64"), ("gpt", "adam", "float64"), ("lenet", "sgd", "float64"),
    ("lenet", "adam", "float32")])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_follows_ddp_on_one_rank(stage, name, opt, dtype):
    epochs = 1 if name == "lenet" else 2
    ref = train(as_communicator(MPI.COMM_SELF), AllReduceStrategy, name, opt, dtype, epochs)
    mine = train(as_communicator(COMM), zero(stage), name, opt, dtype, epochs)
    np.testing.assert_allclose(mine, ref, rtol=0, atol=TOL[dtype])
    everyone = COMM.allgather(mine)
    assert all(np.array_equal(other, everyone[0]) for other in everyone), "ranks disagree"


def test_a_step_leaves_no_message_recorder_on_the_communicator():
    """ZeRO counts its bytes with a message log on the communicator during each step and
    removes it after (plans there would otherwise never run their schedules, and every later
    message would be kept)."""
    comm = MPIComm(COMM.Dup())
    assert comm.message_log is None
    train(comm, zero(3), "mlp", "adam", "float64")
    assert comm.message_log is None


def run_trainer(comm, epochs: int, checkpoint: str | None, resume: bool = False, zero: int = 0):
    from mpdl.training.loop import TrainConfig, Trainer  # noqa: PLC0415

    config = TrainConfig.from_keys({
        "optim.epochs": epochs, "optim.global_batch_size": 50, "checkpoint.dir": checkpoint,
        "checkpoint.resume": resume, "output.progress": False, "optim.lr_schedule": "constant",
        "model.dtype": "float64", "optim.optimizer": "adam", "communication.algorithm": "ring",
        "parallel.zero": zero})
    t = Trainer(config, comm=comm, out=open("/dev/null", "w"))  # noqa: SIM115
    t.setup()
    rows = t.run()
    with t.strategy.gathered():
        params = np.concatenate([p.data.ravel().copy() for p in t.model.parameters()])
    return params, rows


def test_zero3_checkpoint_continues_on_other_ranks_and_stages():
    straight, _ = run_trainer(as_communicator(MPI.COMM_SELF), 2, None)
    directory = COMM.bcast(tempfile.mkdtemp(prefix="mpdl-zero-") if RANK == 0 else None, root=0)
    try:
        _, rows = run_trainer(as_communicator(COMM), 1, directory, zero=3)
        assert rows[0]["model_state_bytes"] > 0 and rows[0]["zero_stage"] == 3
        COMM.Barrier()
        assert sorted(os.listdir(directory)) == [f"shard-{r:05d}.npz" for r in range(P)] + [
            "state.json"]  # one shard per rank
        if RANK == 0:  # the whole state, as one DDP rank takes it
            shutil.copytree(directory, directory + "-ddp")
            resumed, _ = run_trainer(as_communicator(MPI.COMM_SELF), 2, directory + "-ddp",
                                     resume=True)
            np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-10)
        COMM.Barrier()
        resumed, _ = run_trainer(as_communicator(COMM), 2, directory, resume=True, zero=1)
        np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-10)
    finally:
        COMM.Barrier()
        if RANK == 0:
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(directory + "-ddp", ignore_errors=True)


@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_follows_ddp_on_one_rank(stage):
    """Sharded within each node (MPI's, or MPDL_RANKS_PER_NODE's), replicated across nodes; the
    Makefile runs this file at 4 ranks on emulated nodes of 2."""
    comm = as_communicator(COMM)
    sizes = {len(g) for g in comm.node_groups()}

    def make(c):
        return ZeroStrategy(c, stage, first_bucket_mb=5e-4, bucket_mb=1e-3, hybrid=True)

    if len(sizes) > 1:
        with pytest.raises(ValueError, match="same number of ranks on every node"):
            make(comm)
        return
    ref = train(as_communicator(MPI.COMM_SELF), AllReduceStrategy, "mlp", "adam", "float64", 2)
    mine = train(comm, make, "mlp", "adam", "float64", 2)
    np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "tree"])  # mpi: equal blocks only
@pytest.mark.parametrize("stage", [1, 2])
def test_unit_plans_give_the_one_shot_calls_bit_for_bit(stage, algorithm, monkeypatch):
    """Stages 1-2 run their units' reduce-scatters (stage 1) and all-gathers through plans made
    once at setup; the same training with every collective a one-shot call (no plans, no plan
    cache) ends on the same bytes. Hybrid where the nodes allow it (the Makefile's emulated
    nodes of 2 ranks): the sum over the replicas is planned too."""
    from mpdl.collectives import allgather  # noqa: PLC0415
    from mpdl.tuning import plan as plans  # noqa: PLC0415

    comm = as_communicator(COMM)
    hybrid = len({len(g) for g in comm.node_groups()}) == 1 and len(comm.node_groups()) > 1

    def make(c):
        return ZeroStrategy(c, stage, algorithm=algorithm, first_bucket_mb=5e-4, bucket_mb=1e-3,
                            hybrid=hybrid)

    made: list[ZeroStrategy] = []

    def planned(c):
        made.append(make(c))
        return made[-1]

    def one_shot(c):
        strategy = make(c)
        original = strategy.setup

        def setup(model, make_optimizer):
            original(model, make_optimizer)
            for u in strategy.units:
                assert u.gather_plan is not None and (u.reduce_plan is not None) == (stage == 1)
                assert (u.replica_plan is not None) == (stage == 1 and hybrid)
                u.reduce_plan = u.replica_plan = None  # the ordinary calls of stages 2-3

                def gather(u=u):
                    allgather(u.shard, algorithm=algorithm, comm=strategy.shard_comm,
                              count=u.count, out=u.full)
                u.gather_plan = gather

        strategy.setup = setup
        return strategy

    mine = train(comm, planned, "mlp", "adam", "float64", 2)
    for u in made[0].units:
        assert u.gather_plan.x is u.shard and u.gather_plan.result is u.full
        if stage == 1:
            assert u.reduce_plan.x is u.grad
    monkeypatch.setattr(plans, "CACHE_MAX_BYTES", -1)  # nothing through the plan cache
    monkeypatch.setattr(plans, "ALLREDUCE_CACHE_MAX_BYTES", -1)
    plans.clear_cache()
    ref = train(comm, one_shot, "mlp", "adam", "float64", 2)
    assert mine.tobytes() == ref.tobytes()

"""Deterministic training over real MPI, at whatever size mpiexec gives (the Makefile runs 1..5):
the same parameter hash as one in-process rank for every algorithm and ZeRO stage; and without
--deterministic, a GPT's epoch loss with a short last batch within 1e-6 of one rank's."""

from __future__ import annotations

import functools
import io

import pytest
from mpi4py import MPI

from mpdl.threadworld import ThreadWorld
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
#: the shipped digits (1797 = 7 x 256 + 5: a short last batch), 5 atoms a batch
MLP = {"optim.epochs": 1, "optim.seed": 4, "optim.deterministic": True, "optim.atoms": 5,
       "optim.global_batch_size": 256, "output.progress": False}
#: a 2-layer GPT on 1-digit addition: 90 problems in batches of 32, the last one of 26
GPT = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": 2,
       "model.n_head": 2, "model.n_embd": 16, "optim.global_batch_size": 32,
       "optim.optimizer": "sgd", "optim.lr": 0.05, "optim.seed": 6, "optim.epochs": 2,
       "output.progress": False}


def summary(keys: dict, comm=None) -> dict:
    trainer = Trainer(TrainConfig.from_keys(keys), comm=comm, out=io.StringIO())
    trainer.setup()
    return trainer.run()[-1]


@functools.cache
def one_rank_of(frozen: tuple) -> dict:
    return summary(dict(frozen), ThreadWorld(1).comm(0))


def one_rank(keys: dict) -> dict:
    return one_rank_of(tuple(sorted(keys.items())))


@pytest.mark.parametrize("changes", [
    {"communication.algorithm": "ring"}, {"communication.algorithm": "tree"},
    {"communication.algorithm": "recursive_doubling"}, {"parallel.zero": 1},
    {"parallel.zero": 3}])
def test_mlp_hash_is_one_ranks(changes):
    reference = one_rank(MLP)["param_sha256"]
    ours = summary({**MLP, **changes})["param_sha256"]
    assert ours == reference
    assert set(COMM.allgather(ours)) == {reference}


def test_gpt_hash_is_one_ranks():
    keys = {**GPT, "optim.deterministic": True, "optim.epochs": 1}
    assert summary(keys)["param_sha256"] == one_rank(keys)["param_sha256"]


@pytest.mark.parametrize("changes", [
    {"communication.algorithm": "ring"}, {"communication.algorithm": "shm"},
    {"communication.algorithm": "recursive_doubling"}, {"communication.algorithm": "tree"},
    {"optim.grad_accum": 4}])
def test_float_path_loss_is_one_ranks_within_1e6(changes):
    reference = one_rank(GPT)["loss"]
    assert summary({**GPT, **changes})["loss"] == pytest.approx(reference, rel=1e-6, abs=0)


#: pipeline stages at this world size (dp = size / pp): the GPT has 4 pieces to cut
PP = 2 if COMM.size % 2 == 0 else 3 if COMM.size == 3 else 0


@pytest.mark.skipif(not PP, reason="the world size has no divisor between 2 and 4")
def test_gpt_pipeline_hash_is_one_ranks():
    keys = {**GPT, "optim.deterministic": True, "optim.epochs": 1}
    reference = one_rank(keys)["param_sha256"]
    ours = summary({**keys, "parallel.pp": PP, "parallel.microbatches": 2})["param_sha256"]
    assert ours == reference
    assert set(COMM.allgather(ours)) == {reference}

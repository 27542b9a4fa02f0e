"""Generation over real MPI at whatever size mpiexec gives (the Makefile runs 1..5): a tiny GPT
trained for one epoch, its checkpoint whole (one rank), per stage (a pipeline, even world sizes)
or sharded (ZeRO-3, odd ones), then every (dp, pp, tp) layout of the world serving it
from each checkpoint. Greedy tokens must be those of `GPT.generate` (uncached, one process) on
the model each rank loads itself; prompts of lengths 1 to 6 (block size 5: the longest start past
it, the others cross it), fewer prompts than ranks at 5 ranks."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.comm import as_communicator
from mpdl.inference.generation import load_gpt
from mpdl.inference.serving import serve
from mpdl.training.config import TrainConfig
from mpdl.training.loop import Trainer

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
N_HEAD, N_LAYER = 6, 3
#: (dp, pp, tp) with dp·pp·tp = P, tp dividing the heads, pp at most the blocks
LAYOUTS = [(P // (pp * tp), pp, tp) for pp in range(1, N_LAYER + 1) for tp in (1, 2, 3, 6)
           if P % (pp * tp) == 0 and N_HEAD % tp == 0]
TINY = {"model.name": "gpt", "data.dataset": "addition", "data.digits": 1, "model.n_layer": N_LAYER,
        "model.n_head": N_HEAD, "model.n_embd": 12, "optim.global_batch_size": 80,
        "optim.epochs": 1, "optim.optimizer": "adam", "output.progress": False}
#: the layout of training: whole at one rank (the same file as from more: tests/test_generate.py),
#: per stage (a pipeline of 2) at an even world size, sharded (ZeRO-3) at an odd one
TRAINING = ({"whole": {}} if P == 1
            else {"pipeline": {"parallel.pp": 2, "parallel.microbatches": 2}} if P % 2 == 0
            else {"zero3": {"parallel.zero": 3}})
PROMPTS = ["3+4=", "1", "9+9=1", "2+2", "0+7=7", "5+5=10"]


@pytest.fixture(scope="module")
def checkpoints():
    comm = as_communicator(None)
    root = Path(comm.mpi.bcast(tempfile.mkdtemp() if comm.rank == 0 else None, root=0))
    for name, layout in TRAINING.items():
        config = TrainConfig.from_keys({**TINY, **layout, "checkpoint.dir": str(root / name)})
        trainer = Trainer(config, comm=comm, out=io.StringIO())
        trainer.setup()
        trainer.run()
    return root


@pytest.mark.parametrize("training", list(TRAINING))
def test_every_layout_serves_the_tokens_of_one_rank(checkpoints, training):
    comm = as_communicator(None)
    gpt, info = load_gpt(checkpoints / training)
    vocab = info["vocab"]
    prompts = [[vocab.index(ch) for ch in text] for text in PROMPTS]
    expected = [gpt.generate(np.array([p]), 4, top_k=1)[0].tolist() for p in prompts]
    for dp, pp, tp in LAYOUTS:
        sequences, figures = serve(comm, gpt, prompts, 4, dp, pp, tp, top_k=1)
        assert [s.tokens for s in sequences] == expected, (dp, pp, tp)
        assert len(figures) == P and all(len(s.token_times) == 4 for s in sequences)

"""Continuous batching over real MPI at whatever size mpiexec gives: the engine on a pipeline
(2 or 3 stages, each with its own blocks' pages), on 2 × 2 tp × pp, or as independent replicas
(5 ranks) gives every sequence the text `generate_replica` gives it on one process."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl.comm import as_communicator
from mpdl.inference.engine import SamplingParams, replica_engine
from mpdl.inference.inference import Decoder
from mpdl.inference.serving import generate_replica
from mpdl.models.gpt import GPT

pytestmark = pytest.mark.mpi

P = MPI.COMM_WORLD.Get_size()
VOCAB = "abcdefghijklmnopqrstuvwxyz ."
#: (dp, pp, tp) of the world
LAYOUT = {1: (1, 1, 1), 2: (1, 2, 1), 3: (1, 3, 1), 4: (1, 2, 2)}.get(P, (P, 1, 1))


def test_engine_on_every_layout_gives_one_process_texts():
    gpt = GPT(len(VOCAB), 16, 3, 4, 16, seed=2)
    rng = np.random.default_rng(2)
    for name, p in gpt.named_parameters():
        p.data[...] = rng.normal(0, 1.0 if "embedding" in name else 0.3, p.shape)
    gpt.eval()
    prompts = ["the cat", "a", "on the mat sat", "dog", "zz"]
    params = [SamplingParams(max_tokens=20, temperature=0),
              SamplingParams(max_tokens=9, temperature=0.7, seed=3)]
    want = []
    for i, p in enumerate(prompts):
        q = params[i % 2]
        seq, = generate_replica(Decoder(gpt), [[VOCAB.index(c) for c in p]], [0], q.max_tokens,
                                q.temperature or 1.0, 1 if q.temperature == 0 else None, q.seed)
        want.append("".join(VOCAB[t] for t in seq.new_tokens))
    engine, _, _ = replica_engine(as_communicator(MPI.COMM_WORLD), gpt, VOCAB, *LAYOUT,
                                  page_size=4, pages=40, max_batch=3, token_budget=6)
    texts = {i: "" for i in range(len(prompts))}
    for i, p in enumerate(prompts[:3]):
        engine.add(i, [VOCAB.index(c) for c in p], params[i % 2])
    while not engine.idle:
        for s, piece in engine.step():
            texts[s.rid] += piece
        if engine.steps == 2:
            for i, p in enumerate(prompts[3:], 3):
                engine.add(i, [VOCAB.index(c) for c in p], params[i % 2])
    assert [texts[i] for i in range(len(prompts))] == want
    assert engine.pool.in_use == 0

"""The paged KV cache and continuous batching: the same logits as the contiguous cache, pages
shared and freed by reference count, and each sequence's text that of `mpdl generate` whatever
else runs beside it, preempted or started again at the block size."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.inference.engine import Engine, SamplingParams
from mpdl.inference.inference import Decoder
from mpdl.inference.paged import PagePool, forward, last_positions
from mpdl.inference.serving import generate_replica
from mpdl.models.gpt import GPT

VOCAB = "abcdefghijklmnopqrstuvwxyz ."
BLOCK = 24


@pytest.fixture(scope="module")
def gpt() -> GPT:
    model = GPT(len(VOCAB), BLOCK, 2, 4, 16, seed=1)
    rng = np.random.default_rng(1)
    for _, p in model.named_parameters():
        p.data[...] = rng.normal(0, 0.3, p.shape).astype(np.float32)
    model.eval()
    return model


def pool_for(decoder: Decoder, pages: int, page_size: int = 4) -> PagePool:
    return PagePool(len(decoder.layers), decoder.heads, decoder.head_dim, pages, page_size,
                    decoder.dtype)


def test_paged_prefill_chunks_and_steps_give_the_contiguous_caches_logits(gpt):
    decoder = Decoder(gpt)
    pool = pool_for(decoder, 16)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, len(VOCAB), 11).tolist(), rng.integers(0, len(VOCAB), 6).tolist()
    pages = [pool.take() for _ in range(5)]
    ta, tb = pages[4:1:-1], pages[:2]  # out of order: the table, not the layout, gives positions
    cache = decoder.new_cache(2)
    x = decoder.embed(np.array([a[:5], b[:5]]))
    want = decoder.prefill(x, cache)[:, -1]
    rows = [(ta, 0, a[:3]), (tb, 0, b[:5])]  # a: 3 of its 5 first
    got = last_positions(forward(decoder, pool, rows), rows)
    got_a = forward(decoder, pool, [(ta, 3, a[3:5])])[:, -1]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    np.testing.assert_allclose(got_a[0], want[0], atol=1e-5)
    step = decoder.step(decoder.embed([[a[5]], [b[5]]], [5, 5]), [5, 5], cache)
    paged = forward(decoder, pool, [(ta, 5, [a[5]]), (tb, 5, [b[5]])])[:, 0]
    np.testing.assert_allclose(decoder.logits(paged), decoder.logits(step[:, 0]), atol=1e-5)
    whole = gpt(np.array([a[:6]])).data[0, -1]
    np.testing.assert_allclose(decoder.logits(paged)[0], whole, atol=1e-5)


def test_pages_are_shared_by_prefix_and_freed_by_reference_count(gpt):
    decoder = Decoder(gpt)
    pool = pool_for(decoder, 12)
    engine = Engine(decoder, pool, VOCAB)
    prompt = [VOCAB.index(c) for c in "the cat sat on"]  # 14 tokens: 3 whole pages of 4
    engine.add("a", prompt, SamplingParams(max_tokens=5, temperature=0))
    engine.step()  # a's prompt computed and its pages registered
    assert pool.in_use == 4
    engine.add("b", prompt[:13] + [VOCAB.index("x")], SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    b = next(s for s in engine.running if s.rid == "b")
    a = next(s for s in engine.running if s.rid == "a")
    assert b.table[:3] == a.table[:3] and b.table[3] != a.table[3]
    assert [pool.refs[p] for p in a.table[:3]] == [2, 2, 2]
    engine.cancel("a")
    assert [pool.refs[p] for p in b.table[:3]] == [1, 1, 1] and pool.in_use == 4
    engine.cancel("b")
    assert pool.in_use == 0 and not pool.shared


def texts_of_generate(gpt, prompts, params: SamplingParams) -> list[str]:
    top_k = 1 if params.temperature == 0 else params.top_k
    out = []
    for p in prompts:  # one at a time: prompt 0's generator (seed, 0), as the engine's
        seq, = generate_replica(Decoder(gpt), [[VOCAB.index(c) for c in p]], [0],
                                params.max_tokens, params.temperature or 1.0, top_k, params.seed)
        out.append("".join(VOCAB[i] for i in seq.new_tokens))
    return out


@pytest.mark.parametrize("mode", ["greedy", "sampled", "tight pool", "static", "contiguous"])
def test_each_sequence_gets_generates_text_whatever_runs_beside_it(gpt, mode):
    prompts = ["the cat", "a", "on the mat sat a dog", "the cat sat", "zz top", "the"]
    params = SamplingParams(max_tokens=30, temperature=0) if mode != "sampled" else \
        SamplingParams(max_tokens=30, temperature=0.8, top_k=5, seed=4)
    want = texts_of_generate(gpt, prompts, params)
    decoder = Decoder(gpt)
    pages = 14 if mode == "tight pool" else 64
    engine = Engine(decoder, pool_for(decoder, pages), VOCAB, max_batch=4, token_budget=10,
                    static=mode == "static", contiguous=mode == "contiguous")
    texts = {i: "" for i in range(len(prompts))}
    for i, p in enumerate(prompts[:3]):
        engine.add(i, [VOCAB.index(c) for c in p], params)
    while not engine.idle:
        for s, piece in engine.step():
            texts[s.rid] += piece
        if engine.steps == 3:  # the rest arrive while the first run
            for i, p in enumerate(prompts[3:], 3):
                engine.add(i, [VOCAB.index(c) for c in p], params)
    assert [texts[i] for i in range(len(prompts))] == want
    assert engine.pool.in_use == 0


def test_a_sequence_preempted_when_pages_run_out_is_computed_again_to_the_same_text(gpt):
    prompts = ["the cat sat", "on the mat", "a dog"]
    params = SamplingParams(max_tokens=12, temperature=0)
    want = texts_of_generate(gpt, prompts, params)
    decoder = Decoder(gpt)
    engine = Engine(decoder, pool_for(decoder, 30), VOCAB)
    for i, p in enumerate(prompts):
        engine.add(i, [VOCAB.index(c) for c in p], params)
    texts = {i: "" for i in range(len(prompts))}
    for s, piece in engine.step():
        texts[s.rid] += piece
    held = [engine.pool.take() for _ in range(len(engine.pool.free))]  # the pool runs dry
    while engine.steps < 6:
        for s, piece in engine.step():
            texts[s.rid] += piece
    assert len(engine.waiting) >= 1  # someone was preempted to let the others grow
    engine.pool.release(held)
    while not engine.idle:
        for s, piece in engine.step():
            texts[s.rid] += piece
    assert [texts[i] for i in range(len(prompts))] == want and engine.pool.in_use == 0

"""The KV-cache decoder and batched generation against the uncached GPT (`GPT.forward`,
`GPT.generate`): logits within 1e-5 in float32, greedy tokens identical, for batches of prompts of
different lengths, past the block size, and split over tensor-parallel ranks, pipeline stages and
data-parallel replicas of the in-process world (the same over MPI: tests/mpi/test_generate.py)."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.autograd import no_grad
from mpdl.inference.inference import Decoder
from mpdl.inference.serving import blocks_by_count, check_layout, generate_replica, serve, summary
from mpdl.models.gpt import GPT
from mpdl.threadworld import run_world


def model(n_head: int = 6, n_layer: int = 3, block_size: int = 12, seed: int = 3) -> GPT:
    gpt = GPT(vocab_size=11, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=24,
              seed=seed)
    gpt.eval()
    return gpt


def uncached_logits(gpt: GPT, ids: np.ndarray) -> np.ndarray:
    with no_grad():
        return gpt(ids).data


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 11, n).tolist() for n in lengths]


def test_prefill_then_steps_match_the_uncached_forward():
    gpt = model()
    ids = np.random.default_rng(1).integers(0, 11, (3, 12))
    reference = uncached_logits(gpt, ids)
    decoder = Decoder(gpt)
    cache = decoder.new_cache(3)
    assert cache.k.shape == (3, 3, 6, 12, 4)
    hidden = decoder.prefill(decoder.embed(ids[:, :5]), cache)
    assert np.abs(decoder.logits(hidden[:, -1]) - reference[:, 4]).max() < 1e-5
    for t in range(5, 12):
        positions = np.full(3, t)
        hidden = decoder.step(decoder.embed(ids[:, t:t + 1], positions), positions, cache)
        assert np.abs(decoder.logits(hidden[:, 0]) - reference[:, t]).max() < 1e-5


def test_rows_at_different_positions_see_only_their_own_tokens():
    """Right padding: row b's prompt fills positions 0..n_b-1, the rest of the prefill is padding
    whose keys a step must never read."""
    gpt = model()
    prompts = prompts_of([2, 7, 4])
    decoder = Decoder(gpt)
    cache = decoder.new_cache(3)
    padded = np.full((3, 7), 10)  # padding with a real token id: it must not matter
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    decoder.prefill(decoder.embed(padded), cache)
    nxt = np.array([[3], [5], [8]])
    positions = np.array([len(p) for p in prompts])
    hidden = decoder.step(decoder.embed(nxt, positions), positions, cache)
    for b, p in enumerate(prompts):
        alone = uncached_logits(gpt, np.array([[*p, int(nxt[b, 0])]]))[0, -1]
        assert np.abs(decoder.logits(hidden[b:b + 1, 0])[0] - alone).max() < 1e-5


@pytest.mark.parametrize("microbatches", [1, 2, 3])
def test_batched_greedy_tokens_are_those_of_each_prompt_alone(microbatches):
    """Lengths 1 to 15 (block size 12: the longest start past it, others cross it)."""
    gpt = model()
    prompts = prompts_of([1, 5, 12, 15, 9])
    sequences = generate_replica(Decoder(gpt), prompts, list(range(5)), 9, top_k=1,
                                 microbatches=microbatches)
    for p, s in zip(prompts, sequences, strict=True):
        assert s.tokens == gpt.generate(np.array([p]), 9, top_k=1)[0].tolist()
        assert s.prompt_len == len(p) and len(s.token_times) == 9
        assert s.ttft_s > 0 and all(g >= 0 for g in s.latencies_s) and s.tokens_per_s > 0


def test_sampling_draws_per_prompt_so_the_split_does_not_matter():
    gpt = model()
    prompts = prompts_of([3, 4, 6, 2])

    def run(parts: list[list[int]]) -> list[list[int]]:
        out = []
        for part in parts:
            out += [s.tokens for s in generate_replica(
                Decoder(gpt), [prompts[i] for i in part], part, 8, temperature=1.5, top_k=5,
                seed=7)]
        return out

    whole = run([[0, 1, 2, 3]])
    assert run([[0], [1, 2], [3]]) == whole
    other_seed = [s.tokens for s in generate_replica(Decoder(gpt), prompts, [0, 1, 2, 3], 8,
                                                     temperature=1.5, top_k=5, seed=8)]
    assert other_seed != whole


def test_zero_new_tokens_and_summary():
    gpt = model()
    sequences = generate_replica(Decoder(gpt), prompts_of([3]), [0], 0, top_k=1)
    assert sequences[0].new_tokens == [] and np.isnan(sequences[0].ttft_s)
    figures = summary(sequences, [])
    assert figures["new_tokens"] == 0 and figures["latency_p50_s"] is None


@pytest.mark.parametrize("layout", [(1, 1, 2), (1, 2, 1), (1, 3, 1), (2, 1, 2), (1, 2, 3),
                                    (5, 1, 1), (1, 1, 6)])
def test_every_layout_of_the_in_process_world_gives_the_tokens_of_one_rank(layout):
    dp, pp, tp = layout
    gpt = model()
    prompts = prompts_of([4, 1, 13, 7])  # fewer prompts than replicas at dp = 5
    expected = [gpt.generate(np.array([p]), 6, top_k=1)[0].tolist() for p in prompts]

    def body(comm):
        return serve(comm, model(), prompts, 6, dp, pp, tp, top_k=1)

    for sequences, figures in run_world(dp * pp * tp, body):
        assert [s.tokens for s in sequences] == expected
        assert [s.index for s in sequences] == [0, 1, 2, 3]
        assert sum(f.prompts for f in figures if f.coords[1:] == (0, 0)) == 4


def test_tensor_parallel_logits_match_one_rank():
    gpt = model()
    ids = np.random.default_rng(2).integers(0, 11, (2, 9))
    reference = uncached_logits(gpt, ids)[:, -1]

    def body(comm):
        decoder = Decoder(model(), tp_comm=comm)
        cache = decoder.new_cache(2)
        decoder.prefill(decoder.embed(ids[:, :8]), cache)
        positions = np.full(2, 8)
        hidden = decoder.step(decoder.embed(ids[:, 8:], positions), positions, cache)
        return decoder.logits(hidden[:, 0])

    for logits in run_world(3, body):
        assert np.abs(logits - reference).max() < 1e-5


def test_layout_checks_name_the_flag():
    assert check_layout(6, 6, 3, None, 1, 2) == (3, 1, 2)
    for args, message in [((4, 6, 3, None, 1, 4), "--tp: 4 tensor-parallel ranks must divide the "
                                                  "model's 6 heads"),
                          ((4, 6, 3, None, 4, 1), "--pp: 4 pipeline stages need at least"),
                          ((4, 6, 3, None, 3, 1), "--pp × --tp = 3 × 1 must divide the 4 ranks"),
                          ((4, 6, 3, 3, 1, 1), "--dp × --pp × --tp = 3 × 1 × 1 = 3 must equal"),
                          ((4, 6, 3, None, 0, 1), "--pp: expected a positive number")]:
        with pytest.raises(ValueError, match=message.replace("×", ".")):
            check_layout(*args)
    assert [list(blocks_by_count(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]

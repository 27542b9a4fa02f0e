"""The models benchmarks/simulate_agreement.py checks the transformer's axes against: the step with
recomputation, with experts over ep ranks and with context parallelism, hand-computed from their
pieces (the timings belong to the benchmark, not here)."""

from __future__ import annotations

import pytest

from mpdl.collectives import costmodel as cm
from mpdl.perf import agreement as A

PIECES = {"forward_s": 1.0, "backward_s": 2.0, "optimizer_s": 0.3, "blocks_forward_s": 0.8,
          "core_forward_s": 0.2}
#: a ring step of n bytes: 1 ms + 1 ns a byte
LINE = ((0.0, 1e-3), (1e6, 2e-3))
PARAMS = cm.Params(handoff=5e-5, exchange=LINE, ring_exchange=LINE)


def test_recomputation_adds_the_forward_it_runs_again():
    # one rank: no all-reduce
    assert A.recompute_step(PIECES, "none", 1, 1000, PARAMS) == pytest.approx(3.3)
    assert A.recompute_step(PIECES, "selective", 1, 1000, PARAMS) == pytest.approx(3.5)
    assert A.recompute_step(PIECES, "full", 1, 1000, PARAMS) == pytest.approx(4.1)
    # two ranks: the gradient's ring all-reduce after backward, handed to the thread
    reduce = cm.predict("allreduce", "ring", 4000, 2, 1, PARAMS) + 5e-5
    assert A.recompute_step(PIECES, "full", 2, 4000, PARAMS) == pytest.approx(4.1 + reduce)


def test_experts_step_by_hand():
    # 100 dense bytes, 300 of experts: at ep 2 a rank holds 100 + 150 of 400, so its optimizer
    # step is 0.625 of the one timed with every expert
    one = A.expert_step(PIECES, 1, 1, 2, 4096, 100, 300, 4, PARAMS)
    assert one == pytest.approx(3.3)
    got = A.expert_step(PIECES, 2, 2, 2, 4096, 100, 300, 4, PARAMS)
    per_layer = (4 * cm.predict("alltoall", "pairwise", 4096, 2, 1, PARAMS)
                 + cm.predict("alltoall", "pairwise", 32, 2, 1, PARAMS)
                 + cm.predict("allreduce", "ring", 32, 2, 1, PARAMS))
    dense = cm.predict("allreduce", "ring", 100, 2, 1, PARAMS) + 5e-5
    assert got == pytest.approx(3.0 + 0.625 * 0.3 + 2 * per_layer + dense)
    # ep 1 on two ranks: no all-to-all of rows; every expert all-reduced with its replica
    replicated = A.expert_step(PIECES, 2, 1, 2, 4096, 100, 300, 4, PARAMS)
    experts = cm.predict("allreduce", "ring", 300, 2, 1, PARAMS) + 5e-5
    counts = cm.predict("allreduce", "ring", 32, 2, 1, PARAMS)
    assert replicated == pytest.approx(3.3 + 2 * counts + dense + experts)


def test_context_step_by_hand():
    kv = 200_000  # K and V of the whole sequence
    # attention over the whole sequence 0.6 s, a rank's share 0.3 s, 0.1 s of it timed with
    # the pieces: 0.2 s more in forward and twice that in backward
    pieces = {**PIECES, "core_forward_s": 0.1, "core_whole_s": 0.6}
    grads = cm.predict("allreduce", "ring", 1000, 2, 1, PARAMS) + 5e-5
    base = 3.0 + 3 * 0.2 + 0.3 + grads
    # ring, cp 2, 2 layers: one exchange of a 100 kB block (1.1 ms) in forward, of 200 kB
    # (1.2 ms) in backward; a block of attention is 0.3 / 2 / 2 = 75 ms: nothing is exposed
    assert A.context_step(pieces, 2, "ring", 2, kv, 1000, PARAMS) == pytest.approx(base)
    # with attention too short to hide them, the excess shows: a block 0.075 ms
    quick = {**PIECES, "core_forward_s": 0.0, "core_whole_s": 0.0006}
    exposed = (1.1e-3 - 0.075e-3) + (1.2e-3 - 0.15e-3)
    assert A.context_step(quick, 2, "ring", 2, kv, 1000, PARAMS) == pytest.approx(
        3.0 + 3 * 0.0003 + 0.3 + grads + 2 * exposed)
    # ulysses: Q, K, V packed (1.5 kv / cp) and the output (0.5 kv / cp), forward and backward
    a2a = (cm.predict("alltoall", "pairwise", 150_000, 2, 1, PARAMS)
           + cm.predict("alltoall", "pairwise", 50_000, 2, 1, PARAMS))
    assert A.context_step(pieces, 2, "ulysses", 2, kv, 1000, PARAMS) == pytest.approx(
        base + 2 * 2 * a2a)
    # allgather: K and V gathered in forward, gathered again in backward (not kept) and their
    # gradients reduce-scattered
    gather = (2 * cm.predict("allgather", "ring", kv, 2, 1, PARAMS)
              + cm.predict("reduce_scatter", "ring", kv, 2, 1, PARAMS))
    assert A.context_step(pieces, 2, "allgather", 2, kv, 1000, PARAMS) == pytest.approx(
        base + 2 * gather)

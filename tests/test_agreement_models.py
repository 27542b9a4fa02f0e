"""The models benchmarks/simulate_agreement.py checks the transformer's axes against: the step with
recomputation, with experts over ep ranks and with context parallelism, hand-computed from their
pieces (the timings belong to the benchmark, not here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from mpdl.perf import agreement as A
from mpdl.tuning import costmodel as cm

PIECES = {"forward_s": 1.0, "backward_s": 2.0, "optimizer_s": 0.3, "blocks_forward_s": 0.8,
          "core_forward_s": 0.2, "sync_s": 0.01}
#: a ring step of n bytes: 1 ms + 1 ns a byte
LINE = ((0.0, 1e-3), (1e6, 2e-3))
PARAMS = cm.Params(handoff=5e-5, exchange=LINE, ring_exchange=LINE)


def test_recomputation_adds_the_forward_it_runs_again():
    # one rank: no all-reduce
    assert A.recompute_step(PIECES, "none", 1, 1000, PARAMS, 2) == pytest.approx(3.3)
    assert A.recompute_step(PIECES, "selective", 1, 1000, PARAMS, 2) == pytest.approx(3.5)
    assert A.recompute_step(PIECES, "full", 1, 1000, PARAMS, 2) == pytest.approx(4.1)
    # two ranks: the gradient's ring all-reduce after backward, handed to the thread, and the
    # wait for the slower rank before it (10 ms)
    reduce = cm.predict("allreduce", "ring", 4000, 2, 1, PARAMS) + 5e-5
    assert A.recompute_step(PIECES, "full", 2, 4000, PARAMS, 2) == pytest.approx(4.11 + reduce)
    # four ranks on two cores: a waiting rank leaves its core to one that computes (no wait)
    reduce4 = cm.predict("allreduce", "ring", 4000, 4, 1, PARAMS) + 5e-5
    assert A.recompute_step(PIECES, "full", 4, 4000, PARAMS, 2) == pytest.approx(4.1 + reduce4)


def test_experts_step_by_hand():
    # 100 dense bytes, 300 of experts: at ep 2 a rank holds 100 + 150 of 400, so its optimizer
    # step is 0.625 of the one timed with every expert
    one = A.expert_step(PIECES, 1, 1, 2, 4096, 100, 300, 4, PARAMS, 2)
    assert one == pytest.approx(3.3)
    got = A.expert_step(PIECES, 2, 2, 2, 4096, 100, 300, 4, PARAMS, 2)
    per_layer = (4 * cm.predict("alltoall", "pairwise", 4096, 2, 1, PARAMS)
                 + cm.predict("alltoall", "pairwise", 32, 2, 1, PARAMS)
                 + cm.predict("allreduce", "ring", 32, 2, 1, PARAMS))
    dense = cm.predict("allreduce", "ring", 100, 2, 1, PARAMS) + 5e-5
    # waits for the slower rank: per layer the counts' all-reduce, the combine and both
    # backward all-to-alls; once before the gradients' all-reduces
    assert got == pytest.approx(3.0 + 0.625 * 0.3 + 2 * per_layer + dense + 2 * 4 * 0.01 + 0.01)
    # ep 1 on two ranks: no all-to-all of rows; every expert all-reduced with its replica
    replicated = A.expert_step(PIECES, 2, 1, 2, 4096, 100, 300, 4, PARAMS, 2)
    experts = cm.predict("allreduce", "ring", 300, 2, 1, PARAMS) + 5e-5
    counts = cm.predict("allreduce", "ring", 32, 2, 1, PARAMS)
    assert replicated == pytest.approx(3.3 + 2 * counts + dense + experts + 2 * 0.01 + 0.01)


CP_PIECES = {"forward_s": 1.0, "backward_s": 2.0, "optimizer_s": 0.3, "local_attention_s": 0.2,
             "blocked_attention_s": 0.8, "ulysses_attention_s": 0.5, "sync_s": 0.01}


def test_context_step_by_hand():
    kv = 200_000  # K and V of the whole sequence: a rank's block at cp 2 is 100 kB
    # the two all-reduces over cp (1000 bytes of gradients, the loss's 16), not handed off
    reductions = (cm.predict("allreduce", "ring", 1000, 2, 1, PARAMS)
                  + cm.predict("allreduce", "ring", 16, 2, 1, PARAMS))
    # ring on 2 ranks and 2 cores: nothing hidden; per layer one K/V shift in forward, one in
    # backward and two of the dK/dV sums, each 1.1 ms + 0.05 ms of handoff; 3 waits a layer
    # and the all-reduces' 2, 10 ms each; the blocked attention replaces the local one
    ring = A.context_step(CP_PIECES, 2, "ring", 2, kv, 1000, PARAMS, cores=2)
    # on one core the ranks time-slice it: no wait is charged beyond the pieces
    assert A.context_step(CP_PIECES, 2, "ring", 2, kv, 1000, PARAMS, cores=1)["waits_s"] == 0
    assert ring["step_s"] == pytest.approx(3.3 + 0.6 + 2 * 4 * 1.15e-3 + reductions + 8 * 0.01)
    assert ring["attention_s"] == pytest.approx(0.6)
    assert ring["messages_s"] == pytest.approx(2 * 4 * 1.15e-3)
    assert ring["waits_s"] == pytest.approx(0.08)
    # with cores to spare a shift hides behind a chunk step of attention (0.8 / 2 layers / 4
    # steps = 100 ms): only the last sums' wait is left
    spare = A.context_step(CP_PIECES, 2, "ring", 2, kv, 1000, PARAMS, cores=4)
    assert spare["messages_s"] == pytest.approx(2 * 1.15e-3)
    # ... and partly, where a chunk step is 1.5 ms: backward's two shifts outlast it by 0.8 ms
    short = {**CP_PIECES, "blocked_attention_s": 0.012}
    partly = A.context_step(short, 2, "ring", 2, kv, 1000, PARAMS, cores=4)
    assert partly["messages_s"] == pytest.approx(2 * (0.8e-3 + 1.15e-3))
    # ulysses: Q, K, V packed (150 kB) and the output (50 kB), forward and backward; 4 waits
    a2a = (cm.predict("alltoall", "pairwise", 150_000, 2, 1, PARAMS)
           + cm.predict("alltoall", "pairwise", 50_000, 2, 1, PARAMS))
    ulysses = A.context_step(CP_PIECES, 2, "ulysses", 2, kv, 1000, PARAMS, cores=2)
    assert ulysses["step_s"] == pytest.approx(3.3 + 0.3 + 2 * 2 * a2a + reductions + 10 * 0.01)
    # allgather: K and V gathered in forward, gathered again in backward (not kept) and their
    # gradients reduce-scattered; 3 waits
    gather = (2 * cm.predict("allgather", "ring", kv, 2, 1, PARAMS)
              + cm.predict("reduce_scatter", "ring", kv, 2, 1, PARAMS))
    allgather = A.context_step(CP_PIECES, 2, "allgather", 2, kv, 1000, PARAMS, cores=2)
    assert allgather["step_s"] == pytest.approx(3.3 + 0.6 + 2 * gather + reductions + 8 * 0.01)
    assert allgather["step_s"] == pytest.approx(sum(v for k, v in allgather.items()
                                                    if k != "step_s"))


def _benchmark():
    """benchmarks/simulate_agreement.py as a module (it is a script, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "simulate_agreement.py"
    spec = importlib.util.spec_from_file_location("simulate_agreement", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_times_the_pieces_these_models_take():
    # on one rank, once each: the pieces still run against the GPT, the MoE dispatch and the
    # context-parallel attention as they are now, and give every figure the models read
    bench = _benchmark()
    dense = bench.gpt_pieces({"seq": 16, "vocab": 17, "batch": 2, "experts": 0}, 1, 0, 2)
    experts = bench.gpt_pieces({"seq": 16, "vocab": 17, "batch": 2, "experts": 4}, 1, 0, 2)
    context = bench.context_pieces({"seq": 16, "cp": 1, "vocab": 17, "batch": 2}, 1, 0, 2)
    for pieces in (dense, experts, context):
        assert pieces["synchronised_s"] > 0 and pieces["forward_s"] > 0
        pieces["sync_s"] = 0.0
    assert dense["blocks_forward_s"] < dense["forward_s"]
    assert A.recompute_step(dense, "full", 1, 1000, PARAMS, 2) > A.recompute_step(
        dense, "none", 1, 1000, PARAMS, 2)
    assert A.expert_step(experts, 1, 1, 2, 4096, 100, 300, 4, PARAMS, 2) > 0
    for mode in ("ring", "ulysses", "allgather"):
        assert A.context_step(context, 1, mode, 2, 4096, 1000, PARAMS, 2)["step_s"] > 0

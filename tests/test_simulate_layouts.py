"""mpdl simulate for transformer layouts: derived shapes, memory per GPU against hand-computed
cases, monotonicity, --search, and the published figures within their bands."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mpdl.models.gpt import GPT
from mpdl.perf import compute as C
from mpdl.perf import layouts as L
from mpdl.perf import published as P

MPDL = str(Path(sys.executable).parent / "mpdl")
MIXED, FP32 = L.PRECISIONS["bf16"], L.PRECISIONS["fp32"]
SELENE = P.NETWORKS["selene"]
A100 = L.GPUS["a100-80gb"]


def test_gpt2_small_has_its_published_parameter_count():
    # GPT-2 small with tied embeddings (nanoGPT, Hugging Face): 124,439,808 parameters
    assert L.SHAPES["gpt2-small"].params == 124_439_808


@pytest.mark.parametrize("layers,hidden,heads,seq,vocab", [(2, 8, 2, 4, 10), (3, 12, 3, 6, 17)])
def test_shape_counts_as_the_gpt_class(layers, hidden, heads, seq, vocab):
    model = GPT(vocab, seq, layers, heads, hidden, seed=0)
    shape = L.Shape(layers, hidden, heads, seq, vocab)
    assert shape.params == model.num_parameters()
    assert shape.flops_per_token == model.flops_per_token()


def test_model_states_hand_computed():
    # 1000 parameters, mixed-precision Adam: 2 + 2 + 12 bytes each; ZeRO 2 over 4 ranks
    got = L.model_states(1000, MIXED, 2, 4)
    assert (got["params_bytes"], got["grads_bytes"], got["optimizer_bytes"]) == (2000, 500, 3000)
    assert got["model_state_bytes"] == 5500
    # float32 Adam, ZeRO 1 over 4: 4000 + 4000 + 8000/4
    assert L.model_states(1000, FP32, 1, 4)["model_state_bytes"] == 10000
    assert L.model_states(1000, FP32, 3, 4)["model_state_bytes"] == 4000
    assert L.model_states(1000, FP32, 0, 4)["model_state_bytes"] == 16000


def test_zero_paper_figure_one():
    # Rajbhandari et al. 2020, Fig. 1: 7.5B parameters, N_d = 64, K = 12
    gb = {s: L.model_states(7.5e9, MIXED, s, 64)["model_state_bytes"] / 1e9 for s in range(4)}
    assert gb[0] == pytest.approx(120, rel=0.02)
    assert gb[1] == pytest.approx(31.4, rel=0.02)
    assert gb[2] == pytest.approx(16.6, rel=0.02)
    assert gb[3] == pytest.approx(1.9, rel=0.02)


def test_zero_working_buffers_hand_computed():
    # one unit of 100 parameters held whole: stage 2 its float32 gradient, stage 3 also its weights
    assert L.zero_working_bytes(100, FP32, 1) == 0
    assert L.zero_working_bytes(100, FP32, 2) == 400
    assert L.zero_working_bytes(100, FP32, 3) == 800
    shape = L.Shape(2, 8, 2, 4, 10)
    layer = 12 * 64 + 13 * 8
    n = 2 * layer + 14 * 8 + 16
    got = L.memory(shape, L.Layout(dp=4, zero=3), FP32)
    assert got["zero_working_bytes"] == 8 * layer
    assert got["model_state_bytes"] == pytest.approx(16 * n / 4 + 8 * layer)


def test_activations_hand_computed():
    shape = L.Shape(4, 8, 2, 4, 10, microbatch=2)
    # s·b·d·(10 + 24/t + 5·a·s/(d·t)) = 4·2·8·(10 + 24 + 5·2·4/8) = 64·39
    assert L.activation_bytes_per_layer(shape, L.Layout(), MIXED) == 64 * 39
    # t = 2: 64·(10 + 12 + 2.5); float32 doubles it
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=2), MIXED) == 64 * 24.5
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=2), FP32) == 2 * 64 * 24.5
    assert L.activation_bytes_per_layer(shape, L.Layout(recompute="full"), MIXED) == 2 * 64
    # sp: 64·(34/2 + 2.5); selective drops the attention scores: 64·(10 + 12), sp 64·17
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=2, sp=True), MIXED) == 64 * 19.5
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=2, recompute="selective"),
                                        MIXED) == 64 * 22
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=2, sp=True, recompute="selective"),
                                        MIXED) == 64 * 17
    # cp = 2: each rank holds 2 of the 4 tokens against all 4 keys: 2·2·8·(34 + 5·2·4/8) = 32·39
    assert L.activation_bytes_per_layer(shape, L.Layout(cp=2), MIXED) == 32 * 39
    # pp = 2 (2 layers a stage), AFAB holds m = 8 micro-batches, 1F1B min(8, 2) = 2
    afab = L.memory(shape, L.Layout(pp=2, microbatches=8, schedule="afab"), MIXED)
    ofob = L.memory(shape, L.Layout(pp=2, microbatches=8, schedule="1f1b"), MIXED)
    assert afab["activation_bytes"] == 2 * 8 * 64 * 39
    assert ofob["activation_bytes"] == 2 * 2 * 64 * 39
    # parameters per GPU: 2 layers of 12·64 + 13·8 and the embedding (10 + 4)·8 + 16
    assert L.params_per_gpu(shape, L.Layout(pp=2)) == 2 * (12 * 64 + 13 * 8) + 14 * 8 + 16


def test_more_shards_never_more_memory():
    shape = L.SHAPES["megatron-8.3b"]
    for precision in (MIXED, FP32):
        for recompute in ("none", "selective", "full"):
            last = None
            for zero in (0, 1, 2, 3):
                totals = [L.memory(shape, L.Layout(dp=dp, zero=zero, recompute=recompute),
                                   precision)["total_bytes"] for dp in (1, 2, 4, 8, 64, 512)]
                assert all(b <= a for a, b in zip(totals, totals[1:], strict=False))
                if last is not None:  # a higher stage shards more (with one rank: nothing)
                    assert all(b <= a for a, b in zip(last[1:], totals[1:], strict=True))
                last = totals
            for key in ("tp", "pp"):
                totals = [L.memory(shape, L.Layout(**{key: k}, recompute=recompute),
                                   precision)["model_state_bytes"] for k in (1, 2, 4, 8)]
                assert all(b < a for a, b in zip(totals, totals[1:], strict=False))


def test_more_microbatches_never_a_larger_bubble():
    for pp in (1, 2, 4, 8, 64):
        shares = [L.bubble(pp, m) for m in range(1, 200)]
        assert all(b <= a for a, b in zip(shares, shares[1:], strict=False))
    assert L.bubble(4, 12) == pytest.approx(3 / 15)
    assert L.bubble(1, 5) == 0


@pytest.mark.parametrize("schedule", ["afab", "1f1b"])
def test_bubble_formula_matches_a_timetable(schedule):
    for pp, m in ((2, 1), (4, 4), (4, 9), (8, 3)):
        assert P.pipeline_schedule_bubble(pp, m, schedule) == pytest.approx((pp - 1) / (m + pp - 1))


def test_bubbles_of_the_generated_schedules():
    # hand values: zb-h1 (p − 1)/(3m + p − 1); interleaved v-fold less than 1F1B
    assert L.bubble(4, 8, 1, "zb-h1") == pytest.approx(3 / 27)
    assert L.bubble(4, 8, 2, "interleaved") == pytest.approx(3 / 19)
    assert L.bubble(4, 8, 2, "1f1b") == pytest.approx(3 / 19)
    one = L.bubble(4, 8, 1, "1f1b")
    assert 0 < L.bubble(4, 8, 2, "zb-v") < L.bubble(4, 8, 1, "zb-h1") < one
    assert 0 < L.bubble(4, 8, 2, "dualpipev") < one


def test_step_and_memory_follow_the_schedule():
    shape = L.SHAPES["gpt2-small"]
    rows = {kind: L.step(shape, L.Layout(pp=4, microbatches=8, schedule=kind,
                                         virtual=2 if kind in ("zb-v", "dualpipev") else 1),
                         MIXED, A100, SELENE.params, 8) for kind in ("1f1b", "zb-h1", "zb-v")}
    assert rows["zb-h1"]["bubble_share"] == pytest.approx(3 / 27)
    assert rows["zb-h1"]["bubble_s"] / rows["zb-h1"]["step_s"] == pytest.approx(3 / 27, rel=0.01)
    assert rows["zb-v"]["step_s"] < rows["zb-h1"]["step_s"] < rows["1f1b"]["step_s"]
    # the first rank's held activations in stages: 1F1B p, DualPipeV (2p + 1)/2, interleaved
    # p + (p − 1)/v (Korthikanti et al. 2022)
    assert L.in_flight(L.Layout(pp=4, microbatches=8)) == 4
    assert L.in_flight(L.Layout(pp=4, microbatches=8, schedule="dualpipev", virtual=2)) == 4.5
    assert L.in_flight(L.Layout(pp=4, microbatches=8, virtual=2)) == 5.5


def test_search_tries_the_schedule_as_a_dimension():
    shape = L.SHAPES["megatron-8.3b"]
    kinds = ("1f1b", "zb-h1", "zb-v")
    rows = L.search(shape, 64, 512, MIXED, L.GPUS["a100-80gb"], SELENE.params, 8, kinds, top=500)
    assert {r["schedule"] for r in rows if r["pp"] > 1} == set(kinds)
    assert all(r["virtual"] == 2 for r in rows if r["schedule"] == "zb-v")


def test_step_charges_the_bubble():
    shape = L.SHAPES["gpt2-small"]
    one = L.step(shape, L.Layout(microbatches=8), MIXED, A100, SELENE.params, 8)
    four = L.step(shape, L.Layout(pp=4, microbatches=8), MIXED, A100, SELENE.params, 8)
    assert four["bubble_share"] == pytest.approx(3 / 11)
    assert four["bubble_s"] / four["step_s"] == pytest.approx(3 / 11, rel=0.01)
    assert one["mfu"] <= A100.gemm_efficiency


def test_search_returns_only_layouts_that_fit():
    shape = L.SHAPES["megatron-8.3b"]
    for memory in (16e9, 32e9, 80e9):
        gpu = replace(L.GPUS["v100-32gb"], name="v", memory=memory)
        rows = L.search(shape, 64, 512, MIXED, gpu, SELENE.params, 8, top=50)
        assert rows, memory
        assert all(r["fits"] and r["total_bytes"] <= memory for r in rows)
        assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
        assert all(r["gpus"] == 64 for r in rows)
    tiny = replace(L.GPUS["v100-32gb"], name="tiny", memory=1e9)
    assert L.search(shape, 8, 64, MIXED, tiny, SELENE.params, 8) == []


EXPECTED = {  # name: published figure, as the papers state it
    "ZeRO DDP memory": 120.0, "ZeRO stage 1 memory": 31.4, "ZeRO stage 2 memory": 16.6,
    "ZeRO stage 3 memory": 1.9, "Megatron-LM 8.3B on 512 V100": 15.1,
    "Megatron-LM 8.3B weak-scaling efficiency": 0.76, "PTD-P 1T on 3072 A100": 502.0,
    "PTD-P 1T share of peak": 0.52, "Goyal et al. 2017": 3600.0, "Jia et al. 2018": 396.0,
    "Goyal et al. 2017 scaling efficiency 8 -> 256 GPUs": 0.90,
    "Yamazaki et al. 2019 throughput": 1.73e6, "Mikami et al. 2018": 224.0}


#: rows outside ±15%, each explained in docs/results/simulate.md, with the ratio they stand at
OUTSIDE = {"Mikami et al. 2018": 0.39}


def test_published_figures_within_their_bands():
    rows = {r["name"]: r for r in P.rows()}
    for name, figure in EXPECTED.items():
        row = rows[name]
        assert row["published"] == figure
        band = 0.02 if name.startswith("ZeRO") else 0.15
        assert row["band"] == band
        if name in OUTSIDE:
            assert not row["ok"] and row["ratio"] == pytest.approx(OUTSIDE[name], abs=0.01)
            continue
        assert abs(row["predicted"] / figure - 1) <= band, (name, row["predicted"])
        assert row["ok"]
    bubbles = [r for n, r in rows.items() if n.startswith("pipeline bubble")]
    assert len(bubbles) == 4 and all(r["ok"] for r in bubbles)
    # every row's band is ±15% at most
    assert all(r["band"] <= 0.15 for r in rows.values())
    # Mikami et al. stays outside the band: what the model misses is said in docs/results/simulate.md;
    # on the same cluster Yamazaki et al.'s throughput lies inside
    assert not rows["Mikami et al. 2018"]["ok"]
    assert rows["Mikami et al. 2018"]["ratio"] == pytest.approx(OUTSIDE["Mikami et al. 2018"],
                                                                 abs=0.01)
    assert rows["Yamazaki et al. 2019 throughput"]["ok"]
    # every other row is inside its band
    assert [n for n, r in rows.items() if not r["ok"]] == list(OUTSIDE)
    # the PTD-P layout (t, p, d) = (8, 64, 6) is the stated one and fits in 80 GB
    assert rows["PTD-P 1T share of peak"]["layout"] == "dp6 pp64 tp8 m512 1f1b recompute=full"
    assert rows["PTD-P 1T share of peak"]["fits"]


def _mpdl(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MPDL, "simulate", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_cli_published_json(tmp_path):
    out = _mpdl("--published", "--json", str(tmp_path / "p.jsonl"))
    assert out.returncode == 0, out.stderr
    assert "PTD-P 1T on 3072 A100" in out.stdout
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert {"name", "published", "predicted", "unit", "ratio", "band", "ok"} <= set(lines[0])
    assert len(lines) == len({x["name"] for x in lines}) >= 17


def test_cli_layout_json(tmp_path):
    path = tmp_path / "l.jsonl"
    out = _mpdl("--model-shape", "gpt2-small", "--dp", "2", "--pp", "2", "--tp", "2",
                "--microbatches", "4", "--zero", "1", "--gpu-memory", "1GB", "--json", str(path))
    assert out.returncode == 0, out.stderr
    row = json.loads(path.read_text())
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes",
                "total_bytes", "layout", "bubble_share", "mfu", "fits", "dp", "pp", "tp"):
        assert key in row
    assert row["bubble_share"] == pytest.approx(1 / 5)
    assert row["gpu_memory_bytes"] == 1e9 and row["fits"] == (row["total_bytes"] <= 1e9)


@pytest.mark.parametrize("args,flag", [
    (["--model-shape", "nope"], "--model-shape"),
    (["--layers", "2", "--hidden", "8", "--heads", "3", "--seq", "4", "--vocab", "9"], "hidden"),
    (["--model-shape", "gpt2-small", "--tp", "5"], "--tp"),
    (["--model-shape", "gpt2-small", "--pp", "13"], "--pp"),
    (["--model-shape", "gpt2-small", "--cp", "3"], "--cp"),
    (["--model-shape", "gpt2-small", "--cp", "2", "--cp-mode", "ulysses", "--tp", "4"], "--cp"),
    (["--model-shape", "gpt2-small", "--cp-mode", "spiral"], "--cp-mode"),
    (["--model-shape", "gpt2-small", "--dp", "2", "--ep", "2"], "--ep"),
    (["--model-shape", "mixtral-8x7b", "--dp", "4", "--ep", "3"], "--ep"),
    (["--model-shape", "mixtral-8x7b", "--dp", "2", "--ep", "4"], "--ep"),
    (["--model-shape", "mixtral-8x7b", "--moe-top-k", "9"], "--moe-top-k"),
    (["--model-shape", "gpt2-small", "--sp"], "--sp"),
    (["--model-shape", "gpt2-small", "--recompute", "half"], "--recompute"),
    (["--model-shape", "gpt2-small", "--precision", "mixed"], "--precision"),
    (["--model-shape", "gpt2-small", "--zero", "4"], "--zero"),
    (["--model-shape", "gpt2-small", "--pp", "2", "--zero", "3"], "--zero"),
    (["--model-shape", "gpt2-small", "--gpu-memory", "lots"], "--gpu-memory"),
    (["--model-shape", "gpt2-small", "--gpu", "tpu"], "--gpu"),
    (["--model-shape", "gpt2-small", "--precision", "int8"], "--precision"),
    (["--model-shape", "gpt2-small", "--schedule", "zigzag", "--pp", "2"], "--schedule"),
    (["--model-shape", "gpt2-small", "--schedule", "dualpipev", "--pp", "4", "--microbatches",
      "6"], "--microbatches"),
    (["--model-shape", "gpt2-small", "--schedule", "1f1b,zigzag", "--search"], "--schedule"),
    (["--model-shape", "gpt2-small", "--failure-rate", "-1"], "--failure-rate"),
    (["--model-shape", "gpt2-small", "--gpu", "a100-80gb", "--precision", "fp8"], "--precision"),
    (["--model-shape", "gpt2-small", "--checkpoint-bandwidth", "0"], "--checkpoint-bandwidth"),
])
def test_cli_bad_layout_flags(args, flag):
    out = _mpdl(*args)
    assert out.returncode == 2
    assert flag in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_hybrid_sharding_shards_over_its_group_only():
    shape = L.Shape(2, 8, 2, 4, 10)
    n = L.params_per_gpu(shape, L.Layout())
    full = L.memory(shape, L.Layout(dp=8, zero=1), FP32)
    hybrid = L.memory(shape, L.Layout(dp=8, zero=1, zero_group=2), FP32)
    assert full["optimizer_bytes"] == 8 * n / 8
    assert hybrid["optimizer_bytes"] == 8 * n / 2
    assert hybrid["params_bytes"] == full["params_bytes"] == 4 * n
    with pytest.raises(ValueError, match="--zero-group"):
        L.check_layout(shape, L.Layout(dp=8, zero=1, zero_group=3), 8)


def test_korthikanti_table_two_reproduced_exactly():
    rows = [r for r in P.rows() if r["name"].startswith("Korthikanti Table 2")]
    assert len(rows) == 6 and all(r["ok"] and r["band"] < 1e-6 for r in rows)
    # the 530B model, t = 8, by hand: s·b·h·(10 + 24/8 + 5·128·2048/(20480·8)) = s·b·h·21
    shape, sbh = L.SHAPES["mt-nlg-530b"], 2048 * 20480
    assert L.activation_bytes_per_layer(shape, L.Layout(tp=8), MIXED) == pytest.approx(sbh * 21)


def test_llama_and_mixtral_parameters_by_hand():
    d, kv, f, v = 16384, 1024, 53248, 128256
    layer = d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d
    assert L.SHAPES["llama3-405b"].params == 126 * layer + 2 * v * d + d
    d, kv, f, v = 4096, 1024, 14336, 32000
    attention, expert = d * (d + 2 * kv) + d * d, 3 * d * f
    mixtral = L.SHAPES["mixtral-8x7b"]
    assert mixtral.params == 32 * (attention + 8 * expert + 8 * d + 2 * d) + 2 * v * d + d
    assert mixtral.active_params == 32 * (attention + 2 * expert + 8 * d + 2 * d) + 2 * v * d + d
    assert mixtral.flops_per_token == 6 * mixtral.active_params + 12 * 32 * d * 4096


def test_one_expert_is_the_dense_model_plus_its_router():
    dense = L.Shape(4, 16, 2, 8, 50)
    moe = L.Shape(4, 16, 2, 8, 50, experts=1, top_k=1)
    assert moe.params == dense.params + 4 * 16
    every_other = L.Shape(4, 16, 2, 8, 50, experts=4, top_k=2, moe_every=2)
    assert every_other.moe_layers == 2
    assert every_other.params == dense.params + 2 * (3 * dense.mlp_params + 4 * 16)
    assert every_other.active_params == dense.params + 2 * (dense.mlp_params + 4 * 16)


def test_experts_split_over_ep_and_reduced_over_their_replicas():
    shape = L.Shape(2, 16, 2, 8, 50, experts=4, top_k=2)
    dense, experts = L.stage_params(shape, L.Layout(dp=4))
    assert experts == 2 * 4 * shape.mlp_params
    assert L.stage_params(shape, L.Layout(dp=4, ep=4)) == (dense, experts / 4)
    # ZeRO 1 over dp = 4: the experts' optimizer state over the dp/ep = 1 replica of each expert
    got = L.memory(shape, L.Layout(dp=4, ep=4, zero=1), FP32)
    assert got["optimizer_bytes"] == pytest.approx(8 * dense / 4 + 8 * experts / 4)
    # dispatch + combine in forward and backward: 4 pairwise all-to-alls per MoE block of
    # b·T·k·cf·d·bytes: (p − 1)·α + n·(p − 1)/p·β
    params = SELENE.params
    n = 1 * 8 * 2 * 1.0 * 16 * 4
    one = 3 * params.alpha + n * 3 / 4 * params.beta
    assert L.expert_time(shape, L.Layout(dp=4, ep=4), FP32, params, 8) == pytest.approx(2 * 4 * one)
    assert L.expert_time(shape, L.Layout(dp=4), FP32, params, 8) == 0


def test_ring_attention_hides_behind_attention_until_the_link_is_slow():
    shape = L.Shape(2, 1024, 8, 8192, 100)
    fast = L.context_parallel_time(shape, L.Layout(cp=4), MIXED, A100, SELENE.params, 8)
    assert fast["cp_comm_s"] > 0 and fast["cp_exposed_s"] == 0
    slow = P.S.network("slow", 1e6, 1e-3, per_node=8, gamma=0.0).params
    crawl = L.context_parallel_time(shape, L.Layout(cp=4), MIXED, A100, slow, 8)
    assert 0 < crawl["cp_exposed_s"] < crawl["cp_comm_s"]
    for mode in ("ulysses", "allgather"):
        other = L.context_parallel_time(shape, L.Layout(cp=4, cp_mode=mode), MIXED, A100,
                                        SELENE.params, 8)
        assert other["cp_exposed_s"] == other["cp_comm_s"] > 0


def test_interleaving_shrinks_the_bubble():
    assert L.bubble(4, 8, 2) == pytest.approx(3 / 19)
    shape = L.SHAPES["gpt2-small"]
    plain = L.step(shape, L.Layout(pp=4, microbatches=8), MIXED, A100, SELENE.params, 8)
    inter = L.step(shape, L.Layout(pp=4, microbatches=8, virtual=3), MIXED, A100,
                   SELENE.params, 8)
    assert inter["bubble_share"] == pytest.approx(3 / 27)
    assert inter["bubble_s"] < plain["bubble_s"] and inter["pp_comm_s"] == 3 * plain["pp_comm_s"]


def test_search_report_covers_five_axes_and_says_why():
    shape = L.Shape(4, 64, 4, 256, 100, experts=4, top_k=2)
    # every layout that fits (interleaved pipelines among them)
    report = L.search_report(shape, 8, 16, MIXED, A100, SELENE.params, 8, top=10_000)
    rows = report["rows"]
    assert report["tried"] == report["fit"] + report["too_big"] and report["fit"] == len(rows)
    assert {r["virtual"] for r in rows} > {1}
    assert {r["cp"] for r in rows} > {1} and {r["ep"] for r in rows} > {1}
    assert {r["recompute"] for r in rows} == set(L.RECOMPUTE)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    assert "slower_by" not in rows[0] and all(r["slower_by"] for r in rows[1:])
    small = replace(L.GPUS["a100-80gb"], name="small", memory=2e5)
    tight = L.search_report(shape, 8, 16, MIXED, small, SELENE.params, 8, top=50)
    assert tight["too_big"] > 0 and all(r["total_bytes"] <= 2e5 for r in tight["rows"])
    assert tight["smallest_too_big"]["total_bytes"] > 2e5


def test_five_axis_published_rows_are_reported():
    rows = {r["name"]: r for r in P.rows()}
    figures = {"Korthikanti 530B MFU, recompute=selective": 0.542,
               "Korthikanti 530B MFU, recompute=full": 0.421,
               "Llama 3 405B on 8192 H100, cp 1, sequence 8192": 430.0,
               "Llama 3 405B on 16384 H100, cp 1, sequence 8192": 400.0,
               "Llama 3 405B on 16384 H100, cp 16, sequence 131072": 380.0,
               "Mixtral 8x7B parameters": 46.7, "Mixtral 8x7B active parameters per token": 12.9}
    for name, figure in figures.items():
        assert rows[name]["published"] == figure and rows[name]["band"] == 0.15
        assert rows[name]["ok"], (name, rows[name]["ratio"])
    assert rows["Mixtral 8x7B parameters"]["ok"]
    assert rows["Mixtral 8x7B active parameters per token"]["ok"]
    # selective recomputation with sp beats full recomputation, as the paper found (29% faster)
    sel = rows["Korthikanti 530B MFU, recompute=selective"]["predicted"]
    full = rows["Korthikanti 530B MFU, recompute=full"]["predicted"]
    assert 1.15 < sel / full < 1.45


def test_interleaving_depths_the_search_may_take():
    # Llama 3: 126 layers on 16 stages, two chunks holding only the embedding and the output:
    # 128 chunks, so 2, 4 or 8 a stage (v = 8 is the paper's one layer a chunk)
    assert L.virtual_stages(126, 16, 16) == [1, 2, 4, 8]
    # PTD-P's 1T: 128 layers on 64 stages, 2 layers a stage: one chunk or two
    assert L.virtual_stages(128, 64, 512) == [1, 2]
    # 12 layers on 4 stages: 12 chunks (v = 3); 8 or 16 chunks do not hold 12 (or 14) evenly
    assert L.virtual_stages(12, 4, 8) == [1, 3]
    # the micro-batches must fill whole rounds of pp, and AFAB has no interleaved schedule
    assert L.virtual_stages(12, 4, 6) == [1]
    assert L.virtual_stages(12, 4, 8, "afab") == [1]
    assert L.virtual_stages(12, 1, 8) == [1]


def test_search_takes_the_interleaving_depth_with_its_bubble_sends_and_memory():
    shape = L.SHAPES["gpt2-small"]
    report = L.search_report(shape, 8, 64, MIXED, A100, SELENE.params, 8, top=10_000,
                             context=False, sequence_parallel=False, recomputes=("none",),
                             zero_stages=(0,))
    rows = report["rows"]
    interleaved = [r for r in rows if r["virtual"] > 1]
    assert interleaved, "the search tries v > 1"
    for r in interleaved:
        pp, m, v = r["pp"], r["microbatches"], r["virtual"]
        assert v in L.virtual_stages(12, pp, m)
        assert r["bubble_share"] == pytest.approx((pp - 1) / (v * m + pp - 1))
        plain = L.evaluate(shape, replace(_layout(r), virtual=1), MIXED, A100, SELENE.params, 8)
        assert r["bubble_s"] < plain["bubble_s"]
        assert r["pp_comm_s"] == pytest.approx(v * plain["pp_comm_s"])
        # the first stage holds pp + (pp - 1)/v micro-batches' activations, at most all m of
        # them, against 1F1B's pp (Korthikanti et al. 2022, §4.2.3)
        assert r["activation_bytes"] == pytest.approx(
            plain["activation_bytes"] * min(pp + (pp - 1) / v, m) / pp)
    without = L.search_report(shape, 8, 64, MIXED, A100, SELENE.params, 8, top=10_000,
                              context=False, sequence_parallel=False, recomputes=("none",),
                              zero_stages=(0,), interleave=False)
    assert report["tried"] == without["tried"] + len(
        [x for x in L.candidates(shape, 8, 64, 8, zero_stages=(0,), recomputes=("none",),
                                 context=False, sequence_parallel=False) if x.virtual > 1])
    assert all(r["virtual"] == 1 for r in without["rows"])


def _layout(row):
    return L.Layout(row["dp"], row["pp"], row["tp"], row["zero"], row["microbatches"],
                    row["schedule"], row["recompute"], row["zero_group"], row["cp"], row["ep"],
                    row["sp"], row["cp_mode"], row["capacity_factor"], row["virtual"])


def test_frontier_gpus_from_their_data_sheets():
    # dense figures: half the data sheets' "with sparsity" ones; memory and NVLink a GPU
    h200, b200, gb200 = L.GPUS["h200"], L.GPUS["b200"], L.GPUS["gb200"]
    assert (h200.peak_flops, h200.fp8_flops, h200.memory, h200.memory_bandwidth) == (
        989e12, 1979e12, 141 * L.GB, 4.8e12)
    assert (b200.peak_flops, b200.fp8_flops, b200.memory * 8) == (2.25e15, 4.5e15, 1440 * L.GB)
    assert (gb200.peak_flops, gb200.fp8_flops, gb200.nvlink_domain) == (2.5e15, 5e15, 72)
    assert P.NETWORKS[P.GPU_NETWORK["gb200"]].per_node == 72
    assert P.NETWORKS[P.GPU_NETWORK["b200"]].params.beta == pytest.approx(1 / 900e9)
    # tensor parallelism may span the NVL72 domain, not an HGX board
    assert _mpdl("--model-shape", "llama3-405b", "--gpu", "gb200", "--tp", "16",
                 "--pp", "9").returncode == 0
    out = _mpdl("--model-shape", "llama3-405b", "--gpu", "h200", "--tp", "16", "--pp", "9")
    assert out.returncode == 2 and "--tp" in out.stderr


def test_fp8_gemms_at_the_fp8_peak():
    h100 = L.GPUS["h100-80gb"]
    big = dict(microbatch=1, queries=8192, keys=8192, hidden=16384, heads=128, d_kv=2048,
               d_ff=53248, gated=True, family="llama")
    bf16 = C.linear_seconds(C.Layer(**big), h100)
    fp8 = C.linear_seconds(C.Layer(**big, fp8=True), h100)
    # compute-bound, the same η of the FP8 peak: twice as fast
    assert bf16[0] / fp8[0] == pytest.approx(1979 / 989, rel=0.01)
    assert bf16[1] / fp8[1] == pytest.approx(1979 / 989, rel=0.01)
    # the casts: 6 bytes an element of each GEMM's input, weight and output gradient, by hand
    # (QKV 8192 x 16384 by 16384 x 20480, the projection 8192 x 16384 by 16384 x 16384, the
    # MLP's up 8192 x 16384 by 16384 x 106496 and down 8192 x 53248 by 53248 x 16384)
    t = 8192
    gemms = ((16384, 16384 + 2 * 2048), (16384, 16384), (16384, 2 * 53248), (53248, 16384))
    elements = sum(t * k + k * n + t * n for k, n in gemms)
    cast = C.linear_seconds(C.Layer(**big, fp8=True, cast_bytes=6), h100)
    assert cast[0] == fp8[0]
    assert cast[1] - fp8[1] == pytest.approx(6 * elements / 3350e9)
    shape = L.SHAPES["llama3-405b"]
    layout = L.Layout(dp=16, pp=8, tp=8, microbatches=16, recompute="selective", sp=True)
    rows = [L.step(shape, layout, L.PRECISIONS[p], L.GPUS["h200"], SELENE.params, 8)
            for p in ("bf16", "fp8")]
    # the GEMMs get faster, nothing else: the step shrinks by less than 2x
    # (half the GEMM time, plus the casts)
    assert 0.5 < rows[1]["compute_gemm_s"] / rows[0]["compute_gemm_s"] < 0.6
    assert rows[1]["compute_attention_s"] == rows[0]["compute_attention_s"]
    assert 1 < rows[0]["step_s"] / rows[1]["step_s"] < 2
    for gpu, peak in (("h200", "1979 TFLOP/s FP8 peak"), ("b200", "4500 TFLOP/s FP8 peak")):
        out = _mpdl("--model-shape", "llama3-405b", "--gpu", gpu, "--tp", "8", "--pp", "8",
                    "--dp", "16", "--precision", "fp8")
        assert out.returncode == 0 and "fp8 GEMMs" in out.stdout, out.stderr
        # the header names the peak the GEMMs run at
        assert peak in out.stdout.splitlines()[0]


def test_fp8_zero3_gathers_one_byte_a_parameter():
    from mpdl.tuning import costmodel as cm
    shape, h100, fp8 = L.SHAPES["gpt2-small"], L.GPUS["h100-80gb"], L.PRECISIONS["fp8"]
    n = L.params_per_gpu(shape, L.Layout())

    def ring(nbytes):  # one ring all-reduce over 16 ranks on 2 nodes
        return cm.predict("allreduce", "ring", int(round(nbytes)), 16, 2, SELENE.params, "float16")

    rows = {(p, z): L.step(shape, L.Layout(dp=16, zero=z, microbatches=2), L.PRECISIONS[p],
                           h100, SELENE.params, 8) for p in ("bf16", "fp8") for z in (1, 3)}
    # stage 3: the gradients' reduce-scatter in bf16, the two all-gathers of the parameters
    # (before the forward, again for the backward) in FP8: half a ring all-reduce each
    assert rows["bf16", 3]["dp_comm_s"] == pytest.approx(1.5 * ring(2 * n))
    assert rows["fp8", 3]["dp_comm_s"] == pytest.approx(0.5 * ring(2 * n) + ring(n))
    # stages 1 and 2 gather the bf16 parameters the optimizer updated, with or without FP8 GEMMs
    assert rows["fp8", 1]["dp_comm_s"] == rows["bf16", 1]["dp_comm_s"] == pytest.approx(ring(2 * n))
    # and a gathered layer is held in FP8 beside its bf16 gradient
    unit = shape.layer_params
    assert L.zero_working_bytes(unit, fp8, 3) == 3 * unit
    assert L.zero_working_bytes(unit, fp8, 1) == L.zero_working_bytes(unit, MIXED, 1) == 0
    assert L.zero_working_bytes(unit, MIXED, 3) == 4 * unit


def test_dualpipe_bubble_rows():
    rows = {r["name"]: r for r in P.rows(search=False)}
    # (PP/2 − 1)(F&B + B − 3W) at F = W = 1, B = 2, F&B = 3, by hand: 3·2 and 7·2
    for name, figure in (("DualPipeV bubble, 8 stages on 4 ranks, m=10", 6.0),
                         ("DualPipeV bubble, 16 stages on 8 ranks, m=20", 14.0)):
        assert rows[name]["published"] == figure
        assert rows[name]["predicted"] == figure and rows[name]["ok"]


def test_deepseek_v3_parameters_by_hand():
    shape = L.SHAPES["deepseek-v3"]
    d, mla = 7168, 187_107_328  # MLA: 7168·1536 + 1536 + 1536·24576 + 7168·576 + 512 + 512·32768 + 16384·7168
    assert L.MLA_PARAMS == mla
    expert, norms, router = 3 * d * 2048, 2 * d, d * 256
    dense_block = mla + norms + 3 * d * 18432
    moe_block = mla + norms + (256 + 1) * expert + router
    embeddings = 2 * 129280 * d + d
    assert shape.moe_layers == 58
    assert shape.params == 3 * dense_block + 58 * moe_block + embeddings
    assert shape.active_params == 3 * dense_block + 58 * (moe_block - 248 * expert) + embeddings
    # the attention core at MLA's head widths: 128 heads of (192 + 128)/2
    assert shape.flops_per_token == 6 * shape.active_params + 12 * 61 * 128 * 160 * 4096


def test_dualpipe_hides_the_all_to_all_behind_the_other_chunk():
    shape, net = L.SHAPES["deepseek-v3"], P.NETWORKS["h800-cluster"]
    fp8, h800 = L.PRECISIONS["fp8"], L.GPUS["h800"]
    dual = L.step(shape, P.DEEPSEEK_V3, fp8, h800, net.params, 8)
    apart = L.step(shape, replace(P.DEEPSEEK_V3, schedule="zb-v"), fp8, h800, net.params, 8)
    m = P.DEEPSEEK_V3.microbatches
    slot = max(dual["compute_s"], dual["ep_comm_s"] + dual["pp_comm_s"]) / m
    assert dual["step_s"] == pytest.approx(m * slot / (1 - dual["bubble_share"])
                                           + dual["dp_exposed_s"])
    assert apart["step_s"] > dual["step_s"]
    # the bubble of the overlapped pairs: 2(p − 1) units of 6m + 2(p − 1)
    assert dual["bubble_share"] == pytest.approx(30 / (6 * m + 30))
    rows = {r["name"]: r for r in P.rows(search=False)}
    for name, figure in (("DeepSeek-V3 parameters", 671.0),
                         ("DeepSeek-V3 active parameters per token", 37.0),
                         ("DeepSeek-V3 pre-training on 2048 H800", 2.664)):
        assert rows[name]["published"] == figure and rows[name]["ok"], rows[name]["ratio"]


def test_megatron_core_weak_scaling_rows():
    # Megatron-LM README, model table: per-GPU teraFLOP/s of the runs past the 1.7B (η's own)
    figures = {"7.1B on 96": 465.9, "16B on 192": 489.1, "32B on 384": 459.6,
               "70B on 768": 419.7, "119B on 1536": 420.5, "177B on 2304": 432.8,
               "314B on 3072": 474.4, "462B on 6144": 459.9}
    rows = {r["name"]: r for r in P.rows(search=False)}
    for run, figure in figures.items():
        row = rows[f"Megatron-Core {run} H100"]
        assert row["published"] == figure and row["band"] == 0.15
        assert row["ok"] and row["fits"], (run, row["ratio"])
    assert rows["Megatron-Core 462B on 6144 H100"]["layout"] == (
        "dp48 pp16 tp8 sp zero1 m64 1f1b tp-overlap gather-overlap recompute=selective")
    assert not any(name.startswith("Megatron-Core 1.7B") for name in rows)


def test_tp_overlap_hides_collectives_behind_their_gemms():
    shape = L.SHAPES["gpt3-175b"]
    plain = L.Layout(dp=2, tp=8, sp=True, recompute="selective")
    off = L.step(shape, plain, MIXED, L.GPUS["h100-80gb"], SELENE.params, 8)
    on = L.step(shape, replace(plain, tp_overlap=True), MIXED, L.GPUS["h100-80gb"],
                SELENE.params, 8)
    assert off["tp_exposed_s"] == off["tp_comm_s"] > 0
    # each GEMM is longer than the collective beside it: nothing is left exposed
    assert on["tp_comm_s"] == off["tp_comm_s"] and on["tp_exposed_s"] == 0
    assert on["step_s"] == pytest.approx(off["step_s"] - off["tp_comm_s"])
    # on a slow link the collectives outlast the GEMMs: only the excess is exposed
    slow = replace(SELENE.params, beta=SELENE.params.beta * 1000)
    late = L.step(shape, replace(plain, tp_overlap=True), MIXED, L.GPUS["h100-80gb"], slow, 8)
    assert late["tp_exposed_s"] == pytest.approx(late["tp_comm_s"] - late["compute_gemm_s"])


def test_gather_overlap_hides_zero_all_gather_behind_the_forward():
    shape = L.SHAPES["gpt2-small"]
    base = L.Layout(dp=64, zero=1)
    off = L.step(shape, base, MIXED, L.GPUS["a100-80gb"], SELENE.params, 8)
    on = L.step(shape, replace(base, gather_overlap=True), MIXED, L.GPUS["a100-80gb"],
                SELENE.params, 8)
    assert on["step_s"] < off["step_s"]
    # at most one forward (a third of the micro-batch's compute) is won
    assert off["step_s"] - on["step_s"] <= off["compute_s"] / 3 + 1e-12
    # without ZeRO there is no all-gather to hide
    ddp = L.Layout(dp=64)
    assert L.step(shape, replace(ddp, gather_overlap=True), MIXED, L.GPUS["a100-80gb"],
                  SELENE.params, 8)["step_s"] == L.step(shape, ddp, MIXED, L.GPUS["a100-80gb"],
                                                         SELENE.params, 8)["step_s"]


def test_torchtitan_rows():
    rows = {r["name"]: r for r in P.rows(search=False)}
    # docs/performance.md (4d88a8a): WPS of Llama 3 8B and 70B with FSDP on 64 A100
    for name, figure in (("TorchTitan llama3-8b on 64 A100", 2973.0),
                         ("TorchTitan llama3-70b on 64 A100", 331.0)):
        assert rows[name]["published"] == figure and rows[name]["ok"] and rows[name]["fits"]
    # issue #773: 33.88% against 26.52% MFU; the interleaved schedule's smaller bubble is the gain
    gain = rows["TorchTitan 405B on 512 H100: interleaved over 1F1B"]
    assert gain["published"] == pytest.approx(33.88 / 26.52) and gain["ok"]
    assert gain["predicted"] > 1.15
    # Llama 3's Table 3 shapes: 8.0B and 70.6B parameters
    assert L.SHAPES["llama3-8b"].params / 1e9 == pytest.approx(8.03, abs=0.01)
    assert L.SHAPES["llama3-70b"].params / 1e9 == pytest.approx(70.55, abs=0.01)


def test_fp8_and_mxfp8_rows():
    rows = {r["name"]: r for r in P.rows(search=False)}
    for name, figure in (("torchao Llama3-8B on 8 h100-80gb: fp8 over bf16", 7689.5 / 6150),
                         ("torchao Llama3-8B on 8 b200: fp8 over bf16", 10417 / 8307.5),
                         ("torchao Llama3-8B on 8 b200: mxfp8 over bf16", 9969 / 8307.5)):
        assert rows[name]["published"] == pytest.approx(figure) and rows[name]["ok"], name
    # MXFP8 casts cost a little more than tensorwise scaling (scales a block of 32)
    assert L.PRECISIONS["mxfp8"].cast_bytes == pytest.approx(6 + 1 / 16)
    assert L.GPUS["b200"].gemm_efficiency == L.GPUS["gb200"].gemm_efficiency == 0.82
    assert L.GPUS["h800"].gemm_efficiency == L.GPUS["h100-80gb"].gemm_efficiency


def test_cli_keeps_every_field_of_a_named_shape():
    out = _mpdl("--model-shape", "deepseek-v3", "--gpu", "h800", "--pp", "16", "--dp", "128",
                "--ep", "64", "--zero", "1", "--schedule", "dualpipev", "--microbatches", "120",
                "--moe-capacity-factor", "0", "--precision", "fp8")
    assert out.returncode == 0, out.stderr
    assert "671.026B parameters" in out.stdout and "(37.552B active)" in out.stdout


def test_search_takes_the_overlaps():
    shape, h100 = L.SHAPES["gpt3-175b"], L.GPUS["h100-80gb"]
    plain = L.search(shape, 64, 64, MIXED, h100, SELENE.params, 8, top=1)[0]
    hidden = L.search(shape, 64, 64, MIXED, h100, SELENE.params, 8, top=1, tp_overlap=True,
                      gather_overlap=True)[0]
    assert hidden["tp_overlap"] and hidden["gather_overlap"]
    assert hidden["step_s"] < plain["step_s"]
    out = _mpdl("--model-shape", "gpt3-175b", "--gpu", "h100-80gb", "--gpus", "64",
                "--search", "--top", "1", "--tp-overlap")
    assert out.returncode == 0 and "tp-overlap" in out.stdout, out.stderr


def test_node_limited_dispatch_by_hand():
    # 16 experts on ep = 16 ranks, 4 a node (4 nodes); top-4, at most 2 nodes a token; the
    # dispatch in 1 byte, the combine in 2
    shape = L.Shape(2, 64, 4, 32, 100, experts=16, top_k=4, max_nodes_per_token=2)
    precision = replace(MIXED, dispatch=1, combine=2)
    params = P.NETWORKS["h800-cluster"].params
    a_ib, b_ib = params.link(True)
    a_nv, b_nv = params.link(False)
    elements = 32 * 64  # one copy of the micro-batch's tokens
    pair = 0.0
    for nbytes in (1, 2):
        # once to each of 2 of the 4 nodes (a quarter stays home), then 4 copies over NVLink
        # to the node's 4 GPUs (a quarter stays on the GPU that received them)
        scale_out = 3 * a_ib + 2 * elements * nbytes * 3 / 4 * b_ib
        nvlink = 3 * a_nv + 4 * elements * nbytes * 3 / 4 * b_nv
        pair += max(scale_out, nvlink)
    layout = L.Layout(dp=16, ep=16)
    # 2 MoE blocks, a dispatch and a combine in forward and in backward
    assert L.expert_time(shape, layout, precision, params, 4) == pytest.approx(2 * 2 * pair)
    # without the limit every copy crosses the scale-out network: 4 copies over 15 ranks
    free = replace(shape, max_nodes_per_token=0)
    plain = sum(15 * a_ib + 4 * elements * nbytes * 15 / 16 * b_ib for nbytes in (1, 2))
    assert L.expert_time(free, layout, precision, params, 4) == pytest.approx(2 * 2 * plain)
    # within one node the limit changes nothing
    assert L.expert_time(shape, L.Layout(dp=4, ep=4), precision, params, 4) == \
        pytest.approx(L.expert_time(free, L.Layout(dp=4, ep=4), precision, params, 4))
    # tp·cp = 8 fills two nodes of 4: the 2 expert ranks lie on 2 nodes, one each, so a
    # token's copies cross once to the other node (half stay home) and none go on over NVLink
    wide = L.Layout(dp=2, ep=2, tp=2, cp=4)
    tokens = 32 / 4 * 64 / 2  # a GPU's share of one copy: s/cp tokens, d/t wide
    spread = sum(a_ib + 2 * tokens * nbytes / 2 * b_ib for nbytes in (1, 2))
    assert L.expert_time(shape, wide, precision, params, 4) == pytest.approx(2 * 2 * spread)


def test_sms_kept_for_communication_slow_compute_in_proportion():
    shape, h800 = L.SHAPES["llama3-8b"], L.GPUS["h800"]
    plain = L.compute_parts(shape, L.Layout(), MIXED, h800)
    kept = L.compute_parts(shape, L.Layout(comm_sms=20), MIXED, h800)
    # 112 SMs at the same rate each: the 4096-token GEMMs fill whole waves either way only to
    # within one wave, the outside FLOPs exactly
    assert kept["outside_s"] == pytest.approx(plain["outside_s"] * 132 / 112)
    assert kept["gemm_s"] == pytest.approx(plain["gemm_s"] * 132 / 112, rel=0.05)
    assert kept["elementwise_s"] == plain["elementwise_s"]
    with pytest.raises(ValueError, match="--comm-sms"):
        L.compute_parts(shape, L.Layout(comm_sms=132), MIXED, h800)
    out = _mpdl("--model-shape", "llama3-8b", "--gpu", "h800", "--comm-sms", "200")
    assert out.returncode != 0 and "--comm-sms" in out.stderr and "Traceback" not in out.stderr


def test_list_names_every_choice_of_the_flags():
    out = _mpdl("--list")
    assert out.returncode == 0, out.stderr
    names = {line.split()[1] for line in out.stdout.splitlines()}
    for choices in (P.NETWORKS, L.GPUS, L.SHAPES, L.PRECISIONS):
        assert set(choices) <= names
    assert {"hgx-h200", "gb200-nvl72", "h800-cluster", "deepseek-v3", "h800"} <= names


def test_deepseek_v3_fits_and_is_bound_by_compute():
    shape, net = L.SHAPES["deepseek-v3"], P.NETWORKS["h800-cluster"]
    row = L.evaluate(shape, P.DEEPSEEK_V3, L.PRECISIONS["deepseek-fp8"], L.GPUS["h800"],
                     net.params, net.per_node)
    assert row["fits"], row["total_bytes"] / 1e9
    # DualPipe's slot is the longer of compute and the all-to-all plus sends: here compute
    assert row["compute_s"] > row["ep_comm_s"] + row["pp_comm_s"]
    # FP8 dispatch and bf16 combine to at most 4 of 8 nodes: 4 copies a token at 1 + 2 bytes
    # where 8 went at 2 + 2
    bf16 = L.expert_time(replace(shape, max_nodes_per_token=0), P.DEEPSEEK_V3,
                         L.PRECISIONS["bf16"], net.params, 8)
    ours = L.expert_time(shape, P.DEEPSEEK_V3, L.PRECISIONS["deepseek-fp8"], net.params, 8)
    assert ours < bf16 * (4 * 1 + 4 * 2) / (2 * 8 * 2)
    out = _mpdl("--model-shape", "deepseek-v3", "--gpu", "h800", "--pp", "16", "--dp", "128",
                "--ep", "64", "--zero", "1", "--schedule", "dualpipev", "--microbatches", "120",
                "--moe-capacity-factor", "0", "--precision", "deepseek-fp8", "--recompute",
                "selective", "--recompute-up", "--comm-sms", "20")
    assert out.returncode == 0, out.stderr
    assert f"{P.DEEPSEEK_V3.label()} " in out.stdout and f"{row['step_s']:.3f}" in out.stdout


#: the new flags' bad values and combinations: (arguments, the one line of the error)
REFUSED = {
    # a search drops the layouts check_layout refuses: --comm-sms is checked before it
    "comm-sms below 0": (("--model-shape", "llama3-8b", "--gpu", "h800", "--gpus", "8",
                          "--search", "--comm-sms", "-1"),
                         "--comm-sms: expected 0 to 131 of h800's 132 SMs, got -1"),
    "comm-sms every SM": (("--model-shape", "llama3-8b", "--gpu", "h800", "--gpus", "8",
                           "--search", "--comm-sms", "132"),
                          "--comm-sms: expected 0 to 131 of h800's 132 SMs, got 132"),
    "fp8 recipe on a100": (("--model-shape", "llama3-8b", "--gpu", "a100-80gb", "--precision",
                            "deepseek-fp8"),
                           "--precision: deepseek-fp8 needs a GPU with FP8 tensor cores "
                           "(h100-80gb, h800, h200, b200, gb200), got a100-80gb"),
    "mxfp8 on hopper": (("--model-shape", "llama3-8b", "--gpu", "h100-80gb", "--precision",
                         "mxfp8"),
                        "--precision: mxfp8 needs a GPU with MXFP8 tensor cores (b200, gb200), "
                        "got h100-80gb"),
    "layers under first_dense": (("--model-shape", "deepseek-v3", "--gpu", "h800", "--layers",
                                  "3"),
                                 "--layers: expected more than the 3 dense blocks the shape "
                                 "starts with, got 3"),
    "tp-overlap without sp": (("--model-shape", "gpt3-175b", "--gpu", "h100-80gb", "--tp", "8",
                               "--dp", "2", "--tp-overlap"),
                              "--tp-overlap: it pipelines sequence parallelism's all-gathers and "
                              "reduce-scatters with their GEMMs (Megatron-Core requires --sp); "
                              "add --sp"),
    "gather-overlap without zero": (("--model-shape", "gpt2-small", "--dp", "8",
                                     "--gather-overlap"),
                                    "--gather-overlap: it hides ZeRO's parameter all-gather; add "
                                    "--zero 1, 2 or 3"),
    "recompute-up under full": (("--model-shape", "gpt2-small", "--recompute", "full",
                                 "--recompute-up"),
                                "--recompute-up: --recompute full recomputes the whole forward "
                                "already"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_cli_refuses_in_one_line(case):
    args, line = REFUSED[case]
    out = _mpdl(*args)
    assert out.returncode == 2, out.stdout
    assert out.stderr.strip().splitlines() == [f"mpdl simulate: error: {line}"]


def test_new_shape_fields_and_tp_overlap_checked_alone():
    for field in ("first_dense", "shared_experts", "mtp_depth", "max_nodes_per_token"):
        with pytest.raises(ValueError, match=f"^{field}: expected >= 0, got -1$"):
            L.Shape(4, 64, 4, 32, 100, **{field: -1})
    # with one tensor-parallel rank there is nothing to overlap, and nothing to refuse
    L.check_layout(L.SHAPES["gpt3-175b"], L.Layout(tp_overlap=True), 8)


def test_the_model_itself_refuses_gemms_the_gpu_cannot_run():
    shape, layout = L.SHAPES["llama3-8b"], L.Layout(dp=8)
    for word, gpu in (("mxfp8", "h800"), ("fp8", "a100-80gb")):
        with pytest.raises(ValueError, match=f"--precision: {word} needs"):
            L.compute_parts(shape, layout, L.PRECISIONS[word], L.GPUS[gpu])
    assert L.compute_parts(shape, layout, L.PRECISIONS["mxfp8"], L.GPUS["b200"])["gemm_s"] > 0

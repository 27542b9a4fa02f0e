"""The shape-dependent compute of `mpdl simulate`: tile and wave quantisation, the roofline, the
bytes between GEMMs, a layer's GEMMs with recomputation and experts (hand-computed), and the
per-GPU efficiency derived from runs that are not checked rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mpdl.perf import compute as C
from mpdl.perf import layouts as L
from mpdl.perf import published as P

BF16 = L.PRECISIONS["bf16"]
#: 4 SMs, 1 TFLOP/s peak, half of it sustained by full tiles, 1 GB/s
SMALL = L.Gpu("small", 1e12, 1e9, 1e9, 4, 0.5)
#: one SM, memory fast enough never to bind: a GEMM of whole tiles takes FLOPs / (eta * peak)
EXACT = L.Gpu("exact", 1e12, 1e9, 1e30, 1, 0.5)


def test_tile_and_wave_quantisation_by_hand():
    # 512 x 256 output: 2 x 2 tiles of 256 x 128 (or 4 x 1 of 128 x 256): one wave on 4 SMs,
    # each SM a tile's 2 * 256 * 128 * k FLOPs at 0.5e12 / 4 FLOP/s
    one_wave = 2 * 256 * 128 * 64 / (0.5e12 / 4)
    fast = replace(SMALL, memory_bandwidth=1e30)
    assert C.gemm_seconds(512, 256, 64, fast) == pytest.approx(one_wave)
    # one more row: 3 x 2 = 6 or 5 x 1 = 5 tiles, the fewer taken: 5 tiles on 4 SMs, 2 waves
    assert C.gemm_seconds(513, 256, 64, fast) == pytest.approx(2 * one_wave)
    # a single row still costs a whole tile
    assert C.gemm_seconds(1, 1, 64, fast) == pytest.approx(one_wave)
    assert C.gemm_seconds(0, 256, 64, fast) == 0.0
    # batched: 3 x 4 tiles = 12 tiles, 3 waves
    assert C.gemm_seconds(512, 256, 64, fast, batch=3) == pytest.approx(3 * one_wave)


def test_roofline_by_hand():
    # 256^3 at 2 bytes: A, B and C are 3 * 65,536 elements, 393,216 bytes at 1 GB/s, longer than
    # the math (2 tiles, one wave: 2 * 256 * 128 * 256 / 1.25e11 = 134 us)
    assert C.gemm_seconds(256, 256, 256, SMALL) == pytest.approx(393216 / 1e9)
    # the result kept on chip (FlashAttention's scores): only A and B move
    assert C.gemm_seconds(256, 256, 256, SMALL, write_result=False) == pytest.approx(262144 / 1e9)
    # float32 operands: twice the bytes
    assert C.gemm_seconds(256, 256, 256, SMALL, nbytes=4) == pytest.approx(786432 / 1e9)


def test_bytes_between_gemms_by_hand():
    # gpt: h 64, a 4, T 16, f 256, t 2, 16 tokens, 2 bytes an activation, masks 1 byte
    shape = L.Shape(1, 64, 4, 16, 100)
    replicated = 4 * 64 * 2 + 2 * (3 * 64 * 2 + 64)  # LayerNorms, bias-dropout-adds: 1408
    core = 2 * 4 * 16 * 2 / 2 + 4 * 16 * 5 / 2  # softmax, attention dropout: 288
    split = core + 2 * 256 * 2 / 2  # bias-GeLU: 800
    got = C.elementwise_bytes(L.layer_work(shape, L.Layout(tp=2), BF16))
    assert got == (pytest.approx(16 * (replicated + split)), pytest.approx(16 * core))
    sp = C.elementwise_bytes(L.layer_work(shape, L.Layout(tp=2, sp=True), BF16))
    assert sp[0] == pytest.approx(16 * (replicated / 2 + split))
    # llama: RMSNorms 4h·B, residual adds 6h·B; SwiGLU 3f·B/t, rotary 2·(d + d_kv)·B/t
    llama = L.Shape(1, 64, 4, 16, 100, ffn=128, kv_heads=2, gated=True, family="llama")
    expected = 4 * 64 * 2 + 6 * 64 * 2 + 3 * 128 * 2 / 2 + 2 * (64 + 32) * 2 / 2
    assert C.elementwise_bytes(L.layer_work(llama, L.Layout(tp=2), BF16)) == (pytest.approx(16 * expected), 0)


def test_a_layer_of_whole_tiles_takes_its_flops_at_eta_peak():
    # h 256, 2 heads of 128, T 256, f 1024, one sequence: every GEMM dimension a multiple of the
    # tile, one SM, so each GEMM takes its FLOPs / (0.5 * 1e12)
    shape = L.Shape(1, 256, 2, 256, 100)
    linear = 2 * 256 * (256 * 768 + 256 * 256 + 256 * 1024 + 1024 * 256)  # 402,653,184
    core = 2 * 2 * 256 * 256 * 128 * 2  # QK^T and the weighted sum of V, 2 heads: 67,108,864
    rate = 0.5e12
    cases = {"none": 3 * (linear + core), "full": 4 * (linear + core),
             "selective": 3 * linear + 4 * core}
    for mode, flops in cases.items():
        got = C.layer_seconds(L.layer_work(shape, L.Layout(recompute=mode), BF16), EXACT)
        assert got["gemm_s"] + got["attention_s"] == pytest.approx(flops / rate), mode
        assert got["elementwise_s"] == pytest.approx(0.0, abs=1e-20)
    # and the bytes between GEMMs: forward, twice more in backward, once more under full
    # recomputation, the attention core's once more under selective
    slow = replace(EXACT, memory_bandwidth=1e9)
    fwd, core_bytes = C.elementwise_bytes(L.layer_work(shape, L.Layout(), BF16))
    for mode, moved in (("none", 3 * fwd), ("full", 4 * fwd), ("selective", 3 * fwd + core_bytes)):
        got = C.layer_seconds(L.layer_work(shape, L.Layout(recompute=mode), BF16), slow)
        assert got["elementwise_s"] == pytest.approx(moved / 1e9), mode


def test_experts_gemms_by_hand():
    # 4 experts, top-2, cf 1, ep 2: each expert receives 256 * 2 * 2 / 4 = 256 tokens and a GPU
    # holds 2 experts: its MLP GEMMs are twice a dense block's; the router's (d, E) beside them
    dense = L.Shape(1, 256, 2, 256, 100)
    moe = replace(dense, experts=4, top_k=2)
    mlp = 2 * 256 * (256 * 1024 + 1024 * 256)
    attention = 2 * 256 * (256 * 768 + 256 * 256)
    # the router's 4 columns fill one 256 x 128 tile (k = 256); backward: its input's gradient
    # two tiles of k = 4, its weight's one of k = 256
    tile = 2 * 256 * 128
    router, router_bwd = tile * 256, 2 * tile * 4 + tile * 256
    fwd, bwd = C.linear_seconds(L.layer_work(moe, L.Layout(dp=2, ep=2), BF16, moe=True), EXACT)
    assert fwd == pytest.approx((attention + 2 * mlp + router) / 0.5e12)
    assert bwd == pytest.approx((2 * (attention + 2 * mlp) + router_bwd) / 0.5e12)
    # 2 shared experts beside them: every one of the 256 tokens through an MLP twice as wide
    # (256 x 2048 up, 2048 x 256 down), with tp 2 half of it on this GPU
    shared = C.linear_seconds(L.layer_work(replace(moe, shared_experts=2),
                                           L.Layout(dp=2, ep=2), BF16, moe=True), EXACT)
    assert shared[0] - fwd == pytest.approx(2 * 256 * (256 * 2048 + 2048 * 256) / 0.5e12)
    halved = C.linear_seconds(L.layer_work(replace(moe, shared_experts=2),
                                           L.Layout(tp=2), BF16, moe=True), EXACT)
    plain = C.linear_seconds(L.layer_work(moe, L.Layout(tp=2), BF16, moe=True), EXACT)
    assert halved[0] - plain[0] == pytest.approx(256 * (256 * 2048 + 2048 * 256) / 0.5e12)


def test_step_compute_is_the_sum_of_its_parts():
    shape = L.SHAPES["gpt2-small"]
    layout = L.Layout(pp=4, microbatches=8, recompute="selective")
    row = L.step(shape, layout, BF16, L.GPUS["a100-80gb"], P.NETWORKS["selene"].params, 8)
    parts = sum(row[f"compute_{k}_s"] for k in ("gemm", "attention", "elementwise", "outside"))
    assert row["compute_s"] == pytest.approx(parts)
    # the logits and embeddings: 6 * (V + 2) * d FLOPs a token, 8 x 1024 tokens a micro-batch,
    # 8 micro-batches, a quarter of it on this stage (3 of 12 layers)
    outside = 6 * (50257 + 2) * 768 * 1024 * 8 * 8 * (3 / 12) / (0.7471 * 312e12)
    assert row["compute_outside_s"] == pytest.approx(outside, rel=1e-3)


#: Megatron-LM's README, H100 model table, the 1.7B GPT: 408.8 TFLOP/s a GPU in Megatron's count
#: (72·l·h²·(1 + s/(6h)) + 6·V·h = 11,274,289,152 FLOPs a token at l 24, h 2048, s 4096, V 131,072)
H100_TOKENS_PER_GPU = 408.8e12 / 11_274_289_152


@pytest.mark.parametrize("gpu,run", [("a100-80gb", "a100"), ("v100-32gb", "v100"),
                                     ("h100-80gb", "h100")])
def test_eta_is_derived_from_a_run_outside_the_checked_rows(gpu, run):
    assert P.calibrate_efficiency(L.GPUS[gpu], run) == pytest.approx(L.GPUS[gpu].gemm_efficiency,
                                                                    abs=5e-4)
    shape, layout, net, figure, _ = P.CALIBRATION[run]
    row = L.step(shape, layout, L.PRECISIONS["fp16"], L.GPUS[gpu], P.NETWORKS[net].params,
                 P.NETWORKS[net].per_node)
    if run == "h100":
        assert row["tokens_per_s"] / layout.gpus == pytest.approx(H100_TOKENS_PER_GPU, rel=2e-3)
    else:
        # the stated FLOP/s a GPU: 137 TFLOP/s (PTD-P 1.7B), 39 TFLOP/s (Megatron-LM 1.2B)
        assert row["hardware_flops_per_s"] / layout.gpus == pytest.approx(
            {"a100": 137e12, "v100": 39e12}[run], rel=2e-3)
    checked = {r["name"] for r in P.rows(search=False)}
    assert not any(shape.name in name for name in checked)


def test_interleaved_chunks_may_hold_only_the_embedding_or_the_output():
    # Llama 3: 126 layers in 16 stages x 8 chunks, the first holding only the embedding and the
    # last only the output layer
    shape = L.SHAPES["llama3-405b"]
    L.check_layout(shape, L.Layout(pp=16, virtual=8, microbatches=16), 8)
    with pytest.raises(ValueError, match="--pp"):
        L.check_layout(shape, L.Layout(pp=16, virtual=9, microbatches=16), 8)
    assert L.max_stage_layers(shape, L.Layout(pp=16, virtual=8)) == 8


def test_attention_gemms_of_its_own_and_their_up_projections_recomputed():
    # a latent attention: the hidden state down to 256, up to 512, out of 256 wide heads; every
    # GEMM a whole number of 256 x 128 tiles on one SM
    shape = L.Shape(1, 256, 2, 256, 100, attention_gemms=((256, 256, "in"), (256, 512, "up"),
                                                          (256, 256, "out")))
    fwd, bwd = C.linear_seconds(L.layer_work(shape, L.Layout(), BF16), EXACT)
    attention = 2 * 256 * (256 * 256 + 256 * 512 + 256 * 256)
    mlp = 2 * 256 * (256 * 1024 + 1024 * 256)
    assert fwd == pytest.approx((attention + mlp) / 0.5e12)
    # the up-projection's forward again, and the two norms' 4·d·2 bytes a token
    plain = C.layer_seconds(L.layer_work(shape, L.Layout(), BF16), EXACT)
    up = C.layer_seconds(L.layer_work(shape, L.Layout(recompute_up=True), BF16), EXACT)
    assert up["gemm_s"] - plain["gemm_s"] == pytest.approx(2 * 256 * 256 * 512 / 0.5e12)
    slow = replace(EXACT, memory_bandwidth=1e9)
    plain = C.layer_seconds(L.layer_work(shape, L.Layout(), BF16), slow)
    up = C.layer_seconds(L.layer_work(shape, L.Layout(recompute_up=True), BF16), slow)
    assert up["elementwise_s"] - plain["elementwise_s"] == pytest.approx(256 * 4 * 256 * 2 / 1e9)


def test_latent_activations_with_recomputation_and_fp8_caching_by_hand():
    shape = L.Shape(1, 256, 2, 256, 100, attention_gemms=((256, 256, "in"), (256, 512, "up"),
                                                          (256, 256, "out")))
    sbd = 256 * 256
    # bf16: QKV input 2, masks 2, norm inputs 4, MLP input 2; the latent 2·256/d, Q K V
    # 2·512/d, the projection's input 2·256/d; the SwiGLU-less MLP's hidden 4·1024/d
    plain = L.activation_bytes_per_layer(shape, L.Layout(recompute="selective"), BF16)
    assert plain == pytest.approx(sbd * (2 + 2 + 4 + 2 + 2 + 4 + 2 + 16))
    # the norms and the up-projection recomputed: no QKV input, no Q K V; the projection's
    # input in one byte (DeepSeek's caching)
    deepseek = L.activation_bytes_per_layer(
        shape, L.Layout(recompute="selective", recompute_up=True), L.PRECISIONS["deepseek-fp8"])
    assert deepseek == pytest.approx(sbd * (2 + 4 + 2 + 2 + 1 + 16))

"""A GPU's time for a transformer layer's compute, from the shapes of the layer's GEMMs and the
bytes of the work between them.

A GEMM of an m × k by a k × n matrix (times `batch`) is cut into output tiles of 256 × 128 (the
largest tensor-core tile of cuBLAS for 16-bit inputs; NVIDIA, *Matrix Multiplication Background
User's Guide*, §2.3). A GPU computes `sms` tiles at once, one wave; a GEMM takes ceil(tiles/sms)
waves, each as long as one tile's 2·256·128·k FLOPs at an SM's share of η·peak (tile and wave
quantisation, §3 of the guide), and no less than its operands and result over the memory
bandwidth (the roofline, §2 of the guide):

    gemm(m, n, k)   max(ceil(tiles/sms) · 2·256·128·k / (η·peak/sms),
                        (m·k + k·n + m·n) · bytes / bandwidth)

η, the share of peak a full wave of full tiles sustains, is the one input that is not data-sheet
data; `mpdl.perf.published.calibrate_efficiency` derives it from a published run that is not one
of the rows the model is checked against.

Per layer and micro-batch on one GPU, with s = T/cp the tokens it holds, t tensor-parallel ranks:

    linear GEMMs    m = b·s tokens: QKV (k = d, n = (d + 2·d_kv)/t), the projection (d/t, d) (or
                    the attention's own GEMMs, MLA's down- and up-projections, n/t each), the
                    MLP's up (d, f/t; 2f/t gated) and down (f/t, d) matrices; in a MoE block the
                    MLP's per expert, m = the tokens an expert receives (b·s·k·cf·ep/E), E/ep
                    experts, and the router (d, E), in 16 bits under FP8; the SMs kept for
                    communication (`with_reserved_sms`) do none of it
    attention core  per head (b·a/t of them), s queries against T keys: QKᵀ (m = s, n = T,
                    k = d/a) and the weighted sum of V (m = s, n = d/a, k = T); the gpt family
                    writes the scores to memory (the roofline's m·n), the llama family
                    (FlashAttention) keeps them on chip
    backward        two GEMMs per forward GEMM: the input's gradient (m × n by n × k) and the
                    weight's (k × m by m × n)
    elementwise     bytes moved by the work between the GEMMs over the memory bandwidth, forward
                    (backward: twice the forward's, as for FLOPs), per token, B bytes an
                    activation, masks 1 byte:
                    gpt (Megatron's fused kernels): two LayerNorms 4·h·B, two bias-dropout-adds
                    2·(3·h·B + h), scale-mask-softmax 2·a·T·B/t, attention dropout
                    a·T·(2·B + 1)/t, bias-GeLU 2·f·B/t;
                    llama: two RMSNorms 4·h·B, two residual adds 6·h·B, SwiGLU 3·f·B/t, rotary
                    embedding of Q and K 2·(d + d_kv)·B/t;
                    the norms and residual terms divided by t with sequence parallelism; a MoE
                    block's MLP terms times k·cf, and its dispatch and combine copies
                    4·k·cf·h·B/t
    recomputation   full: the forward again (GEMMs and elementwise); selective: the attention
                    core's forward again (with its softmax and dropout); besides either but
                    full, the up-projections and the two norms again (`recompute_up`), and a
                    MoE block's SwiGLU again from its cached input (DeepSeek-V3, §3.2.3, §3.3.2)

Pure functions of a `Layer` (what one layer asks of one GPU; `mpdl.perf.layouts.layer_work`
builds it from a shape and a layout) and a `Gpu`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

#: cuBLAS's largest tensor-core output tile for 16-bit inputs (NVIDIA's GEMM guide, §2.3)
TILE = (256, 128)


@dataclass(frozen=True)
class Gpu:
    """A GPU: peak 16-bit tensor-core FLOP/s, memory, memory bandwidth, streaming
    multiprocessors, η, the share of peak a full wave of full GEMM tiles sustains, its dense FP8
    peak and its NVLink domain."""

    name: str
    peak_flops: float
    memory: float
    memory_bandwidth: float
    sms: int
    gemm_efficiency: float
    source: str = ""
    #: dense FP8 tensor-core FLOP/s (0: none)
    fp8_flops: float = 0.0
    #: GPUs on one NVLink domain (HGX: 8; GB200 NVL72: 72)
    nvlink_domain: int = 8
    #: block-scaled (OCP microscaling) FP8 tensor cores: MXFP8 GEMMs run on Blackwell, not Hopper
    microscaling: bool = False


@dataclass(frozen=True)
class Layer:
    """One transformer layer's work on one GPU for one micro-batch: b sequences of s queries
    against T keys, hidden d, a heads, key/value width d_kv, MLP width f (gated: SwiGLU), the
    family's kernels (gpt: Megatron's, scores in memory; llama: FlashAttention), t tensor-parallel
    ranks with or without sp, recomputation, bytes an activation, and a MoE block's E experts,
    top-k, capacity factor and ep (experts 0: a dense MLP)."""

    microbatch: int
    queries: float
    keys: int
    hidden: int
    heads: int
    d_kv: int
    d_ff: int
    gated: bool = False
    family: str = "gpt"
    tp: int = 1
    sp: bool = False
    recompute: str = "none"
    act_bytes: int = 2
    experts: int = 0
    top_k: int = 1
    capacity_factor: float = 1.0
    ep: int = 1
    #: the weight GEMMs in FP8 (one-byte operands at the GPU's FP8 peak), the rest as act_bytes
    fp8: bool = False
    #: a MoE block's shared experts (every token passes through them), and the attention core's
    #: width, heads × head width (0: hidden)
    shared: int = 0
    core: int = 0
    #: bytes a FP8 recipe moves per element of each weight GEMM's operand to scale and cast it
    cast_bytes: float = 0.0
    #: the attention's own GEMMs (k, n, role; `layouts.Shape.attention_gemms`), their
    #: up-projections and the norms recomputed in backward, and the SwiGLU's output recomputed
    #: from its cached input
    attention_gemms: tuple[tuple[int, int, str], ...] = ()
    recompute_up: bool = False
    recompute_swiglu: bool = False

    @property
    def tokens(self) -> float:
        """b·s: the rows of the layer's weight GEMMs."""
        return self.microbatch * self.queries

    @property
    def routed(self) -> float:
        """Copies of a token in the MLP: k·cf in a MoE block, else 1."""
        return self.top_k * (self.capacity_factor or 1.0) if self.experts else 1.0

    @property
    def mlps(self) -> float:
        """Copies of a token through an MLP's width: routed and shared."""
        return self.routed + (self.shared if self.experts else 0)


def gemm_seconds(m: float, n: float, k: float, gpu: Gpu, nbytes: float = 2.0,
                 batch: float = 1.0, write_result: bool = True) -> float:
    """One (batched) GEMM: whole waves of 256 × 128 output tiles at η·peak, or its operands and
    result over the memory bandwidth if that is longer."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    tm, tn = TILE
    tiles = batch * min(math.ceil(m / tm) * math.ceil(n / tn),
                        math.ceil(m / tn) * math.ceil(n / tm))
    waves = math.ceil(tiles / gpu.sms)
    math_s = waves * 2 * tm * tn * k / (gpu.gemm_efficiency * gpu.peak_flops / gpu.sms)
    moved = batch * (m * k + k * n + (m * n if write_result else 0)) * nbytes
    return max(math_s, moved / gpu.memory_bandwidth)


def _with_backward(m: float, n: float, k: float, gpu: Gpu, nbytes: float, batch: float = 1.0,
                   write_result: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of a GEMM: backward is the input's and the weight's gradient."""
    forward = gemm_seconds(m, n, k, gpu, nbytes, batch, write_result)
    backward = (gemm_seconds(m, k, n, gpu, nbytes, batch)
                + gemm_seconds(k, n, m, gpu, nbytes, batch))
    return forward, backward


def fp8_view(gpu: Gpu) -> Gpu:
    """The GPU as its FP8 GEMMs see it: the FP8 peak at the GPU's own η (torchao's float8
    roofline takes one achievable share of peak a GPU for both; DeepGEMM's 1,550 TFLOP/s of FP8
    GEMM on H800, 0.78 of the H100's 1,979, lies within 7% of the H100's η)."""
    if not gpu.fp8_flops:
        raise ValueError(f"--precision: fp8 needs a GPU with FP8 tensor cores, {gpu.name} has none")
    return replace(gpu, peak_flops=gpu.fp8_flops)


def with_reserved_sms(gpu: Gpu, reserved: int) -> Gpu:
    """The GPU as its compute sees it with `reserved` SMs kept for communication kernels: the
    SMs left, each as fast as before (the peaks in proportion)."""
    if not 0 <= reserved < gpu.sms:
        raise ValueError(f"--comm-sms: expected 0 to {gpu.sms - 1} of {gpu.name}'s {gpu.sms} "
                         f"SMs, got {reserved}")
    left = (gpu.sms - reserved) / gpu.sms
    return replace(gpu, sms=gpu.sms - reserved, peak_flops=gpu.peak_flops * left,
                   fp8_flops=gpu.fp8_flops * left)


def attention_gemms(layer: Layer, role: str = "") -> list[tuple[float, float, float, float]]:
    """(m, n, k, batch) of the attention's weight GEMMs (those of `role` only, if given): Q, K, V
    and the projection, or the layer's own (outputs split t ways)."""
    if layer.attention_gemms:
        return [(layer.tokens, n / layer.tp, k, 1) for k, n, kind in layer.attention_gemms
                if kind == role or not role]
    d = layer.hidden
    return [] if role else [(layer.tokens, (d + 2 * layer.d_kv) / layer.tp, d, 1),
                            (layer.tokens, d, d / layer.tp, 1)]


def linear_seconds(layer: Layer, gpu: Gpu) -> tuple[float, float]:
    """(forward, backward) seconds of the layer's weight GEMMs (in FP8 with `layer.fp8`) and a MoE
    block's router (in 16 bits)."""
    t, d, nbytes = layer.tp, layer.hidden, layer.act_bytes
    # the router's GEMM stays in 16 bits under FP8 recipes (DeepSeek-V3 report, §3.3)
    router = _with_backward(layer.tokens, layer.experts, d, gpu, nbytes) if layer.experts \
        else (0.0, 0.0)
    if layer.fp8:
        gpu, nbytes = fp8_view(gpu), 1
    up = (2 if layer.gated else 1) * layer.d_ff / t
    if layer.experts:
        experts = layer.experts / layer.ep
        per_expert = layer.tokens * layer.routed * layer.ep / layer.experts
        mlp = [(per_expert, up, d, experts), (per_expert, d, layer.d_ff / t, experts)]
        if layer.shared:  # the shared experts: one dense MLP of their summed width
            mlp += [(layer.tokens, layer.shared * up, d, 1),
                    (layer.tokens, d, layer.shared * layer.d_ff / t, 1)]
    else:
        mlp = [(layer.tokens, up, d, 1), (layer.tokens, d, layer.d_ff / t, 1)]
    gemms = [*attention_gemms(layer), *mlp]
    fwd, bwd = router
    for m, n, k, batch in gemms:
        f, b = _with_backward(m, n, k, gpu, nbytes, batch)
        fwd, bwd = fwd + f, bwd + b
    if layer.fp8:  # the input, the weight and the output's gradient scaled and cast, each once
        cast = sum(batch * (m * k + k * n + m * n) for m, n, k, batch in gemms)
        bwd += layer.cast_bytes * cast / gpu.memory_bandwidth
    return fwd, bwd


def attention_seconds(layer: Layer, gpu: Gpu) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core: QKᵀ and the weighted sum of V for the
    GPU's heads and queries against all T keys."""
    head = (layer.core or layer.hidden) / layer.heads
    batch = layer.microbatch * layer.heads / layer.tp
    qk = _with_backward(layer.queries, layer.keys, head, gpu, layer.act_bytes, batch,
                        write_result=layer.family == "gpt")
    av = _with_backward(layer.queries, head, layer.keys, gpu, layer.act_bytes, batch)
    return qk[0] + av[0], qk[1] + av[1]


def elementwise_bytes(layer: Layer) -> tuple[float, float]:
    """(whole forward, attention core's part) bytes the layer's work between GEMMs moves (the
    module docstring)."""
    t, h, f, bb = layer.tp, layer.hidden, layer.d_ff, layer.act_bytes
    if layer.family == "gpt":
        replicated = 4 * h * bb + 2 * (3 * h * bb + h)
        core = 2 * layer.heads * layer.keys * bb / t + layer.heads * layer.keys * (2 * bb + 1) / t
        split = core + 2 * f * bb / t * layer.mlps
    else:
        replicated = 4 * h * bb + 6 * h * bb
        core = 0.0
        split = 3 * f * bb / t * layer.mlps + 2 * (h + layer.d_kv) * bb / t
    if layer.experts:
        split += 4 * layer.routed * h * bb / t
    per_token = (replicated / t if layer.sp else replicated) + split
    return layer.tokens * per_token, layer.tokens * core


def layer_seconds(layer: Layer, gpu: Gpu) -> dict[str, float]:
    """The layer's compute, forward, backward and recomputation, by part: `gemm_s` (the weight
    GEMMs), `attention_s` (the attention core), `elementwise_s` (the bytes between them over the
    memory bandwidth) and their sum `total_s`."""
    lin_f, lin_b = linear_seconds(layer, gpu)
    att_f, att_b = attention_seconds(layer, gpu)
    fwd_bytes, core_bytes = elementwise_bytes(layer)
    gemm, attention, moved = lin_f + lin_b, att_f + att_b, 3 * fwd_bytes
    if layer.recompute == "full":
        gemm, attention, moved = gemm + lin_f, attention + att_f, moved + fwd_bytes
    elif layer.recompute == "selective":
        attention, moved = attention + att_f, moved + core_bytes
    if layer.recompute != "full":
        gemm, moved = gemm + _recomputed_up(layer, gpu), moved + _recomputed_bytes(layer)
    elementwise = moved / gpu.memory_bandwidth
    return {"gemm_s": gemm, "attention_s": attention, "elementwise_s": elementwise,
            "total_s": gemm + attention + elementwise}


def _recomputed_up(layer: Layer, gpu: Gpu) -> float:
    """Seconds of the attention's up-projections run again in backward (`recompute_up`)."""
    if not layer.recompute_up:
        return 0.0
    gpu, nbytes = (fp8_view(gpu), 1) if layer.fp8 else (gpu, layer.act_bytes)
    return sum(gemm_seconds(m, n, k, gpu, nbytes, batch)
               for m, n, k, batch in attention_gemms(layer, "up"))


def _recomputed_bytes(layer: Layer) -> float:
    """Bytes of the norms (`recompute_up`) and the SwiGLU (`recompute_swiglu`) run again."""
    bb, norms = layer.act_bytes, 4 * layer.hidden * layer.act_bytes
    per_token = (norms / layer.tp if layer.sp else norms) if layer.recompute_up else 0.0
    if layer.recompute_swiglu:
        per_token += 3 * layer.d_ff * bb / layer.tp * layer.mlps
    return layer.tokens * per_token


def rate(gpu: Gpu) -> float:
    """FLOP/s of a full wave of full tiles: η·peak."""
    return gpu.gemm_efficiency * gpu.peak_flops

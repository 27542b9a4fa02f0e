"""Transformer layouts for `mpdl simulate`: memory per GPU and step time of dp × pp × cp × tp × ep
with ZeRO, recomputation and precision.

A workload is a transformer's shape (`Shape`: layers L, hidden d, heads a, sequence T, vocab V,
micro-batch b; optionally an MLP width f, grouped-query key/value heads, a gated (SwiGLU) MLP, and
mixture-of-experts blocks of E experts with top-k routing). Two families: ``gpt`` counts as
`mpdl.models.gpt.GPT` (biases, LayerNorms, learned positions, output tied to the input
embedding); ``llama`` has no biases, RMSNorms, rotary positions and an untied output layer.

    params          N = embeddings + L·(attention + norms) + dense blocks·MLP
                        + MoE blocks·(E·MLP + router)         (the GPT: V·d + T·d + L·(12d² + 13d) + 2d)
    model FLOPs     6·(N_active − T·d) + 12·L·d·T per token (PaLM appendix B; N_active counts k
                    experts of E)
    recomputation   full: each layer's forward again, 2·(N_active − embeddings) + 4·L·d·T;
                    selective (the attention core only): 4·L·d·T; either may add the norms
                    and the attention's up-projections (`recompute_up`, DeepSeek-V3)

Memory per GPU (bytes; `Precision`): parameters, gradients and optimizer state per parameter are
2 / 2 / 12 for bf16 or fp16 training with Adam (K = 12, the ZeRO paper: fp32 master copy, momentum
and variance) and 4 / 4 / 8 for float32 Adam (what `mpdl train` runs by default). A GPU holds the
parameters of ceil(L/pp) layers split t ways plus the embeddings split t ways (the worst stage); the
experts of a MoE block are split over ep ranks (and t ways within each expert). ZeRO stage 1
divides the optimizer state, stage 2 also the gradients, stage 3 also the parameters by the
sharding group (dp × cp ranks hold the same dense parameters; dp × cp / ep the same experts);
stages 2 and 3 also hold one layer whole for a moment (its gradient; and its gathered parameters),
as mpdl's ZeRO does with its units.

Activations per layer and micro-batch follow Korthikanti et al. 2022 (16-bit activations; scaled by
bytes/2 for float32), with s = T/cp the tokens a rank holds:

    none                    s·b·d·(10 + 24/t + 5·a·T/(d·t))       sp: s·b·d·(34/t + 5·a·T/(d·t))
    selective               s·b·d·(10 + 24/t)                      sp: s·b·d·34/t
    full                    2·s·b·d (each layer's input)           sp: 2·s·b·d/t

(T in the attention term: a rank's s queries against all T keys; without cp, s = T and these are
the paper's Table 2.) The 24 is Q, K, V and the projection's input (8, less with fewer key/value
heads) and the MLP's two hidden activations (16 = 4·f/d, 8·f/d for a gated MLP); a MoE block holds
its experts' part k·cf times (each token at k experts, padded to the capacity) and the router's
float32 logits and probabilities. Held for ceil(L/pp) layers and, at the first stage, m micro-batches
(AFAB) or min(m, pp) (1F1B), times (1 + (pp − 1)/(pp·v)) with v interleaved stages per GPU.

Step time (one step = m micro-batches on each of dp replicas):

    per micro-batch   compute of ceil(L/pp) layers on a GPU from the shapes of their GEMMs and
                        the bytes between them (`mpdl.perf.compute`), and the embeddings' and
                        logits' FLOPs · ceil(L/pp)/L / (t·cp) at η·peak (the heaviest stage sets
                        the pace)
                      + tensor parallel: 4 ring all-reduces of b·s·d activations per layer (6 with
                        full recomputation; sp's reduce-scatter + all-gather move the same bytes)
                      + pipeline: 2·v point-to-point sends of b·s·d/t activations
                      + context parallel, per layer: ring: cp − 1 sends of a K and V block, each
                        behind one block's attention (only the excess counts), twice in backward;
                        ulysses: 4 all-to-alls of b·s·d/t over cp in forward, 4 in backward;
                        allgather: all-gather of K and V, reduce-scatter of their gradients
                      + experts, per MoE block: dispatch and combine all-to-alls over ep of
                        b·s·k·cf·d/t elements (2 in forward, 2 in backward, each at its
                        precision's bytes); node-limited routing (M nodes a token): min(M, k·cf)
                        copies over the scale-out network, k·cf over NVLink, the longer counts
                      (each forward's messages again under full recomputation)
    pipeline          (m + (pp − 1)/v) micro-batch slots: bubble share (pp − 1)/(v·m + pp − 1)
    data parallel     ring all-reduce of the dense gradients over dp × cp and of the experts'
                      over dp × cp / ep (ZeRO 1/2: reduce-scatter + all-gather, the same bytes;
                      stage 3: 1.5×), overlapped with the last micro-batch's backward when pp = 1,
                      exposed after the flush when pp > 1; ZeRO's all-gather of the parameters
                      after the optimizer is always exposed

All-to-all is pairwise: (p − 1)·α + n·(p − 1)/p·β for n bytes a rank sends in all. Pure
functions; the cost model is `mpdl.tuning.costmodel`.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from mpdl.parallel.pipeline import schedule as S
from mpdl.perf import compute as C
from mpdl.perf import goodput as G
from mpdl.perf.compute import Gpu
from mpdl.tuning import costmodel as cm

GB = 1e9
FAMILIES = ("gpt", "llama")
RECOMPUTE = ("none", "selective", "full")
CP_MODES = ("ring", "ulysses", "allgather")


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A transformer: layers, hidden size, heads, sequence length, vocabulary, micro-batch size;
    the MLP's width (default 4·hidden), key/value heads (default heads), a gated MLP, the family,
    and mixture-of-experts blocks (experts 0: dense; every `moe_every`-th block a MoE block)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    microbatch: int = 1
    name: str = "gpt"
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False
    family: str = "gpt"
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    #: the first blocks that stay dense (DeepSeek-V3: 3), their MLP width (default ffn), and the
    #: experts every token passes through in a MoE block beside its top-k (shared experts)
    first_dense: int = 0
    dense_ffn: int | None = None
    shared_experts: int = 0
    #: attention parameters per block when they are not Q, K, V and the projection (MLA's
    #: low-rank projections), and the attention core's width, heads × the mean of the query-key
    #: and value head widths (default hidden)
    attention: int | None = None
    core: int | None = None
    #: node-limited routing: the most nodes a token's experts may lie on (DeepSeek-V3: 4; 0:
    #: any), its dispatch then going once to each node and on over NVLink
    max_nodes_per_token: int = 0
    #: multi-token prediction modules trained beside the model (DeepSeek-V3: 1, §2.2), each a
    #: block, a d × 2d projection and the shared output head for every token; not counted in N
    mtp_depth: int = 0
    #: the attention's weight GEMMs (k, n, role) when they are not Q, K, V and the projection:
    #: role "in" reads the hidden state, "up" a low-rank latent, "out" writes the hidden state
    attention_gemms: tuple[tuple[int, int, str], ...] = ()

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq", "vocab", "microbatch", "top_k",
                    "moe_every"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: expected a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got "
                             f"{self.family!r}")
        if self.experts < 0 or (self.experts and self.top_k > self.experts):
            raise ValueError(f"top_k: {self.top_k} must not exceed the experts ({self.experts})")
        for key in ("max_nodes_per_token", "mtp_depth", "first_dense", "shared_experts"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: expected >= 0, got {getattr(self, key)}")
        if self.first_dense >= self.layers:  # named by the flag that can change it
            raise ValueError(f"layers: expected more than the {self.first_dense} dense blocks "
                             f"the shape starts with, got {self.layers}")

    @property
    def d_ff(self) -> int:
        """The MLP's hidden width f."""
        return self.ffn or 4 * self.hidden

    @property
    def core_width(self) -> int:
        """The attention core's width: hidden unless the heads are wider (MLA)."""
        return self.core or self.hidden

    @property
    def d_kv(self) -> int:
        """The width of the keys (and of the values): d·kv_heads/heads."""
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def _bias(self) -> int:
        return 1 if self.family == "gpt" else 0

    @property
    def attention_params(self) -> int:
        """Q, K, V and the output projection (with their biases in the gpt family)."""
        if self.attention is not None:
            return self.attention
        d, kv = self.hidden, self.d_kv
        return d * (d + 2 * kv) + d * d + self._bias * (2 * d + 2 * kv)

    @property
    def norm_params(self) -> int:
        """A block's two norms: LayerNorm scale and shift (gpt), RMSNorm scale (llama)."""
        return 2 * self.hidden * (2 if self.family == "gpt" else 1)

    def _mlp(self, f: int) -> int:
        d = self.hidden
        return (3 if self.gated else 2) * d * f + self._bias * ((2 if self.gated else 1) * f + d)

    @property
    def mlp_params(self) -> int:
        """One MLP (one expert): two matrices, three when gated."""
        return self._mlp(self.d_ff)

    @property
    def dense_ffn_width(self) -> int:
        """The MLP width of a dense block."""
        return self.dense_ffn or self.d_ff

    @property
    def moe_layers(self) -> int:
        """The MoE blocks: every moe_every-th block after the first_dense ones (none for a dense
        model)."""
        return (self.layers - self.first_dense) // self.moe_every if self.experts else 0

    @property
    def dense_mlp_params(self) -> int:
        """The MLP of a dense block."""
        return self._mlp(self.dense_ffn_width)

    @property
    def layer_params(self) -> int:
        """Parameters of one dense block (the GPT's: 12d² + 13d)."""
        return self.attention_params + self.norm_params + self.dense_mlp_params

    def _moe_params(self, experts: int) -> int:
        return self.attention_params + self.norm_params \
            + (experts + self.shared_experts) * self.mlp_params + self.hidden * self.experts

    @property
    def embedding_params(self) -> int:
        """Embeddings and the final norm: V·d + T·d + 2d (gpt); 2·V·d + d (llama, untied)."""
        d = self.hidden
        if self.family == "gpt":
            return (self.vocab + self.seq) * d + 2 * d
        return 2 * self.vocab * d + d

    @property
    def params(self) -> int:
        """N, as `GPT.num_parameters()` counts it (every expert counted)."""
        dense = self.layers - self.moe_layers
        return dense * self.layer_params + self.moe_layers * self._moe_params(self.experts) \
            + self.embedding_params

    @property
    def active_params(self) -> int:
        """The parameters one token passes through: k experts of each MoE block."""
        dense = self.layers - self.moe_layers
        return dense * self.layer_params + self.moe_layers * self._moe_params(self.top_k) \
            + self.embedding_params

    @property
    def flops_per_token(self) -> int:
        """Model FLOPs per token, as `GPT.flops_per_token()`: 6·(N_active − T·d) + 12·L·d·T."""
        d, t = self.hidden, self.seq
        positions = t * d if self.family == "gpt" else 0
        return 6 * (self.active_params - positions) + 12 * self.layers * self.core_width * t

    def recompute_flops_per_token(self, mode: str = "full") -> int:
        """Extra FLOPs per token of recomputation: full, the layers' forward again; selective,
        the attention core's forward (QKᵀ and the weighted sum of V)."""
        core = 4 * self.layers * self.core_width * self.seq
        if mode == "full":
            return 2 * (self.active_params - self.embedding_params) + core
        return core if mode == "selective" else 0


#: DeepSeek-V3's multi-head latent attention per block (its released configuration: 128 heads,
#: query rank 1536, key-value rank 512, query-key head width 128 + 64 rotary, value 128): the
#: down- and up-projections of Q and of the shared K-V latent, the output projection
MLA_GEMMS = ((7168, 1536, "in"), (1536, 128 * 192, "up"), (7168, 512 + 64, "in"),
             (512, 128 * (128 + 128), "up"), (128 * 128, 7168, "out"))
#: and the latents' two norms
MLA_PARAMS = sum(k * n for k, n, _ in MLA_GEMMS) + 1536 + 512

#: shapes of published models (Megatron-LM 2019 Table 1; Narayanan et al. 2021 Table 1;
#: Korthikanti et al. 2022 Table 3; Llama 3 8B, 70B and 405B, Dubey et al. 2024 Table 3; Mixtral 8x7B's
#: released configuration)
SHAPES: dict[str, Shape] = {
    "gpt2-small": Shape(12, 768, 12, 1024, 50257, 8, "gpt2-small"),
    "megatron-8.3b": Shape(72, 3072, 32, 1024, 51200, 8, "megatron-8.3b"),
    "ptdp-1t": Shape(128, 25600, 160, 2048, 51200, 1, "ptdp-1t"),
    "ptdp-1.7b": Shape(24, 2304, 24, 2048, 51200, 1, "ptdp-1.7b"),
    "gpt3-175b": Shape(96, 12288, 96, 2048, 51200, 1, "gpt3-175b"),
    "mt-nlg-530b": Shape(105, 20480, 128, 2048, 51200, 1, "mt-nlg-530b"),
    "llama3-8b": Shape(32, 4096, 32, 8192, 128256, 1, "llama3-8b", ffn=14336, kv_heads=8,
                       gated=True, family="llama"),
    "llama3-70b": Shape(80, 8192, 64, 8192, 128256, 1, "llama3-70b", ffn=28672, kv_heads=8,
                        gated=True, family="llama"),
    "llama3-405b": Shape(126, 16384, 128, 8192, 128256, 1, "llama3-405b", ffn=53248, kv_heads=8,
                         gated=True, family="llama"),
    "mixtral-8x7b": Shape(32, 4096, 32, 4096, 32000, 1, "mixtral-8x7b", ffn=14336, kv_heads=8,
                          gated=True, family="llama", experts=8, top_k=2),
    "deepseek-v3": Shape(61, 7168, 128, 4096, 129280, 1, "deepseek-v3", ffn=2048, gated=True,
                         family="llama", experts=256, top_k=8, first_dense=3, dense_ffn=18432,
                         shared_experts=1, attention=MLA_PARAMS, core=128 * (192 + 128) // 2,
                         attention_gemms=MLA_GEMMS, max_nodes_per_token=4, mtp_depth=1),
}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of parameters, gradients and optimizer state, and per activation,
    whether the weight GEMMs run in FP8, and the bytes per parameter ZeRO-3's all-gathers of
    the parameters move (0: the parameters' own)."""

    name: str
    param: int
    grad: int
    optimizer: int
    activation: int
    fp8_gemms: bool = False
    zero3_gather: float = 0
    #: bytes moved per element of a weight GEMM's operand to scale and cast it to FP8
    cast_bytes: float = 0
    #: bytes per element of the experts' dispatch and combine all-to-alls (0: an activation's)
    dispatch: float = 0
    combine: float = 0
    #: DeepSeek-V3's FP8 caching (§3.3.2): the attention output and, in MoE blocks, the experts'
    #: inputs and SwiGLU inputs kept for backward in one byte, the SwiGLU output recomputed
    fp8_cache: bool = False
    #: the GEMMs need block-scaled (microscaling) tensor cores
    microscaled: bool = False

    def gathered(self, zero: int) -> float:
        """Bytes per parameter an all-gather of the parameters moves under ZeRO stage `zero`."""
        return self.zero3_gather if zero == 3 and self.zero3_gather else self.param


#: the words of `mpdl train --precision`, and fp8 (the simulator's only)
PRECISIONS = {
    # Transformer Engine's recipe: FP8 GEMM operands with per-tensor scales; parameters,
    # gradients, the optimizer and the activations kept between layers stay as bf16's. ZeRO-3
    # gathers the weights already cast to FP8 (torchao's float8 all-gather for FSDP2: one byte a
    # parameter, one float32 scale a tensor)
    # a cast reads the bf16 operand twice (its amax, then the cast) and writes it in FP8 along
    # each of its two dimensions (torchao's float8 roofline, tensorwise: 2 + 2 + 2·1 bytes)
    "fp8": Precision("fp8 GEMMs, otherwise bf16 with float32 master weights and Adam (K=12)",
                     2, 2, 12, 2, True, zero3_gather=1, cast_bytes=6),
    # MXFP8 (OCP microscaling, one 1-byte scale a block of 32): two casts of an operand, each
    # reading bf16 and writing FP8 and its scales (torchao's roofline of mxfp8_cublas); the
    # collectives stay bf16 (TorchTitan's mxfp8.md)
    "mxfp8": Precision("mxfp8 GEMMs, otherwise bf16 with float32 master weights and Adam (K=12)",
                       2, 2, 12, 2, True, cast_bytes=2 * (2 + 1 + 1 / 32), microscaled=True),
    # DeepSeek-V3's recipe (arXiv 2412.19437, §3.3): FP8 GEMMs with 1x128 and 128x128 block
    # scales, each cast reading bf16 and writing FP8 in both directions (§3.5.2), as tensorwise;
    # the experts' dispatch in FP8, their combine in bf16 (§3.3.2); float32 master weights and
    # gradients, AdamW's two moments in bf16 (§3.3.3): 4 + 2 + 2 bytes of optimizer state
    "deepseek-fp8": Precision("DeepSeek-V3's FP8: block-scaled FP8 GEMMs, FP8 dispatch, bf16 "
                              "combine, float32 master weights and gradients, bf16 Adam moments",
                              2, 4, 8, 2, True, cast_bytes=6, dispatch=1, combine=2,
                              fp8_cache=True),
    "bf16": Precision("bf16 with float32 master weights and Adam (K=12)", 2, 2, 12, 2),
    "fp16": Precision("fp16 with float32 master weights and Adam (K=12)", 2, 2, 12, 2),
    "fp32": Precision("float32 Adam", 4, 4, 8, 4),
}


#: η of Blackwell GPUs: torchao's float8 roofline (pytorch/ao,
#: torchao/testing/training/roofline_utils.py) measured 0.82 of peak for GEMMs on a B300, whose
#: bf16 and FP8 peaks are the B200's (its B200 entry copies the H100's, unmeasured)
BLACKWELL_ETA = 0.82

GPUS = {
    "v100-32gb": Gpu("v100-32gb", 125e12, 32 * GB, 900e9, 80, 0.3890,
                     "V100 SXM2 data sheet: 125 TFLOP/s fp16 tensor cores, 900 GB/s HBM2, 80 SMs; "
                     "eta from Megatron-LM's one-GPU baseline (Shoeybi et al. 2019: the 1.2B model, "
                     "39 TFLOP/s)"),
    "a100-80gb": Gpu("a100-80gb", 312e12, 80 * GB, 2039e9, 108, 0.7471,
                     "A100 SXM4 80GB data sheet: 312 TFLOP/s fp16/bf16 tensor cores, 2,039 GB/s "
                     "HBM2e, 108 SMs; eta from Narayanan et al. 2021, Table 1: the 1.7B model, "
                     "(t, p) = (1, 1), 32 GPUs, 137 TFLOP/s"),
    "a100-40gb": Gpu("a100-40gb", 312e12, 40 * GB, 1555e9, 108, 0.7471,
                     "A100 SXM4 40GB data sheet: 1,555 GB/s HBM2; otherwise as a100-80gb"),
    "h100-80gb": Gpu("h100-80gb", 989e12, 80 * GB, 3350e9, 132, 0.7269,
                     "H100 SXM5 data sheet: 989 TFLOP/s dense bf16 tensor cores, 3.35 TB/s HBM3, "
                     "132 SMs; eta from Megatron-LM's README, H100 model table: the 1.7B GPT, "
                     "(t, p, d) = (1, 1, 48), 408.8 TFLOP/s", fp8_flops=1979e12),
    "h800": Gpu("h800", 989e12, 80 * GB, 3350e9, 132, 0.7269,
                "H800 SXM5 data sheet (nvidia.com, H800 Tensor Core GPU): the H100 SXM5's die and "
                "tensor cores (989 TFLOP/s dense bf16, 1,979 FP8, 80 GB HBM3 at 3.35 TB/s, 132 "
                "SMs) with NVLink cut to 400 GB/s both ways; eta as h100-80gb's (the same "
                "tensor cores)", fp8_flops=1979e12, nvlink_domain=8),
    # eta: H100's (the same die)
    "h200": Gpu("h200", 989e12, 141 * GB, 4800e9, 132, 0.7269,
                      "H200 SXM data sheet (nvidia.com/h200): 1,979 TFLOP/s bf16 and 3,958 FP8 "
                      "with sparsity (989 and 1,979 dense), 141 GB HBM3e at 4.8 TB/s, NVLink 900 "
                      "GB/s both ways, 8 on an HGX board; the H100's die (132 SMs), eta as h100",
                      fp8_flops=1979e12, nvlink_domain=8),
    "b200": Gpu("b200", 2250e12, 180 * GB, 8000e9, 148, BLACKWELL_ETA,
                      "DGX B200 data sheet (nvidia.com/dgx-b200): 8 GPUs, 1,440 GB HBM3e at 64 "
                      "TB/s, 72 PFLOP/s FP8 training with sparsity (4.5 dense a GPU; bf16 half: "
                      "2.25), NVLink 14.4 TB/s (1.8 TB/s a GPU both ways); 148 SMs; eta: "
                      "torchao's measured B300 GEMM share (0.82)", fp8_flops=4500e12, nvlink_domain=8,
                      microscaling=True),
    "gb200": Gpu("gb200", 2500e12, 186 * GB, 8000e9, 148, BLACKWELL_ETA,
                 "GB200 NVL72 data sheet (nvidia.com/gb200-nvl72): 72 Blackwell GPUs on one NVLink "
                 "domain, 360 PFLOP/s bf16 and 720 FP8 with sparsity (2.5 and 5 dense a GPU), up "
                 "to 13.4 TB HBM3e (186 GB a GPU) at 576 TB/s (8 TB/s a GPU), NVLink 130 TB/s "
                 "(1.8 TB/s a GPU both ways); 148 SMs; eta: torchao's measured B300 GEMM share (0.82)",
                 fp8_flops=5000e12, nvlink_domain=72, microscaling=True),
}


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split: data, pipeline and tensor parallel degrees, ZeRO stage and group,
    micro-batches per step, schedule and recomputation; context parallel degree and mode, expert
    parallel degree (carved out of dp) and capacity factor, sequence parallelism, and interleaved
    pipeline stages per GPU."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"
    #: hybrid sharding: ZeRO shards over groups of this many data-parallel ranks (None: all dp)
    zero_group: int | None = None
    cp: int = 1
    ep: int = 1
    sp: bool = False
    cp_mode: str = "ring"
    #: expert capacity over the even share (0: dropless, no padding)
    capacity_factor: float = 1.0
    #: interleaved pipeline: model chunks per GPU (Narayanan et al. 2021)
    virtual: int = 1
    #: tensor-parallel collectives cut into chunks and pipelined with the GEMMs beside them
    #: (Megatron-Core's --tp-comm-overlap, PyTorch's async TP)
    tp_overlap: bool = False
    #: ZeRO's parameter all-gather prefetched behind the forward (Megatron-Core's
    #: --overlap-param-gather, FSDP's prefetch)
    gather_overlap: bool = False
    #: SMs kept for communication kernels, away from compute (DeepSeek-V3: 20 of 132, §3.2.2)
    comm_sms: int = 0
    #: the norms and the attention's up-projections recomputed in backward, their outputs not
    #: kept (DeepSeek-V3, §3.2.3)
    recompute_up: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def shard(self) -> int:
        """Ranks that hold the same dense parameters and share ZeRO's shards."""
        return (self.zero_group or self.dp) * self.cp

    def label(self) -> str:
        text = f"dp{self.dp} pp{self.pp} tp{self.tp}"
        if self.cp > 1:
            text += f" cp{self.cp} {self.cp_mode}"
        if self.ep > 1:
            text += f" ep{self.ep}"
        if self.sp:
            text += " sp"
        if self.zero:
            text += f" zero{self.zero}" + (f"/{self.zero_group}" if self.zero_group else "")
        if self.pp > 1:
            text += f" m{self.microbatches} {self.schedule}"
            if self.virtual > 1:
                text += f" v{self.virtual}"
        if self.tp_overlap and self.tp > 1:
            text += " tp-overlap"
        if self.gather_overlap and self.zero:
            text += " gather-overlap"
        if self.comm_sms:
            text += f" comm-sms{self.comm_sms}"
        if self.recompute_up:
            text += " recompute-up"
        return text + ("" if self.recompute == "none" else f" recompute={self.recompute}")


def check_layout(shape: Shape, layout: Layout, per_node: int) -> None:
    """ValueError naming the setting when the layout cannot run the shape."""
    for key in ("dp", "pp", "tp", "cp", "ep", "microbatches", "virtual"):
        if getattr(layout, key) < 1:
            raise ValueError(f"--{key}: expected a positive integer, got {getattr(layout, key)}")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero: expected 0, 1, 2 or 3, got {layout.zero}")
    if layout.schedule not in S.KINDS:
        raise ValueError(f"--schedule: expected one of {', '.join(S.KINDS)}, got "
                         f"{layout.schedule!r}")
    if layout.pp > 1 and layout.schedule not in ("afab", "1f1b"):
        why = S.allowed(layout.schedule, layout.pp, layout.microbatches, layout.virtual)
        if why:
            raise ValueError(f"--{why}")
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"--recompute: expected one of {', '.join(RECOMPUTE)}, got "
                         f"{layout.recompute!r}")
    if layout.cp_mode not in CP_MODES:
        raise ValueError(f"--cp-mode: expected one of {', '.join(CP_MODES)}, got "
                         f"{layout.cp_mode!r}")
    # interleaved, the first chunk may hold only the embedding and the last only the output
    # layer (Llama 3: 126 layers in 16 x 8 chunks)
    chunks = shape.layers + (2 if layout.virtual > 1 else 0)
    if layout.pp * layout.virtual > chunks:
        what = "pp" if layout.virtual == 1 else "pp x virtual stages"
        extra = " and the two chunks that may hold only the embedding or the output" \
            if layout.virtual > 1 else ""
        raise ValueError(f"--pp: {what} = {layout.pp * layout.virtual} exceeds the "
                         f"{shape.layers} layers{extra}")
    if layout.virtual > 1 and layout.pp == 1:
        raise ValueError("--virtual-stages: an interleaved schedule needs --pp > 1")
    if shape.heads % layout.tp:
        raise ValueError(f"--tp: {layout.tp} does not divide {shape.heads} heads")
    if layout.tp > per_node:
        raise ValueError(f"--tp: {layout.tp} exceeds {per_node} GPUs per node")
    if layout.sp and layout.tp == 1:
        raise ValueError("--sp: sequence parallelism shards the tensor-parallel regions; it "
                         "needs --tp > 1")
    if shape.seq % layout.cp:
        raise ValueError(f"--cp: {layout.cp} does not divide the sequence ({shape.seq})")
    if layout.cp > 1 and layout.cp_mode == "ring" and shape.seq % (2 * layout.cp):
        raise ValueError(f"--cp: the zigzag ring splits the sequence into 2 x cp = "
                         f"{2 * layout.cp} chunks; {shape.seq} is not divisible")
    if layout.cp_mode == "ulysses" and (shape.heads // layout.tp) % layout.cp:
        raise ValueError(f"--cp: ulysses scatters heads; {layout.cp} does not divide the "
                         f"{shape.heads // layout.tp} heads of a tensor-parallel rank")
    if layout.ep > 1 and not shape.experts:
        raise ValueError("--ep: expert parallelism needs --moe-experts E > 0")
    if shape.experts and shape.experts % layout.ep:
        raise ValueError(f"--ep: {layout.ep} does not divide the {shape.experts} experts")
    if layout.dp % layout.ep:
        raise ValueError(f"--ep: {layout.ep} does not divide dp = {layout.dp} (expert-parallel "
                         f"groups are carved out of the data-parallel ranks)")
    if layout.capacity_factor < 0:
        raise ValueError(f"--moe-capacity-factor: expected >= 0 (0: dropless), got "
                         f"{layout.capacity_factor}")
    if layout.pp > 1 and layout.zero > 1:
        raise ValueError("--zero: stages 2 and 3 shard gradients or parameters that a pipeline "
                         "accumulates over micro-batches; use --zero 0 or 1 with --pp > 1")
    if layout.tp_overlap and layout.tp > 1 and not layout.sp:
        raise ValueError("--tp-overlap: it pipelines sequence parallelism's all-gathers and "
                         "reduce-scatters with their GEMMs (Megatron-Core requires --sp); add --sp")
    if layout.comm_sms < 0:
        raise ValueError(f"--comm-sms: expected >= 0, got {layout.comm_sms}")
    if layout.zero_group is not None and (layout.zero_group < 1 or layout.dp % layout.zero_group):
        raise ValueError(f"--zero-group: {layout.zero_group} must divide dp = {layout.dp}")


# -- memory ----------------------------------------------------------------------------------------
def max_stage_layers(shape: Shape, layout: Layout) -> int:
    """Layers of the heaviest pipeline stage: ceil(L/pp), the multi-token prediction modules'
    blocks counted as layers (Llama 3 ran 126 layers on 16 stages, the first and last one layer
    short)."""
    return math.ceil((shape.layers + shape.mtp_depth) / layout.pp)


def stage_params(shape: Shape, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters one GPU holds before ZeRO: ceil(L/pp) layers and the embeddings split
    tp ways, and the experts of the stage's MoE blocks split ep × tp ways."""
    layers = max_stage_layers(shape, layout)
    moe = shape.moe_layers * layers / shape.layers
    dense = (layers * (shape.attention_params + shape.norm_params)
             + (layers - moe) * shape.dense_mlp_params
             + moe * (shape.hidden * shape.experts + shape.shared_experts * shape.mlp_params)
             + shape.embedding_params) / layout.tp
    experts = moe * shape.experts * shape.mlp_params / (layout.ep * layout.tp)
    return dense, experts


def params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Parameters one GPU holds before ZeRO (dense and expert)."""
    return sum(stage_params(shape, layout))


def activation_bytes_per_layer(shape: Shape, layout: Layout, precision: Precision,
                               recompute: str | None = None, moe: bool = False) -> float:
    """Korthikanti et al. 2022, per layer and micro-batch on one GPU (the module docstring);
    `recompute` overrides the layout's, `moe` counts a MoE block."""
    mode = layout.recompute if recompute is None else recompute
    t, sp = layout.tp, layout.sp
    s, b, d, a = shape.seq / layout.cp, shape.microbatch, shape.hidden, shape.heads
    sbd = s * b * d
    scale = precision.activation / 2
    if mode == "full":
        return 2 * sbd * scale / (t if sp else 1)
    mlps = layer_work(shape, layout, precision, moe).mlps  # a token's copies: routed and shared
    mlp_hidden = (8 if shape.gated else 4) * (shape.d_ff if moe else shape.dense_ffn_width) / d
    fp8 = precision.fp8_cache and moe  # one byte where two were
    if fp8:  # the SwiGLU's two inputs, f wide each, in one byte
        mlp_hidden = 2 * shape.d_ff / d
    # replicated without sp: the QKV input (2, unless its norm is recomputed), the attention
    # output's dropout mask (1), two norm inputs (4), the MLP's input (2, at every expert it
    # reaches) and dropout mask (1)
    replicated = (5 if layout.recompute_up else 7) + 1 + (1 if fp8 else 2) * mlps
    # split t ways: Q, K, V (2 + 4·kv/d), the projection's input (2), the MLP's hidden (2·4f/d);
    # with its own GEMMs the attention keeps its latents, its Q, K and V (the up-projections'
    # outputs, unless recomputed) and the output projection's input
    out = 1 if precision.fp8_cache else 2
    if shape.attention_gemms:
        kept = [k for k, _, role in shape.attention_gemms if role == "up"]
        if not layout.recompute_up:
            kept += [n for _, n, role in shape.attention_gemms if role == "up"]
        attention = (2 * sum(kept) + out * sum(k for k, _, role in shape.attention_gemms
                                               if role == "out")) / d
    else:
        attention = 2 + 4 * shape.d_kv / d + out
    split = attention + mlp_hidden * mlps
    per_token = (replicated + split) / t if sp else replicated + split / t
    if mode == "none":
        per_token += 5 * a * shape.seq / (d * t)
    router = 8 * s * b * shape.experts / scale if moe else 0.0  # float32 logits, probabilities
    return (sbd * per_token + router) * scale


def pipeline_kind(layout: Layout) -> str:
    """The generator's kind of the layout's schedule (1F1B over v > 1 chunks is interleaved)."""
    return "interleaved" if layout.schedule == "1f1b" and layout.virtual > 1 else layout.schedule


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once: the generator's peak of
    chunk activations on rank 0 over the v chunks of a stage (interleaved: pp + (pp − 1)/v,
    Korthikanti et al. 2022 §4.2.3)."""
    if layout.pp == 1:
        return 1
    kind = pipeline_kind(layout)
    return S.peak_formula(kind, layout.pp, layout.microbatches, layout.virtual, 0) \
        / layout.virtual


def model_states(params: float, precision: Precision, zero: int = 0, shard: int = 1
                 ) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state for `params` parameters, ZeRO stage
    `zero` sharding over `shard` ranks (ZeRO paper, §5: 2Ψ + 2Ψ + KΨ, divided by N_d from stage
    3, 2 and 1 on respectively)."""
    out = {"params_bytes": params * precision.param / (shard if zero >= 3 else 1),
           "grads_bytes": params * precision.grad / (shard if zero >= 2 else 1),
           "optimizer_bytes": params * precision.optimizer / (shard if zero >= 1 else 1)}
    out["model_state_bytes"] = out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"]
    return out


def zero_working_bytes(unit_params: float, precision: Precision, zero: int) -> float:
    """What ZeRO holds whole for a moment, beside its shards, for a unit of `unit_params`
    parameters (mpdl's units: a GPT's blocks): stage 2, the unit's full gradient until its
    reduce-scatter; stage 3, its gathered parameters and full gradient during its backward."""
    if zero == 2:
        return unit_params * precision.grad
    if zero == 3:
        return unit_params * (precision.gathered(zero) + precision.grad)
    return 0.0


def memory(shape: Shape, layout: Layout, precision: Precision) -> dict[str, float]:
    """Bytes per GPU: parameters, gradients, optimizer state, ZeRO's working buffers of one
    layer (in model_state_bytes), activations and the total."""
    dense, experts = stage_params(shape, layout)
    out = model_states(dense, precision, layout.zero, layout.shard)
    expert_shard = max(1, layout.shard // layout.ep)
    for key, value in model_states(experts, precision, layout.zero, expert_shard).items():
        out[key] += value
    out["zero_working_bytes"] = zero_working_bytes(shape.layer_params / layout.tp, precision,
                                                   layout.zero)
    out["model_state_bytes"] += out["zero_working_bytes"]
    layers = max_stage_layers(shape, layout)
    moe = shape.moe_layers * layers / shape.layers
    per_mb = ((layers - moe) * activation_bytes_per_layer(shape, layout, precision)
              + moe * activation_bytes_per_layer(shape, layout, precision, moe=bool(moe)))
    act = in_flight(layout) * per_mb
    if layout.recompute == "full":  # one layer's activations while it is recomputed
        act += activation_bytes_per_layer(shape, layout, precision, "none", moe=bool(moe))
    out["activation_bytes"] = act
    out["total_bytes"] = out["model_state_bytes"] + act
    return out


@functools.lru_cache(maxsize=4096)
def bubble(pp: int, microbatches: int, virtual: int = 1, schedule: str = "1f1b") -> float:
    """The pipeline bubble's share of a step, from the schedule generator
    (`mpdl.parallel.pipeline.schedule.schedule_bubble`): (p − 1)/(v·m + p − 1) for afab, 1f1b and
    interleaved, (p − 1)/(3m + p − 1) for zb-h1, the unit-clock replay for zb-v and dualpipev
    (its forward-backward pairs overlapped, as DualPipe runs them)."""
    if pp == 1:
        return 0.0
    kind = "interleaved" if schedule == "1f1b" and virtual > 1 else schedule
    return S.schedule_bubble(kind, pp, microbatches, virtual, overlap=kind == "dualpipev")


# -- time ------------------------------------------------------------------------------------------
def _allreduce(nbytes: float, ranks: int, nodes: int, params: cm.Params) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return cm.predict("allreduce", "ring", int(round(nbytes)), ranks, max(1, min(nodes, ranks)),
                      params, "float16")


def _allgather(nbytes: float, ranks: int, inter: bool, params: cm.Params) -> float:
    """A ring all-gather (or reduce-scatter) of nbytes in all: (p − 1)·(α + n/p·β)."""
    if ranks <= 1:
        return 0.0
    alpha, beta = params.link(inter)
    return (ranks - 1) * (alpha + nbytes / ranks * beta)


def alltoall_time(nbytes: float, ranks: int, inter: bool, params: cm.Params) -> float:
    """Pairwise all-to-all of nbytes a rank sends in all: (p − 1)·α + n·(p − 1)/p·β."""
    if ranks <= 1:
        return 0.0
    alpha, beta = params.link(inter)
    return (ranks - 1) * alpha + nbytes * (ranks - 1) / ranks * beta


def _p2p(nbytes: float, inter: bool, params: cm.Params) -> float:
    alpha, beta = params.link(inter)
    return alpha + nbytes * beta


def context_parallel_time(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu,
                          params: cm.Params, per_node: int) -> dict[str, float]:
    """One micro-batch's context-parallel messages over all the stage's layers: their time,
    and the part not hidden behind attention (all of it for ulysses and allgather)."""
    cp = layout.cp
    if cp == 1:
        return {"cp_comm_s": 0.0, "cp_exposed_s": 0.0}
    layers = max_stage_layers(shape, layout)
    b, s, t = shape.microbatch, shape.seq / cp, layout.tp
    inter = layout.tp * cp > per_node
    passes = 4 if layout.recompute == "full" else 3  # forward, backward (2x), forward again
    forwards = passes - 2
    if layout.cp_mode == "ring":
        block = 2 * b * s * shape.d_kv / t * precision.activation  # one K and one V block
        send = _p2p(block, inter, params)
        # one block of causal attention (zigzag: half of every off-diagonal pair), forward
        attend = 2 * b * s * s * shape.hidden / t / C.rate(gpu)
        comm = (cp - 1) * send * (forwards + 2)  # backward also sends dK and dV
        exposed = (cp - 1) * (forwards * max(0.0, send - attend) + 2 * max(0.0, send - attend))
    elif layout.cp_mode == "ulysses":
        qkvo = b * s * (2 * shape.hidden + 2 * shape.d_kv) / t * precision.activation
        comm = alltoall_time(qkvo, cp, inter, params) * (forwards + 1)
        exposed = comm
    else:
        kv = 2 * b * shape.seq * shape.d_kv / t * precision.activation
        comm = _allgather(kv, cp, inter, params) * (forwards + 1)
        exposed = comm
    return {"cp_comm_s": layers * comm, "cp_exposed_s": layers * exposed}


def expert_time(shape: Shape, layout: Layout, precision: Precision, params: cm.Params,
                per_node: int) -> float:
    """One micro-batch's dispatch and combine all-to-alls over the stage's MoE blocks, each
    at its precision's bytes. With node-limited routing (at most M nodes a token) over an
    expert group that spans nodes, a token goes once to each of its nodes over the scale-out
    network (to the GPU of the same in-node index), then over NVLink to its experts' GPUs, the
    two pipelined (DeepSeek-V3 report, §3.2.2); otherwise each routed copy goes to its rank."""
    if not shape.moe_layers or layout.ep == 1:
        return 0.0
    copy = shape.microbatch * shape.seq / layout.cp * shape.hidden / layout.tp
    copies = layer_work(shape, layout, precision, moe=True).routed
    # the nodes the expert group spans: its ranks lie tp·cp apart, so at most ep
    nodes = min(layout.ep, math.ceil(layout.tp * layout.cp * layout.ep / per_node))
    hops: list[tuple[float, int, bool]]  # (copies of the tokens sent, ranks, inter-node)
    if shape.max_nodes_per_token and nodes > 1:
        hops = [(min(shape.max_nodes_per_token, copies, nodes), nodes, True),
                (copies, layout.ep // nodes, False)]
    else:
        hops = [(copies, layout.ep, nodes > 1)]
    # dispatch, and the combine's gradient in backward, at the dispatch's bytes; the combine and
    # the dispatch's gradient at the combine's
    pair = sum(max(alltoall_time(sent * copy * nbytes, ranks, inter, params)
                   for sent, ranks, inter in hops)
               for nbytes in (precision.dispatch or precision.activation,
                              precision.combine or precision.activation))
    pairs = 3 if layout.recompute == "full" else 2
    moe = shape.moe_layers * max_stage_layers(shape, layout) / shape.layers
    return moe * pairs * pair


def layer_work(shape: Shape, layout: Layout, precision: Precision, moe: bool = False
               ) -> C.Layer:
    """What one layer of the shape asks of one GPU of the layout for one micro-batch (a MoE
    block's with `moe`)."""
    return C.Layer(shape.microbatch, shape.seq / layout.cp, shape.seq, shape.hidden, shape.heads,
                   shape.d_kv, shape.d_ff if moe else shape.dense_ffn_width, shape.gated,
                   shape.family, layout.tp, layout.sp, layout.recompute, precision.activation,
                   shape.experts if moe else 0, shape.top_k, layout.capacity_factor, layout.ep,
                   precision.fp8_gemms, shape.shared_experts if moe else 0, shape.core_width,
                   precision.cast_bytes, shape.attention_gemms, layout.recompute_up,
                   precision.fp8_cache and moe)


def check_precision(precision: Precision, gpu: Gpu) -> None:
    """ValueError naming --precision when the GPU's tensor cores cannot run its GEMMs."""
    if not precision.fp8_gemms:
        return
    kind = "MXFP8" if precision.microscaled else "FP8"
    runs = (lambda g: g.microscaling) if precision.microscaled else (lambda g: g.fp8_flops > 0)
    if not runs(gpu):
        word = next((k for k, v in PRECISIONS.items() if v is precision), kind.lower())
        able = ", ".join(name for name, g in GPUS.items() if runs(g))
        raise ValueError(f"--precision: {word} needs a GPU with {kind} tensor cores ({able}), "
                         f"got {gpu.name}")


def compute_parts(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu
                  ) -> dict[str, float]:
    """One micro-batch's compute on a GPU of the heaviest stage (`mpdl.perf.compute`), by part:
    the layers' weight GEMMs (`gemm_s`), attention cores (`attention_s`) and work between GEMMs
    (`elementwise_s`), and the embeddings' and logits' FLOPs outside the layers (`outside_s`,
    at η·peak, shared among the stages as the layers are)."""
    check_precision(precision, gpu)
    gpu = C.with_reserved_sms(gpu, layout.comm_sms)
    layers = max_stage_layers(shape, layout)
    moe = shape.moe_layers * layers / shape.layers
    dense = C.layer_seconds(layer_work(shape, layout, precision), gpu)
    routed = C.layer_seconds(layer_work(shape, layout, precision, moe=True), gpu) if moe \
        else dense
    parts = {key[:-2] + "_s": (layers - moe) * dense[key] + moe * routed[key]
             for key in ("gemm_s", "attention_s", "elementwise_s")}
    positions = shape.seq * shape.hidden if shape.family == "gpt" else 0
    # each multi-token prediction module runs the output head and its projection once more
    mtp = shape.mtp_depth * (shape.vocab * shape.hidden + 2 * shape.hidden ** 2)
    outside = 6 * (shape.embedding_params - positions + mtp) * shape.microbatch * shape.seq
    parts["outside_s"] = outside * layers / shape.layers / (layout.tp * layout.cp) / C.rate(gpu)
    return parts


def step(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu, params: cm.Params,
         per_node: int, overlap: bool = True) -> dict[str, Any]:
    """One step of the layout: its times (seconds), throughput and FLOP rates."""
    b, s, d = shape.microbatch, shape.seq, shape.hidden
    tokens_mb = b * s
    model_tok = shape.flops_per_token
    hw_tok = model_tok + shape.recompute_flops_per_token(layout.recompute)
    layers = max_stage_layers(shape, layout)
    parts = compute_parts(shape, layout, precision, gpu)
    compute_mb = sum(parts.values())
    act = tokens_mb / layout.cp * d * precision.activation
    tp_calls = (6 if layout.recompute == "full" else 4) * layers
    tp_mb = tp_calls * _allreduce(act, layout.tp, 1, params)
    # overlapped, a collective waits only for what its GEMMs leave uncovered
    tp_exposed_mb = max(0.0, tp_mb - parts["gemm_s"]) if layout.tp_overlap else tp_mb
    inter_stage = layout.tp * layout.cp * layout.pp > per_node or layout.tp * layout.cp == per_node
    pp_mb = 2 * layout.virtual * _p2p(act / layout.tp, inter_stage, params) \
        if layout.pp > 1 else 0.0
    cp = context_parallel_time(shape, layout, precision, gpu, params, per_node)
    ep_mb = expert_time(shape, layout, precision, params, per_node)
    if layout.pp > 1 and layout.schedule == "dualpipev":
        # DualPipe runs one chunk's experts' all-to-all and pipeline sends beside the other
        # chunk's compute (DeepSeek-V3 report, §3.2.1): a slot is the longer of the two
        slot = max(compute_mb, pp_mb + ep_mb) + tp_exposed_mb + cp["cp_exposed_s"]
    else:
        slot = compute_mb + tp_exposed_mb + pp_mb + cp["cp_exposed_s"] + ep_mb
    m = layout.microbatches
    share = bubble(layout.pp, m, layout.virtual, layout.schedule)
    # the bubble is idle time beside the m slots a stage works: m·slot / (1 − share) in all
    pipeline_s = m * slot / (1 - share)
    # data parallel: the gradient of one GPU over the ranks holding the same parameters
    dense, experts = stage_params(shape, layout)
    per_node_replicas = max(1, per_node // (layout.tp * layout.cp * layout.pp))
    dp_nodes = math.ceil(layout.dp / per_node_replicas)
    ranks = layout.dp * layout.cp

    def dense_and_experts(per_param: float, dense_ranks: int, nodes: int) -> float:
        """A ring all-reduce of the dense and of the expert parameters at `per_param` bytes."""
        return _allreduce(dense * per_param, dense_ranks, nodes, params) \
            + _allreduce(experts * per_param, max(1, dense_ranks // layout.ep),
                         math.ceil(nodes / layout.ep), params)

    # ZeRO gathers the parameters after the optimizer step (stage 3: before the first forward),
    # half a ring all-reduce of their bytes (FP8 ones under stage 3 with fp8), that no backward
    # hides; the gradients' reduce-scatter is the other half of DDP's all-reduce
    after = 0.5 * dense_and_experts(precision.gathered(layout.zero), ranks, dp_nodes) \
        if layout.zero else 0.0
    dp_s = (0.5 if layout.zero else 1.0) * dense_and_experts(precision.grad, ranks, dp_nodes) \
        + after
    if layout.zero == 3:  # the parameters gathered again for the backward, in the shard group
        group_nodes = math.ceil(layout.shard / layout.cp / per_node_replicas)
        dp_s += 0.5 * dense_and_experts(precision.gathered(3), layout.shard, group_nodes)
    window = (2 / 3) * compute_mb if (overlap and layout.pp == 1) else 0.0
    # prefetched, the all-gather runs under the first micro-batch's forward
    gathered = max(0.0, after - compute_mb / 3) if layout.gather_overlap else after
    dp_exposed = gathered + max(0.0, dp_s - after - window)
    total = pipeline_s + dp_exposed
    global_batch = layout.dp * m * b
    tokens_s = global_batch * s / total
    gpus = layout.gpus
    return {"compute_s": m * compute_mb, **{f"compute_{k}": m * v for k, v in parts.items()},
            "tp_comm_s": m * tp_mb, "tp_exposed_s": m * tp_exposed_mb, "pp_comm_s": m * pp_mb,
            "cp_comm_s": m * cp["cp_comm_s"], "cp_exposed_s": m * cp["cp_exposed_s"],
            "ep_comm_s": m * ep_mb, "bubble_s": pipeline_s - m * slot,
            "bubble_share": share,
            "dp_comm_s": dp_s, "dp_exposed_s": dp_exposed, "step_s": total,
            "global_batch": global_batch, "tokens_per_s": tokens_s,
            "model_flops_per_s": tokens_s * model_tok,
            "hardware_flops_per_s": tokens_s * hw_tok,
            "mfu": tokens_s * model_tok / (gpus * gpu.peak_flops),
            "hfu": tokens_s * hw_tok / (gpus * gpu.peak_flops)}


def evaluate(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu, params: cm.Params,
             per_node: int, tokens: float | None = None, price_per_hour: float | None = None,
             overlap: bool = True, failures: G.Failures = G.LLAMA3) -> dict[str, Any]:
    """One JSON-ready row: the layout, memory per component and in total, whether it fits,
    the step, goodput under `failures` (checkpoints of the parameters and optimizer state) and,
    with `tokens`, wall time (and cost) to train at that goodput."""
    row: dict[str, Any] = {"layout": layout.label(), **asdict(layout), "gpus": layout.gpus,
                           "model": shape.name, "params": shape.params,
                           "active_params": shape.active_params,
                           "flops_per_token": shape.flops_per_token, "precision": precision.name,
                           "gpu": gpu.name, "gpu_memory_bytes": gpu.memory}
    row.update(memory(shape, layout, precision))
    row["fits"] = row["total_bytes"] <= gpu.memory
    row.update(step(shape, layout, precision, gpu, params, per_node, overlap))
    row.update(G.goodput(layout.gpus, shape.params * (precision.param + precision.optimizer),
                         failures))
    if tokens:
        row["time_to_train_no_failures_s"] = tokens / row["tokens_per_s"]
        seconds = row["time_to_train_no_failures_s"] / row["goodput"] if row["goodput"] \
            else math.inf
        row["time_to_train_s"] = seconds
        row["gpu_hours"] = layout.gpus * seconds / 3600
        if price_per_hour is not None:
            row["cost"] = row["gpu_hours"] * price_per_hour
    return row


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


#: the parts of a step `why_slower` compares
STEP_PARTS = ("compute_s", "tp_exposed_s", "pp_comm_s", "cp_exposed_s", "ep_comm_s", "bubble_s",
              "dp_exposed_s")


def why_slower(row: dict[str, Any], best: dict[str, Any]) -> str:
    """The part of row's step that exceeds the best layout's the most, in words."""
    part = max(STEP_PARTS, key=lambda k: row[k] - best[k])
    return f"{part[:-2].replace('_', ' ')} +{row[part] - best[part]:.3g} s"


def virtual_stages(layers: int, pp: int, microbatches: int, schedule: str = "1f1b") -> list[int]:
    """The interleaving depths v a pipeline of pp stages can run: 1, and with 1F1B each v ≥ 2
    whose pp·v chunks hold the layers evenly, or evenly after two chunks that hold only the
    embedding and the output layer (Llama 3: 126 layers in 128 chunks), with the micro-batches a
    multiple of pp (the interleaved schedule's rounds, Narayanan et al. 2021, §2.2.2)."""
    if pp == 1 or schedule != "1f1b" or microbatches % pp:
        return [1]
    return [1] + [v for v in range(2, (layers + 2) // pp + 1)
                  if layers % (pp * v) == 0 or (layers + 2) % (pp * v) == 0]


def _pipelines(shape: Shape, pp: int, m: int, kinds: tuple[str, ...], interleave: bool
               ) -> list[tuple[str, int]]:
    """The (schedule, chunks per GPU) pairs to try for pp stages and m micro-batches: one when
    pp = 1 (no pipeline), each interleaving depth for 1f1b (v > 1: interleaved), two chunks
    for a V."""
    if pp == 1:
        return [(kinds[0], 1)]
    out = []
    for kind in kinds:
        if kind in S.V_KINDS:
            out.append((kind, 2))
        elif kind == "1f1b":
            out += [(kind, v) for v in (virtual_stages(shape.layers, pp, m) if interleave
                                        else [1])]
        elif kind == "interleaved" and "1f1b" not in kinds:
            out += [(kind, v) for v in virtual_stages(shape.layers, pp, m) if v > 1]
        else:
            out.append((kind, 1))
    return out


def candidates(shape: Shape, gpus: int, global_batch: int, per_node: int,
               schedule: str | tuple[str, ...] = "1f1b", zero_stages: tuple[int, ...] = (0, 1, 2, 3),
               cp_mode: str = "ring", capacity_factor: float = 1.0,
               recomputes: tuple[str, ...] = RECOMPUTE, context: bool = True,
               sequence_parallel: bool = True, interleave: bool = True,
               tp_overlap: bool = False, gather_overlap: bool = False, comm_sms: int = 0,
               recompute_up: bool = False):
    """Every dp × pp × cp × tp × ep layout of `gpus` GPUs that can run the shape: tp dividing the
    heads and at most a node, pp the layers, cp the sequence, ep the experts and dp, dp the global
    batch in micro-batches; each ZeRO stage allowed, each of `recomputes`, with and without sp
    (unless `sequence_parallel` is false), cp > 1 only with `context`, and with `interleave`
    each interleaving depth of `virtual_stages`; `schedule` is one kind or a tuple of kinds to
    try (`mpdl.parallel.pipeline.schedule.KINDS`); every layout with the overlaps and the SMs
    kept for communication asked for."""
    kinds = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    for tp in _divisors(gpus):
        if tp > per_node or shape.heads % tp:
            continue
        for cp in (_divisors(gpus // tp) if context else [1]):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if shape.layers % pp or (global_batch // shape.microbatch) % dp:
                    continue
                m = global_batch // shape.microbatch // dp
                for ep in (_divisors(dp) if shape.experts else [1]):
                    for zero in zero_stages:
                        if (pp > 1 and zero > 1) or (dp * cp == 1 and zero > 0):
                            continue
                        for recompute, sp, (kind, virtual) in itertools.product(
                                recomputes, (False, True) if tp > 1 and sequence_parallel
                                else (False,), _pipelines(shape, pp, m, kinds, interleave)):
                            layout = Layout(dp, pp, tp, zero, m, kind, recompute, None, cp,
                                            ep, sp, cp_mode, capacity_factor, virtual,
                                            tp_overlap, gather_overlap, comm_sms,
                                            recompute_up)
                            try:
                                check_layout(shape, layout, per_node)
                            except ValueError:
                                continue
                            yield layout


def search(shape: Shape, gpus: int, global_batch: int, precision: Precision, gpu: Gpu,
           params: cm.Params, per_node: int, schedule: str | tuple[str, ...] = "1f1b",
           zero_stages: tuple[int, ...] = (0, 1, 2, 3), top: int = 5,
           **axes: Any) -> list[dict[str, Any]]:
    """The fastest layouts of `gpus` GPUs that fit in the GPU's memory, fastest first (see
    `candidates` for `axes`); each row after the first says why it is slower (`slower_by`)."""
    return search_report(shape, gpus, global_batch, precision, gpu, params, per_node, schedule,
                         zero_stages, top, **axes)["rows"]


def search_report(shape: Shape, gpus: int, global_batch: int, precision: Precision, gpu: Gpu,
                  params: cm.Params, per_node: int, schedule: str | tuple[str, ...] = "1f1b",
                  zero_stages: tuple[int, ...] = (0, 1, 2, 3), top: int = 5,
                  failures: G.Failures = G.LLAMA3, **axes: Any) -> dict[str, Any]:
    """`search`'s rows (goodput under `failures`), how many layouts were tried and did not fit,
    and the smallest of those that did not (what it would need)."""
    if global_batch % shape.microbatch:
        raise ValueError(f"--global-batch: {global_batch} is not a multiple of the micro-batch "
                         f"{shape.microbatch}")
    fit, too_big = [], []
    for layout in candidates(shape, gpus, global_batch, per_node, schedule, zero_stages, **axes):
        row = evaluate(shape, layout, precision, gpu, params, per_node, failures=failures)
        (fit if row["fits"] else too_big).append(row)
    fit.sort(key=lambda r: (r["step_s"], r["total_bytes"]))
    rows = fit[:top]
    for row in rows[1:]:
        row["slower_by"] = why_slower(row, rows[0])
    smallest = min(too_big, key=lambda r: r["total_bytes"]) if too_big else None
    return {"rows": rows, "tried": len(fit) + len(too_big), "fit": len(fit),
            "too_big": len(too_big), "smallest_too_big": smallest}


def with_microbatch(shape: Shape, microbatch: int) -> Shape:
    return replace(shape, microbatch=microbatch)

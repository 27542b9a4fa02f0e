"""Transformer layouts for `mpdl simulate`: memory per GPU and step time of dp × pp × tp with ZeRO.

A workload is a GPT's shape (`Shape`: layers L, hidden d, heads a, sequence T, vocab V,
micro-batch b). Its parameter count and FLOPs per token are derived with the formulas of
`mpdl.training.gpt.GPT` (tied embedding, learned positions):

    params          N = V·d + T·d + L·(12d² + 13d) + 2d
    model FLOPs     6·(N − T·d) + 12·L·d·T per token (forward + backward, PaLM appendix B)
    recomputation   full recomputation runs each layer's forward again: + 2·L·(12d² + 13d) + 4·L·d·T

Memory per GPU (bytes; `Precision`): parameters, gradients and optimizer state per parameter are
2 / 2 / 12 for mixed-precision Adam (K = 12, the ZeRO paper: fp32 master copy, momentum and
variance) and 4 / 4 / 8 for float32 Adam (what `mpdl train` runs). A GPU holds the parameters of
L/pp layers split t ways plus the embedding split t ways (the worst stage). ZeRO stage 1 divides the
optimizer state, stage 2 also the gradients, stage 3 also the parameters by the sharding group (dp,
or the hybrid group); stages 2 and 3 also hold one layer whole for a moment (its gradient;
and its gathered parameters), as mpdl's ZeRO does with its units. Activations follow
Korthikanti et al. 2022 (tensor parallel without sequence parallelism, 16-bit activations, scaled
by bytes/2 for float32): per layer and micro-batch

    no recomputation    T·b·d·(10 + 24/t + 5·a·T/(d·t))
    full recomputation  2·T·b·d (each layer's input), plus one layer's full activations while it
                        is recomputed

held for L/pp layers and, at the first stage, m micro-batches (AFAB) or min(m, pp) (1F1B).

Step time (one step = m micro-batches on each of dp replicas):

    per micro-batch   compute = b·T·FLOPs per token / (pp·t) / the GPU's sustained FLOP/s
                      + tensor parallel: 4 ring all-reduces of b·T·d activations per layer (6 with
                      recomputation), inside the node, not overlapped
                      + pipeline: 2 point-to-point sends of b·T·d/t activations (scatter/gather)
    pipeline          (m + pp − 1) micro-batch slots: bubble share (pp − 1)/(m + pp − 1), the same
                      for AFAB and 1F1B
    data parallel     ring all-reduce of the gradients over dp (ZeRO 1/2: reduce-scatter +
                      all-gather, the same bytes; stage 3: 1.5×), overlapped with the last
                      micro-batch's backward when pp = 1, exposed after the flush when pp > 1;
                      ZeRO's all-gather of the parameters after the optimizer is always exposed

Pure functions; the cost model is `mpdl.collectives.costmodel`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from mpdl.collectives import costmodel as cm

GB = 1e9


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """A GPT: layers, hidden size, heads, sequence length, vocabulary and micro-batch size."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    microbatch: int = 1
    name: str = "gpt"

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "seq", "vocab", "microbatch"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}: expected a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer block: 12d² + 13d."""
        d = self.hidden
        return 12 * d * d + 13 * d

    @property
    def embedding_params(self) -> int:
        """Token and position embeddings and the final LayerNorm: V·d + T·d + 2d."""
        return (self.vocab + self.seq) * self.hidden + 2 * self.hidden

    @property
    def params(self) -> int:
        """N, as `GPT.num_parameters()` counts it."""
        return self.layers * self.layer_params + self.embedding_params

    @property
    def flops_per_token(self) -> int:
        """Model FLOPs per token, as `GPT.flops_per_token()`: 6·(N − T·d) + 12·L·d·T."""
        d, t = self.hidden, self.seq
        return 6 * (self.params - t * d) + 12 * self.layers * d * t

    @property
    def recompute_flops_per_token(self) -> int:
        """Extra FLOPs per token of full recomputation: the layers' forward again."""
        return 2 * self.layers * self.layer_params + 4 * self.layers * self.hidden * self.seq


#: shapes of published models (Megatron-LM 2019 Table 1; Narayanan et al. 2021 Table 1)
SHAPES: dict[str, Shape] = {
    "gpt2-small": Shape(12, 768, 12, 1024, 50257, 8, "gpt2-small"),
    "megatron-8.3b": Shape(72, 3072, 32, 1024, 51200, 8, "megatron-8.3b"),
    "ptdp-1t": Shape(128, 25600, 160, 2048, 51200, 1, "ptdp-1t"),
    "ptdp-1.7b": Shape(24, 2304, 24, 2048, 51200, 1, "ptdp-1.7b"),
}


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of parameters, gradients and optimizer state, and per activation."""

    name: str
    param: int
    grad: int
    optimizer: int
    activation: int


PRECISIONS = {
    "mixed": Precision("mixed-precision Adam (K=12)", 2, 2, 12, 2),
    "fp32": Precision("float32 Adam", 4, 4, 8, 4),
}


@dataclass(frozen=True)
class Gpu:
    """A GPU: peak and sustained FLOP/s of a transformer layer's compute, and its memory."""

    name: str
    peak_flops: float
    sustained_flops: float
    memory: float
    source: str = ""


GPUS = {
    "v100-32gb": Gpu("v100-32gb", 125e12, 39e12, 32 * GB,
                     "V100 fp16 tensor-core peak 125 TFLOP/s; sustained 39 TFLOP/s is Megatron-LM's "
                     "one-GPU baseline (Shoeybi et al. 2019, 1.2B model, 30% of peak)"),
    "a100-80gb": Gpu("a100-80gb", 312e12, 137e12, 80 * GB,
                     "A100 fp16 tensor-core peak 312 TFLOP/s; sustained 137 TFLOP/s is the smallest "
                     "run of Narayanan et al. 2021 (1.7B model, t=p=1, 32 GPUs, 44% of peak)"),
    "a100-40gb": Gpu("a100-40gb", 312e12, 137e12, 40 * GB, "as a100-80gb, 40 GB"),
    "h100-80gb": Gpu("h100-80gb", 989e12, 0.44 * 989e12, 80 * GB,
                     "H100 SXM dense fp16 peak 989 TFLOP/s; sustained assumed 44% of peak, as the "
                     "A100's"),
}


@dataclass(frozen=True)
class Layout:
    """How the GPUs are split: data, pipeline and tensor parallel degrees, ZeRO stage and group,
    micro-batches per step, schedule and recomputation."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    zero: int = 0
    microbatches: int = 1
    schedule: str = "1f1b"
    recompute: bool = False
    #: hybrid sharding: ZeRO shards over groups of this many data-parallel ranks (None: all dp)
    zero_group: int | None = None

    @property
    def gpus(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shard(self) -> int:
        return self.zero_group or self.dp

    def label(self) -> str:
        text = f"dp{self.dp} pp{self.pp} tp{self.tp}"
        if self.zero:
            text += f" zero{self.zero}" + (f"/{self.zero_group}" if self.zero_group else "")
        if self.pp > 1:
            text += f" m{self.microbatches} {self.schedule}"
        return text + (" recompute" if self.recompute else "")


def check_layout(shape: Shape, layout: Layout, per_node: int) -> None:
    """ValueError naming the setting when the layout cannot run the shape."""
    for key in ("dp", "pp", "tp", "microbatches"):
        if getattr(layout, key) < 1:
            raise ValueError(f"--{key}: expected a positive integer, got {getattr(layout, key)}")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero: expected 0, 1, 2 or 3, got {layout.zero}")
    if layout.schedule not in ("afab", "1f1b"):
        raise ValueError(f"--schedule: expected afab or 1f1b, got {layout.schedule!r}")
    if shape.layers % layout.pp:
        raise ValueError(f"--pp: {layout.pp} does not divide {shape.layers} layers")
    if shape.heads % layout.tp:
        raise ValueError(f"--tp: {layout.tp} does not divide {shape.heads} heads")
    if layout.tp > per_node:
        raise ValueError(f"--tp: {layout.tp} exceeds {per_node} GPUs per node")
    if layout.pp > 1 and layout.zero > 1:
        raise ValueError("--zero: stages 2 and 3 shard gradients or parameters that a pipeline "
                         "accumulates over micro-batches; use --zero 0 or 1 with --pp > 1")
    if layout.zero_group is not None and (layout.zero_group < 1 or layout.dp % layout.zero_group):
        raise ValueError(f"--zero-group: {layout.zero_group} must divide dp = {layout.dp}")


# -- memory ----------------------------------------------------------------------------------------
def params_per_gpu(shape: Shape, layout: Layout) -> float:
    """Parameters one GPU holds before ZeRO: L/pp layers and the embedding, split tp ways."""
    return (shape.layers // layout.pp * shape.layer_params + shape.embedding_params) / layout.tp


def activation_bytes_per_layer(shape: Shape, tp: int, precision: Precision,
                               recompute: bool) -> float:
    """Korthikanti et al. 2022, per layer and micro-batch (see the module docstring)."""
    s, b, d, a = shape.seq, shape.microbatch, shape.hidden, shape.heads
    scale = precision.activation / 2
    if recompute:
        return 2 * s * b * d * scale
    return s * b * d * (10 + 24 / tp + 5 * a * s / (d * tp)) * scale


def in_flight(layout: Layout) -> int:
    """Micro-batches whose activations the first stage holds at once."""
    if layout.pp == 1:
        return 1
    return layout.microbatches if layout.schedule == "afab" else min(layout.microbatches, layout.pp)


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
        return unit_params * (precision.param + precision.grad)
    return 0.0


def memory(shape: Shape, layout: Layout, precision: Precision) -> dict[str, float]:
    """Bytes per GPU: parameters, gradients, optimizer state, ZeRO's working buffers of one
    layer (in model_state_bytes), activations and the total."""
    out = model_states(params_per_gpu(shape, layout), precision, layout.zero, layout.shard)
    out["zero_working_bytes"] = zero_working_bytes(shape.layer_params / layout.tp, precision,
                                                   layout.zero)
    out["model_state_bytes"] += out["zero_working_bytes"]
    layers = shape.layers // layout.pp
    act = layers * in_flight(layout) * activation_bytes_per_layer(
        shape, layout.tp, precision, layout.recompute)
    if layout.recompute:  # one layer's activations while it is recomputed
        act += activation_bytes_per_layer(shape, layout.tp, precision, False)
    out["activation_bytes"] = act
    out["total_bytes"] = out["model_state_bytes"] + act
    return out


def bubble(pp: int, microbatches: int) -> float:
    """The pipeline bubble's share of a step: (p − 1)/(m + p − 1)."""
    return (pp - 1) / (microbatches + pp - 1)


# -- time ------------------------------------------------------------------------------------------
def _allreduce(nbytes: float, ranks: int, nodes: int, params: cm.Params) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return cm.predict("allreduce", "ring", int(round(nbytes)), ranks, max(1, min(nodes, ranks)),
                      params, "float16")


def _p2p(nbytes: float, inter: bool, params: cm.Params) -> float:
    alpha, beta = params.link(inter)
    return alpha + nbytes * beta


def step(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu, params: cm.Params,
         per_node: int, overlap: bool = True) -> dict[str, Any]:
    """One step of the layout: its times (seconds), throughput and FLOP rates."""
    b, s, d = shape.microbatch, shape.seq, shape.hidden
    tokens_mb = b * s
    model_tok = shape.flops_per_token
    hw_tok = model_tok + (shape.recompute_flops_per_token if layout.recompute else 0)
    compute_mb = tokens_mb * hw_tok / (layout.pp * layout.tp) / gpu.sustained_flops
    layers = shape.layers // layout.pp
    act = tokens_mb * d * precision.activation
    tp_calls = (6 if layout.recompute else 4) * layers
    tp_mb = tp_calls * _allreduce(act, layout.tp, 1, params)
    inter_stage = layout.tp * layout.pp > per_node or layout.tp == per_node
    pp_mb = 2 * _p2p(act / layout.tp, inter_stage, params) if layout.pp > 1 else 0.0
    slot = compute_mb + tp_mb + pp_mb
    m = layout.microbatches
    slots = m + layout.pp - 1
    pipeline_s = slots * slot
    # data parallel: the gradient of one GPU over dp ranks; nodes that group spans
    grad_bytes = params_per_gpu(shape, layout) * precision.grad
    per_node_replicas = max(1, per_node // (layout.tp * layout.pp))
    dp_nodes = math.ceil(layout.dp / per_node_replicas)
    dp_s = _allreduce(grad_bytes, layout.dp, dp_nodes, params)
    if layout.zero == 3:
        group_nodes = math.ceil(layout.shard / per_node_replicas)
        dp_s += 0.5 * _allreduce(grad_bytes, layout.shard, group_nodes, params)
    window = (2 / 3) * compute_mb if (overlap and layout.pp == 1) else 0.0
    # ZeRO gathers the parameters after the optimizer step (stage 3: before the first forward):
    # half an all-reduce that no backward hides
    after = 0.5 * _allreduce(grad_bytes, layout.dp, dp_nodes, params) if layout.zero else 0.0
    dp_exposed = after + max(0.0, dp_s - after - window)
    total = pipeline_s + dp_exposed
    global_batch = layout.dp * m * b
    tokens_s = global_batch * s / total
    gpus = layout.gpus
    return {"compute_s": m * compute_mb, "tp_comm_s": m * tp_mb, "pp_comm_s": m * pp_mb,
            "bubble_s": (layout.pp - 1) * slot, "bubble_share": bubble(layout.pp, m),
            "dp_comm_s": dp_s, "dp_exposed_s": dp_exposed, "step_s": total,
            "global_batch": global_batch, "tokens_per_s": tokens_s,
            "model_flops_per_s": tokens_s * model_tok,
            "hardware_flops_per_s": tokens_s * hw_tok,
            "mfu": tokens_s * model_tok / (gpus * gpu.peak_flops),
            "hfu": tokens_s * hw_tok / (gpus * gpu.peak_flops)}


def evaluate(shape: Shape, layout: Layout, precision: Precision, gpu: Gpu, params: cm.Params,
             per_node: int, tokens: float | None = None, price_per_hour: float | None = None,
             overlap: bool = True) -> dict[str, Any]:
    """One JSON-ready row: the layout, memory per component and in total, whether it fits,
    the step and, with `tokens`, time (and cost) to train."""
    row: dict[str, Any] = {"layout": layout.label(), **asdict(layout), "gpus": layout.gpus,
                           "model": shape.name, "params": shape.params,
                           "flops_per_token": shape.flops_per_token, "precision": precision.name,
                           "gpu": gpu.name, "gpu_memory_bytes": gpu.memory}
    row.update(memory(shape, layout, precision))
    row["fits"] = row["total_bytes"] <= gpu.memory
    row.update(step(shape, layout, precision, gpu, params, per_node, overlap))
    if tokens:
        seconds = tokens / row["tokens_per_s"]
        row["time_to_train_s"] = seconds
        row["gpu_hours"] = layout.gpus * seconds / 3600
        if price_per_hour is not None:
            row["cost"] = row["gpu_hours"] * price_per_hour
    return row


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def search(shape: Shape, gpus: int, global_batch: int, precision: Precision, gpu: Gpu,
           params: cm.Params, per_node: int, schedule: str = "1f1b",
           zero_stages: tuple[int, ...] = (0, 1, 2, 3), top: int = 5) -> list[dict[str, Any]]:
    """The fastest layouts of `gpus` GPUs that fit in the GPU's memory, fastest first: every
    dp × pp × tp = gpus with tp dividing the heads and at most a node, pp dividing the layers, dp
    dividing the global batch in micro-batches, each ZeRO stage allowed, with and without
    recomputation."""
    if global_batch % shape.microbatch:
        raise ValueError(f"--global-batch: {global_batch} is not a multiple of the micro-batch "
                         f"{shape.microbatch}")
    rows = []
    for tp in _divisors(gpus):
        if tp > per_node or shape.heads % tp:
            continue
        for pp in _divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if shape.layers % pp or (global_batch // shape.microbatch) % dp:
                continue
            m = global_batch // shape.microbatch // dp
            for zero in zero_stages:
                if (pp > 1 and zero > 1) or (dp == 1 and zero > 0):
                    continue
                for recompute in (False, True):
                    layout = Layout(dp, pp, tp, zero, m, schedule, recompute)
                    row = evaluate(shape, layout, precision, gpu, params, per_node)
                    if row["fits"]:
                        rows.append(row)
    rows.sort(key=lambda r: (r["step_s"], r["total_bytes"]))
    return rows[:top]


def with_microbatch(shape: Shape, microbatch: int) -> Shape:
    return replace(shape, microbatch=microbatch)

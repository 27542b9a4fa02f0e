"""The scaling model behind `mpdl simulate`: time per step and time to train data-parallel SGD.

One synchronous step on each of N workers (b samples per worker):

    compute(b) = b·sample_s + step_s                 forward, backward and optimizer on b samples
    backward   = backward_fraction · b·sample_s       the part communication can hide behind
    G          = params · bytes_per_param / compression            gradient bytes per step
    k buckets  = ceil(G / bucket_bytes), G/k bytes each
    T          = one bucket's all-reduce on N workers (mpdl's α-β-γ cost model, per algorithm)
    comm       = k·T
    exposed    = k·T without overlap; with overlap, bucket i is ready at (i+1)·backward/k and the
                 buckets are reduced one after another: exposed = max(backward/k + k·T, backward + T)
                 − backward
    step       = compute(b) + exposed

One worker does no communication. Speedup is measured in samples per second against one worker
and comes in two regimes: a fixed per-worker batch (the global batch grows with N) and a fixed
global batch B (each worker gets B/N samples). Efficiency = speedup / N, never above 1 because
communication only adds time. Time to train = epochs · ceil(dataset / global batch) steps.

All functions here are pure: no MPI, no clock, except `measure_workload`, which times an mpdl zoo
model on this machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd import optim
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import algorithms
from mpdl.models.zoo import build_model
from mpdl.tuning import costmodel as cm

MB = 1 << 20
#: ImageNet-1k training images
IMAGENET_TRAIN = 1_281_167
#: torchvision's ResNet-50
RESNET50_PARAMS = 25_557_032
#: the all-reduce algorithms a simulated cluster can run: the registry's, but shm, which needs
#: ranks that share one machine's memory
ALGORITHMS = tuple(name for name in algorithms("allreduce") if name != "shm")
DEFAULT_ALGORITHMS = ("ring", "recursive_doubling", "tree", "hierarchical", "torus2d")


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """A model: its parameter count and the compute time of one worker."""

    name: str
    params: int
    #: seconds of forward + backward per sample on one worker
    sample_s: float
    #: seconds per step that do not depend on the batch (optimizer step, launch overheads)
    step_s: float = 0.0
    #: bytes per gradient element on the wire (2 for fp16 gradients of mixed precision)
    bytes_per_param: int = 4
    #: share of forward + backward spent in backward (where communication can overlap)
    backward_fraction: float = 2 / 3
    source: str = ""

    def compute(self, batch: float) -> float:
        return batch * self.sample_s + self.step_s

    def backward(self, batch: float) -> float:
        return self.backward_fraction * batch * self.sample_s


@dataclass(frozen=True)
class Network:
    """Links inside a node and between nodes, as the cost model's parameters, with the usual
    number of workers per node."""

    name: str
    params: cm.Params
    per_node: int = 1
    source: str = ""
    #: the inter-node bandwidth is the node's, shared by its workers when they cross at once (the
    #: inter-node phase of hierarchical and torus2d); False: each worker has it to itself
    shared_inter: bool = False


#: the all-reduces whose inter-node phase runs one flow per worker of a node at the same time
NODE_WIDE_INTER = ("hierarchical", "torus2d")


@dataclass(frozen=True)
class GradientSync:
    """How gradients are reduced: the all-reduce algorithm, overlap with backward, a compression
    ratio (gradient bytes are divided by it) and the bucket size."""

    algorithm: str = "ring"
    overlap: bool = True
    compression: float = 1.0
    bucket_bytes: float = 25 * MB

    def label(self) -> str:
        extras = [] if self.overlap else ["no-overlap"]
        if self.compression != 1:
            extras.append(f"{self.compression:g}x")
        return self.algorithm + (f" ({', '.join(extras)})" if extras else "")


def network(name: str, intra_bw: float, intra_latency: float, inter_bw: float | None = None,
            inter_latency: float | None = None, per_node: int = 1, gamma: float = 1 / 400e9,
            source: str = "", shared_inter: bool = False) -> Network:
    """A network from bandwidths in bytes/s (math.inf allowed) and latencies in seconds. Library
    overheads of mpdl's Python API (call, copy) are zero: the model describes the hardware."""
    beta = 0.0 if math.isinf(intra_bw) else 1 / intra_bw
    beta_inter = None if inter_bw is None else (0.0 if math.isinf(inter_bw) else 1 / inter_bw)
    params = cm.Params(alpha=intra_latency, beta=beta, gamma=gamma, alpha_inter=inter_latency,
                       beta_inter=beta_inter, copy=0.0, barrier=0.0, call=0.0,
                       alpha_native=intra_latency, source=name)
    return Network(name, params, per_node, source, shared_inter)


def _gbit(x: float) -> float:
    return x * 1e9 / 8


def saturating(name: str, rate: float, batch: int, half_batch: float, bytes_per_param: int,
               source: str) -> Workload:
    """A profile measured at `rate` samples/s and `batch` samples a step whose step time is
    (b + half_batch)·sample_s: a fixed share per step (kernel launches, small-batch kernels) worth
    half_batch samples, so at b = half_batch the GPU runs at half its large-batch rate."""
    sample_s = batch / rate / (batch + half_batch)
    return Workload(name, RESNET50_PARAMS, sample_s=sample_s, step_s=half_batch * sample_s,
                    bytes_per_param=bytes_per_param, source=source)


#: samples' worth of fixed time per step (see `saturating`), from NVIDIA's published ResNet-50
#: latencies (derivation: docs/results/simulate.md, "Where the profiles' constants come from")
HALF_BATCH = {"v100": 10.6, "a100": 13.9}

#: one server's iteration of 32 images a GPU in Goyal et al. 2017, §5.5 (derivation: the journal's
#: "Where the profiles' constants come from")
GOYAL_SERVER_ITERATION_S = 30.0 / math.ceil(IMAGENET_TRAIN / 11264) / 1.12
#: the published backward of ResNet-50 on one P100 at 32 images (Goyal et al. 2017, §4.3)
GOYAL_BACKWARD_S = 0.120

PROFILES: dict[str, Workload] = {
    "resnet50-p100": Workload(
        "resnet50-p100", RESNET50_PARAMS, sample_s=GOYAL_SERVER_ITERATION_S / 32,
        bytes_per_param=4, backward_fraction=GOYAL_BACKWARD_S / GOYAL_SERVER_ITERATION_S,
        source="Goyal et al. 2017 (Caffe2, fp32): one server's iteration of 32 images a GPU, "
               "0.235 s (§5.5: 30 s an epoch at 11k on 352 GPUs, 12% above 8 GPUs at 256), "
               "of which backward 120 ms (§4.3)"),
    "resnet50-v100": saturating(
        "resnet50-v100", 1200, 256, HALF_BATCH["v100"], 2,
        source="NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, DGX-1 16GB: 1200 img/s on "
               "one V100 at batch 256, mixed precision (fp16 gradients); a fixed 10.6 images' "
               "worth per step from the same examples' V100 latency at batch 1-128 (MXNet)"),
    "resnet50-v100-mxnet": saturating(
        "resnet50-v100-mxnet", 1376, 192, HALF_BATCH["v100"], 2,
        source="NVIDIA DeepLearningExamples, MXNet ResNet-50 v1.5, DGX-1 16GB: 1376 img/s on "
               "one V100 at batch 192, mixed precision (fp16 gradients); the same examples' "
               "small-batch share (10.6 images)"),
    "resnet50-v100-fp32": Workload(
        "resnet50-v100-fp32", RESNET50_PARAMS, sample_s=1 / 367, bytes_per_param=4,
        source="NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, DGX-1 16GB: 367 img/s on "
               "one V100, fp32"),
    "resnet50-a100": saturating(
        "resnet50-a100", 2470, 256, HALF_BATCH["a100"], 2,
        source="NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, DGX A100 80GB: 2470 img/s "
               "on one A100 at batch 256, mixed precision (fp16 gradients); a fixed 13.9 "
               "images' worth per step from the same examples' A100 latency at batch 1-128 "
               "(MXNet)"),
    "resnet50-a100-tf32": Workload(
        "resnet50-a100-tf32", RESNET50_PARAMS, sample_s=1 / 938, bytes_per_param=4,
        source="NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, DGX A100 80GB: 938 img/s "
               "on one A100, TF32"),
}

NETWORKS: dict[str, Network] = {
    "bigbasin": network(
        "bigbasin", 20e9, 5e-6, _gbit(50), 20e-6, per_node=8, shared_inter=True,
        source="Goyal et al. 2017: Big Basin servers, 8 P100 on NVLink, 50 Gbit/s Ethernet "
               "per server, shared by its GPUs (NVLink rate and both latencies assumed)"),
    "p40-ib": network(
        "p40-ib", 10e9, 5e-6, _gbit(100), 5e-6, per_node=8, shared_inter=True,
        source="Jia et al. 2018: 8 P40 per node (PCIe), 100 Gbit/s InfiniBand per node, shared "
               "by its GPUs (PCIe rate and latencies assumed)"),
    "abci": network(
        "abci", 50e9, 5e-6, _gbit(200), 5e-6, per_node=4, shared_inter=True,
        source="Mikami et al. 2018 on ABCI: 4 V100 per node on NVLink, 2 x InfiniBand EDR per "
               "node (200 Gbit/s), shared by its GPUs (NVLink rate and latencies assumed)"),
    "dgx-a100": network(
        "dgx-a100", 200e9, 5e-6, _gbit(200), 5e-6, per_node=8,
        source="DGX A100: 8 A100 on NVSwitch, one 200 Gbit/s HDR InfiniBand adapter per GPU "
               "(rates and latencies assumed from the data sheet)"),
    "ethernet-10g": network(
        "ethernet-10g", 10e9, 5e-6, _gbit(10), 30e-6, per_node=8, shared_inter=True,
        source="a generic cluster: PCIe inside a node, 10 Gbit/s Ethernet per node between "
               "nodes (assumed)"),
}

#: the network each profile runs on unless told otherwise
PROFILE_NETWORK = {"resnet50-p100": "bigbasin", "resnet50-v100": "abci",
                   "resnet50-v100-mxnet": "abci",
                   "resnet50-v100-fp32": "abci", "resnet50-a100": "dgx-a100",
                   "resnet50-a100-tf32": "dgx-a100"}


# -- the all-reduce of one bucket --------------------------------------------------------------------
def allreduce_seconds(algorithm: str, nbytes: float, workers: int, nodes: int,
                      params: cm.Params, dtype: str = "float32", shared_inter: bool = False
                      ) -> float:
    """Seconds of one all-reduce of nbytes over `workers` ranks on `nodes` nodes of consecutive
    ranks (`mpdl.tuning.costmodel.predict`). One worker communicates nothing: 0. With
    shared_inter, the inter-node bandwidth is the node's: in the inter-node phase of the
    NODE_WIDE_INTER algorithms the node's workers cross at once, each at 1/g of it."""
    if workers <= 1:
        return 0.0
    nodes = max(1, min(nodes, workers))
    if shared_inter and nodes > 1 and algorithm in NODE_WIDE_INTER:
        g = math.ceil(workers / nodes)
        params = replace(params, beta_inter=g * (params.beta if params.beta_inter is None
                                                 else params.beta_inter))
    return cm.predict("allreduce", algorithm, int(round(nbytes)), workers, nodes, params, dtype)


# -- one step ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """One step on one worker, in seconds."""

    compute: float
    comm: float
    exposed: float
    buckets: int
    bucket_bytes: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed


def gradient_bytes(workload: Workload, strategy: GradientSync) -> float:
    return workload.params * workload.bytes_per_param / strategy.compression


def buckets(workload: Workload, strategy: GradientSync) -> tuple[int, float]:
    """(number of buckets, bytes per bucket): the gradient in equal buckets of at most
    strategy.bucket_bytes."""
    total = gradient_bytes(workload, strategy)
    k = max(1, math.ceil(total / strategy.bucket_bytes - 1e-9))
    return k, total / k


def exposed_seconds(bucket_s: float, k: int, backward_s: float, overlap: bool) -> float:
    """Communication not hidden behind backward: k buckets of bucket_s each, the i-th ready at
    (i+1)·backward/k, reduced one after another (all after backward without overlap)."""
    if not overlap:
        return k * bucket_s
    end = max(backward_s / k + k * bucket_s, backward_s + bucket_s)
    return min(end - backward_s, k * bucket_s)


def comm_per_bucket(workload: Workload, strategy: GradientSync, workers: int, nodes: int,
                    params: cm.Params, shared_inter: bool = False) -> tuple[int, float, float]:
    """(buckets, bytes per bucket, seconds per bucket's all-reduce, handed to the communication
    thread as DDP hands it: params.handoff, calibrated on this machine, 0 for a modelled one)."""
    k, size = buckets(workload, strategy)
    dtype = "float16" if workload.bytes_per_param == 2 else "float32"
    return k, size, allreduce_seconds(strategy.algorithm, size, workers, nodes, params, dtype,
                                      shared_inter) + params.handoff


def step_time(workload: Workload, strategy: GradientSync, workers: int, nodes: int,
              params: cm.Params, batch: float, bucket_s: float | None = None,
              shared_inter: bool = False) -> StepTime:
    """One step with `batch` samples per worker (bucket_s: a precomputed all-reduce time)."""
    k, size = buckets(workload, strategy)
    if workers <= 1:
        return StepTime(workload.compute(batch), 0.0, 0.0, k, size)
    if bucket_s is None:
        bucket_s = comm_per_bucket(workload, strategy, workers, nodes, params, shared_inter)[2]
    exposed = exposed_seconds(bucket_s, k, workload.backward(batch), strategy.overlap)
    return StepTime(workload.compute(batch), k * bucket_s, exposed, k, size)


def pipeline_compute(stage_slots: Sequence[float], microbatches: int) -> float:
    """Seconds of a pipeline flush: stage_slots[i] is stage i's forward + backward of one
    microbatch. One microbatch passes every stage, the other m-1 are paced by the slowest: with
    equal stages t, (m + pp - 1)·t, whose idle share is the bubble (pp-1)/(m+pp-1)."""
    if not stage_slots or microbatches < 1:
        raise ValueError(f"stage_slots and microbatches: expected stages and m >= 1, got "
                         f"{len(stage_slots)} and {microbatches}")
    return float(sum(stage_slots) + (microbatches - 1) * max(stage_slots))


# -- sweeps ------------------------------------------------------------------------------------------
def nodes_for(workers: int, per_node: int) -> int:
    """Nodes used by `workers` workers filled per_node at a time."""
    return max(1, math.ceil(workers / max(1, per_node)))


def worker_counts(max_workers: int, extra: Iterable[int] = ()) -> list[int]:
    """1, 2, 4, ... up to max_workers, plus `extra`, sorted."""
    counts = {1 << i for i in range(max(0, int(max_workers)).bit_length()) if 1 << i <= max_workers}
    counts.update(int(n) for n in extra if 1 <= n)
    return sorted(counts)


@dataclass(frozen=True)
class Job:
    """What to train: samples per epoch and epochs; the batch (per worker or global) and the price."""

    dataset_size: int = IMAGENET_TRAIN
    epochs: float = 90.0
    batch_per_worker: float = 32.0
    global_batch: int | None = None
    price_per_hour: float | None = None

    def steps(self, global_batch: float) -> float:
        return self.epochs * math.ceil(self.dataset_size / global_batch)


@dataclass
class Row:
    """One (strategy, N): both scaling regimes and the costs of the job's own regime."""

    strategy: GradientSync
    workers: int
    nodes: int
    per_worker: dict[str, float] = field(default_factory=dict)
    global_: dict[str, float] = field(default_factory=dict)
    regime: str = "per_worker"

    @property
    def main(self) -> dict[str, float]:
        return self.per_worker if self.regime == "per_worker" else self.global_

    def to_json(self) -> dict[str, Any]:
        s = self.strategy
        row = {"algorithm": s.algorithm, "overlap": s.overlap, "compression": s.compression,
               "bucket_mb": s.bucket_bytes / MB, "workers": self.workers, "nodes": self.nodes,
               "regime": "fixed per-worker batch" if self.regime == "per_worker"
               else "fixed global batch"}
        row.update(self.main)
        for key in ("speedup", "efficiency"):
            row[f"{key}_fixed_per_worker_batch"] = self.per_worker.get(key)
            row[f"{key}_fixed_global_batch"] = self.global_.get(key)
        return row


def _regime(workload: Workload, step: StepTime, workers: int, batch: float, job: Job,
            one_worker_rate: float) -> dict[str, float]:
    global_batch = batch * workers
    rate = global_batch / step.total
    speedup = rate / one_worker_rate
    steps = job.steps(global_batch)
    seconds = steps * step.total
    out = {"batch_per_worker": batch, "global_batch": global_batch, "compute_s": step.compute,
           "comm_s": step.comm, "exposed_comm_s": step.exposed, "step_s": step.total,
           "buckets": step.buckets, "bucket_bytes": step.bucket_bytes,
           "samples_per_s": rate, "speedup": speedup, "efficiency": speedup / workers,
           "steps": steps, "time_to_train_s": seconds, "worker_hours": workers * seconds / 3600}
    if job.price_per_hour is not None:
        out["cost"] = out["worker_hours"] * job.price_per_hour
    return out


def simulate(workload: Workload, net: Network, strategies: Sequence[GradientSync], job: Job,
             workers: Sequence[int], per_node: int | None = None,
             headline: int | None = None) -> list[Row]:
    """Every strategy at every worker count. The fixed per-worker batch is job.batch_per_worker
    unless job.global_batch is set; the fixed global batch is job.global_batch, or the headline
    configuration's global batch (headline × batch per worker). Worker counts above the global
    batch get no fixed-global-batch figures (a worker needs a sample)."""
    g = per_node or net.per_node
    top = headline or max(workers)
    if job.global_batch is not None:
        regime, fixed_global = "global", float(job.global_batch)
        per_worker_batch = fixed_global / top
    else:
        regime, per_worker_batch = "per_worker", float(job.batch_per_worker)
        fixed_global = per_worker_batch * top
    rows = []
    for strategy in strategies:
        for n in workers:
            m = nodes_for(n, g)
            bucket_s = (comm_per_bucket(workload, strategy, n, m, net.params, net.shared_inter)[2]
                        if n > 1 else 0.0)
            row = Row(strategy, n, m, regime=regime)
            step = step_time(workload, strategy, n, m, net.params, per_worker_batch, bucket_s)
            row.per_worker = _regime(workload, step, n, per_worker_batch, job,
                                     per_worker_batch / workload.compute(per_worker_batch))
            if n <= fixed_global:
                local = fixed_global / n
                step = step_time(workload, strategy, n, m, net.params, local, bucket_s)
                row.global_ = _regime(workload, step, n, local, job,
                                      fixed_global / workload.compute(fixed_global))
            rows.append(row)
    return rows


def useful_limit(workers: Sequence[int], speedups: Sequence[float], min_gain: float = 0.05
                 ) -> int | None:
    """The worker count beyond which doubling no longer helps: the first N (of a sweep of powers of
    two) whose double raises the speedup by less than min_gain (relative); None if every doubling
    in the sweep helps."""
    pairs = dict(zip(workers, speedups, strict=True))
    for n in sorted(pairs):
        if 2 * n in pairs and pairs[2 * n] < pairs[n] * (1 + min_gain):
            return n
    return None


def limits(rows: Sequence[Row], min_gain: float = 0.05) -> dict[str, dict[str, int | None]]:
    """Per strategy label: the useful limit at a fixed global batch and at a fixed per-worker
    batch (see useful_limit)."""
    out: dict[str, dict[str, int | None]] = {}
    for label in dict.fromkeys(r.strategy.label() for r in rows):
        mine = [r for r in rows if r.strategy.label() == label and r.workers & (r.workers - 1) == 0]
        fixed_global = [r for r in mine if r.global_]
        out[label] = {
            "fixed_global_batch": useful_limit([r.workers for r in fixed_global],
                                               [r.global_["speedup"] for r in fixed_global],
                                               min_gain),
            "fixed_per_worker_batch": useful_limit([r.workers for r in mine],
                                                   [r.per_worker["speedup"] for r in mine],
                                                   min_gain)}
    return out


# -- measuring an mpdl model on this machine -----------------------------------------------------------
INPUT_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar": (3, 32, 32)}
#: the optimizers `measure_workload` can time, as `mpdl train` builds them by default
MEASURE_OPTIMIZERS = ("sgd", "adam")


#: how `measure_workload` sums up its repeats: the median drops the odd slow one; the mean is
#: what a rank sharing its core with other ranks computes per step over time (its steps run either
#: alone or time-sliced, and the median lands on one of the two)
STATISTICS = {"median": np.median, "mean": np.mean}


def measure_workload(model: str, shape: str = "digits", batch: int = 32, repeats: int = 15,
                     classes: int = 10, dtype: str = "float32", seed: int = 0,
                     optimizer: str = "sgd", statistic: str = "median") -> Workload:
    """Time forward, backward and an optimizer step (SGD with momentum, or Adam) of an mpdl zoo
    model at batch/4 and batch samples (interleaved; each summed up by `statistic` over the
    repeats, see STATISTICS) and fit sample_s (slope), step_s (intercept plus the optimizer) and
    the backward share."""
    if shape not in INPUT_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(INPUT_SHAPES)}, got {shape!r}")
    if optimizer not in MEASURE_OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {', '.join(MEASURE_OPTIMIZERS)}, "
                         f"got {optimizer!r}")
    if batch < 1 or repeats < 1:
        raise ValueError(f"batch and repeats: expected positive counts, got {batch}, {repeats}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic: expected one of {', '.join(STATISTICS)}, got {statistic!r}")
    net = build_model(model, INPUT_SHAPES[shape], classes, seed=seed, dtype=np.dtype(dtype))
    opt = (optim.SGD(net.parameters(), lr=0.01, momentum=0.9) if optimizer == "sgd"
           else optim.Adam(net.parameters(), lr=1e-3))
    rng = np.random.default_rng(seed)
    sizes = sorted({max(1, batch // 4), batch})
    data = {b: (rng.standard_normal((b, *INPUT_SHAPES[shape])).astype(dtype),
                rng.integers(0, classes, b)) for b in sizes}
    times: dict[int, list[tuple[float, float, float]]] = {b: [] for b in sizes}
    warmup = 5  # rounds that warm caches, allocations and compiled kernels up
    for i in range(repeats + warmup):
        for b in sizes:
            x, y = data[b]
            t0 = time.perf_counter()
            loss = F.cross_entropy(net(Tensor(x)), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if i >= warmup:
                times[b].append((t1 - t0, t2 - t1, t3 - t2))
    med = {b: STATISTICS[statistic](np.array(times[b]), axis=0) for b in sizes}
    fwd_bwd = {b: float(med[b][0] + med[b][1]) for b in sizes}
    optimizer = float(np.median([med[b][2] for b in sizes]))
    if len(sizes) == 2:
        lo, hi = sizes
        sample_s = max((fwd_bwd[hi] - fwd_bwd[lo]) / (hi - lo), 1e-12)
        intercept = max(fwd_bwd[hi] - hi * sample_s, 0.0)
    else:
        sample_s, intercept = fwd_bwd[sizes[0]] / sizes[0], 0.0
    backward_fraction = float(med[batch][1] / max(fwd_bwd[batch], 1e-12))
    params = sum(int(p.data.size) for p in net.parameters())
    return Workload(f"{model} ({shape} input)", params, sample_s, intercept + optimizer,
                    np.dtype(dtype).itemsize, min(max(backward_fraction, 0.0), 1.0),
                    source=f"measured on this machine: batches {sizes}, {repeats} repeats, "
                           f"{statistic}s")


# -- published results --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Published:
    """A published large-scale ResNet-50 run and the model inputs that describe its hardware."""

    name: str
    result: str
    seconds: float
    workload: Workload
    network: str
    workers: int
    per_node: int
    global_batch: int
    algorithm: str
    epochs: float = 90.0
    note: str = ""


#: Jia et al.'s P40s have no published ResNet-50 rate: a P100's, as the journal's "Where the
#: profiles' constants come from" says why
RESNET50_P40 = Workload("resnet50-p40", RESNET50_PARAMS, sample_s=1.5 * GOYAL_BACKWARD_S / 32,
                        bytes_per_param=2,
                        source="assumed: a P100's backward of 32 images (120 ms, Goyal et al. "
                               "2017, §4.3) and a forward of half of it; fp16 gradients (Jia et "
                               "al. 2018 train in mixed precision)")

PUBLISHED = (
    Published("Goyal et al. 2017", "256 P100, batch 8K, 1 h; ~90% scaling efficiency 8 -> 256",
              3600.0, PROFILES["resnet50-p100"], "bigbasin", 256, 8, 8192, "hierarchical",
              note="Gloo: intra-server reduce, inter-server all-reduce, intra-server broadcast"),
    Published("Jia et al. 2018", "2048 P40, batch 64K, 6.6 min", 6.6 * 60, RESNET50_P40, "p40-ib",
              2048, 8, 65536, "hierarchical",
              note="hierarchical all-reduce with tensor fusion, fp16 gradients"),
    Published("Mikami et al. 2018", "2176 V100, batch ~68K, 224 s", 224.0,
              PROFILES["resnet50-v100"], "abci", 2176, 4, 2176 * 32, "torus2d",
              note="2D-torus all-reduce, fp16 gradients, batch-size control"),
)


def predict_published(run: Published, bucket_bytes: float = 64 * MB) -> dict[str, Any]:
    """The model's step time, time to train and scaling efficiency for a published run (the
    efficiency against one node of the same hardware at the same per-worker batch)."""
    net = NETWORKS[run.network]
    strategy = GradientSync(run.algorithm, overlap=True, bucket_bytes=bucket_bytes)
    job = Job(IMAGENET_TRAIN, run.epochs, global_batch=run.global_batch)
    rows = simulate(run.workload, net, [strategy], job, [1, run.per_node, run.workers],
                    run.per_node, run.workers)
    by_n = {r.workers: r.global_ for r in rows}
    one_node, full = by_n[run.per_node], by_n[run.workers]
    # at the same per-worker batch: per-worker throughput at N against one node's
    node_step = step_time(run.workload, strategy, run.per_node, 1, net.params,
                          full["batch_per_worker"], shared_inter=net.shared_inter)
    node_rate = full["batch_per_worker"] / node_step.total
    return {"name": run.name, "published": run.result, "published_s": run.seconds,
            "predicted_s": full["time_to_train_s"], "step_s": full["step_s"],
            "compute_s": full["compute_s"], "exposed_comm_s": full["exposed_comm_s"],
            "efficiency_vs_one_worker": full["efficiency"],
            "efficiency_vs_one_node": (full["samples_per_s"] / run.workers) / node_rate,
            "one_node_step_s": one_node["step_s"], "ratio": full["time_to_train_s"] / run.seconds}

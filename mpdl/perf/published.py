"""Published figures beside `mpdl simulate`'s predictions (`mpdl simulate --published`).

Each row: name, published, predicted, unit, ratio (predicted/published), band (the allowed
relative error) and ok. The inputs are the hardware and layouts the papers state; where a paper
leaves a figure out, the assumption is named in `NETWORKS`' and `layouts.GPUS`' sources.
"""

from __future__ import annotations

from typing import Any

from mpdl.parallel.pipeline import schedule_ops, timed_bubble
from mpdl.parallel.pipeline.schedule import check, generate
from mpdl.perf import goodput as G
from mpdl.perf import layouts as L
from mpdl.perf import simulate as S

#: clusters of the transformer papers; the inter-node bandwidth is per GPU (the node's adapters
#: shared by its GPUs), the intra-node one per direction
NETWORKS: dict[str, S.Network] = {
    "dgx2h": S.network(
        "dgx2h", 150e9, 5e-6, 100e9 / 16, 5e-6, per_node=16, gamma=0.0,
        source="Shoeybi et al. 2019: DGX-2H, 16 V100 on NVSwitch (300 GB/s stated, both "
               "directions: 150 GB/s each way), 8 x 100 Gbit/s InfiniBand per server shared by "
               "16 GPUs (6.25 GB/s per GPU); latencies assumed"),
    "selene": S.network(
        "selene", 300e9, 5e-6, 25e9, 5e-6, per_node=8, gamma=0.0,
        source="Narayanan et al. 2021: DGX A100, 8 A100 on NVSwitch (600 GB/s stated, both "
               "directions: 300 GB/s each way), 8 x 200 Gbit/s HDR InfiniBand per node "
               "(25 GB/s per GPU); latencies assumed"),
    "grand-teton": S.network(
        "grand-teton", 450e9, 5e-6, 50e9, 5e-6, per_node=8, gamma=0.0,
        source="Dubey et al. 2024 (Llama 3), section 3.3.1: 8 H100 per server on NVLink (900 "
               "GB/s both directions: 450 GB/s each way), 400 Gbit/s RoCE per GPU (50 GB/s); "
               "latencies assumed"),
    "hgx-h200": S.network(
        "hgx-h200", 450e9, 5e-6, 50e9, 5e-6, per_node=8, gamma=0.0,
        source="HGX H200 (nvidia.com/h200): 8 H200 on NVLink (900 GB/s both directions: 450 "
               "GB/s each way), a 400 Gbit/s ConnectX-7 per GPU (50 GB/s); latencies assumed"),
    "hgx-b200": S.network(
        "hgx-b200", 900e9, 5e-6, 50e9, 5e-6, per_node=8, gamma=0.0,
        source="DGX B200 (nvidia.com/dgx-b200): 8 B200 on NVLink 5 (1.8 TB/s both directions: "
               "900 GB/s each way), a 400 Gbit/s ConnectX-7 per GPU (50 GB/s); latencies assumed"),
    "gb200-nvl72": S.network(
        "gb200-nvl72", 900e9, 5e-6, 50e9, 5e-6, per_node=72, gamma=0.0,
        source="GB200 NVL72 (nvidia.com/gb200-nvl72): 72 GPUs on one NVLink 5 domain (1.8 TB/s "
               "a GPU both directions: 900 GB/s each way), 400 Gbit/s a GPU between racks "
               "(assumed, as HGX); latencies assumed"),
    "h800-cluster": S.network(
        "h800-cluster", 200e9, 5e-6, 50e9, 5e-6, per_node=8, gamma=0.0,
        source="DeepSeek-V3 report (arXiv 2412.19437), sections 3.1 and 3.2.2: 8 H800 a node on "
               "NVLink and NVSwitch (400 GB/s both directions on the data sheet: 200 GB/s each "
               "way), InfiniBand between nodes at 50 GB/s a GPU; latencies assumed"),
}

#: the network `mpdl simulate --gpu` runs on unless --network says otherwise
GPU_NETWORK = {"h200": "hgx-h200", "b200": "hgx-b200", "gb200": "gb200-nvl72",
               "h800": "h800-cluster"}

MEGATRON = (L.SHAPES["megatron-8.3b"], L.Layout(dp=64, pp=1, tp=8, microbatches=1,
                                                recompute="full"), "dgx2h", "v100-32gb")
PTDP = (L.SHAPES["ptdp-1t"], L.Layout(dp=6, pp=64, tp=8, microbatches=512, recompute="full"),
        "selene", "a100-80gb")
#: Korthikanti et al. 2022: the 530B model on 2240 A100 (t = 8, p = 35, d = 8), one sequence a
#: micro-batch; the global batch of 2240 sequences is assumed (the abstract states the GPUs and the
#: MFU only)
KORTHIKANTI_530B = dict(dp=8, pp=35, tp=8, microbatches=280)
#: Llama 3 405B, Dubey et al. 2024, Table 4: (GPUs, tp, cp, pp, dp, sequence, sequences per dp
#: rank, TFLOP/s per GPU). FlashAttention recomputes the attention core in backward: the memory
#: and FLOPs of selective recomputation. The third row's dp is 8, as its 16,384 GPUs and 16M
#: tokens per batch require (the table prints 4)
LLAMA3 = ((8192, 8, 1, 16, 64, 8192, 32, 430.0), (16384, 8, 1, 16, 128, 8192, 16, 400.0),
          (16384, 8, 16, 16, 8, 131072, 16, 380.0))
#: Llama 3's interleaving depth, from §3.3.2: one layer removed from the first and the last
#: stage leaves "the first model chunk on the first stage" with "only the embedding", so a chunk
#: is one layer, and 126 + 2 = 128 chunks on 16 stages are 8 a stage
LLAMA3_VIRTUAL = 8
#: the band of every row: predicted/published within ±15%
BAND = 0.15
#: Korthikanti et al. 2022, Table 2: activation bytes per layer, 16-bit, as the paper writes them
KORTHIKANTI_TABLE2 = {
    ("none", False, 1): lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h),
    ("none", False, 8): lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
    ("none", True, 8): lambda s, b, h, a, t: s * b * h * (34 / t + 5 * a * s / (h * t)),
    ("selective", False, 8): lambda s, b, h, a, t: s * b * h * (10 + 24 / t),
    ("selective", True, 8): lambda s, b, h, a, t: s * b * h * 34 / t,
    ("full", False, 8): lambda s, b, h, a, t: 2 * s * b * h,
}


def megatron_flops_per_token(layers: int, hidden: int, seq: int, vocab: int) -> float:
    """Model FLOPs per token as Megatron-LM counts them (Narayanan et al. 2021, eq. 3, without
    recomputation): 72·l·h²·(1 + s/(6h)) + 6·V·h."""
    return 72 * layers * hidden ** 2 * (1 + seq / (6 * hidden)) + 6 * vocab * hidden


#: Megatron-LM's README (github.com/NVIDIA/Megatron-LM, README.md, "Performance Benchmarking",
#: images/model_table.png, added in f2e5db4 "New scaling figures on H100 GPUs"; Megatron-Core
#: r0.8.0): GPTs of vocabulary 131,072 and sequence 4096 on H100, distributed optimizer with
#: --overlap-grad-reduce --overlap-param-gather, --tp-comm-overlap (which needs sequence
#: parallelism): (size, heads, hidden, layers, t, p, d, batch, TFLOP/s per GPU in Megatron's
#: count). The first row calibrates the H100's η; the others are checked
MCORE_TABLE = (("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
               ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
               ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
               ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
               ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
               ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
               ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
               ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
               ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9))


def mcore_run(size: str) -> tuple[L.Shape, L.Layout, float]:
    """A row of `MCORE_TABLE` as the model takes it: the shape with FlashAttention's kernels (the
    llama family's, and the attention core recomputed in backward: selective recomputation),
    one sequence a micro-batch and no interleaving (the README states neither), and the
    published TFLOP/s per GPU."""
    _, heads, hidden, layers, tp, pp, dp, batch, figure = next(
        r for r in MCORE_TABLE if r[0] == size)
    shape = L.Shape(layers, hidden, heads, 4096, 131072, 1, f"mcore-{size.lower()}",
                    family="llama")
    layout = L.Layout(dp=dp, pp=pp, tp=tp, zero=1, microbatches=batch // dp,
                      recompute="selective", sp=tp > 1, tp_overlap=True, gather_overlap=True)
    return shape, layout, figure


MCORE_1_7B, MCORE_1_7B_LAYOUT, _ = mcore_run("1.7B")

#: the published runs each GPU's η (`mpdl.perf.compute`) is derived from, none of them a row the
#: model is checked against: (shape, layout, network, stated FLOP/s per GPU counted with
#: recomputation, source)
CALIBRATION: dict[str, tuple[L.Shape, L.Layout, str, float, str]] = {
    "a100": (L.SHAPES["ptdp-1.7b"], L.Layout(dp=32, microbatches=16, recompute="full"), "selene",
             137e12, "Narayanan et al. 2021, Table 1: 1.7B, (t, p) = (1, 1), 32 GPUs, batch 512, "
                     "137 TFLOP/s a GPU"),
    "v100": (L.Shape(40, 1536, 16, 1024, 51200, 8, "megatron-1.2b"), L.Layout(recompute="full"),
             "dgx2h", 39e12, "Shoeybi et al. 2019, §5.1: the 1.2B model on one GPU, 39 TFLOP/s"),
    # the README's 408.8 TFLOP/s in Megatron's count, as tokens/s, times the model's own count
    # with FlashAttention's recomputation
    "h100": (MCORE_1_7B, MCORE_1_7B_LAYOUT, "grand-teton",
             408.8e12 / megatron_flops_per_token(24, 2048, 4096, 131072)
             * (MCORE_1_7B.flops_per_token + MCORE_1_7B.recompute_flops_per_token("selective")),
             "Megatron-LM README, H100 model table: 1.7B, (t, p, d) = (1, 1, 48), batch 192, "
             "408.8 TFLOP/s a GPU"),
}


def calibrate_efficiency(gpu: L.Gpu, run: str) -> float:
    """The η at which the model gives `run` (a key of `CALIBRATION`) its stated FLOP/s per GPU
    on `gpu` (bisection to 10⁻⁶)."""
    shape, layout, net_name, figure, _ = CALIBRATION[run]
    net = NETWORKS[net_name]
    low, high = 0.01, 1.0
    while high - low > 1e-6:
        eta = (low + high) / 2
        row = L.step(shape, layout, L.PRECISIONS["fp16"], L.replace(gpu, gemm_efficiency=eta),
                     net.params, net.per_node)
        low, high = (eta, high) if row["hardware_flops_per_s"] / layout.gpus < figure \
            else (low, eta)
    return (low + high) / 2


def _row(name: str, published: float, predicted: float, unit: str, band: float,
         lower_bound: bool = False, **extra: Any) -> dict[str, Any]:
    """A row; with `lower_bound` the published figure is a floor ("over 90%"): ok when the
    ratio lies in [1, 1 + band]."""
    ratio = predicted / published
    low = 1 if lower_bound else 1 - band
    return {"name": name, "published": published, "predicted": predicted, "unit": unit,
            "ratio": ratio, "band": band, "ok": low - 1e-12 <= ratio <= 1 + band + 1e-12,
            **({"bound": "lower"} if lower_bound else {}), **extra}


def pipeline_schedule_bubble(pp: int, m: int, schedule: str) -> float:
    """The idle share of a stage in an event-by-event pipeline timetable: the op orders the
    pipeline runs (`schedule_ops`: AFAB, all forwards then all backwards; 1F1B, pp−i−1 warm-up
    forwards, then one forward and one backward in turn) on a clock where a forward takes 1 unit
    and a backward 2, each op starting when its stage is free and its input has arrived
    (`timed_bubble`)."""
    orders = [schedule_ops(schedule, m, pp, i) for i in range(pp)]
    durations = [{op: 1.0 if op[0] == "F" else 2.0 for op in order} for order in orders]
    makespan, _ = timed_bubble(orders, durations)
    return 1 - 3.0 * m / makespan


def rows(search: bool = True) -> list[dict[str, Any]]:
    """Every published figure beside its prediction."""
    out = []
    mixed = L.PRECISIONS["fp16"]
    psi, nd = 7.5e9, 64
    for stage, figure in ((0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)):
        got = L.model_states(psi, mixed, stage, nd)["model_state_bytes"] / L.GB
        name = "ZeRO DDP memory" if stage == 0 else f"ZeRO stage {stage} memory"
        out.append(_row(name, figure, got, "GB per GPU", 0.02,
                        source="Rajbhandari et al. 2020, Fig. 1: Psi = 7.5B, N_d = 64, K = 12"))
    shape, layout, net_name, gpu_name = MEGATRON
    net, gpu = NETWORKS[net_name], L.GPUS[gpu_name]
    m = L.evaluate(shape, layout, mixed, gpu, net.params, net.per_node)
    eff = m["hardware_flops_per_s"] / (layout.gpus * CALIBRATION["v100"][3])
    src = "Shoeybi et al. 2019: 8.3B, 8-way model parallel x 64-way data parallel, batch 512"
    out.append(_row("Megatron-LM 8.3B on 512 V100", 15.1, m["hardware_flops_per_s"] / 1e15,
                    "PFLOP/s", BAND, layout=layout.label(), source=src))
    out.append(_row("Megatron-LM 8.3B weak-scaling efficiency", 0.76, eff,
                    "of 512 x 39 TFLOP/s", BAND, layout=layout.label(), source=src))
    shape, layout, net_name, gpu_name = PTDP
    net, gpu = NETWORKS[net_name], L.GPUS[gpu_name]
    p = L.evaluate(shape, layout, mixed, gpu, net.params, net.per_node)
    src = "Narayanan et al. 2021, Table 1: 1T, (t, p, d) = (8, 64, 6), batch 3072, micro-batch 1"
    out.append(_row("PTD-P 1T on 3072 A100", 502.0, p["hardware_flops_per_s"] / 1e15, "PFLOP/s",
                    BAND, layout=layout.label(), source=src))
    out.append(_row("PTD-P 1T share of peak", 0.52, p["hfu"], "of peak", BAND,
                    layout=layout.label(), fits=p["fits"], source=src))
    if search:
        # what 2021's Megatron-LM could choose: no context or sequence parallelism, full
        # recomputation or none
        found = L.search(shape, layout.gpus, 3072, mixed, gpu, net.params, net.per_node,
                         zero_stages=(0,), recomputes=("none", "full"), context=False,
                         sequence_parallel=False)
        best = found[0]
        out.append(_row("PTD-P 1T: --search's best against the stated layout",
                        p["step_s"], best["step_s"], "s per step", BAND,
                        best=best["layout"], stated=layout.label(),
                        stated_is_best=best["layout"] == layout.label(),
                        runners_up=[r["layout"] for r in found[1:]], source=src))
    for pp, mb in ((4, 8), (8, 32)):
        for schedule in ("afab", "1f1b"):
            out.append(_row(f"pipeline bubble p={pp} m={mb} {schedule}", L.bubble(pp, mb),
                            pipeline_schedule_bubble(pp, mb, schedule), "share of step", 1e-9,
                            source="GPipe / PipeDream-flush: (p-1)/(m+p-1), against an "
                                   "event-by-event timetable"))
        out.append(_row(f"zero bubble ZB-H1 p={pp} m={mb}", (pp - 1) / (3 * mb + pp - 1),
                        check(generate("zb-h1", pp, mb)).bubble, "share of step", 1e-9,
                        source="Qi et al. 2024 (Zero Bubble Pipeline Parallelism), ZB-H1: a "
                               "bubble of (p-1)(T_F+T_B-T_W), with T_F=T_B=T_W (p-1)/(3m+p-1), "
                               "against the generator's schedule replayed on a unit clock"))
    out += dualpipe_rows()
    for run in S.PUBLISHED:
        r = S.predict_published(run)
        out.append(_row(run.name, run.seconds, r["predicted_s"], "s to train", BAND,
                        source=run.result))
        if run.name == "Goyal et al. 2017":
            out.append(_row("Goyal et al. 2017 scaling efficiency 8 -> 256 GPUs", 0.90,
                            r["efficiency_vs_one_node"], "of one server's rate a GPU", BAND,
                            source="Goyal et al. 2017, abstract: ~90% scaling efficiency when "
                                   "moving from 8 to 256 GPUs"))
    out += five_axis_rows()
    out += mcore_rows()
    out += torchtitan_rows()
    out += deepseek_rows()
    out += fp8_rows()
    out.append(llama3_goodput_row())
    # Mikami et al.'s cluster and all-reduce, MXNet's V100 rate, 40 images per GPU
    r = S.predict_published(YAMAZAKI)
    out.append(_row("Yamazaki et al. 2019 throughput", 1.73e6,
                    YAMAZAKI.global_batch / r["step_s"], "images/s", BAND,
                    source=YAMAZAKI.result))
    return out


def dualpipe_formula(stages: int, b: float, w: float, fb: float) -> float:
    """The bubble of DualPipe and DualPipeV (PP stages; on PP/2 ranks in a V) in the DeepSeek-V3
    report's Table 2: (PP/2 − 1)(F&B + B − 3W), B a chunk's full backward, W its weight gradient,
    F&B an overlapped forward and backward pair."""
    return (stages / 2 - 1) * (fb + b - 3 * w)


def dualpipe_rows() -> list[dict[str, Any]]:
    """DualPipeV's bubble from the schedule generator, its pairs overlapped (`check(overlap=True)`),
    on the unit clock (F = W = 1, B = 2, F&B = F + B: the overlap hides communication, the two
    computations still take their time), against DeepSeek's formula: the README's example of 4
    ranks (8 stages) and 10 micro-batches, and DeepSeek-V3's 16 stages on 8 ranks."""
    src = ("DeepSeek-V3 technical report (arXiv 2412.19437), Table 2, and "
           "github.com/deepseek-ai/DualPipe README: DualPipeV bubble (PP/2-1)(F&B+B-3W), at "
           "F = W = 1, B = 2, F&B = 3, against the generator's schedule replayed with its pairs "
           "overlapped")
    out = []
    for ranks, m in ((4, 10), (8, 20)):
        replay = check(generate("dualpipev", ranks, m), overlap=True)
        out.append(_row(f"DualPipeV bubble, {2 * ranks} stages on {ranks} ranks, m={m}",
                        dualpipe_formula(2 * ranks, 2, 1, 3), max(replay.idle),
                        "forward-chunk times idle", 1e-9, source=src))
    return out


#: a run on Mikami et al.'s cluster (ABCI, V100) whose throughput the paper states: over 1.73 M
#: images/s on 2,048 GPUs at a batch of 81,920 (40 a GPU), in MXNet. The model takes it with the
#: V100's MXNet rate (NVIDIA's MXNet ResNet-50 v1.5 example) and Mikami et al.'s network and 2D
#: torus
YAMAZAKI = S.Published(
    "Yamazaki et al. 2019", "2048 V100 on ABCI, batch 81,920, MXNet, 74.7 s, over 1.73 M "
    "images/s", 74.7, S.PROFILES["resnet50-v100-mxnet"], "abci", 2048, 4, 81920, "torus2d")


def llama3_layouts(virtual: int = LLAMA3_VIRTUAL) -> list[tuple[L.Shape, L.Layout]]:
    """Llama 3 405B's three layouts of Table 4 as the model takes them: ZeRO 1, sp, selective
    recomputation, and from §3.3.2 context parallelism by an all-gather of K and V ("our CP
    implementation adopts an all-gather based method") and an interleaved schedule of `virtual`
    chunks a stage."""
    return [(L.replace(L.SHAPES["llama3-405b"], seq=seq),
             L.Layout(dp=dp, pp=pp, tp=tp, zero=1, microbatches=per_dp, recompute="selective",
                      cp=cp, sp=True, cp_mode="allgather", virtual=virtual))
            for _, tp, cp, pp, dp, seq, per_dp, _ in LLAMA3]


def five_axis_rows() -> list[dict[str, Any]]:
    """Recomputation, sequence and context parallelism, and experts: Korthikanti et al.'s
    activation table and 530B run, Llama 3 405B's three layouts, Mixtral 8x7B's parameters."""
    out = []
    bf16 = L.PRECISIONS["bf16"]
    shape = L.SHAPES["mt-nlg-530b"]
    src = "Korthikanti et al. 2022, Table 2 (530B: s = 2048, b = 1, h = 20480, a = 128)"
    for (mode, sp, t), formula in KORTHIKANTI_TABLE2.items():
        layout = L.Layout(tp=t, sp=sp, recompute=mode)
        got = L.activation_bytes_per_layer(shape, layout, bf16)
        want = formula(shape.seq, shape.microbatch, shape.hidden, shape.heads, t)
        name = f"Korthikanti Table 2: t={t}{' sp' if sp else ''} recompute={mode}"
        out.append(_row(name, want / L.GB, got / L.GB,
                        "GB per layer", 1e-9, source=src))
    net, gpu = NETWORKS["selene"], L.GPUS["a100-80gb"]
    src = ("Korthikanti et al. 2022, abstract: 530B on 2240 A100, 54.2% MFU with sequence "
           "parallelism and selective recomputation, 42.1% with full recomputation")
    for mode, sp, figure in (("selective", True, 0.542), ("full", False, 0.421)):
        layout = L.Layout(**KORTHIKANTI_530B, recompute=mode, sp=sp)
        r = L.evaluate(shape, layout, bf16, gpu, net.params, net.per_node)
        out.append(_row(f"Korthikanti 530B MFU, recompute={mode}", figure, r["mfu"], "MFU", BAND,
                        layout=layout.label(), fits=r["fits"], source=src))
    net, gpu = NETWORKS["grand-teton"], L.GPUS["h100-80gb"]
    for (gpus, *_, figure), (shape, layout) in zip(LLAMA3, llama3_layouts(), strict=True):
        r = L.evaluate(shape, layout, bf16, gpu, net.params, net.per_node)
        out.append(_row(f"Llama 3 405B on {gpus} H100, cp {layout.cp}, sequence {shape.seq}",
                        figure,
                        r["model_flops_per_s"] / gpus / 1e12, "TFLOP/s per GPU", BAND,
                        layout=layout.label(), fits=r["fits"],
                        source="Dubey et al. 2024, Table 4: BF16 model TFLOP/s per GPU"))
    mixtral = L.SHAPES["mixtral-8x7b"]
    src = ("Mistral AI, 'Mixtral of experts' (2023-12-11): 46.7B total parameters, 12.9B used per "
           "token (32 layers, d 4096, 8 experts of SwiGLU width 14336, top-2, 8 key/value heads, "
           "vocabulary 32000, untied output)")
    out.append(_row("Mixtral 8x7B parameters", 46.7, mixtral.params / 1e9, "billion", BAND,
                    source=src))
    out.append(_row("Mixtral 8x7B active parameters per token", 12.9,
                    mixtral.active_params / 1e9, "billion", BAND, source=src))
    return out


def llama3_goodput_row() -> dict[str, Any]:
    """Llama 3's effective training time against the failure model (`mpdl.perf.goodput`) at its
    interruption rate, storage and scale, with a checkpoint of bf16 weights and float32 Adam.
    "Higher than 90%" is a floor: the row passes from 0.90 up to 1.0 (a band of 1/0.9 − 1)."""
    shape = L.SHAPES["llama3-405b"]
    bf16 = L.PRECISIONS["bf16"]
    got = G.goodput(G.LLAMA3_GPUS, shape.params * (bf16.param + bf16.optimizer), G.LLAMA3)
    return _row(f"Llama 3 effective training time on {G.LLAMA3_GPUS} H100", 0.90,
                got["goodput"], "share of wall time", 1 / 0.90 - 1, lower_bound=True,
                mtbf_h=got["mtbf_s"] / 3600, checkpoint_interval_s=got["checkpoint_interval_s"],
                source="Dubey et al. 2024 (Llama 3, https://arxiv.org/abs/2407.21783), "
                       "section 3.3.4: 419 unexpected "
                       "interruptions in a 54-day snapshot on 16,384 H100, \"higher than 90% "
                       "effective training time\"; restart 600 s assumed (not stated)")


def mcore_rows() -> list[dict[str, Any]]:
    """Megatron-Core's weak scaling on H100, every row of `MCORE_TABLE` but the one η comes
    from, in TFLOP/s per GPU as Megatron counts them."""
    net, gpu = NETWORKS["grand-teton"], L.GPUS["h100-80gb"]
    out = []
    for size, *_ in MCORE_TABLE[1:]:
        shape, layout, figure = mcore_run(size)
        r = L.evaluate(shape, layout, L.PRECISIONS["bf16"], gpu, net.params, net.per_node)
        count = megatron_flops_per_token(shape.layers, shape.hidden, shape.seq, shape.vocab)
        out.append(_row(f"Megatron-Core {size} on {layout.gpus} H100", figure,
                        r["tokens_per_s"] * count / layout.gpus / 1e12,
                        "TFLOP/s per GPU (Megatron's count)", BAND, layout=layout.label(),
                        fits=r["fits"],
                        source="https://github.com/NVIDIA/Megatron-LM/blob/main/README.md"
                               "#performance-benchmarking, the model table "
                               "(images/model_table.png): per-GPU teraFLOP/s"))
    return out


#: DeepSeek-V3 on 2,048 H800 (DeepSeek-V3 report, arXiv 2412.19437, §3.1-3.3): pp 16 with
#: DualPipe, ep 64 over 8 nodes, ZeRO-1 data parallelism over the rest (dp 128), no tensor
#: parallelism, its FP8 recipe, dropless routing, 20 of the 132 SMs kept for communication
#: (§3.2.2), the norms and MLA's up-projections recomputed in backward (§3.2.3), the attention
#: core too (FlashAttention's, as the Llama 3 rows take it), 4K sequences at the final batch of
#: 15,360 (the ramp from 3,072 over the first 469B tokens left out), one sequence a micro-batch
#: assumed
DEEPSEEK_V3 = L.Layout(dp=128, pp=16, tp=1, zero=1, microbatches=15360 // 128,
                       schedule="dualpipev", recompute="selective", ep=64, capacity_factor=0,
                       virtual=2, comm_sms=20, recompute_up=True)


def deepseek_rows() -> list[dict[str, Any]]:
    """DeepSeek-V3's parameters (671B, 37B active) and its pre-training GPU-hours."""
    shape = L.SHAPES["deepseek-v3"]
    src = ("DeepSeek-V3 report (arXiv 2412.19437), §1 and §4.2: 671B total parameters, 37B "
           "activated per token (61 layers, d 7168, the first 3 dense of width 18432, then 256 "
           "routed experts of width 2048, top-8, and 1 shared; MLA's parameters counted whole)")
    out = [_row("DeepSeek-V3 parameters", 671.0, shape.params / 1e9, "billion", BAND,
                source=src),
           _row("DeepSeek-V3 active parameters per token", 37.0, shape.active_params / 1e9,
                "billion", BAND, source=src)]
    net = NETWORKS["h800-cluster"]
    r = L.evaluate(shape, DEEPSEEK_V3, L.PRECISIONS["deepseek-fp8"], L.GPUS["h800"],
                   net.params, net.per_node, tokens=14.8e12)
    out.append(_row("DeepSeek-V3 pre-training on 2048 H800", 2.664, r["gpu_hours"] / 1e6,
                    "million GPU-hours", BAND, layout=DEEPSEEK_V3.label(), fits=r["fits"],
                    source="DeepSeek-V3 report (arXiv 2412.19437), Table 1 and §1: 2,664K H800 "
                           "GPU-hours for pre-training on 14.8T tokens (180K a trillion)"))
    return out


#: TorchTitan's Llama 3 runs on 64 A100 80GB with FSDP2 (ZeRO 3, its all-gathers prefetched),
#: one sequence of 8192 a GPU (github.com/pytorch/torchtitan, docs/performance.md at 4d88a8a,
#: "Llama 3 performance numbers"): (shape, recomputation, tokens/s a GPU). The cluster's network
#: is not stated: DGX A100's 200 Gbit/s a GPU (selene) assumed; "selective op" recomputation
#: (matmul outputs kept) taken as selective
TORCHTITAN_A100 = (("llama3-8b", "selective", 2973.0), ("llama3-70b", "full", 331.0))
#: TorchTitan's Llama 3.1 405B on 512 H100 (FSDP 8, TP 8 with async TP, PP 8, Float8, full
#: recomputation, 32 sequences a data-parallel rank), 1F1B against Interleaved 1F1B: MFU from
#: pytorch/torchtitan issue #773 (the runs of benchmarks/llama3_h100_202412_torchtitan.md,
#: Table 5); 8 micro-batches (the pipeline degree) and 2 stages a rank in the interleaved one
#: are torchtitan's defaults at the commit the benchmark names (9dec370,
#: torchtitan/parallelisms/pipelining_utils.py)
TORCHTITAN_405B_MFU = {1: 0.2652, 2: 0.3388}


def torchtitan_rows() -> list[dict[str, Any]]:
    """TorchTitan's Llama 3 runs: tokens/s a GPU on 64 A100, and the 405B's gain from an
    interleaved pipeline on 512 H100 (a ratio of two runs on the same GPUs, Float8 and network,
    so what the model does not know of those cancels)."""
    out = []
    net, gpu = NETWORKS["selene"], L.GPUS["a100-80gb"]
    for name, recompute, figure in TORCHTITAN_A100:
        shape = L.SHAPES[name]
        layout = L.Layout(dp=64, zero=3, recompute=recompute, gather_overlap=True)
        r = L.evaluate(shape, layout, L.PRECISIONS["bf16"], gpu, net.params, net.per_node)
        out.append(_row(f"TorchTitan {name} on 64 A100", figure, r["tokens_per_s"] / 64,
                        "tokens/s per GPU", BAND, layout=layout.label(), fits=r["fits"],
                        source="https://github.com/pytorch/torchtitan/blob/4d88a8a/docs/"
                               "performance.md, \"Llama 3 performance numbers\": FSDP on 64 "
                               "A100, local batch 1, WPS"))
    net, gpu = NETWORKS["grand-teton"], L.GPUS["h100-80gb"]
    shape = L.replace(L.SHAPES["llama3-405b"], microbatch=4)
    rate = {}
    for virtual in TORCHTITAN_405B_MFU:
        layout = L.Layout(dp=8, pp=8, tp=8, zero=3, microbatches=8, recompute="full", sp=True,
                          virtual=virtual, tp_overlap=True, gather_overlap=True)
        rate[virtual] = L.evaluate(shape, layout, L.PRECISIONS["fp8"], gpu, net.params,
                                   net.per_node)["tokens_per_s"]
    out.append(_row("TorchTitan 405B on 512 H100: interleaved over 1F1B",
                    TORCHTITAN_405B_MFU[2] / TORCHTITAN_405B_MFU[1], rate[2] / rate[1],
                    "ratio of throughputs", BAND, layout=layout.label(),
                    source="https://github.com/pytorch/torchtitan/issues/773: 512 H100, 1F1B "
                           "26.52% MFU, Interleaved1F1B 33.88%"))
    return out


#: torchao's float8 and MXFP8 training benchmarks (pytorch/ao, docs/source/workflows/training.md,
#: "e2e training benchmarks"; TorchTitan's mxfp8.md prints the B200 table): Llama3-8B on one node
#: of 8 GPUs, FSDP2, one sequence of 8192 a GPU, per-op selective recomputation, torch.compile;
#: (GPU, network, recipe, bf16 tokens/s, the recipe's tokens/s, what the row says)
TORCHAO_FP8 = (("h100-80gb", "grand-teton", "fp8", 6150.0, 7689.5,
                "H100: tensorwise float8 with float8 all-gather"),
               ("b200", "hgx-b200", "fp8", 8307.5, 10417.0,
                "power-limited B200: tensorwise float8 with float8 all-gather"),
               ("b200", "hgx-b200", "mxfp8", 8307.5, 9969.0,
                "power-limited B200: mxfp8_cublas"))


def fp8_rows() -> list[dict[str, Any]]:
    """FP8 and MXFP8 training's speedup over bf16 on one node: the ratio of two runs on the same
    GPUs (the B200s' power limit, which the model does not know, slows both)."""
    shape = L.SHAPES["llama3-8b"]
    layout = L.Layout(dp=8, zero=3, recompute="selective", gather_overlap=True)
    out = []
    for gpu, net_name, recipe, bf16, figure, what in TORCHAO_FP8:
        net = NETWORKS[net_name]
        rate = {p: L.evaluate(shape, layout, L.PRECISIONS[p], L.GPUS[gpu], net.params,
                              net.per_node)["tokens_per_s"] for p in ("bf16", recipe)}
        out.append(_row(f"torchao Llama3-8B on 8 {gpu}: {recipe} over bf16", figure / bf16,
                        rate[recipe] / rate["bf16"], "ratio of throughputs", BAND,
                        layout=layout.label(),
                        source=f"pytorch/ao docs/source/workflows/training.md, e2e training "
                               f"benchmarks, {what}: {figure:g} against {bf16:g} tokens/s"))
    return out

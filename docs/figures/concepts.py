"""The concept pages' figures, drawn from the formulas they teach (no measurement, no mpdl import).

`make docs-figures` (or `python docs/figures/concepts.py`) rewrites docs/figures/concept_*.svg
byte for byte the same each time (fixed seeds, no dates in the files)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

OUT = Path(__file__).resolve().parent
plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "mpdl", "font.size": 9,
                     "axes.spines.top": False, "axes.spines.right": False})
COLORS = plt.get_cmap("tab10").colors


def save(fig, name: str) -> None:
    """Write one figure as docs/figures/concept_NAME.svg, without a date."""
    fig.tight_layout()
    fig.savefig(OUT / f"concept_{name}.svg", metadata={"Date": None})
    plt.close(fig)


def ring() -> None:
    """Ring all-reduce on 4 ranks: which block each rank sends at each of the 2(p-1) steps."""
    p = 4
    fig, ax = plt.subplots(figsize=(7, 2.4))
    for step in range(2 * (p - 1)):
        for r in range(p):
            block = (r - step - 1) % p if step < p - 1 else (r - (step - (p - 1))) % p
            ax.add_patch(plt.Rectangle((step, r), 0.9, 0.8, color=COLORS[block], alpha=0.8))
            ax.text(step + 0.45, r + 0.4, f"b{block}→{(r + 1) % p}", ha="center", va="center", fontsize=8)
    ax.axvline(p - 1 - 0.05, color="k", ls="--", lw=1)
    ax.text((p - 1) / 2, p + 0.1, "reduce-scatter: add the block received", ha="center")
    ax.text(p - 1 + (p - 1) / 2, p + 0.1, "all-gather: copy the block received", ha="center")
    ax.set(xlim=(0, 2 * (p - 1)), ylim=(0, p + 0.5), xlabel="step", ylabel="rank",
           yticks=np.arange(p) + 0.4, yticklabels=range(p), xticks=np.arange(2 * (p - 1)) + 0.45,
           xticklabels=range(1, 2 * (p - 1) + 1))
    save(fig, "ring")


def autograd() -> None:
    """The graph of y = sum(d + sum(d)), d = x + 0: the backward order Kahn's algorithm gives."""
    nodes = {"x": (0, 1), "d = x + 0": (1, 1), "s = d.sum()": (2, 0.1), "d + s": (3, 1), "y = sum": (4, 1)}
    order = {"y = sum": 1, "d + s": 2, "s = d.sum()": 3, "d = x + 0": 4, "x": 5}
    edges = [("x", "d = x + 0"), ("d = x + 0", "s = d.sum()"), ("d = x + 0", "d + s"),
             ("s = d.sum()", "d + s"), ("d + s", "y = sum")]
    fig, ax = plt.subplots(figsize=(7, 2))
    for a, b in edges:
        ax.annotate("", xy=nodes[b], xytext=nodes[a],
                    arrowprops={"arrowstyle": "-|>", "color": "0.4", "shrinkA": 32, "shrinkB": 32})
    for name, (x, y) in nodes.items():
        ax.text(x, y, f"{name}\nbackward #{order[name]}", ha="center", va="center",
                bbox={"boxstyle": "round", "fc": "#dde8f5" if name != "x" else "#f5e6c8"})
    ax.text(3.2, 0.1, "d has two consumers:\nits backward waits for both", ha="left", color="C3")
    ax.set(xlim=(-0.5, 4.5), ylim=(-0.4, 1.5)); ax.axis("off")
    save(fig, "autograd")


def ddp() -> None:
    """DDP's overlap: bucket all-reduces start while backward computes the earlier layers."""
    fig, ax = plt.subplots(figsize=(7, 2))
    layers, t = 6, 1.0
    for i in range(layers):
        ax.barh(1, t, left=i * t, color=COLORS[0], edgecolor="w")
        ax.text(i * t + 0.5, 1, f"grad L{layers - i}", ha="center", va="center", color="w", fontsize=8)
    free = 0.0
    for k in range(3):
        start = max((2 * k + 2) * t, free)
        ax.barh(0, 1.4, left=start, color=COLORS[1], edgecolor="w")
        ax.text(start + 0.7, 0, f"all-reduce\nbucket {k}", ha="center", va="center", fontsize=8)
        free = start + 1.4
    ax.annotate("exposed", xy=(layers * t, -0.45), xytext=(free, -0.45),
                arrowprops={"arrowstyle": "<->"}, va="center")
    ax.set(yticks=[0, 1], yticklabels=["communication", "backward"], xlabel="time")
    save(fig, "ddp")


def zero() -> None:
    """Memory per rank of model states, (2 + 2 + K)Ψ bytes, by ZeRO stage (Ψ = 7.5B, N = 64, K = 12)."""
    psi, n, k = 7.5, 64, 12
    stages = {"DDP": (2 * psi, 2 * psi, k * psi), "ZeRO-1": (2 * psi, 2 * psi, k * psi / n),
              "ZeRO-2": (2 * psi, 2 * psi / n, k * psi / n), "ZeRO-3": (2 * psi / n, 2 * psi / n, k * psi / n)}
    fig, ax = plt.subplots(figsize=(6, 2.6))
    for i, (name, parts) in enumerate(stages.items()):
        left = 0
        for j, (label, v) in enumerate(zip(("parameters (16-bit)", "gradients (16-bit)",
                                            "optimizer state (K = 12)"), parts)):
            ax.barh(i, v, left=left, color=COLORS[j], label=label if i == 0 else None)
            left += v
        ax.text(left + 2, i, f"{left:.1f} GB", va="center")
    ax.set(yticks=range(4), yticklabels=stages, xlabel="GB per rank (Ψ = 7.5B parameters, 64 ranks)",
           xlim=(0, 145)); ax.invert_yaxis(); ax.legend(loc="lower right", fontsize=8)
    save(fig, "zero")


def pipeline() -> None:
    """AFAB and 1F1B on 4 stages and 8 micro-batches (backward = 2 × forward): the bubble."""
    p, m = 4, 8
    fig, axes = plt.subplots(2, 1, figsize=(7, 3.2), sharex=True)
    for ax, name in zip(axes, ("AFAB", "1F1B")):
        for s in range(p):
            if name == "AFAB":
                ops = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            else:
                warm = p - 1 - s
                ops = [("F", i) for i in range(warm)]
                for i in range(m - warm):
                    ops += [("F", warm + i), ("B", i)]
                ops += [("B", i) for i in range(m - warm, m)]
            ax.ops = getattr(ax, "ops", {}); ax.ops[s] = ops
        done = {}
        free = [0.0] * p
        pending = {s: list(ax.ops[s]) for s in range(p)}
        while any(pending.values()):
            for s in range(p):
                while pending[s]:
                    kind, i = pending[s][0]
                    dep = (kind, s - 1, i) if kind == "F" and s > 0 else \
                        ("B", s + 1, i) if kind == "B" and s < p - 1 else ("F", s, i) if kind == "B" else None
                    if dep is not None and dep not in done:
                        break
                    start = max(free[s], done.get(dep, 0.0))
                    dur = 1.0 if kind == "F" else 2.0
                    ax.barh(s, dur, left=start, color=COLORS[0] if kind == "F" else COLORS[1], edgecolor="w")
                    ax.text(start + dur / 2, s, str(i), ha="center", va="center", color="w", fontsize=7)
                    done[(kind, s, i)] = free[s] = start + dur
                    pending[s].pop(0)
        ax.set(yticks=range(p), yticklabels=[f"stage {s}" for s in range(p)], title=name)
        ax.invert_yaxis()
    axes[1].set_xlabel("time (forward = 1, backward = 2); blue forward, orange backward, white: the bubble")
    save(fig, "pipeline")


def context() -> None:
    """Causal attention on 4 ranks: which rank computes each block, contiguous against zigzag."""
    p = 4
    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    for ax, mode in zip(axes, ("contiguous", "zigzag")):
        chunks = 2 * p
        owner = [c // 2 for c in range(chunks)] if mode == "contiguous" else \
            [c if c < p else 2 * p - 1 - c for c in range(chunks)]
        grid = np.full((chunks, chunks), np.nan)
        for q in range(chunks):
            grid[q, : q + 1] = owner[q]
        ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(COLORS[:p]), vmin=-0.5, vmax=p - 0.5)
        work = [int(np.sum(grid == r)) for r in range(p)]
        ax.set(title=f"{mode}: blocks per rank {work}", xlabel="key block", ylabel="query block")
    save(fig, "context")


def moe() -> None:
    """Top-2 routing of 64 tokens per rank to 4 experts on 4 ranks: the all-to-all's send counts."""
    rng = np.random.default_rng(0)
    p = 4
    counts = np.zeros((p, p), dtype=int)
    for src in range(p):
        logits = rng.normal(size=(64, p)) + np.array([0.6, 0.2, 0.0, -0.3])
        top2 = np.argsort(-logits, axis=1)[:, :2]
        counts[src] = np.bincount(top2.ravel(), minlength=p)
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.imshow(counts, cmap="Blues")
    for i in range(p):
        for j in range(p):
            ax.text(j, i, counts[i, j], ha="center", va="center")
    ax.set(xlabel="destination rank (its expert)", ylabel="source rank", xticks=range(p), yticks=range(p),
           title="tokens sent: dispatch all-to-all")
    save(fig, "moe")


def memory() -> None:
    """Activation bytes per layer, s·b·h·(34 + 5as/h) (Korthikanti et al.), by recomputation."""
    s, b, h, a = 2048, 1, 12288, 96
    full, sel, none = 2 * s * b * h, 34 * s * b * h, s * b * h * (34 + 5 * a * s / h)
    fig, ax = plt.subplots(figsize=(6, 2))
    for i, (name, v) in enumerate((("none", none), ("selective", sel), ("full", full))):
        ax.barh(i, v / 2 ** 30, color=COLORS[i])
        ax.text(v / 2 ** 30 + 0.05, i, f"{v / 2 ** 30:.2f} GiB", va="center")
    ax.set(yticks=range(3), yticklabels=["no recomputation", "selective", "full"],
           xlabel="activation GiB per layer (GPT-3 175B shapes, s = 2048, b = 1, 16-bit)", xlim=(0, 3.2))
    ax.invert_yaxis()
    save(fig, "memory")


def precision() -> None:
    """The bits of float32, bfloat16 and float16: sign, exponent, mantissa."""
    formats = {"float32": (1, 8, 23), "bfloat16": (1, 8, 7), "float16": (1, 5, 10)}
    fig, ax = plt.subplots(figsize=(7, 1.8))
    for i, (name, (sg, ex, ma)) in enumerate(formats.items()):
        left = 0
        for j, (label, n) in enumerate((("sign", sg), ("exponent", ex), ("mantissa", ma))):
            ax.barh(i, n, left=left, color=COLORS[j], edgecolor="w")
            ax.text(left + n / 2, i, f"{label} {n}" if n > 2 else str(n), ha="center", va="center", fontsize=8)
            left += n
    ax.set(yticks=range(3), yticklabels=formats, xlabel="bits"); ax.invert_yaxis()
    save(fig, "precision")


def inference() -> None:
    """A roofline: decoding one token per sequence reads every weight for 2·b FLOPs per parameter."""
    peak, bw = 989e12, 3.35e12   # H100 SXM bf16 dense FLOP/s, HBM bytes/s (data sheet)
    intensity = np.logspace(-1, 4, 200)
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.loglog(intensity, np.minimum(peak, bw * intensity) / 1e12, "k")
    for b in (1, 8, 64):
        x = b  # 2·b FLOPs per 2-byte weight read
        ax.plot(x, min(peak, bw * x) / 1e12, "o", color=COLORS[1])
        ax.text(x, min(peak, bw * x) / 1e12 * 1.4, f"decode b={b}", ha="center", fontsize=8)
    x = 2048
    ax.plot(x, peak / 1e12, "o", color=COLORS[0]); ax.text(x, peak / 1e12 * 1.4, "prefill / training", ha="center", fontsize=8)
    ax.set(xlabel="FLOPs per byte read", ylabel="TFLOP/s (H100, 16-bit)", ylim=(0.2, 3000))
    save(fig, "inference")


def diloco() -> None:
    """Which steps send what: DDP every step, DiLoCo every H steps, Streaming DiLoCo one of F
    fragments every H/F steps, its all-reduce overlapping the next step (H = 8, F = 4)."""
    h, f, steps = 8, 4, 24
    fig, ax = plt.subplots(figsize=(7, 2.4))
    rows = {"DDP": [(s, 1.0, 0) for s in range(steps)],
            "DiLoCo": [(s, 1.0, 0) for s in range(h - 1, steps, h)],
            "Streaming": [(s, 1 / f, (s + 1) // (h // f) % f) for s in range(steps)
                          if (s + 1) % (h // f) == 0]}
    for y, (name, sends) in enumerate(rows.items()):
        ax.barh(2 - y + 0.25, steps, left=0, height=0.12, color="0.85")
        for s, share, frag in sends:
            ax.add_patch(plt.Rectangle((s + (1 if name == "Streaming" else 0.6), 2 - y - 0.1),
                                       0.9 if name == "Streaming" else 0.35, 0.7 * share + 0.05,
                                       color=COLORS[frag + 1 if name == "Streaming" else 0]))
        ax.text(-0.5, 2 - y + 0.1, name, ha="right", va="center")
    ax.set_title("bytes sent after each inner step (height ∝ bytes), H = 8, F = 4: a colour a "
                 "fragment, sent during the next step", fontsize=8)
    ax.set(xlim=(-4, steps + 1), ylim=(-0.3, 2.9), xlabel="inner step"); ax.set_yticks([])
    ax.spines["left"].set_visible(False)
    save(fig, "diloco")


def simulate() -> None:
    """Speedup of data parallelism with the ring's cost: compute falls as 1/N, communication does not."""
    params, sample_s, batch = 25.6e6 * 4, 2.7e-3, 32 * 1024   # ResNet-50, fixed global batch
    alpha, beta = 5e-6, 1 / 12.5e9
    n = 2 ** np.arange(0, 13)
    compute = sample_s * batch / n
    comm = np.where(n > 1, 2 * (n - 1) * alpha + 2 * params * (n - 1) / n * beta, 0)
    fig, ax = plt.subplots(figsize=(6, 2.8))
    ax.loglog(n, compute[0] / (compute + comm), "o-", label="compute + ring all-reduce")
    ax.loglog(n, n, "k:", label="ideal")
    ax.set(xlabel="workers N (global batch 32k, ResNet-50, 100 Gbit/s)", ylabel="speedup"); ax.legend()
    save(fig, "simulate")


if __name__ == "__main__":
    for draw in (ring, autograd, ddp, zero, pipeline, context, moe, memory, precision, inference, simulate,
                 diloco):
        draw()

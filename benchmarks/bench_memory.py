"""Where the memory of a GPT step goes, per rank, with and without activation recomputation.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py [--layers 8] [--width 64] [--batch 16]
        [--reps 5] [--precision both|fp32|bf16] [--json PATH]

For {none, selective, full} recomputation x {fp32, bf16} x {1 rank, tp 2, pp 2, ZeRO-3 at 4
ranks}, one `mpiexec -n N mpdl train --model gpt --dataset text --precision P` epoch each (Adam,
a 17-character text, so the default GPT has psi = 403,136 parameters); its JSON's
`memory_peak_bytes` (the ledger's peaks, max over ranks) beside mpdl's activation formula
(`mpdl.training.activation_memory.model_activation_bytes`: the layers a rank runs, its batch, its
share of the heads, the embedding and head it holds, the precision of its messages) and
Korthikanti et al.'s per-layer 16-bit count for scale.

Then the step time recomputation costs, on one process, as the thread's CPU time (steadier than
wall time on a shared machine; with OMP_NUM_THREADS=1 it is the whole step's): forward +
backward of the same GPT and batch under each mode and precision, taking turns (fp32 none,
selective, full, none with the memory ledger counting, bf16 none, selective, full, fp32 none,
...), median of `--reps`, and the forward alone; (full - none) / forward is the extra forward
full recomputation runs, and the ledger's row its overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from mpdl import memory
from mpdl.autograd import functional as F
from mpdl.models.gpt import GPT
from mpdl.parallel.pipeline import model_pieces, partition_by_weight
from mpdl.training import precision
from mpdl.training.activation_memory import korthikanti_layer_bytes, model_activation_bytes

MODES = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16")
LAYOUTS = (("1 rank", 1, []), ("tp 2", 2, ["--tp", "2"]), ("pp 2", 2, ["--pp", "2"]),
           ("zero 3", 4, ["--zero", "3"]))
VOCAB = "0123456789abcdef\n"
ROOT = Path(__file__).resolve().parents[1]


def write_text(path: Path, windows: int, block: int) -> None:
    """A text whose training part cuts into `windows` sequences of `block` characters."""
    rng = np.random.default_rng(0)
    length = int((windows * block + 1) / 0.9) + 2 * block
    path.write_text("".join(rng.choice(list(VOCAB), length)))


def train(ranks: int, flags: list[str], out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    mpiexec = Path(sys.executable).with_name("mpiexec")
    done = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, "-m", "mpdl.cli",
                           "train", *flags, "--json", str(out), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if done.returncode:
        raise SystemExit(f"mpdl train {' '.join(flags)} failed:\n{done.stderr}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return next(row for row in rows if "memory_peak_bytes" in row)  # the first epoch's


def stage_contents(args: argparse.Namespace) -> list[tuple[int, bool, bool]]:
    """(blocks, has the embedding, has the head) of each of 2 pipeline stages, as mpdl cuts."""
    gpt = GPT(len(VOCAB), args.block, args.layers, args.heads, args.width, seed=0)
    pieces = model_pieces(gpt)
    bounds = partition_by_weight([w for _, w in pieces], 2)
    last = len(pieces) - 1
    return [(sum(1 for i in range(a, b) if 0 < i < last), a == 0, b == last + 1)
            for a, b in zip(bounds, bounds[1:], strict=False)]


def formula(args: argparse.Namespace, layout: str, mode: str, name: str) -> int:
    common = dict(s=args.block, h=args.width, a=args.heads, vocab=len(VOCAB), recompute=mode,
                  precision=name)
    if layout == "tp 2":
        return model_activation_bytes(b=args.batch, layers=args.layers, t=2, **common)
    if layout == "pp 2":
        return max(model_activation_bytes(b=args.batch, layers=n, embedding=e, head=h, **common)
                   for n, e, h in stage_contents(args))
    ranks = 4 if layout == "zero 3" else 1
    return model_activation_bytes(b=args.batch // ranks, layers=args.layers, **common)


def step_times(args: argparse.Namespace) -> dict[str, float]:
    """Median CPU seconds of this thread, forward + backward, per precision and mode ("bf16
    full"; fp32 without a prefix) and with the ledger counting; and of the forwards alone
    ("forward", "bf16 forward": recomputation none)."""
    models = {}
    for name in PRECISIONS:
        for mode in MODES:
            model = GPT(len(VOCAB), args.block, args.layers, args.heads, args.width, seed=0)
            model.set_recompute(mode)
            precision.prepare(model, types.SimpleNamespace(
                optim=types.SimpleNamespace(precision=name)))
            models[label(name, mode)] = model
    rng = np.random.default_rng(0)
    x = rng.integers(0, len(VOCAB), (args.batch, args.block))
    y = rng.integers(0, len(VOCAB), (args.batch, args.block))
    ledger = memory.Ledger()
    turns = [*(label(n, m) for n in PRECISIONS[:1] for m in MODES), "ledger",
             *(label(n, m) for n in PRECISIONS[1:] for m in MODES)]
    times: dict[str, list[float]] = {k: [] for k in (*turns, "forward", "bf16 forward")}
    for rep in range(args.reps + 1):
        for turn in turns:
            with memory.counting_into(ledger if turn == "ledger" else None):
                start = time.thread_time()
                loss = F.cross_entropy(models[turn if turn != "ledger" else "none"](x), y)
                forward = time.thread_time()
                loss.backward()
                end = time.thread_time()
            if rep:  # the first round warms up
                times[turn].append(end - start)
                if turn in ("none", "bf16 none"):
                    times[turn.replace("none", "forward")].append(forward - start)
    return {k: float(np.median(v)) for k, v in times.items()}


def label(name: str, mode: str) -> str:
    """The step_times key of a precision and mode: the mode for fp32, "bf16 <mode>" else."""
    return mode if name == "fp32" else f"{name} {mode}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--batch", type=int, default=16, help="global batch (divisible by 4)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--precision", choices=("both", *PRECISIONS), default="both",
                   help="the precisions of the memory rows (the step times measure both)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    psi = sum(q.size for q in GPT(len(VOCAB), args.block, args.layers, args.heads,
                                  args.width).parameters())
    rows = []
    print(f"# GPT {args.layers} layers, width {args.width}, {args.heads} heads, T {args.block}, "
          f"global batch {args.batch}, psi = {psi:,}, Adam; bytes per rank (max over ranks); "
          f"activations: ledger / formula")
    print(f"{'layout':>8} {'prec':>4} {'recompute':>10} {'params':>9} {'master':>9} "
          f"{'grads':>9} {'optim':>9} {'comm':>8} {'activ':>10} {'formula':>10} {'ratio':>6} "
          f"{'state/psi':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        write_text(text, 2 * args.batch, args.block)
        for layout, ranks, extra in LAYOUTS:
            for name in PRECISIONS if args.precision == "both" else (args.precision,):
                for mode in MODES:
                    flags = ["--model", "gpt", "--dataset", "text", "--data", str(text),
                             "--block-size", str(args.block), "--n-layer", str(args.layers),
                             "--n-embd", str(args.width), "--n-head", str(args.heads),
                             "--optimizer", "adam", "--epochs", "1", "--global-batch-size",
                             str(args.batch), "--drop-last", "--recompute", mode,
                             "--precision", name, *extra]
                    row = train(ranks, flags, Path(tmp) / "run.jsonl")
                    peak = row["memory_peak_bytes"]
                    expected = formula(args, layout, mode, name)
                    rows.append({"layout": layout, "ranks": ranks, "recompute": mode,
                                 "precision": name, "memory_peak_bytes": peak,
                                 "state_bytes": row["memory_peak_state_bytes"],
                                 "total_bytes": row["memory_peak_total_bytes"],
                                 "activation_formula_bytes": expected})
                    print(f"{layout:>8} {name:>4} {mode:>10} {peak['parameters']:>9,} "
                          f"{peak['master_weights']:>9,} {peak['gradients']:>9,} "
                          f"{peak['optimizer_state']:>9,} {peak['communication']:>8,} "
                          f"{peak['activations']:>10,} {expected:>10,} "
                          f"{peak['activations'] / expected:>6.3f} "
                          f"{row['memory_peak_state_bytes'] / psi:>9.2f}", flush=True)
    s, b, h, a = args.block, args.batch, args.width, args.heads
    print(f"# per layer at 1 rank, Korthikanti (16-bit): none {korthikanti_layer_bytes(s, b, h, a):,.0f}"
          f", selective {korthikanti_layer_bytes(s, b, h, a, recompute='selective'):,.0f}, full "
          f"{korthikanti_layer_bytes(s, b, h, a, recompute='full'):,.0f} bytes")
    times = step_times(args)
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    for name in PRECISIONS:
        t = {m: times[label(name, m)] for m in (*MODES, "forward")}
        extra = (t["full"] - t["none"]) / t["forward"]
        print(f"# step CPU time {name}, 1 process (OMP_NUM_THREADS={threads}), median of "
              f"{args.reps}: none {t['none'] * 1e3:.1f} ms (forward {t['forward'] * 1e3:.1f} ms), "
              f"selective {t['selective'] * 1e3:.1f} ms ({t['selective'] / t['none']:.2f}x), "
              f"full {t['full'] * 1e3:.1f} ms ({t['full'] / t['none']:.2f}x): full "
              f"recomputation adds {extra:.2f} forwards")
    print(f"# with the memory ledger counting, fp32 none takes {times['ledger'] * 1e3:.1f} ms "
          f"({times['ledger'] / times['none']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "step_s": times, "psi": psi}))


if __name__ == "__main__":
    main()

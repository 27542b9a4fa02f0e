"""Clipping that binds, on every layout: `mpdl train --grad-clip 0.05` of a 2-layer GPT on
characters for 60 steps (AdamW, nanoGPT's schedule, random batches by default) on 1 rank, then
on dp 2, ZeRO 3 over dp 2, tp 2 and pp 2. For each layout: the largest difference of a final
parameter from the 1-rank run's, its validation loss beside the 1-rank one (the target: within
1e-4), and the smallest pre-clip norm logged (above the clip: it binds at every logged step).

    python benchmarks/bench_clip_layouts.py [--data FILE] [--steps 60] [--clip 0.05]
        [--batch-sampling random|epoch]

FILE: any UTF-8 text (default: the project's docs pages, cut to 200,000 characters).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from mpdl.training.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: name, ranks and flags of each layout
LAYOUTS = [("1 rank", 1, []), ("dp 2", 2, []), ("ZeRO 3 over dp 2", 2, ["--zero", "3"]),
           ("tp 2", 2, ["--tp", "2"]), ("pp 2", 2, ["--pp", "2"])]


def corpus(path: str | None, folder: Path) -> str:
    if path:
        return path
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    out = folder / "docs.txt"
    out.write_text(text[:200_000], encoding="utf-8")
    return str(out)


def run(ranks: int, flags: list[str], folder: Path) -> tuple[dict[str, np.ndarray], float, float]:
    """The final parameters (from its checkpoint), the validation loss and the smallest logged
    pre-clip gradient norm of one run."""
    folder.mkdir()
    cmd = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "mpdl"), "train", "--no-progress",
           *flags, "--checkpoint", str(folder), "--json", str(folder / "run.jsonl")]
    subprocess.run(["timeout", "-k", "5", "900", *cmd], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in (folder / "run.jsonl").read_text().splitlines()]
    norms = [d["grad_norm"] for d in lines if d.get("grad_norm") is not None]
    model_state, _, _ = load_checkpoint(folder)  # whole tensors, sharded checkpoint or not
    return model_state, lines[-1]["val_loss"], min(norms, default=float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a UTF-8 text file (default: the docs pages)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--clip", type=float, default=0.05)
    parser.add_argument("--batch-sampling", choices=("random", "epoch"), default="random")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        recipe = ["--model", "gpt", "--dataset", "text", "--data", corpus(args.data, folder),
                  "--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "64",
                  "--global-batch-size", "12", "--optimizer", "adamw", "--lr", "1e-3",
                  "--weight-decay", "0.1", "--beta2", "0.99", "--max-steps", str(args.steps),
                  "--warmup-steps", "10", "--lr-decay-steps", str(args.steps),
                  "--min-lr", "1e-4", "--grad-clip", str(args.clip),
                  "--batch-sampling", args.batch_sampling, "--log-interval", "5"]
        print(f"# mpdl train {' '.join(recipe[4:])}")
        print(f"{'layout':18s} {'max |param - 1 rank|':>21s} {'val_loss':>10s} {'- 1 rank':>10s} "
              f"{'min norm':>9s}")
        reference, reference_loss = None, 0.0
        for i, (name, ranks, flags) in enumerate(LAYOUTS):
            params, loss, norm = run(ranks, [*recipe, *flags], folder / f"run{i}")
            if reference is None:
                reference, reference_loss = params, loss
            diff = max(float(np.abs(params[k] - reference[k]).max()) for k in reference)
            print(f"{name:18s} {diff:21.2e} {loss:10.6f} {loss - reference_loss:10.2e} "
                  f"{norm:9.3f}")


if __name__ == "__main__":
    main()

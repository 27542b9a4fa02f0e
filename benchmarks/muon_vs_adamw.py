"""Steps to a validation loss: Muon decaying over fewer steps against AdamW, one process.

    python benchmarks/muon_vs_adamw.py [--text FILE] [--adamw-steps 2000] [--muon-steps 1400]
                                       [--adamw-lr 1e-3] [--muon-lr 1e-3[,2e-3...]]

A character GPT (2 blocks of width 64, block 64; vocabulary: the text's characters) trains on
the first 90% of a text (default: mpdl's own docs and README, concatenated) with the same seed,
batches and schedule shape for both optimizers: 100 warmup steps (a tenth of a shorter run),
then a cosine to lr/10 at the run's last step (AdamW at --adamw-steps and --adamw-lr, Muon at
--muon-steps and each of --muon-lr; weight decay 0.1, AdamW's betas (0.9, 0.99) for both). The
validation loss on the last 10% (the same 16 batches) is taken every --every steps; per Muon
learning rate the last lines give the first step at which Muon reaches AdamW's final validation
loss, and the first step at which AdamW reaches Muon's final one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mpdl.autograd import Tensor, no_grad, optim
from mpdl.autograd import functional as F
from mpdl.models.gpt import GPT

ROOT = Path(__file__).resolve().parents[1]
BLOCK, BATCH, LR, WD, BETAS, WARMUP = 64, 16, 1e-3, 0.1, (0.9, 0.99), 100


def corpus(path: str | None) -> str:
    if path:
        return Path(path).read_text(encoding="utf-8")
    return "".join(p.read_text(encoding="utf-8") for p in
                   [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"])


def windows(ids: np.ndarray, rng: np.random.Generator, count: int) -> np.ndarray:
    starts = rng.integers(0, len(ids) - BLOCK - 1, count)
    return np.stack([ids[s:s + BLOCK + 1] for s in starts])


def run(name: str, lr: float, steps: int, train: np.ndarray, val: np.ndarray, vocab: int,
        every: int) -> list[tuple[int, float]]:
    """(step, validation loss) every `every` steps of one optimizer's run."""
    model = GPT(vocab_size=vocab, block_size=BLOCK, n_layer=2, n_head=4, n_embd=64, seed=0)
    make = optim.AdamW if name == "adamw" else optim.Muon
    opt = make(model.parameters(), lr=lr, betas=BETAS, weight_decay=WD)
    schedule = optim.WarmupSchedule(lr, min(WARMUP, steps // 10), steps, kind="cosine",
                                    min_lr=lr / 10)
    rng = np.random.default_rng(1)
    held_out = windows(val, np.random.default_rng(2), 16 * BATCH)
    curve = []
    for step in range(1, steps + 1):
        batch = windows(train, rng, BATCH)
        opt.lr = schedule(step - 1)
        loss = F.cross_entropy(model(Tensor(batch[:, :-1])), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % every == 0 or step == steps:
            with no_grad():
                losses = [float(F.cross_entropy(model(Tensor(b[:, :-1])), b[:, 1:]).item())
                          for b in np.split(held_out, 16)]
            curve.append((step, float(np.mean(losses))))
            print(f"{name:>6} lr {lr:g} step {step:5d} val_loss {curve[-1][1]:.4f}", flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", help="a UTF-8 text (default: mpdl's docs and README)")
    parser.add_argument("--adamw-steps", type=int, default=2000)
    parser.add_argument("--muon-steps", type=int, default=1400)
    parser.add_argument("--every", type=int, default=100, help="steps between validations")
    parser.add_argument("--adamw-lr", type=float, default=LR, help="AdamW's learning rate")
    parser.add_argument("--muon-lr", default="1e-3", help="Muon's learning rates, commas")
    parser.add_argument("--json", metavar="PATH", help="the curves and the step counts")
    args = parser.parse_args()
    text = corpus(args.text)
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.int64)
    cut = int(0.9 * len(ids))
    data = (ids[:cut], ids[cut:], len(chars), args.every)
    adamw = run("adamw", args.adamw_lr, args.adamw_steps, *data)
    rows = []
    for lr in (float(v) for v in args.muon_lr.split(",")):
        muon = run("muon", lr, args.muon_steps, *data)
        reached = next((step for step, loss in muon if loss <= adamw[-1][1]), None)
        adamw_needs = next((step for step, loss in adamw if loss <= muon[-1][1]), None)
        rows.append({"muon_lr": lr, "adamw": adamw, "muon": muon, "muon_reaches_at": reached,
                     "adamw_reaches_muon_final_at": adamw_needs})
        print(f"# muon lr {lr:g}: AdamW's val loss at step {args.adamw_steps} {adamw[-1][1]:.4f},"
              f" Muon's at step {args.muon_steps} {muon[-1][1]:.4f}; Muon reaches AdamW's at "
              f"step {reached}; AdamW reaches Muon's at step {adamw_needs}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()

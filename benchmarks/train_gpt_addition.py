"""Train a small GPT on n-digit addition in one process and report held-out exact match.

The task is ``datasets.addition`` (answers written reversed); training is next-token
cross-entropy on the answer positions with Adam, a linear warmup and a cosine decay. Every
``--eval-every`` steps (and at the end) the model greedily decodes the held-out problems; the run
stops early once exact match reaches ``--target``.

    python benchmarks/train_gpt_addition.py [--digits 3] [--steps 3000] [--batch 128] ...
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import mpdl.autograd.functional as F  # noqa: E402
from mpdl import datasets  # noqa: E402
from mpdl.autograd import optim  # noqa: E402
from mpdl.models.gpt import GPT  # noqa: E402
from mpdl.models.moe import MoESettings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--digits", type=int, default=3)
    parser.add_argument("--n-train", type=int, default=50_000, help="distinct training problems")
    parser.add_argument("--n-test", type=int, default=1_000, help="held-out problems")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--target", type=float, default=0.95, help="stop at this exact match")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe-experts", type=int, default=0,
                        help="a mixture of E experts (top-2, dropless) in place of each MLP")
    args = parser.parse_args()

    task = datasets.addition(args.digits, args.n_train, args.n_test, seed=args.seed)
    model = GPT(len(task.vocab), task.block_size, args.n_layer, args.n_head, args.n_embd,
                seed=args.seed, moe=MoESettings(args.moe_experts) if args.moe_experts else None)
    opt = optim.Adam(model.parameters(), lr=args.lr)
    schedule = optim.WarmupSchedule(args.lr, args.warmup, args.steps, kind="cosine",
                                    min_lr=args.lr / 10)
    rng = np.random.default_rng(args.seed)
    print(f"{args.digits}-digit addition: {len(task.x_train)} training problems, "
          f"{len(task.x_test)} held out; GPT {args.n_layer} layers, {args.n_head} heads, width "
          f"{args.n_embd}, {model.num_parameters():,} parameters; batch {args.batch}, lr "
          f"{args.lr}, up to {args.steps} steps")
    start = time.perf_counter()
    match, step = 0.0, 0
    while step < args.steps:
        opt.lr = schedule(step)
        pick = rng.integers(0, len(task.x_train), args.batch)
        loss = F.cross_entropy(model(task.x_train[pick]), task.y_train[pick])
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        if step % args.eval_every == 0 or step == args.steps:
            match = datasets.exact_match(model, task)
            print(f"step {step:>6}  loss {loss.item():.4f}  exact match {match:.3f}  "
                  f"{time.perf_counter() - start:7.1f} s", flush=True)
            if match >= args.target:
                break
    print(f"exact match {match:.3f} on {len(task.x_test)} held-out problems after {step} steps, "
          f"{time.perf_counter() - start:.1f} s wall time")


if __name__ == "__main__":
    main()

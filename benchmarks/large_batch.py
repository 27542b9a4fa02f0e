"""The large-batch recipe on small data: linear scaling, gradual warmup, LARS.

    python benchmarks/large_batch.py [--epochs 30] [--ks 8,32] [--datasets digits,mnist]

Goyal et al. (2017): with k× the batch, multiply the learning rate by k and warm it up over the
first epochs; without warmup the large rate hurts early training and accuracy drops. You et al.
(2017): LARS's per-layer trust ratio keeps accuracy at batch sizes where SGD's does not. Every
run has the same epoch budget (so k× batch = k× fewer steps), momentum 0.9 and a cosine decay
after warmup; the table gives the final test accuracy of each (dataset, batch, recipe).

Datasets: the shipped UCI digits (8×8) and MNIST-shaped data: the real MNIST if `--mnist PATH`
points at it (IDX folder or .npz), otherwise a synthetic, learnable 1×28×28 set from
`mpdl.datasets.synthetic` (class templates plus noise), which the header says. Single process:
large-batch behaviour needs no MPI.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from mpdl import datasets
from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import LARS, SGD, WarmupSchedule
from mpdl.autograd.tensor import Tensor


def mlp(inputs: int, seed: int) -> nn.Module:
    return nn.Sequential(nn.Linear(inputs, 128, seed=seed), nn.ReLU(),
                         nn.Linear(128, 128, seed=seed + 1), nn.ReLU(),
                         nn.Linear(128, 10, seed=seed + 2))


def train(data, batch: int, lr: float, warmup_epochs: float, optimizer: str, epochs: int,
          seed: int = 0) -> float:
    xtr, ytr, xte, yte = data
    model = mlp(xtr.shape[1], seed)
    params = model.parameters()
    opt = (LARS(params, lr=lr, momentum=0.9, weight_decay=5e-4, eta=0.001) if optimizer == "lars"
           else SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4))
    steps_per_epoch = -(-len(xtr) // batch)
    total = epochs * steps_per_epoch
    schedule = WarmupSchedule(lr, warmup_steps=int(round(warmup_epochs * steps_per_epoch)),
                              total_steps=total, kind="cosine")
    rng = np.random.default_rng(seed)
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(xtr))
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            opt.lr = schedule(step)
            loss = F.cross_entropy(model(Tensor(xtr[idx])), ytr[idx])
            if not np.isfinite(loss.item()):
                return float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
    pred = model(Tensor(xte)).data.argmax(1)
    return float((pred == yte).mean())


def load(name: str, mnist: str | None):
    if name == "digits":
        return datasets.load_digits(seed=0), "UCI digits 8x8 (1437 train / 360 test)"
    if mnist:
        xtr, ytr, xte, yte = datasets.load_mnist(mnist)
        label = f"MNIST from {mnist}"
    else:
        xtr, ytr, xte, yte = datasets.synthetic("mnist", 6000, 1000, seed=0)
        label = "MNIST-shaped SYNTHETIC data (no MNIST given): 1x28x28, 6000 train / 1000 test"
    return (xtr.reshape(len(xtr), -1), ytr, xte.reshape(len(xte), -1), yte), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--base-batch", type=int, default=32)
    parser.add_argument("--base-lr", type=float, default=0.05)
    parser.add_argument("--ks", default="8,16", help="batch multipliers")
    parser.add_argument("--warmup-epochs", type=float, default=5.0)
    parser.add_argument("--lars-lr", type=float, default=0.5,
                        help="LARS base rate at the base batch (scaled by k like SGD's)")
    parser.add_argument("--datasets", default="digits,mnist")
    parser.add_argument("--mnist", metavar="PATH", help="real MNIST (IDX folder or .npz)")
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    b0, lr0, warm = args.base_batch, args.base_lr, args.warmup_epochs
    started = time.perf_counter()
    for name in args.datasets.split(","):
        data, label = load(name, args.mnist)
        print(f"# {label}; MLP 128-128, momentum 0.9, weight decay 5e-4, {args.epochs} epochs, "
              f"cosine decay; warmup = {warm:g} epochs linear")
        print(f"{'batch':>6} {'recipe':>34} {'lr':>7} {'test acc':>8}")
        rows = [(b0, "baseline (small batch)", lr0, 0.0, "sgd")]
        for k in ks:
            rows += [(k * b0, "same lr (no scaling)", lr0, 0.0, "sgd"),
                     (k * b0, "lr x k, no warmup", lr0 * k, 0.0, "sgd"),
                     (k * b0, "lr x k + warmup (Goyal et al.)", lr0 * k, warm, "sgd"),
                     (k * b0, "LARS, lr x k + warmup", args.lars_lr * k, warm, "lars")]
        for batch, recipe, lr, w, opt in rows:
            acc = train(data, batch, lr, w, opt, args.epochs)
            print(f"{batch:>6} {recipe:>34} {lr:>7.3g} {acc:>8.4f}", flush=True)
    print(f"# {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()

"""Train-step time of mpdl.autograd against PyTorch on the CPU, one thread each.

One step is forward + backward + SGD update on the same model, batch and initial weights.
Runs alternate (ours, torch, ours, torch, ...) so that machine noise hits both alike; the table
reports the median ms/step of each and their ratio.

    python benchmarks/bench_autograd.py [--reps 7] [--steps 20]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import mpdl.autograd.functional as F  # noqa: E402
from mpdl.autograd import Tensor, nn, optim  # noqa: E402


def mlp(rng):
    return nn.Sequential(nn.Linear(784, 512, rng=rng), nn.ReLU(), nn.Linear(512, 512, rng=rng),
                         nn.ReLU(), nn.Linear(512, 10, rng=rng))


def lenet(rng):
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2, rng=rng), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5, rng=rng), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120, rng=rng), nn.ReLU(), nn.Linear(120, 84, rng=rng), nn.ReLU(),
        nn.Linear(84, 10, rng=rng))


def torch_mlp(torch):
    t = torch.nn
    return t.Sequential(t.Linear(784, 512), t.ReLU(), t.Linear(512, 512), t.ReLU(),
                        t.Linear(512, 10))


def torch_lenet(torch):
    t = torch.nn
    return t.Sequential(t.Conv2d(1, 6, 5, padding=2), t.ReLU(), t.MaxPool2d(2),
                        t.Conv2d(6, 16, 5), t.ReLU(), t.MaxPool2d(2), t.Flatten(),
                        t.Linear(400, 120), t.ReLU(), t.Linear(120, 84), t.ReLU(),
                        t.Linear(84, 10))


MODELS = {
    "MLP 784-512-512-10, batch 128": (mlp, torch_mlp, (128, 784), 1.3),
    "LeNet-5 CNN 1x28x28, batch 64": (lenet, torch_lenet, (64, 1, 28, 28), 3.0),
}


def ours_step_fn(model, x, y):
    opt = optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xt = Tensor(x)

    def step():
        loss = F.cross_entropy(model(xt), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def torch_step_fn(torch, model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        loss = torch.nn.functional.cross_entropy(model(xt), yt)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def time_steps(step, steps: int) -> float:
    """Milliseconds per step over ``steps`` steps (after one warm-up step)."""
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per side")
    parser.add_argument("--steps", type=int, default=20, help="train steps per repetition")
    args = parser.parse_args()

    import torch  # noqa: PLC0415  (optional: only the benchmark needs it)

    torch.set_num_threads(1)
    threadpool_limits(1)
    print(f"numpy {np.__version__}, torch {torch.__version__}, 1 thread each, "
          f"{args.reps} interleaved repetitions x {args.steps} steps, median ms/step")
    print(f"{'model':<32}{'mpdl':>10}{'torch':>10}{'ratio':>8}{'target':>8}")
    for name, (build, build_torch, shape, target) in MODELS.items():
        rng = np.random.default_rng(0)
        ours = build(rng)
        theirs = build_torch(torch)
        with torch.no_grad():
            for (_, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters(),
                                      strict=True):
                q.copy_(torch.from_numpy(p.data))
        x = rng.random(shape, dtype=np.float32)
        y = rng.integers(0, 10, shape[0])
        ours_step = ours_step_fn(ours, x, y)
        torch_step = torch_step_fn(torch, theirs, x, y)
        ours_ms, torch_ms = [], []
        for _ in range(args.reps):
            ours_ms.append(time_steps(ours_step, args.steps))
            torch_ms.append(time_steps(torch_step, args.steps))
        a, b = statistics.median(ours_ms), statistics.median(torch_ms)
        print(f"{name:<32}{a:>10.2f}{b:>10.2f}{a / b:>8.2f}{target:>8.1f}")


if __name__ == "__main__":
    main()

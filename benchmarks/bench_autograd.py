"""Train-step time of mpdl.autograd against PyTorch on the CPU, one thread each.

One step is forward + backward + SGD update on the same model, batch and initial weights.
Runs alternate (ours, torch, ours, torch, ...) so that machine noise hits both alike; the table
reports the median ms/step of each and their ratio.

    python benchmarks/bench_autograd.py [--reps 7] [--steps 20] [--ops] [--clock wall|cpu]

``--ops`` adds, for the LeNet step, the forward and backward time of each layer, the loss and the
optimizer update on both sides (each layer timed on its own input from the step, same medians).
The header names the BLAS kernel NumPy runs (``OPENBLAS_CORETYPE`` can force an older one) and
whether the glibc heap is kept between steps, as ``mpdl train`` keeps it (``MPDL_MALLOC=default``:
not), which spares both sides re-faulting their freed activations every step.
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
from mpdl.allocator import keep_heap  # noqa: E402
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


_clock = time.perf_counter


def _layer_pair_fns(torch, ours_layer, torch_layer, a, input_grad: bool):
    """(forward, forward + backward) closures of one layer on its input ``a``, for both sides."""
    g = np.random.default_rng(1).standard_normal(
        ours_layer(Tensor(a)).shape).astype(a.dtype)
    ta, tg = torch.from_numpy(a).requires_grad_(input_grad), torch.from_numpy(g)

    def ours_fwd():
        ours_layer(Tensor(a, requires_grad=input_grad))

    def ours_both():
        ours_layer(Tensor(a, requires_grad=input_grad)).backward(g)

    def torch_fwd():
        torch_layer(ta)

    def torch_both():
        ta.grad = None
        torch_layer(ta).backward(tg)

    return (ours_fwd, ours_both), (torch_fwd, torch_both)


def _median_ms(fn, calls: int, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = _clock()
        for _ in range(calls):
            fn()
        times.append((_clock() - start) * 1e3 / calls)
    return statistics.median(times)


def op_breakdown(torch, ours, theirs, x, y, reps: int, calls: int) -> None:
    """Print forward / backward ms of every layer, the loss and the optimizer, both sides."""
    rows = []
    a = x
    for i, (lo, lt) in enumerate(zip(ours, theirs, strict=True)):
        (of, ob), (tf, tb) = _layer_pair_fns(torch, lo, lt, a, input_grad=i > 0)
        fwd = [_median_ms(f, calls, reps) for f in (of, tf)]
        both = [_median_ms(f, calls, reps) for f in (ob, tb)]
        rows.append((f"{i}: {type(lo).__name__}", fwd, [b - f for b, f in zip(both, fwd, strict=True)]))
        a = lo(Tensor(a)).data
    logits = a
    tl, ty = torch.from_numpy(logits).requires_grad_(True), torch.from_numpy(y)

    def ours_loss():
        F.cross_entropy(Tensor(logits, requires_grad=True), y).backward()

    def torch_loss():
        tl.grad = None
        torch.nn.functional.cross_entropy(tl, ty).backward()

    rows.append(("loss fwd+bwd", [_median_ms(f, calls, reps) for f in (ours_loss, torch_loss)],
                 [0.0, 0.0]))
    ours_opt = optim.SGD(ours.parameters(), lr=0.0, momentum=0.9)
    torch_opt = torch.optim.SGD(theirs.parameters(), lr=0.0, momentum=0.9)
    for p in ours.parameters():
        p.grad = np.zeros_like(p.data)
    for q in theirs.parameters():
        q.grad = torch.zeros_like(q)
    rows.append(("optimizer step", [_median_ms(f, calls, reps)
                                    for f in (ours_opt.step, torch_opt.step)], [0.0, 0.0]))
    print("\nper op, ms (forward | backward):")
    print(f"{'op':<22}{'mpdl fwd':>10}{'torch fwd':>10}{'mpdl bwd':>10}{'torch bwd':>10}"
          f"{'ratio f+b':>10}")
    total = [0.0, 0.0]
    for name, fwd, bwd in rows:
        ours_t, torch_t = fwd[0] + bwd[0], fwd[1] + bwd[1]
        total[0] += ours_t
        total[1] += torch_t
        print(f"{name:<22}{fwd[0]:>10.3f}{fwd[1]:>10.3f}{bwd[0]:>10.3f}{bwd[1]:>10.3f}"
              f"{ours_t / torch_t:>10.2f}")
    print(f"{'sum':<22}{total[0]:>20.3f}{total[1]:>20.3f}{total[0] / total[1]:>10.2f}")


def blas_kernel() -> str:
    """The BLAS library, version and CPU kernel NumPy's matmul runs on."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    for info in threadpool_info():
        if info.get("user_api") == "blas":
            return (f"{info.get('internal_api')} {info.get('version')}, kernel "
                    f"{info.get('architecture')}"
                    + (f" (OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']})"
                       if "OPENBLAS_CORETYPE" in os.environ else ""))
    return "no BLAS found by threadpoolctl"


def time_steps(step, steps: int) -> float:
    """Milliseconds per step over ``steps`` steps (after one warm-up step)."""
    step()
    start = _clock()
    for _ in range(steps):
        step()
    return (_clock() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per side")
    parser.add_argument("--steps", type=int, default=20, help="train steps per repetition")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, which other jobs on a busy machine "
                             "disturb less than the wall-clock time")
    parser.add_argument("--ops", action="store_true",
                        help="also time each LeNet layer's forward and backward on both sides")
    args = parser.parse_args()
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import torch  # noqa: PLC0415  (optional: only the benchmark needs it)

    torch.set_num_threads(1)
    threadpool_limits(1)
    print(f"numpy {np.__version__}, torch {torch.__version__}, 1 thread each, "
          f"{args.reps} interleaved repetitions x {args.steps} steps, median ms/step "
          f"({args.clock} clock)")
    print(f"numpy BLAS: {blas_kernel()}")
    kept = keep_heap()  # as `mpdl train` does; MPDL_MALLOC=default leaves glibc's malloc as it is
    print(f"glibc heap kept between steps (mpdl.allocator.keep_heap): {'yes' if kept else 'no'}")
    print(f"{'model':<32}{'mpdl':>10}{'torch':>10}{'ratio':>8}{'target':>8}")
    breakdown = []
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
        if args.ops and build is lenet:
            breakdown.append((ours, theirs, x, y))
    for ours, theirs, x, y in breakdown:
        op_breakdown(torch, ours, theirs, x, y, args.reps, args.steps)


if __name__ == "__main__":
    main()

"""GPT train-step time in fp32, bf16 and fp16 (mpdl's mixed precision on NumPy), one thread.

One step is forward + cross-entropy + backward + the optimizer update (Adam; under bf16/fp16 over
float32 master weights, fp16 with loss scaling), on mpdl train's default GPT and batch. Runs
alternate (fp32, bf16, fp16, fp32, ...) so that machine noise hits all alike; the table reports
the median CPU ms/step of each (this thread's CPU time: on a machine shared with other jobs the
wall clock mostly measures the wait for a core) and its ratio to fp32. A second table times what
the emulation adds per element: rounding a float32 array to the 16-bit dtype and back (every
product does that to its operands and result), against a float32 add of the same array.

    python benchmarks/bench_precision.py [--reps 5] [--steps 4] [--batch 128]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402

import mpdl.autograd.functional as F  # noqa: E402
from mpdl.autograd import optim  # noqa: E402
from mpdl.autograd.tensor import Tensor  # noqa: E402
from mpdl.backend import bfloat16  # noqa: E402
from mpdl.models.gpt import GPT  # noqa: E402
from mpdl.training import precision  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")


def trainer(name: str, batch: int, block: int):
    """A function running one train step of a fresh default GPT in precision `name`."""
    model = GPT(vocab_size=13, block_size=block, n_layer=2, n_head=4, n_embd=64, seed=0)
    config = types.SimpleNamespace(optim=types.SimpleNamespace(precision=name,
                                                               loss_scale_init=2.0**16))
    precision.prepare(model, config)
    opt = precision.optimizer_factory(lambda p: optim.Adam(p, lr=3e-3), config)(model.parameters())
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 13, (batch, block)), rng.integers(0, 13, (batch, block))

    def step() -> None:
        loss = F.cross_entropy(model(Tensor(x)), y)
        scale = getattr(opt, "loss_scale", 1.0)
        loss.backward(None if scale == 1.0 else scale)
        opt.step()
        opt.zero_grad()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=11)
    args = ap.parse_args()
    steps = {name: trainer(name, args.batch, args.block_size) for name in PRECISIONS}
    for step in steps.values():
        step()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    for _ in range(args.reps):
        for name, step in steps.items():
            start = time.thread_time()
            for _ in range(args.steps):
                step()
            times[name].append((time.thread_time() - start) / args.steps)
    base = statistics.median(times["fp32"])
    print(f"# GPT (2 layers, width 64, block {args.block_size}), batch {args.batch}, 1 thread; "
          f"median of {args.reps} x {args.steps} steps, interleaved; CPU time")
    print(f"{'precision':>9} {'ms/step':>9} {'x fp32':>7}")
    for name in PRECISIONS:
        med = statistics.median(times[name])
        print(f"{name:>9} {1000 * med:9.1f} {med / base:7.2f}")
    a = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
    print("# per element of a 2^20 float32 array, median of 9, CPU time")
    print(f"{'operation':>28} {'ns':>6}")
    ops = {"float32 add": lambda: np.add(a, a),
           "round to bfloat16 and back": lambda: a.astype(bfloat16).astype(np.float32),
           "round to float16 and back": lambda: a.astype(np.float16).astype(np.float32)}
    for label, op in ops.items():
        samples = []
        for _ in range(9):
            start = time.thread_time()
            op()
            samples.append(time.thread_time() - start)
        print(f"{label:>28} {1e9 * statistics.median(samples) / a.size:6.2f}")


if __name__ == "__main__":
    main()

"""GPT train-step time of mpdl against the same model in PyTorch on the CPU, one thread each.

One step is forward + cross-entropy + backward + Adam update, in float32, on the same shapes,
batch, sequence length and initial weights. Runs alternate (ours, torch, ours, torch, ...) so
that machine noise hits both alike; the table reports the median ms/step of each, their ratio,
tokens/s, the model FLOP/s (``GPT.flops_per_token``: 6N + 12·L·d·T, the PaLM formula) and the
MFU: model FLOP/s over the one-thread float32 GEMM peak NumPy reaches in the same run
(``mpdl.training.throughput.gemm_flops``, 512×512 products; PyTorch's own peak is printed
beside it). A last line splits the step: the linear layers' GEMMs at the step's shapes, timed
alone in each library (NumPy's BLAS against PyTorch's), and the rest of the step. The glibc
heap is kept between steps, as ``mpdl train`` keeps it (``MPDL_MALLOC=default``: not).

    python benchmarks/bench_gpt.py [--reps 7] [--steps 5] [--batch 16] [--block-size 64]
                                   [--n-layer 4] [--n-head 4] [--n-embd 128] [--vocab 65]
                                   [--clock wall|cpu]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import mpdl.autograd.functional as F  # noqa: E402
from mpdl import blas  # noqa: E402
from mpdl.allocator import keep_heap  # noqa: E402
from mpdl.autograd import optim  # noqa: E402
from mpdl.models.gpt import GPT  # noqa: E402
from mpdl.training.throughput import GEMM_N, gemm_flops  # noqa: E402


def torch_gpt(torch, model: GPT):
    """The same GPT in PyTorch (parameter names match mpdl's), holding ``model``'s weights."""
    tnn, TF = torch.nn, torch.nn.functional

    class Attn(tnn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h, self.qkv, self.proj = h, tnn.Linear(d, 3 * d), tnn.Linear(d, d)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=2)
            q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
            y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    class MLP(tnn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc, self.proj = tnn.Linear(d, 4 * d), tnn.Linear(4 * d, d)

        def forward(self, x):
            return self.proj(TF.gelu(self.fc(x)))

    class Block(tnn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln1, self.attn = tnn.LayerNorm(d), Attn(d, h)
            self.ln2, self.mlp = tnn.LayerNorm(d), MLP(d)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class TorchGPT(tnn.Module):
        def __init__(self, m):
            super().__init__()
            self.token_embedding = tnn.Embedding(m.vocab_size, m.n_embd)
            self.position_embedding = tnn.Embedding(m.block_size, m.n_embd)
            self.blocks = tnn.ModuleList(Block(m.n_embd, m.n_head) for _ in range(m.n_layer))
            self.ln_f = tnn.LayerNorm(m.n_embd)

        def forward(self, idx):
            x = self.token_embedding(idx) + self.position_embedding(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln_f(x) @ self.token_embedding.weight.T

    theirs = TorchGPT(model)
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return theirs


def ours_step_fn(model, x, y):
    opt = optim.Adam(model.parameters(), lr=1e-4)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


def torch_step_fn(torch, model, x, y):
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)

    def step():
        logits = model(xt)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 yt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


_clock = time.perf_counter


def time_steps(step, steps: int) -> float:
    """Milliseconds per step over ``steps`` steps (after one warm-up step)."""
    step()
    start = _clock()
    for _ in range(steps):
        step()
    return (_clock() - start) * 1e3 / steps


def linear_gemm_ms(torch, model: GPT, rows: int, reps: int = 5) -> tuple[float, float]:
    """Milliseconds of the linear layers' GEMMs of one step, mpdl's (``mpdl.blas``) and PyTorch's: for each
    layer's (rows, in) input and (out, in) weight, the forward x·wᵀ and the backward g·w and
    gᵀ·x, each the best of ``reps`` (on the clock the steps are timed on)."""
    shapes = [(p.shape[1], p.shape[0]) for name, p in model.named_parameters()
              if name.endswith(("qkv.weight", "proj.weight", "fc.weight"))]
    shapes.append((model.n_embd, model.vocab_size))  # the head, tied to the token embedding
    rng = np.random.default_rng(0)
    totals = [0.0, 0.0]
    for n_in, n_out in shapes:
        x, w, g = (rng.standard_normal(shape).astype(np.float32)
                   for shape in ((rows, n_in), (n_out, n_in), (rows, n_out)))
        tx, tw, tg = (torch.from_numpy(a) for a in (x, w, g))
        for side, (product, pairs) in enumerate(((blas.matmul, ((x, w.T), (g, w), (g.T, x))),
                                                 (torch.matmul, ((tx, tw.T), (tg, tw), (tg.T, tx))))):
            for a, b in pairs:
                product(a, b)
                best = float("inf")
                for _ in range(reps):
                    start = _clock()
                    product(a, b)
                    best = min(best, _clock() - start)
                totals[side] += best * 1e3
    return totals[0], totals[1]


def torch_gemm_flops(torch, n: int = GEMM_N, seconds: float = 0.2) -> float:
    """FLOP/s of an n×n float32 product in PyTorch: the best of repeated products (as
    ``gemm_flops`` measures NumPy's)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    best, count, end = float("inf"), 0, time.perf_counter() + seconds
    while count < 3 or time.perf_counter() < end:
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
        count += 1
    return 2.0 * n ** 3 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions per side")
    parser.add_argument("--steps", type=int, default=5, help="train steps per repetition")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, which other jobs on a busy machine "
                             "disturb less than the wall-clock time")
    args = parser.parse_args()
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter

    try:
        import torch  # noqa: PLC0415  (optional: only the benchmark needs it)
    except ImportError:
        raise SystemExit("bench_gpt.py: needs PyTorch, from the bench extra: "
                         "pip install -e '.[bench]'") from None
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    torch.set_num_threads(1)
    threadpool_limits(1)
    kept = keep_heap()
    model = GPT(args.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, seed=0)
    theirs = torch_gpt(torch, model)
    rng = np.random.default_rng(0)
    x = rng.integers(0, args.vocab, (args.batch, args.block_size))
    y = rng.integers(0, args.vocab, (args.batch, args.block_size))
    ours_step, torch_step = ours_step_fn(model, x, y), torch_step_fn(torch, theirs, x, y)
    ours_ms, torch_ms = [], []
    for _ in range(args.reps):
        ours_ms.append(time_steps(ours_step, args.steps))
        torch_ms.append(time_steps(torch_step, args.steps))
    peak, torch_peak = gemm_flops(), torch_gemm_flops(torch)
    gemm_ms = linear_gemm_ms(torch, model, args.batch * args.block_size)
    tokens = args.batch * args.block_size
    flops = model.flops_per_token(args.block_size) * tokens
    print(f"GPT vocab {args.vocab}, block {args.block_size}, {args.n_layer} layers, "
          f"{args.n_head} heads, width {args.n_embd} ({model.num_parameters():,} parameters); "
          f"batch {args.batch} = {tokens} tokens/step, float32, Adam")
    print(f"numpy {np.__version__} (products: {blas.describe()}), torch {torch.__version__}, "
          f"1 thread each, {args.reps} "
          f"interleaved repetitions x {args.steps} steps, median ({args.clock} clock); glibc "
          f"heap kept between steps: {'yes' if kept else 'no'}")
    print(f"GEMM peak ({GEMM_N}x{GEMM_N} float32, 1 thread, this run): mpdl "
          f"{peak / 1e9:.1f} GFLOP/s, torch {torch_peak / 1e9:.1f} GFLOP/s; MFU against mpdl's")
    print(f"{'':<8}{'ms/step':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'MFU':>8}")
    for name, ms in (("mpdl", statistics.median(ours_ms)), ("torch", statistics.median(torch_ms))):
        print(f"{name:<8}{ms:>10.1f}{tokens / ms * 1e3:>12,.0f}{flops / ms / 1e6:>10.2f}"
              f"{flops / ms * 1e3 / peak:>8.1%}")
    ratio = statistics.median(ours_ms) / statistics.median(torch_ms)
    print(f"ratio mpdl/torch {ratio:.2f} (target <= 1.0)")
    rest = [statistics.median(ms) - gemm for ms, gemm in zip((ours_ms, torch_ms), gemm_ms,
                                                              strict=True)]
    print(f"the linear layers' GEMMs at this step's shapes, alone: mpdl {gemm_ms[0]:.1f} ms, "
          f"torch {gemm_ms[1]:.1f} ms ({gemm_ms[0] / gemm_ms[1]:.2f}x); the rest of the step: "
          f"mpdl {rest[0]:.1f} ms, torch {rest[1]:.1f} ms ({rest[0] / rest[1]:.2f}x)")


if __name__ == "__main__":
    main()

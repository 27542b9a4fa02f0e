"""The backward split in two halves (`Tensor.backward_split`): the input gradients now, the
weights' later, the same gradients bit for bit as one backward, for Linear, the attention's
projections, the MLP and a whole GPT block, in float32 and float64, over several microbatches."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.tensor import Tensor
from mpdl.models.gpt import MLP, Block, CausalSelfAttention


def modules(dtype):
    rng = np.random.default_rng(0)
    return {"linear": nn.Linear(6, 5, rng=rng, dtype=dtype),
            "attention": CausalSelfAttention(8, 2, 0.0, rng, dtype),
            "mlp": MLP(8, 0.0, rng, dtype),
            "block": Block(8, 2, 0.0, rng, dtype)}


def inputs(name, dtype, k):
    width = 6 if name == "linear" else 8
    return np.random.default_rng(10 + k).standard_normal((3, 4, width)).astype(dtype)


def run(module, xs, split):
    """Each microbatch's input gradient (taken before any weight gradient exists when split) and
    the weights' gradients after all of them."""
    for p in module.parameters():
        p.grad = None
    weights, later, seen = module.parameters(), [], []
    for k, x in enumerate(xs):
        leaf = Tensor(x, requires_grad=True)
        out = module(leaf)
        grad = np.random.default_rng(20 + k).standard_normal(out.shape).astype(x.dtype)
        if split:
            later.append(out.backward_split(grad, weights))
            assert all(p.grad is None for p in weights), "a weight gradient came in the first half"
        else:
            out.backward(grad)
        seen.append(leaf.grad)
    for half in later:
        half.run()
    return seen, [p.grad for p in weights]


@pytest.mark.parametrize("name", ["linear", "attention", "mlp", "block"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_backward_gives_the_fused_gradients(name, dtype):
    module = modules(dtype)[name]
    xs = [inputs(name, dtype, k) for k in range(3)]
    fused_inputs, fused_weights = run(module, xs, split=False)
    split_inputs, split_weights = run(module, xs, split=True)
    assert len(fused_weights) >= 2 and all(g is not None for g in fused_weights)
    for a, b in zip(fused_inputs + fused_weights, split_inputs + split_weights, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_weights_outside_the_split_get_their_gradients_in_the_first_half():
    rng = np.random.default_rng(1)
    w, v = (Tensor(rng.standard_normal((4, 4)), requires_grad=True) for _ in range(2))
    x = Tensor(rng.standard_normal((2, 4)), requires_grad=True)
    out = F.linear(F.linear(x, w), v).sum()
    later = out.backward_split(weights=[w])
    assert w.grad is None and v.grad is not None and x.grad is not None
    later.run()
    xr, wr = Tensor(x.data, requires_grad=True), Tensor(w.data, requires_grad=True)
    F.linear(F.linear(xr, wr), Tensor(v.data)).sum().backward()
    assert np.array_equal(w.grad, wr.grad) and np.array_equal(x.grad, xr.grad)

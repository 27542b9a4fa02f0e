"""Multi-head self-attention read straight from the fused qkv projection.

``packed_attention(qkv)`` takes the (B, T, 3, H, hd) output of one qkv projection and returns the
heads' attention as (B, T, H, hd), ready to reshape to (B, T, H·hd) without a copy: the products
read q, k and v in place and write their results into the layouts the neighbouring linear
layers use, and backward writes the three gradients into one (B, T, 3, H, hd) array. Splitting
qkv into three head-major tensors instead costs, per layer, a copy of the attention output and,
in backward, three zero-filled gradients of qkv's size and two sums of them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdl.autograd import fused
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module


def _matmul_into(a: Any, b: Any, out: Any) -> Any:
    """a @ b written into ``out`` (any strides)."""
    if type(out) is np.ndarray:
        return np.matmul(a, b, out=out)
    out[...] = a @ b
    return out


def _heads(packed: Any, part: int) -> Any:
    """The (B, H, T, hd) view of q (part 0), k (1) or v (2) in (B, T, 3, H, hd) ``packed``."""
    return packed[:, :, part].transpose(0, 2, 1, 3)


class PackedAttention(Function):
    def forward(self, qkv, is_causal, scale):
        xp = get_array_module(qkv)
        q, k, v = (_heads(qkv, i) for i in range(3))
        probs = fused.softmax_(q @ k.transpose(0, 1, 3, 2), scale, is_causal)
        b, t, _, h, d = qkv.shape
        out = xp.empty((b, t, h, d), dtype=qkv.dtype)
        _matmul_into(probs, v, out.transpose(0, 2, 1, 3))
        self.qkv, self.probs, self.is_causal, self.scale = qkv, probs, is_causal, scale
        return out

    def backward(self, grad):
        xp = get_array_module(grad)
        qkv, p = self.qkv, self.probs
        q, k, v = (_heads(qkv, i) for i in range(3))
        g = grad.transpose(0, 2, 1, 3)
        gqkv = xp.empty(qkv.shape, dtype=qkv.dtype)
        _matmul_into(p.transpose(0, 1, 3, 2), g, _heads(gqkv, 2))
        gs = fused.softmax_backward_(g @ v.transpose(0, 1, 3, 2), p, self.scale, self.is_causal)
        _matmul_into(gs, k, _heads(gqkv, 0))
        _matmul_into(gs.transpose(0, 1, 3, 2), q, _heads(gqkv, 1))
        return gqkv


def packed_attention(qkv: Tensor, is_causal: bool = True, scale: float | None = None) -> Tensor:
    """softmax(q kᵀ · scale) v per head, of q, k, v packed in ``qkv`` (B, T, 3, H, hd): (B, T, H,
    hd). ``scale`` defaults to 1/√hd; ``is_causal`` lets position i attend to 0..i only."""
    if not isinstance(qkv, Tensor):
        raise TypeError(f"packed_attention: qkv must be a Tensor, not {type(qkv).__name__}")
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"packed_attention: qkv must be (batch, time, 3, heads, head_dim), got "
                         f"shape {qkv.shape}")
    scale = 1.0 / math.sqrt(qkv.shape[-1]) if scale is None else float(scale)
    return PackedAttention.apply(qkv, is_causal=bool(is_causal), scale=scale)

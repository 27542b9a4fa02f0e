"""Multi-head self-attention read straight from the fused qkv projection.

``packed_attention(qkv)`` takes the (B, T, 3, H, hd) output of one qkv projection and returns the
heads' attention as (B, T, H, hd), ready to reshape to (B, T, H·hd) without a copy: the products
read q, k and v in place and write their results into the layouts the neighbouring linear
layers use, and backward writes the three gradients into one (B, T, 3, H, hd) array. Splitting
qkv into three head-major tensors instead costs, per layer, a copy of the attention output and,
in backward, three zero-filled gradients of qkv's size and two sums of them. With the causal
mask the products run on blocks of `CAUSAL_BLOCK` query rows and skip the keys the block cannot
see: at T = 4 blocks, 5/8 of the full products' work. The batch runs in chunks of at most
`CHUNK_BYTES` of scores (one element at least), so that each chunk's scores are normalised and
multiplied again while they are still in cache
(docs/results/gpt.md#attention-in-cache-sized-chunks).
"""

from __future__ import annotations

import math
from typing import Any

from mpdl import blas
from mpdl.autograd import fused
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module

#: query rows per block of a causal product: the blocks above the diagonal are skipped
CAUSAL_BLOCK = 64
#: scores per batch chunk: each chunk's products, softmax and products again run while its
#: scores are still in the core's cache
CHUNK_BYTES = 1 << 20


def _heads(packed: Any, part: int) -> Any:
    """The (B, H, T, hd) view of q (part 0), k (1) or v (2) in (B, T, 3, H, hd) ``packed``."""
    return packed[:, :, part].transpose(0, 2, 1, 3)


def _blocks(t: int, causal: bool) -> list[tuple[int, int]]:
    """The [start, stop) ranges of query rows that are multiplied as one block."""
    step = CAUSAL_BLOCK if causal else t
    return [(start, min(start + step, t)) for start in range(0, t, step)]


def _batch_chunks(probs: Any) -> list[tuple[int, int]]:
    """The [start, stop) ranges of batch elements whose (H, T, S) scores are computed, normalised
    and multiplied together: at most `CHUNK_BYTES` of scores, at least one element."""
    b = probs.shape[0]
    step = max(1, CHUNK_BYTES // max(1, probs[:1].nbytes))
    return [(start, min(start + step, b)) for start in range(0, b, step)]


def _swap(a: Any) -> Any:
    return a.swapaxes(-1, -2)


def _scratch(xp: Any, shape: tuple[int, ...], dtype: Any, zeroed: bool) -> Any:
    return xp.zeros(shape, dtype=dtype) if zeroed else xp.empty(shape, dtype=dtype)


class PackedAttention(Function):
    def forward(self, qkv, is_causal, scale):
        xp = get_array_module(qkv)
        b, t, _, h, d = qkv.shape
        # causal: rows [r0, r1) see keys [0, r1) only, so each block multiplies that much; the
        # scores right of it are never read (zero on the array path, which reads them)
        blocks = _blocks(t, is_causal)
        probs = _scratch(xp, (b, h, t, t), qkv.dtype, len(blocks) > 1 and not fused.kernels_apply(
            qkv))
        out = xp.empty((b, t, h, d), dtype=qkv.dtype)
        for i0, i1 in _batch_chunks(probs):
            q, k, v = (_heads(qkv[i0:i1], i) for i in range(3))
            scores = probs[i0:i1]
            for r0, r1 in blocks:
                blas.matmul_into(q[:, :, r0:r1], _swap(k[:, :, :r1]), scores[:, :, r0:r1, :r1])
            fused.softmax_(scores, scale, is_causal)
            heads_out = out[i0:i1].transpose(0, 2, 1, 3)
            for r0, r1 in blocks:
                # these products stay with NumPy, faster here than MKL's batched GEMM
                # (docs/results/gpt.md#gpt-train-step-against-pytorch-cpu)
                blas.numpy_matmul_into(scores[:, :, r0:r1, :r1], v[:, :, :r1],
                                       heads_out[:, :, r0:r1])
        self.qkv, self.probs, self.is_causal, self.scale = qkv, probs, is_causal, scale
        return out

    def backward(self, grad):
        xp = get_array_module(grad)
        qkv, probs = self.qkv, self.probs
        t = probs.shape[-1]
        blocks = _blocks(t, self.is_causal)
        gqkv = xp.empty(qkv.shape, dtype=qkv.dtype)
        chunks = _batch_chunks(probs)
        scratch = _scratch(xp, (chunks[0][1] if chunks else 0,) + probs.shape[1:], probs.dtype,
                           len(blocks) > 1 and not fused.kernels_apply(probs))
        for i0, i1 in chunks:
            q, k, v = (_heads(qkv[i0:i1], i) for i in range(3))
            gq, gk, gv = (_heads(gqkv[i0:i1], i) for i in range(3))
            g, p, gs = grad[i0:i1].transpose(0, 2, 1, 3), probs[i0:i1], scratch[:i1 - i0]
            for r0, r1 in blocks:  # keys [r0, r1) are seen by the rows from r0 on
                blas.numpy_matmul_into(_swap(p[:, :, r0:, r0:r1]), g[:, :, r0:], gv[:, :, r0:r1])
                blas.matmul_into(g[:, :, r0:r1], _swap(v[:, :, :r1]), gs[:, :, r0:r1, :r1])
            gs = fused.softmax_backward_(gs, p, self.scale, self.is_causal)
            for r0, r1 in blocks:
                blas.numpy_matmul_into(gs[:, :, r0:r1, :r1], k[:, :, :r1], gq[:, :, r0:r1])
                blas.numpy_matmul_into(_swap(gs[:, :, r0:, r0:r1]), q[:, :, r0:], gk[:, :, r0:r1])
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

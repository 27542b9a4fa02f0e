"""Fused kernels of the transformer's row-wise and elementwise ops and of Adam's update: numba on
the host, array expressions on CuPy.

LayerNorm, GELU, the attention softmax and softmax cross-entropy each take several NumPy passes
(and as many temporaries) per step: one per elementwise operation and reduction. On the host each
is one numba kernel (two for a forward with its backward) that reads its inputs once, keeps a
row in cache for its reductions and writes its outputs once; their saved state is the smallest
that lets backward recompute the rest (LayerNorm's row statistics, GELU's input, the loss's
log-sum-exp per row). On a GPU, for other dtypes and under ``array_path()``, the same functions
run as array expressions with the same saved state.

Adam's update is one pass over the parameter, its gradient and moments instead of nine, with
the same operations in the same order as the array expressions and no contraction: the same
bits.

The host kernels compute in the input's dtype. float64 uses the C library's exp and erf;
float32 uses polynomial approximations that vectorize (exp: Cephes' expf, relative error below
3e-7; erf: Eigen's rational approximation, absolute error below 4e-7), with NaN and infinities
carried through as ``np.exp`` and ``math.erf`` carry them. The kernels are deterministic: the
same inputs give the same bits on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from mpdl.backend import get_array_module

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

#: reassociation (vectorized reductions) and contraction (FMA); no assumption on NaN or inf, no
#: approximate division or square root
_FASTMATH = {"nsz", "contract", "reassoc"}

_state = threading.local()


@contextlib.contextmanager
def array_path() -> Iterator[None]:
    """Within this context the host runs the array expressions, as a GPU does (for tests)."""
    previous = getattr(_state, "array_path", False)
    _state.array_path = True
    try:
        yield
    finally:
        _state.array_path = previous


def kernels_apply(*arrays: Any) -> bool:
    """Whether the host kernels apply: NumPy arrays of one dtype, float32 or float64."""
    if getattr(_state, "array_path", False):
        return False
    dtype = arrays[0].dtype
    return dtype in (np.float32, np.float64) and all(
        type(a) is np.ndarray and a.dtype == dtype for a in arrays)


def _constants(dtype: Any, *values: float) -> np.ndarray:
    """Scalars for a kernel, in the arrays' dtype (a numba literal would be float64)."""
    return np.array((0.0, 1.0) + values, dtype=dtype)


# ---------------------------------------------------------------------- scalar functions
def _exp(v):
    """exp(v); numba compiles the float32 case as `_exp32`."""
    return math.exp(v)


def _erf(v):
    """erf(v); numba compiles the float32 case as `_erf32`."""
    return math.erf(v)


def _exp32(v):
    # Cephes expf: exp(v) = 2**n · exp(r), |r| <= ln2/2, a degree-7 polynomial for exp(r)
    x = np.float32(-87.0) if v < np.float32(-87.0) else v
    x = np.float32(88.0) if x > np.float32(88.0) else x
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    n = n if n == n else np.float32(0.0)  # NaN: any n, the polynomial carries the NaN
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    scale = np.int32((np.int32(n) + np.int32(127)) << np.int32(23)).view(np.float32)
    out = p * scale
    out = np.float32(0.0) if v < np.float32(-87.0) else out
    return np.float32(np.inf) if v > np.float32(88.0) else out


def _erf32(v):
    # Eigen's float erf: x·p(x²)/q(x²) on [-4, 4], ±1 beyond
    x = np.float32(-4.0) if v < np.float32(-4.0) else v
    x = np.float32(4.0) if x > np.float32(4.0) else x
    x2 = x * x
    p = x2 * np.float32(-2.72614225801306e-10) + np.float32(2.77068142495902e-08)
    p = x2 * p + np.float32(-2.10102402082508e-06)
    p = x2 * p + np.float32(-5.69250639462346e-05)
    p = x2 * p + np.float32(-7.34990630326855e-04)
    p = x2 * p + np.float32(-2.95459980854025e-03)
    p = x2 * p + np.float32(-1.60960333262415e-02)
    q = x2 * np.float32(-1.45660718464996e-05) + np.float32(-2.13374055278905e-04)
    q = x2 * q + np.float32(-1.68282697438203e-03)
    q = x2 * q + np.float32(-7.37332916720468e-03)
    q = x2 * q + np.float32(-1.42647390514189e-02)
    return x * p / q


@functools.cache
def _register() -> Any:
    """Import numba and teach it `_exp` and `_erf` per dtype and `_row_max` (once, on first
    use)."""
    import numba  # noqa: PLC0415  (slow import, only when a kernel is first needed)
    from numba.extending import overload  # noqa: PLC0415

    @overload(_exp)
    def _exp_typed(v):
        return _exp32 if v == numba.types.float32 else (lambda v: math.exp(v))

    @overload(_erf)
    def _erf_typed(v):
        return _erf32 if v == numba.types.float32 else (lambda v: math.erf(v))

    @overload(_row_max)
    def _row_max_typed(row, end, scale):
        return _row_max

    return numba


@functools.cache
def _compiled(name: str, fastmath: bool = True):
    numba = _register()
    return numba.njit(cache=True, nogil=True, fastmath=_FASTMATH if fastmath else False,
                      error_model="numpy")(globals()[name])


# ---------------------------------------------------------------------- host kernels
def _layer_norm_loop(x, w, b, eps, y, mean, rstd, c):
    rows, n = x.shape
    inv_n = c[2]
    for r in range(rows):
        s = c[0]
        for j in range(n):
            s += x[r, j]
        m = s * inv_n
        v = c[0]
        for j in range(n):
            d = x[r, j] - m
            v += d * d
        rs = c[1] / np.sqrt(v * inv_n + eps)
        for j in range(n):
            y[r, j] = (x[r, j] - m) * rs * w[j] + b[j]
        mean[r] = m
        rstd[r] = rs


def _layer_norm_backward_loop(g, x, w, mean, rstd, gx, gw, gb, c):
    rows, n = x.shape
    inv_n = c[2]
    for r in range(rows):
        m, rs = mean[r], rstd[r]
        sg = c[0]
        sgx = c[0]
        for j in range(n):
            xhat = (x[r, j] - m) * rs
            gxhat = g[r, j] * w[j]
            sg += gxhat
            sgx += gxhat * xhat
            gw[j] += g[r, j] * xhat
            gb[j] += g[r, j]
        sg *= inv_n
        sgx *= inv_n
        for j in range(n):
            xhat = (x[r, j] - m) * rs
            gx[r, j] = (g[r, j] * w[j] - sg - xhat * sgx) * rs


def _gelu_loop(x, y, c):
    half, inv_sqrt2 = c[2], c[3]
    for i in range(x.size):
        v = x[i]
        y[i] = v * (half + half * _erf(v * inv_sqrt2))


def _gelu_backward_loop(g, x, gx, c):
    half, inv_sqrt2, inv_sqrt_2pi = c[2], c[3], c[4]
    for i in range(x.size):
        v = x[i]
        cdf = half + half * _erf(v * inv_sqrt2)
        gx[i] = g[i] * (cdf + v * inv_sqrt_2pi * _exp(-half * v * v))


def _softmax_loop(att, scale, causal, c):
    batch, t, s = att.shape
    for m in range(batch):
        for i in range(t):
            end = min(i + 1, s) if causal else s
            top = _row_max(att[m, i], end, scale)
            total = c[0]
            for j in range(end):
                e = _exp(att[m, i, j] * scale - top)
                att[m, i, j] = e
                total += e
            inv = c[1] / total
            for j in range(end):
                att[m, i, j] *= inv
            for j in range(end, s):
                att[m, i, j] = c[0]


def _bias_gelu_loop(h, b, y, c):
    half, inv_sqrt2 = c[2], c[3]
    rows, n = h.shape
    for r in range(rows):
        for j in range(n):
            v = h[r, j] + b[j]
            y[r, j] = v * (half + half * _erf(v * inv_sqrt2))


def _bias_gelu_backward_loop(g, h, b, gh, gb, c):
    half, inv_sqrt2, inv_sqrt_2pi = c[2], c[3], c[4]
    rows, n = h.shape
    for r in range(rows):
        for j in range(n):
            v = h[r, j] + b[j]
            cdf = half + half * _erf(v * inv_sqrt2)
            gv = g[r, j] * (cdf + v * inv_sqrt_2pi * _exp(-half * v * v))
            gh[r, j] = gv
            gb[j] += gv


def _row_max(row, end, scale):
    """The largest of row[:end] · scale (end ≥ 1), in eight running maxima: one chain of
    dependent comparisons would not vectorize (the maximum is the same in any order; with a NaN
    in the row, softmax gives NaN whatever the maximum)."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[0] * scale
    j = 0
    while j + 8 <= end:
        m0 = max(m0, row[j] * scale)
        m1 = max(m1, row[j + 1] * scale)
        m2 = max(m2, row[j + 2] * scale)
        m3 = max(m3, row[j + 3] * scale)
        m4 = max(m4, row[j + 4] * scale)
        m5 = max(m5, row[j + 5] * scale)
        m6 = max(m6, row[j + 6] * scale)
        m7 = max(m7, row[j + 7] * scale)
        j += 8
    for k in range(j, end):
        m0 = max(m0, row[k] * scale)
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


def _softmax_backward_loop(gp, p, scale, causal, c):
    batch, t, s = p.shape
    for m in range(batch):
        for i in range(t):
            end = min(i + 1, s) if causal else s
            d = c[0]
            for j in range(end):
                d += gp[m, i, j] * p[m, i, j]
            for j in range(end):
                gp[m, i, j] = p[m, i, j] * (gp[m, i, j] - d) * scale
            for j in range(end, s):
                gp[m, i, j] = c[0]


def _cross_entropy_loop(logits, labels, keep, losses, lse, c):
    rows, classes = logits.shape
    for r in range(rows):
        top = logits[r, 0]
        for j in range(classes):
            top = max(top, logits[r, j])
        total = c[0]
        for j in range(classes):
            total += _exp(logits[r, j] - top)
        lse[r] = top + np.log(total)
        losses[r] = (lse[r] - logits[r, labels[r]]) if keep[r] else c[0]


def _cross_entropy_backward_loop(logits, labels, lse, scale, g):
    rows, classes = logits.shape
    for r in range(rows):
        for j in range(classes):
            g[r, j] = _exp(logits[r, j] - lse[r]) * scale[r]
        g[r, labels[r]] -= scale[r]


def _adam_loop(p, g, m, v, c):
    b1, one_minus_b1, b2, one_minus_b2, correction2, eps, step = c[2:]
    for i in range(p.size):
        gi = g[i]
        mi = m[i] * b1
        mi = mi + one_minus_b1 * gi
        vi = v[i] * b2
        vi = vi + one_minus_b2 * (gi * gi)
        m[i] = mi
        v[i] = vi
        denom = np.sqrt(vi) * correction2
        denom = denom + eps
        p[i] = p[i] - step * (mi / denom)


# ---------------------------------------------------------------------- the ops
def layer_norm(x: Any, weight: Any, bias: Any, eps: float) -> tuple[Any, Any, Any]:
    """LayerNorm of (R, n) ``x`` over its rows, scaled by ``weight`` and shifted by ``bias`` (n,):
    (y, mean, rstd), the last two of shape (R, 1)."""
    if kernels_apply(x, weight, bias):
        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        mean, rstd = np.empty((x.shape[0], 1), x.dtype), np.empty((x.shape[0], 1), x.dtype)
        _compiled("_layer_norm_loop")(x, weight, bias, x.dtype.type(eps), y, mean[:, 0],
                                      rstd[:, 0], _constants(x.dtype, 1.0 / x.shape[1]))
        return y, mean, rstd
    xp = get_array_module(x)
    mean = x.mean(axis=1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=1, keepdims=True)
    rstd = 1.0 / xp.sqrt(var + eps)
    xc *= rstd
    return xc * weight + bias, mean, rstd


def layer_norm_backward(grad: Any, x: Any, weight: Any, mean: Any, rstd: Any
                        ) -> tuple[Any, Any, Any]:
    """The gradients (x, weight, bias) of ``layer_norm`` for the output gradient ``grad``."""
    if kernels_apply(grad, x, weight, mean, rstd):
        grad, x = np.ascontiguousarray(grad), np.ascontiguousarray(x)
        gx = np.empty_like(x)
        gw, gb = np.zeros_like(weight), np.zeros_like(weight)
        _compiled("_layer_norm_backward_loop")(grad, x, weight, mean[:, 0], rstd[:, 0], gx, gw,
                                               gb, _constants(x.dtype, 1.0 / x.shape[1]))
        return gx, gw, gb
    xhat = (x - mean) * rstd
    gxhat = grad * weight
    mean_g = gxhat.mean(axis=1, keepdims=True)
    mean_gx = (gxhat * xhat).mean(axis=1, keepdims=True)
    gx = xhat * mean_gx
    gx += mean_g
    gx = gxhat - gx
    gx *= rstd
    return gx, (grad * xhat).sum(axis=0), grad.sum(axis=0)


def gelu(x: Any) -> Any:
    """x·Φ(x), elementwise (Φ the standard normal distribution function)."""
    if kernels_apply(x):
        flat = np.ascontiguousarray(x).reshape(-1)
        y = np.empty_like(flat)
        _compiled("_gelu_loop")(flat, y, _constants(x.dtype, 0.5, _INV_SQRT_2))
        return y.reshape(x.shape)
    from mpdl.autograd import kernels  # noqa: PLC0415  (kernels imports numba lazily too)

    return x * (0.5 * (1 + kernels.erf(x * _INV_SQRT_2)))


def gelu_backward(grad: Any, x: Any) -> Any:
    """The gradient of ``gelu`` at ``x`` for the output gradient ``grad``."""
    if kernels_apply(grad, x):
        g, flat = np.ascontiguousarray(grad).reshape(-1), np.ascontiguousarray(x).reshape(-1)
        gx = np.empty_like(flat)
        _compiled("_gelu_backward_loop")(g, flat, gx, _constants(x.dtype, 0.5, _INV_SQRT_2,
                                                                 _INV_SQRT_2PI))
        return gx.reshape(x.shape)
    from mpdl.autograd import kernels  # noqa: PLC0415

    xp = get_array_module(x)
    cdf = 0.5 * (1 + kernels.erf(x * _INV_SQRT_2))
    return grad * (cdf + x * (_INV_SQRT_2PI * xp.exp(-0.5 * x * x)))


def bias_gelu(h: Any, bias: Any) -> Any:
    """gelu(h + bias) of (R, n) ``h`` and (n,) ``bias``: a linear layer's GELU with its bias
    added on the way, in one pass."""
    if kernels_apply(h, bias):
        h = np.ascontiguousarray(h)
        y = np.empty_like(h)
        _compiled("_bias_gelu_loop")(h, np.ascontiguousarray(bias), y,
                                     _constants(h.dtype, 0.5, _INV_SQRT_2))
        return y
    return gelu(h + bias)


def bias_gelu_backward(grad: Any, h: Any, bias: Any) -> tuple[Any, Any]:
    """The gradients (h, bias) of ``bias_gelu`` for the output gradient ``grad``; the bias's is
    the column sum of h's, added row after row as ``sum(axis=0)`` adds them."""
    if kernels_apply(grad, h, bias):
        grad, h = np.ascontiguousarray(grad), np.ascontiguousarray(h)
        gh, gb = np.empty_like(h), np.zeros_like(bias)
        _compiled("_bias_gelu_backward_loop")(grad, h, np.ascontiguousarray(bias), gh, gb,
                                              _constants(h.dtype, 0.5, _INV_SQRT_2,
                                                         _INV_SQRT_2PI))
        return gh, gb
    gh = gelu_backward(grad, h + bias)
    return gh, gh.sum(axis=0)


def softmax_(scores: Any, scale: float, causal: bool) -> Any:
    """softmax(scores · scale) over the last axis of (..., T, S) ``scores``, in place; with
    ``causal``, row i over its first i + 1 entries only (the rest become 0; on the host they are
    not read)."""
    t, s = scores.shape[-2:]
    if kernels_apply(scores) and scores.flags.c_contiguous and scores.size:
        _compiled("_softmax_loop")(scores.reshape(-1, t, s), scores.dtype.type(scale), causal,
                                   _constants(scores.dtype))
        return scores
    xp = get_array_module(scores)
    scores *= scale
    if causal:
        scores += xp.triu(xp.full((t, s), -xp.inf, dtype=scores.dtype), 1)
    scores -= scores.max(axis=-1, keepdims=True)
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def softmax_backward_(grad: Any, probs: Any, scale: float, causal: bool) -> Any:
    """The gradient of ``softmax_`` with respect to its scores, for the gradient ``grad`` of its
    probabilities ``probs``, computed in place of ``grad`` (on the host, the entries a causal
    mask hides are not read)."""
    t, s = probs.shape[-2:]
    if (kernels_apply(grad, probs) and grad.flags.c_contiguous and probs.flags.c_contiguous
            and grad.size):
        _compiled("_softmax_backward_loop")(grad.reshape(-1, t, s), probs.reshape(-1, t, s),
                                            probs.dtype.type(scale), causal,
                                            _constants(probs.dtype))
        return grad
    grad -= (grad * probs).sum(axis=-1, keepdims=True)
    grad *= probs
    grad *= scale
    return grad


def cross_entropy(logits: Any, labels: Any, keep: Any) -> tuple[Any, Any]:
    """Per row of (N, C) ``logits``: the loss -log softmax(logits)[label] (0 where ``keep`` (N,)
    is False, or everywhere where ``keep`` is None), and the row's log-sum-exp, as (N,) arrays."""
    xp = get_array_module(logits)
    n = logits.shape[0]
    if kernels_apply(logits) and type(labels) is np.ndarray and n:
        logits = np.ascontiguousarray(logits)
        losses, lse = np.empty(n, logits.dtype), np.empty(n, logits.dtype)
        _compiled("_cross_entropy_loop")(logits, labels, np.ones(n, bool) if keep is None else
                                         keep, losses, lse, _constants(logits.dtype))
        return losses, lse
    top = logits.max(axis=1, keepdims=True)
    lse = (top + xp.log(xp.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
    losses = lse - logits[xp.arange(n), labels]
    if keep is not None:
        losses *= keep
    return losses, lse


def cross_entropy_backward(logits: Any, labels: Any, lse: Any, scale: Any) -> Any:
    """The gradient of ``cross_entropy``'s losses with respect to ``logits``, each row weighted
    by ``scale`` (N,): scale · (softmax(logits) - onehot(labels))."""
    xp = get_array_module(logits)
    if kernels_apply(logits, lse, scale) and type(labels) is np.ndarray and logits.shape[0]:
        g = np.empty_like(logits)
        _compiled("_cross_entropy_backward_loop")(np.ascontiguousarray(logits), labels, lse,
                                                  scale, g)
        return g
    g = xp.exp(logits - lse[:, None])
    g[xp.arange(logits.shape[0]), labels] -= 1
    g *= scale[:, None]
    return g


def adam_(param: Any, grad: Any, m: Any, v: Any, betas: tuple[float, float], step: int,
          lr: float, eps: float) -> None:
    """Adam's step ``step`` (from 1) in place: the moments ``m`` and ``v`` advance with ``grad``
    and ``param`` moves by lr / (1 - β1^t) · m / (√v / √(1 - β2^t) + eps)."""
    b1, b2 = betas
    arrays = (param, grad, m, v)
    if kernels_apply(*arrays) and all(a.flags.c_contiguous for a in arrays) and all(
            type(b) is float for b in betas):
        c = _constants(param.dtype, b1, 1 - b1, b2, 1 - b2, 1.0 / math.sqrt(1 - b2**step), eps,
                       lr / (1 - b1**step))
        _compiled("_adam_loop", fastmath=False)(*(a.reshape(-1) for a in arrays), c)
        return
    xp = get_array_module(param)
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * (grad * grad)
    denom = xp.sqrt(v) * (1.0 / math.sqrt(1 - b2**step))
    denom += eps
    param -= (lr / (1 - b1**step)) * (m / denom)

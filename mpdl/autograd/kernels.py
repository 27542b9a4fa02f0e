"""Scatter-add kernels for the image ops and the error function: numba on CPU, CuPy on GPU.

im2col is a strided view (no kernel needed); its adjoint col2im, the max-pool backward scatter
and ``erf`` are loops NumPy cannot vectorise without ``np.add.at``. On the host they are numba
kernels, compiled on first use and cached on disk; on a GPU they are CuPy array expressions
looping only over the kernel window (a handful of whole-array adds).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from mpdl.backend import get_array_module


def windows(x: Any, kh: int, kw: int, stride: int) -> Any:
    """A read-only view (N, C, OH, OW, kh, kw) of every kh×kw window of NCHW ``x``."""
    xp = get_array_module(x)
    n, c, h, w = x.shape
    oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    sn, sc, sh, sw = x.strides
    return xp.lib.stride_tricks.as_strided(
        x, (n, c, oh, ow, kh, kw), (sn, sc, sh * stride, sw * stride, sh, sw))


def _col2im_loop(cols, out, stride):
    n_, c_, kh_, kw_, oh_, ow_ = cols.shape
    for n in range(n_):
        for c in range(c_):
            for i in range(kh_):
                for j in range(kw_):
                    for oh in range(oh_):
                        for ow in range(ow_):
                            out[n, c, oh * stride + i, ow * stride + j] += cols[n, c, i, j, oh, ow]


def _max_pool_loop(x, out, argmax, kh, kw, stride):
    # branch-free: the window maxima are in random places, so branches would mispredict
    n_, c_, oh_, ow_ = out.shape
    nan = False
    for n in range(n_):
        for c in range(c_):
            for oh in range(oh_):
                for ow in range(ow_):
                    best = x[n, c, oh * stride, ow * stride]
                    k = 0
                    for i in range(kh):
                        for j in range(kw):
                            v = x[n, c, oh * stride + i, ow * stride + j]
                            nan |= v != v
                            k += (i * kw + j - k) * np.int32(v > best)
                            best = max(v, best)
                    out[n, c, oh, ow] = best
                    argmax[n, c, oh, ow] = k
    return nan


def _max_scatter_loop(grad, argmax, out, kw, stride):
    n_, c_, oh_, ow_ = grad.shape
    for n in range(n_):
        for c in range(c_):
            for oh in range(oh_):
                for ow in range(ow_):
                    k = argmax[n, c, oh, ow]
                    out[n, c, oh * stride + k // kw, ow * stride + k % kw] += grad[n, c, oh, ow]


def _erf_loop(x, out):
    flat_x = x.reshape(-1)
    flat_out = out.reshape(-1)
    for i in range(flat_x.size):
        flat_out[i] = math.erf(flat_x[i])


@functools.cache
def _compiled(name: str):
    import numba  # noqa: PLC0415  (slow import, only when a kernel is first needed)

    return numba.njit(cache=True, nogil=True)(globals()[name])


def col2im(cols: Any, padded_shape: tuple[int, ...], stride: int, force_array_path: bool = False
           ) -> Any:
    """Sum the windows ``cols`` (N, C, kh, kw, OH, OW) back into an NCHW array of padded_shape."""
    xp = get_array_module(cols)
    out = xp.zeros(padded_shape, dtype=cols.dtype)
    if xp is np and not force_array_path:
        _compiled("_col2im_loop")(cols, out, stride)
        return out
    _, _, kh, kw, oh, ow = cols.shape
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += cols[:, :, i, j]
    return out


def pad(x: Any, padding: tuple[int, int], value: float = 0.0) -> Any:
    """NCHW ``x`` with ``padding`` (rows, columns) of ``value`` on both sides of H and W."""
    if padding == (0, 0):
        return x
    ph, pw = padding
    return get_array_module(x).pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def crop(x: Any, padding: tuple[int, int], shape: tuple[int, ...]) -> Any:
    """The inverse of ``pad``: the (H, W) = shape[2:] interior of NCHW ``x``."""
    ph, pw = padding
    return x[:, :, ph:ph + shape[2], pw:pw + shape[3]]


def max_pool(x: Any, kh: int, kw: int, stride: int, padding: tuple[int, int] = (0, 0),
             force_array_path: bool = False) -> tuple[Any, Any]:
    """The maximum of every kh×kw window of NCHW ``x`` (padded with -inf) and, per window, the
    row-major index i·kw + j of its first maximum (a NaN counts as the maximum)."""
    xp = get_array_module(x)
    xpad = pad(x, padding, -np.inf)
    win = windows(xpad, kh, kw, stride)
    if xp is np and x.dtype in (np.float32, np.float64) and not force_array_path:
        out = np.empty(win.shape[:4], dtype=x.dtype)
        argmax = np.empty(win.shape[:4], dtype=np.int32)
        if not _compiled("_max_pool_loop")(xpad, out, argmax, kh, kw, stride):
            return out, argmax  # with a NaN in x, the array path below finds the first one
    flat = win.reshape(win.shape[:4] + (-1,))
    argmax = flat.argmax(axis=-1)
    return xp.take_along_axis(flat, argmax[..., None], axis=-1)[..., 0], argmax


def max_pool_scatter(grad: Any, argmax: Any, x_shape: tuple[int, ...], kh: int, kw: int,
                     stride: int, padding: tuple[int, int] = (0, 0),
                     force_array_path: bool = False) -> Any:
    """Route each pooled gradient to the input position (in an array of x_shape) its window's
    maximum came from."""
    xp = get_array_module(grad)
    ph, pw = padding
    n, c, h, w = x_shape
    out = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=grad.dtype)
    if xp is np and not force_array_path:
        _compiled("_max_scatter_loop")(grad, argmax, out, kw, stride)
        return crop(out, padding, x_shape)
    oh, ow = grad.shape[2:]
    for i in range(kh):
        for j in range(kw):
            hit = argmax == i * kw + j
            out[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += grad * hit
    return crop(out, padding, x_shape)


def erf(x: Any) -> Any:
    """The error function, elementwise."""
    xp = get_array_module(x)
    if xp is np:
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        _compiled("_erf_loop")(x, out)
        return out
    from cupyx.scipy.special import erf as cupy_erf  # noqa: PLC0415

    return cupy_erf(x)

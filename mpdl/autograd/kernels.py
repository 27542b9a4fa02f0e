"""Kernels of the image ops and the error function: numba on the host, array expressions on CuPy.

im2col is a copy of a strided view; its adjoint col2im, max pooling and its backward scatter, and
``erf`` are loops NumPy cannot express without extra passes or ``np.add.at``. On the host they are
numba kernels, compiled on first use and cached on disk; on a GPU (and under
``force_array_path``) they are CuPy array expressions looping only over the kernel window.
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


def _col2im_rows_loop(cols, out, kh, kw, row):
    n_, k_, length = cols.shape
    for n in range(n_):
        for k in range(k_):
            c, ij = k // (kh * kw), k % (kh * kw)
            off = (ij // kw) * row + ij % kw
            for r in range(length):
                out[n, c, off + r] += cols[n, k, r]


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


def im2col(x: Any, kh: int, kw: int, stride: int, padding: tuple[int, int]
           ) -> tuple[Any, tuple[int, int, int]]:
    """The kh×kw windows of NCHW ``x`` as a contiguous (C·kh·kw, N, OH·R) array, and (OH, OW, R).

    Row k = (c, i, j) holds, per image, x_padded[c, oh·stride + i, r·stride + j] for r < R. With
    stride 1, R is the padded width (columns r ≥ OW are junk that wraps into the next row): then
    each row of an image is one contiguous run of the padded input, cheap to copy. With a larger
    stride, R = OW.
    """
    xp = get_array_module(x)
    n, c, h, w = x.shape
    ph, pw = padding
    oh, ow = (h + 2 * ph - kh) // stride + 1, (w + 2 * pw - kw) // stride + 1
    if stride == 1:
        # one extra zero row at the bottom: the last window's run ends kw - 1 past the padding
        xpad = xp.pad(x, ((0, 0), (0, 0), (ph, ph + 1), (pw, pw)))
        row = w + 2 * pw
        sn, sc, sh, sw = xpad.strides
        view = xp.lib.stride_tricks.as_strided(xpad, (c, kh, kw, n, oh * row),
                                               (sc, sh, sw, sn, sw))
    else:
        row = ow
        view = windows(pad(x, padding), kh, kw, stride).transpose(1, 4, 5, 0, 2, 3)
    return xp.ascontiguousarray(view).reshape(c * kh * kw, n, oh * row), (oh, ow, row)


def col2im(cols: Any, x_shape: tuple[int, ...], kh: int, kw: int, stride: int,
           padding: tuple[int, int], row: int, force_array_path: bool = False) -> Any:
    """The adjoint of ``im2col``: sum the (N, C·kh·kw, OH·R) window values ``cols`` back into an
    array of x_shape. With stride 1 the junk columns r ≥ OW of ``cols`` must be zero."""
    xp = get_array_module(cols)
    n, c, h, w = x_shape
    ph, pw = padding
    hp, wp = h + 2 * ph, w + 2 * pw
    if stride == 1:
        out = xp.zeros((n, c, hp + 1, wp), dtype=cols.dtype)
        flat = out.reshape(n, c, -1)
        if xp is np and cols.dtype in (np.float32, np.float64) and not force_array_path:
            _compiled("_col2im_rows_loop")(cols, flat, kh, kw, row)
            return crop(out, padding, x_shape)
        cols = cols.reshape(n, c, kh, kw, -1)
        length = cols.shape[-1]
        for i in range(kh):
            for j in range(kw):
                flat[:, :, i * wp + j:i * wp + j + length] += cols[:, :, i, j]
    else:
        out = xp.zeros((n, c, hp, wp), dtype=cols.dtype)
        oh = cols.shape[-1] // row
        cols = cols.reshape(n, c, kh, kw, oh, row)
        for i in range(kh):
            for j in range(kw):
                out[:, :, i:i + stride * oh:stride, j:j + stride * row:stride] += cols[:, :, i, j]
    return crop(out, padding, x_shape)


def window_sum_adjoint(grad: Any, x_shape: tuple[int, ...], kh: int, kw: int, stride: int,
                       padding: tuple[int, int]) -> Any:
    """The adjoint of summing every kh×kw window: each input gets the sum of ``grad`` over the
    windows that cover it."""
    xp = get_array_module(grad)
    n, c, h, w = x_shape
    ph, pw = padding
    out = xp.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=grad.dtype)
    oh, ow = grad.shape[2:]
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += grad
    return crop(out, padding, x_shape)


def window_sum(x: Any, kh: int, kw: int, stride: int, padding: tuple[int, int]) -> Any:
    """The sum of every kh×kw window of NCHW ``x`` (zero padded)."""
    xpad = pad(x, padding)
    _, _, h, w = xpad.shape
    oh, ow = (h - kh) // stride + 1, (w - kw) // stride + 1
    out = None
    for i in range(kh):
        for j in range(kw):
            part = xpad[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]
            out = part.copy() if out is None else out.__iadd__(part)
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

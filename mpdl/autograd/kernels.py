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


def max_pool_scatter(grad: Any, argmax: Any, padded_shape: tuple[int, ...], kh: int, kw: int,
                     stride: int, force_array_path: bool = False) -> Any:
    """Route each pooled gradient to the input position its window's maximum came from."""
    xp = get_array_module(grad)
    out = xp.zeros(padded_shape, dtype=grad.dtype)
    if xp is np and not force_array_path:
        _compiled("_max_scatter_loop")(grad, argmax, out, kw, stride)
        return out
    oh, ow = grad.shape[2:]
    for i in range(kh):
        for j in range(kw):
            hit = argmax == i * kw + j
            out[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride] += grad * hit
    return out


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

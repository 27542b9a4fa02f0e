"""conv2d, max_pool2d and avg_pool2d on random geometries: against PyTorch (optional oracle),
against central differences, and the host kernels against the array path CuPy runs."""

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import Tensor, gradcheck, kernels

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(
    torch is None, reason="PyTorch is the optional oracle for these tests (pip install 'mpdl[bench]')")

TOL = {np.float32: dict(rtol=2e-4, atol=2e-5), np.float64: dict(rtol=1e-9, atol=1e-11)}


def conv_case(seed):
    """A random small conv2d geometry: batch 1-3, 1-4 channels each way, non-square input and
    kernel, stride 1-3, padding 0-2 per side, and whether there is a bias."""
    rng = np.random.default_rng(seed)
    n, c, o = (int(v) for v in rng.integers(1, [4, 5, 5]))
    kh, kw = (int(v) for v in rng.integers(1, 5, size=2))
    ph, pw = (int(v) for v in rng.integers(0, 3, size=2))
    stride = int(rng.integers(1, 4))
    h = int(rng.integers(max(1, kh - 2 * ph), 10))
    w = int(rng.integers(max(1, kw - 2 * pw), 10))
    return rng, (n, c, h, w), (o, c, kh, kw), stride, (ph, pw), bool(rng.random() < 0.7)


def pool_case(seed):
    """A random small pooling geometry (padding at most half the kernel, as PyTorch requires)."""
    rng = np.random.default_rng(seed)
    n, c = (int(v) for v in rng.integers(1, [4, 5]))
    kh, kw = (int(v) for v in rng.integers(1, 5, size=2))
    ph, pw = int(rng.integers(0, kh // 2 + 1)), int(rng.integers(0, kw // 2 + 1))
    stride = int(rng.integers(1, 4))
    h, w = int(rng.integers(max(1, kh - 2 * ph), 10)), int(rng.integers(max(1, kw - 2 * pw), 10))
    return rng, (n, c, h, w), (kh, kw), stride, (ph, pw)


def against_torch(ours_fn, torch_fn, arrays, dtype):
    ours_in = [Tensor(a.astype(dtype), requires_grad=True) for a in arrays]
    theirs_in = [torch.tensor(a.astype(dtype), requires_grad=True) for a in arrays]
    ours, theirs = ours_fn(*ours_in), torch_fn(*theirs_in)
    assert ours.dtype == dtype
    np.testing.assert_allclose(ours.data, theirs.detach().numpy(), **TOL[dtype])
    cotangent = np.random.default_rng(1).standard_normal(ours.shape).astype(dtype)
    ours.backward(cotangent)
    theirs.backward(torch.tensor(cotangent))
    for i, (a, b) in enumerate(zip(ours_in, theirs_in, strict=True)):
        assert a.grad.dtype == dtype, f"input {i}"
        np.testing.assert_allclose(a.grad, b.grad.numpy(), **TOL[dtype], err_msg=f"input {i}")


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(20))
def test_conv2d_matches_torch(seed, dtype, monkeypatch):
    # odd seeds: the weight gradient in GEMMs of 5 columns, to test the chunking
    monkeypatch.setattr(F, "_GW_CHUNK", 5 if seed % 2 else F._GW_CHUNK)
    rng, x_shape, w_shape, stride, padding, bias = conv_case(seed)
    arrays = [rng.standard_normal(x_shape), rng.standard_normal(w_shape)]
    if bias:
        arrays.append(rng.standard_normal(w_shape[0]))
    against_torch(lambda *t: F.conv2d(*t, stride=stride, padding=padding),
                  lambda *t: torch.nn.functional.conv2d(*t, stride=stride, padding=padding),
                  arrays, dtype)


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
def test_pooling_matches_torch(pool, seed, dtype):
    rng, x_shape, kernel, stride, padding = pool_case(seed)
    x = rng.standard_normal(x_shape)
    ours, theirs = getattr(F, pool), getattr(torch.nn.functional, pool)
    against_torch(lambda t: ours(t, kernel, stride, padding),
                  lambda t: theirs(t, kernel, stride, padding), [x], dtype)


@needs_torch
@pytest.mark.parametrize("nan", [False, True])
def test_max_pool2d_ties_and_nan_match_torch(nan):
    x = np.zeros((1, 2, 4, 6))  # after a ReLU, whole windows tie at 0: the first one gets it all
    x[0, 0, 2:, 2:4] = 1.5
    if nan:
        x[0, 1, 1, 2] = np.nan
        x[0, 1, 3, 3] = np.nan
    against_torch(lambda t: F.max_pool2d(t, 2), lambda t: torch.nn.functional.max_pool2d(t, 2),
                  [x], np.float64)


@pytest.mark.parametrize("seed", range(12))
def test_conv2d_gradcheck(seed):
    rng, x_shape, w_shape, stride, padding, bias = conv_case(100 + seed)
    x, w, b = (rng.standard_normal(s) for s in (x_shape, w_shape, w_shape[:1]))
    if bias:
        assert gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride, padding), x, w, b)
    else:
        assert gradcheck(lambda x, w: F.conv2d(x, w, None, stride, padding), x, w)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pool", [F.max_pool2d, F.avg_pool2d])
def test_pooling_gradcheck(pool, seed):
    rng, x_shape, kernel, stride, padding = pool_case(200 + seed)
    # distinct values a few eps apart at least, so that no window maximum changes under ±eps
    x = rng.permutation(np.prod(x_shape)).reshape(x_shape) * 0.01 + rng.standard_normal() * 1e-4
    assert gradcheck(lambda x: pool(x, kernel, stride, padding), x)


@pytest.mark.parametrize("seed", range(12))
def test_im2col_and_col2im_are_adjoint(seed):
    """<im2col(x), y> = <x, col2im(y)> with y zero in the stride-1 junk columns, on the host
    kernel and on the array path."""
    rng, x_shape, (_, _, kh, kw), stride, padding, _ = conv_case(300 + seed)
    x = rng.standard_normal(x_shape)
    cols, (oh, ow, row) = kernels.im2col(x, kh, kw, stride, padding)
    y = rng.standard_normal(cols.shape).reshape(cols.shape[:2] + (oh, row))
    y[..., ow:] = 0
    y = y.reshape(cols.shape)
    y_images = np.ascontiguousarray(y.transpose(1, 0, 2))  # col2im takes (N, C·kh·kw, OH·R)
    for force in (False, True):
        back = kernels.col2im(y_images, x_shape, kh, kw, stride, padding, row,
                              force_array_path=force)
        assert back.shape == x_shape
        np.testing.assert_allclose(float((cols * y).sum()), float((x * back).sum()), rtol=1e-10)


@pytest.mark.parametrize("seed", range(12))
def test_max_pool_kernels_match_the_array_path(seed):
    rng, x_shape, (kh, kw), stride, padding = pool_case(400 + seed)
    for dtype in (np.float32, np.float64):
        x = rng.standard_normal(x_shape).astype(dtype)
        out, argmax = kernels.max_pool(x, kh, kw, stride, padding)
        ref_out, ref_argmax = kernels.max_pool(x, kh, kw, stride, padding, force_array_path=True)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(argmax, ref_argmax)
        grad = rng.standard_normal(out.shape).astype(dtype)
        np.testing.assert_allclose(
            kernels.max_pool_scatter(grad, argmax, x_shape, kh, kw, stride, padding),
            kernels.max_pool_scatter(grad, argmax, x_shape, kh, kw, stride, padding,
                                     force_array_path=True), rtol=1e-5, atol=1e-6)

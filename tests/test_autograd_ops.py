"""Every differentiable op passes a float64 central-difference gradient check, on CPU and GPU."""

import numpy as np
import pytest

import mpdl.autograd.functional as F
from mpdl.autograd import GradcheckError, Tensor, gradcheck, kernels
from mpdl.backend import cupy_module

DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.skipif(
    cupy_module() is None, reason="needs CuPy and a GPU (mpdl.backend.cupy_module() is None)"))]


def on(device, a):
    """``a`` as an array of the device's module."""
    return np.asarray(a) if device == "cpu" else cupy_module().asarray(a)


def randn(device, rng, *shape, offset=0.0):
    return on(device, rng.standard_normal(shape) + offset)


def random_shape(rng, ndim):
    return tuple(int(n) for n in rng.integers(1, 5, size=ndim))


def broadcast_partner(rng, shape):
    """A shape that broadcasts against ``shape``: some axes 1, maybe fewer leading axes."""
    partner = [1 if rng.random() < 0.4 else n for n in shape]
    return tuple(partner[int(rng.integers(0, len(shape))):])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "pow"])
def test_binary_ops_with_broadcasting(device, seed, op):
    rng = np.random.default_rng(seed)
    shape = random_shape(rng, int(rng.integers(1, 4)))
    other = broadcast_partner(rng, shape)
    a, b = randn(device, rng, *shape), randn(device, rng, *other)
    if seed % 2:
        a, b = b, a
    if op == "pow":
        a = abs(a) + 0.5
    fn = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
          "div": lambda x, y: x / (y * y + 1.0), "pow": lambda x, y: x ** y}[op]
    assert gradcheck(fn, a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_scalar_operands_and_reflected_ops(device):
    rng = np.random.default_rng(0)
    a = randn(device, rng, 3, 4)
    assert gradcheck(lambda x: 2.0 + x - 1.5 * x / 3.0 + 1 / (x * x + 1.0) - (4.0 - x), a)
    assert gradcheck(lambda x: -x ** 3 + x ** 2 + x ** 0.5 * 0 + 2.0 ** x, abs(a) + 0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((4,), (4, 2)), ((3, 4), (4,)), ((4,), (4,)),
                                    ((2, 3, 4), (4, 2)), ((2, 1, 3, 4), (5, 4, 2))])
def test_matmul(device, shapes):
    rng = np.random.default_rng(1)
    a, b = (randn(device, rng, *s) for s in shapes)
    assert gradcheck(lambda x, y: x @ y, a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_reductions(device, axis, keepdims, reduce):
    rng = np.random.default_rng(2)
    a = randn(device, rng, 3, 4, 2)
    assert gradcheck(lambda x: getattr(x, reduce)(axis=axis, keepdims=keepdims), a)


@pytest.mark.parametrize("device", DEVICES)
def test_max_splits_gradient_between_ties(device):
    x = Tensor(on(device, np.array([1.0, 3.0, 3.0])), requires_grad=True)
    x.max().backward()
    np.testing.assert_allclose(_host(x.grad), [0.0, 0.5, 0.5])


def _host(a):
    return a.get() if hasattr(a, "get") else a


@pytest.mark.parametrize("device", DEVICES)
def test_shape_ops(device):
    rng = np.random.default_rng(3)
    a = randn(device, rng, 2, 3, 4)
    assert gradcheck(lambda x: x.reshape(6, 4) * on(device, np.arange(24.0).reshape(6, 4)), a)
    assert gradcheck(lambda x: x.reshape((4, -1)).T, a)
    assert gradcheck(lambda x: x.transpose(2, 0, 1) * on(device, np.arange(24.0).reshape(4, 2, 3)),
                     a)
    assert gradcheck(lambda x: F.flatten(x), a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [
    (slice(1, None), slice(None, None, 2)),
    (0,),
    (Ellipsis, 1),
    (np.array([2, 0, 2, 2]),),
    (slice(None), np.array([[0, 1], [3, 3]])),
    (np.array([0, 1, 1]), np.array([3, 2, 2])),
    (np.array([True, False, True]),),
])
def test_indexing(device, index):
    rng = np.random.default_rng(4)
    a = randn(device, rng, 3, 4)
    index = tuple(on(device, i) if isinstance(i, np.ndarray) else i for i in index)
    assert gradcheck(lambda x: x[index if len(index) > 1 else index[0]], a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["exp", "log", "tanh", "sigmoid", "relu"])
def test_unary_methods(device, name):
    rng = np.random.default_rng(5)
    a = randn(device, rng, 3, 5)
    if name == "log":
        a = abs(a) + 0.1
    assert gradcheck(lambda x: getattr(x, name)(), a)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_is_stable_for_large_inputs(device):
    with np.errstate(over="raise"):
        y = Tensor(on(device, np.array([-1000.0, 0.0, 1000.0]))).sigmoid()
    np.testing.assert_allclose(_host(y.data), [0.0, 0.5, 1.0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [
    F.relu, F.sigmoid, F.tanh, F.gelu,
    lambda x: F.gelu(x, approximate="tanh"),
    F.softmax, F.log_softmax,
    lambda x: F.softmax(x, axis=0),
    lambda x: F.log_softmax(x, axis=0),
], ids=["relu", "sigmoid", "tanh", "gelu", "gelu_tanh", "softmax", "log_softmax",
        "softmax0", "log_softmax0"])
def test_activations(device, fn):
    rng = np.random.default_rng(6)
    a = randn(device, rng, 4, 5)
    assert gradcheck(fn, a)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses(device, reduction):
    rng = np.random.default_rng(7)
    logits, target = randn(device, rng, 5, 4), randn(device, rng, 5, 4)
    labels = on(device, np.array([0, 3, 1, 1, 2]))
    assert gradcheck(lambda x: F.cross_entropy(x, labels, reduction=reduction), logits)
    assert gradcheck(lambda x, t: F.mse_loss(x, t, reduction=reduction), logits, target)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch_shape", [(5,), (2, 3)])
def test_linear(device, batch_shape):
    rng = np.random.default_rng(8)
    x, w, b = randn(device, rng, *batch_shape, 4), randn(device, rng, 3, 4), randn(device, rng, 3)
    assert gradcheck(F.linear, x, w, b)
    assert gradcheck(F.linear, x, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stride,padding,kernel,bias", [
    (1, 0, (3, 3), True), (2, 1, (3, 3), True), (1, (1, 2), (2, 3), False), (3, 0, (1, 1), True)])
def test_conv2d(device, stride, padding, kernel, bias):
    rng = np.random.default_rng(9)
    x, w = randn(device, rng, 2, 3, 6, 5), randn(device, rng, 4, 3, *kernel)
    b = randn(device, rng, 4) if bias else None
    if bias:
        assert gradcheck(lambda x, w, b: F.conv2d(x, w, b, stride, padding), x, w, b)
    else:
        assert gradcheck(lambda x, w: F.conv2d(x, w, None, stride, padding), x, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool", [F.max_pool2d, F.avg_pool2d])
@pytest.mark.parametrize("kernel,stride,padding", [(2, None, 0), (3, 2, 1), ((2, 3), 1, 0)])
def test_pooling(device, pool, kernel, stride, padding):
    rng = np.random.default_rng(10)
    x = randn(device, rng, 2, 3, 6, 5)
    assert gradcheck(lambda x: pool(x, kernel, stride, padding), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5), (3, 3, 2, 4)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(device, shape, training):
    rng = np.random.default_rng(11)
    x, w, b = randn(device, rng, *shape), randn(device, rng, 3), randn(device, rng, 3)
    mean, var = on(device, rng.standard_normal(3)), on(device, rng.random(3) + 0.5)

    def f(x, w, b):
        return F.batch_norm(x, mean.copy(), var.copy(), w, b, training=training)

    assert gradcheck(f, x, w, b)
    assert gradcheck(lambda x: F.batch_norm(x, mean.copy(), var.copy(), training=training), x)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout(device):
    rng = np.random.default_rng(12)
    x = randn(device, rng, 4, 6)
    assert gradcheck(lambda x: F.dropout(x, 0.3, rng=np.random.default_rng(0)), x)


def test_composite_expression_with_shared_subgraph():
    rng = np.random.default_rng(13)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((4,))

    def f(x, y):
        h = (x * y).tanh()
        return (h @ h.T).sum(axis=0) + h.max(axis=1) * h.mean()

    assert gradcheck(f, a, b)


def test_gradcheck_reports_a_wrong_gradient():
    from mpdl.autograd.tensor import Function

    class WrongSquare(Function):
        def forward(self, x):
            self.x = x
            return x * x

        def backward(self, grad):
            return grad * self.x

    x = np.random.default_rng(0).standard_normal(5)
    with pytest.raises(GradcheckError, match="input 0"):
        gradcheck(lambda t: WrongSquare.apply(t), x)
    assert gradcheck(lambda t: WrongSquare.apply(t), x, raise_exception=False) is False


@pytest.mark.parametrize("stride", [1, 2])
def test_numba_kernels_match_the_array_path(stride):
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 3, 1 + stride * 3, 1 + stride * 3))  # padding 1: 4×4 windows
    x[0, 0, :2, :2] = 1.5  # a tie: the first maximum wins
    pooled = kernels.max_pool(x, 3, 3, stride, (1, 1))
    reference = kernels.max_pool(x, 3, 3, stride, (1, 1), force_array_path=True)
    for ours, theirs in zip(pooled, reference, strict=True):
        np.testing.assert_array_equal(ours, theirs)
    grad = rng.standard_normal((2, 3, 4, 4))
    np.testing.assert_allclose(
        kernels.max_pool_scatter(grad, pooled[1], x.shape, 3, 3, stride, (1, 1)),
        kernels.max_pool_scatter(grad, pooled[1], x.shape, 3, 3, stride, (1, 1),
                                 force_array_path=True))


def test_erf_kernel():
    import math

    x = np.linspace(-4, 4, 41)
    np.testing.assert_allclose(kernels.erf(x), [math.erf(v) for v in x], rtol=1e-14)
    assert kernels.erf(x.astype(np.float32)).dtype == np.float32

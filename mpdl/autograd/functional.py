"""Neural-network operations on Tensors: activations, losses and layers (``import ... as F``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdl.autograd import kernels
from mpdl.autograd.tensor import Function, Rectify, Sigmoid, Tanh, Tensor
from mpdl.backend import get_array_module

_default_rng = np.random.default_rng()


def _tensor(x: Any, argument: str) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return Tensor(x)
    raise TypeError(f"{argument}: expected a Tensor or an array, not {type(x).__name__}")


def _pair(value: int | tuple[int, int], argument: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 0 for v in pair):
        raise ValueError(f"{argument}: expected a non-negative int or a pair of them, not {value!r}")
    return pair


# ---------------------------------------------------------------------- activations
def relu(x: Tensor) -> Tensor:
    """max(x, 0), elementwise."""
    return Rectify.apply(_tensor(x, "x"))


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)), elementwise."""
    return Sigmoid.apply(_tensor(x, "x"))


def tanh(x: Tensor) -> Tensor:
    """Hyperbolic tangent, elementwise."""
    return Tanh.apply(_tensor(x, "x"))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class GELU(Function):
    def forward(self, x, approximate):
        xp = get_array_module(x)
        self.x, self.approximate = x, approximate
        if approximate == "tanh":
            self.t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
            return 0.5 * x * (1 + self.t)
        self.cdf = 0.5 * (1 + kernels.erf(x * _INV_SQRT_2))
        return x * self.cdf

    def backward(self, grad):
        xp = get_array_module(grad)
        x = self.x
        if self.approximate == "tanh":
            t = self.t
            inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
            return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * inner)
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)
        return grad * (self.cdf + x * pdf)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit x·Φ(x); ``approximate="tanh"`` uses the tanh formula."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', not {approximate!r}")
    return GELU.apply(_tensor(x, "x"), approximate=approximate)


def _log_softmax(x: Any, axis: int) -> Any:
    xp = get_array_module(x)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))


class Softmax(Function):
    def forward(self, x, axis):
        xp = get_array_module(x)
        e = xp.exp(x - x.max(axis=axis, keepdims=True))
        self.out, self.axis = e / e.sum(axis=axis, keepdims=True), axis
        return self.out

    def backward(self, grad):
        y = self.out
        return y * (grad - (grad * y).sum(axis=self.axis, keepdims=True))


class LogSoftmax(Function):
    def forward(self, x, axis):
        self.out, self.axis = _log_softmax(x, axis), axis
        return self.out

    def backward(self, grad):
        xp = get_array_module(grad)
        return grad - xp.exp(self.out) * grad.sum(axis=self.axis, keepdims=True)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x) normalised to sum to one along ``axis``."""
    return Softmax.apply(_tensor(x, "x"), axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """log(softmax(x)) along ``axis``, computed stably."""
    return LogSoftmax.apply(_tensor(x, "x"), axis=axis)


# ---------------------------------------------------------------------- losses
_REDUCTIONS = ("mean", "sum", "none")


class CrossEntropy(Function):
    def forward(self, logits, labels, reduction):
        xp = get_array_module(logits)
        n = logits.shape[0]
        logp = _log_softmax(logits, axis=1)
        rows = xp.arange(n)
        self.logp, self.labels, self.reduction, self.rows = logp, labels, reduction, rows
        losses = -logp[rows, labels]
        if reduction == "none":
            return losses
        total = losses.sum()
        return total * (1.0 / n) if reduction == "mean" else total

    def backward(self, grad):
        xp = get_array_module(grad)
        g = xp.exp(self.logp)
        g[self.rows, self.labels] -= 1
        n = g.shape[0]
        if self.reduction == "none":
            g *= grad[:, None]
        elif self.reduction == "mean":
            g *= grad * (1.0 / n)
        else:
            g *= grad
        return g


def cross_entropy(logits: Tensor, labels: Any, reduction: str = "mean") -> Tensor:
    """Softmax cross-entropy of (N, C) ``logits`` against integer class ``labels`` (N,)."""
    logits = _tensor(logits, "logits")
    labels = labels.data if isinstance(labels, Tensor) else labels
    xp = get_array_module(logits.data)
    labels = xp.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: labels must be an integer array, not {labels.dtype}")
    if logits.ndim != 2:
        raise ValueError(f"cross_entropy: logits must be (N, C), got shape {logits.shape}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy: labels shape {tuple(labels.shape)} does not match "
                         f"logits shape {logits.shape}; expected ({logits.shape[0]},)")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, "
                         f"not {reduction!r}")
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
        raise ValueError(f"cross_entropy: labels must lie in [0, {logits.shape[1]})")
    return CrossEntropy.apply(logits, labels=labels, reduction=reduction)


def mse_loss(input: Tensor, target: Any, reduction: str = "mean") -> Tensor:
    """Squared error between ``input`` and ``target`` (same shape), averaged or summed."""
    input = _tensor(input, "input")
    target = target if isinstance(target, Tensor) else _tensor(target, "target")
    if input.shape != target.shape:
        raise ValueError(f"mse_loss: input shape {input.shape} and target shape "
                         f"{target.shape} differ")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"mse_loss: reduction must be one of {_REDUCTIONS}, not {reduction!r}")
    diff = input - target
    squared = diff * diff
    if reduction == "none":
        return squared
    return squared.mean() if reduction == "mean" else squared.sum()


# ---------------------------------------------------------------------- layers
class Linear(Function):
    def forward(self, x, w, *bias):
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"linear: input shape {tuple(x.shape)} does not fit weight shape "
                             f"{tuple(w.shape)} (expected input[..., {w.shape[1]}])")
        self.x, self.w = x, w
        out = x @ w.T
        if bias:
            out += bias[0]
        return out

    def backward(self, grad):
        x, w = self.x, self.w
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = grad @ w if self.needs_input_grad[0] else None
        gw = g2.T @ x.reshape(-1, x.shape[-1]) if self.needs_input_grad[1] else None
        if len(self.needs_input_grad) == 2:
            return gx, gw
        gb = g2.sum(axis=0) if self.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, with weight of shape (out_features, in_features)."""
    args = (_tensor(x, "x"), _tensor(weight, "weight"))
    if bias is not None:
        args += (_tensor(bias, "bias"),)
    return Linear.apply(*args)


def _pad(x: Any, padding: tuple[int, int], value: float = 0.0) -> Any:
    if padding == (0, 0):
        return x
    xp = get_array_module(x)
    ph, pw = padding
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _check_image(x: Tensor, op: str, argument: str = "x") -> None:
    if x.ndim != 4:
        raise ValueError(f"{op}: {argument} must be 4-D (N, C, H, W), got shape {x.shape}")


class Conv2d(Function):
    def forward(self, x, w, *bias, stride, padding):
        xp = get_array_module(x)
        n = x.shape[0]
        o, c, kh, kw = w.shape
        xpad = _pad(x, padding)
        win = kernels.windows(xpad, kh, kw, stride)
        oh, ow = win.shape[2:4]
        cols = xp.ascontiguousarray(win.transpose(0, 1, 4, 5, 2, 3)).reshape(n, c * kh * kw, -1)
        out = w.reshape(o, -1) @ cols
        if bias:
            out += bias[0][:, None]
        self.cols, self.w, self.stride, self.padding = cols, w, stride, padding
        self.padded_shape, self.x_shape = xpad.shape, x.shape
        return out.reshape(n, o, oh, ow)

    def backward(self, grad):
        w = self.w
        o, c, kh, kw = w.shape
        n, _, oh, ow = grad.shape
        g = grad.reshape(n, o, oh * ow)
        gx = gw = gb = None
        if self.needs_input_grad[0]:
            gcols = (w.reshape(o, -1).T @ g).reshape(n, c, kh, kw, oh, ow)
            gpad = kernels.col2im(gcols, self.padded_shape, self.stride)
            gx = _crop(gpad, self.padding, self.x_shape)
        if self.needs_input_grad[1]:
            gw = (g @ self.cols.transpose(0, 2, 1)).sum(axis=0).reshape(w.shape)
        if len(self.needs_input_grad) == 2:
            return gx, gw
        if self.needs_input_grad[2]:
            gb = g.sum(axis=(0, 2))
        return gx, gw, gb


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           stride: int = 1, padding: int | tuple[int, int] = 0) -> Tensor:
    """2-D cross-correlation of NCHW ``x`` with OIHW ``weight`` (plus ``bias`` per channel)."""
    x, weight = _tensor(x, "x"), _tensor(weight, "weight")
    _check_image(x, "conv2d")
    _check_image(weight, "conv2d", "weight")
    if not isinstance(stride, int) or stride < 1:
        raise ValueError(f"conv2d: stride must be a positive int, not {stride!r}")
    padding = _pair(padding, "conv2d: padding")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"conv2d: x has {x.shape[1]} channels but weight {weight.shape} "
                         f"expects {weight.shape[1]}")
    h, w = x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1]
    if h < weight.shape[2] or w < weight.shape[3]:
        raise ValueError(f"conv2d: kernel {weight.shape[2:]} is larger than the padded input "
                         f"({h}, {w})")
    args = (x, weight) if bias is None else (x, weight, _tensor(bias, "bias"))
    if bias is not None and args[2].shape != (weight.shape[0],):
        raise ValueError(f"conv2d: bias shape {args[2].shape} must be ({weight.shape[0]},)")
    return Conv2d.apply(*args, stride=stride, padding=padding)


class MaxPool2d(Function):
    def forward(self, x, kernel, stride, padding):
        xp = get_array_module(x)
        xpad = _pad(x, padding, -np.inf)
        win = kernels.windows(xpad, *kernel, stride)
        flat = win.reshape(win.shape[:4] + (-1,))
        self.argmax = flat.argmax(axis=-1)
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.padded_shape, self.x_shape = xpad.shape, x.shape
        return xp.take_along_axis(flat, self.argmax[..., None], axis=-1)[..., 0]

    def backward(self, grad):
        gpad = kernels.max_pool_scatter(grad, self.argmax, self.padded_shape, *self.kernel,
                                        self.stride)
        return _crop(gpad, self.padding, self.x_shape)


class AvgPool2d(Function):
    def forward(self, x, kernel, stride, padding):
        xpad = _pad(x, padding)
        win = kernels.windows(xpad, *kernel, stride)
        self.kernel, self.stride, self.padding = kernel, stride, padding
        self.padded_shape, self.x_shape = xpad.shape, x.shape
        return win.sum(axis=(-2, -1)) * (1.0 / (kernel[0] * kernel[1]))

    def backward(self, grad):
        xp = get_array_module(grad)
        kh, kw = self.kernel
        scaled = grad * (1.0 / (kh * kw))
        n, c, oh, ow = grad.shape
        cols = xp.broadcast_to(scaled[:, :, None, None], (n, c, kh, kw, oh, ow))
        gpad = kernels.col2im(cols, self.padded_shape, self.stride)
        return _crop(gpad, self.padding, self.x_shape)


def _crop(x: Any, padding: tuple[int, int], shape: tuple[int, ...]) -> Any:
    ph, pw = padding
    return x[:, :, ph:ph + shape[2], pw:pw + shape[3]]


def _pool_args(op: str, x: Tensor, kernel_size: Any, stride: Any, padding: Any):
    _check_image(x, op)
    kernel = _pair(kernel_size, f"{op}: kernel_size")
    stride = kernel[0] if stride is None else stride
    if not isinstance(stride, int) or stride < 1 or kernel[0] < 1 or kernel[1] < 1:
        raise ValueError(f"{op}: kernel_size and stride must be positive ints")
    padding = _pair(padding, f"{op}: padding")
    if padding[0] * 2 > kernel[0] or padding[1] * 2 > kernel[1]:
        raise ValueError(f"{op}: padding {padding} must be at most half of kernel_size {kernel}")
    if x.shape[2] + 2 * padding[0] < kernel[0] or x.shape[3] + 2 * padding[1] < kernel[1]:
        raise ValueError(f"{op}: kernel_size {kernel} is larger than the input {x.shape[2:]}")
    return kernel, stride, padding


def max_pool2d(x: Tensor, kernel_size: int | tuple[int, int], stride: int | None = None,
               padding: int | tuple[int, int] = 0) -> Tensor:
    """Maximum over each kernel window of NCHW ``x`` (stride defaults to kernel_size)."""
    x = _tensor(x, "x")
    kernel, stride, padding = _pool_args("max_pool2d", x, kernel_size, stride, padding)
    return MaxPool2d.apply(x, kernel=kernel, stride=stride, padding=padding)


def avg_pool2d(x: Tensor, kernel_size: int | tuple[int, int], stride: int | None = None,
               padding: int | tuple[int, int] = 0) -> Tensor:
    """Mean over each kernel window of NCHW ``x``, zero padding counted."""
    x = _tensor(x, "x")
    kernel, stride, padding = _pool_args("avg_pool2d", x, kernel_size, stride, padding)
    return AvgPool2d.apply(x, kernel=kernel, stride=stride, padding=padding)


class BatchNorm(Function):
    def forward(self, x, *affine, mean, var, batch_stats, eps):
        xp = get_array_module(x)
        axes = (0,) + tuple(range(2, x.ndim))
        bshape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        self.axes, self.batch_stats = axes, batch_stats
        self.invstd = (1 / xp.sqrt(var + eps)).astype(x.dtype, copy=False).reshape(bshape)
        self.xhat = (x - mean.reshape(bshape)) * self.invstd
        self.weight = affine[0].reshape(bshape) if affine else None
        if not affine:
            return self.xhat
        return self.xhat * self.weight + affine[1].reshape(bshape)

    def backward(self, grad):
        xhat, axes = self.xhat, self.axes
        gw = gb = None
        if self.weight is not None:
            gw = (grad * xhat).sum(axis=axes) if self.needs_input_grad[1] else None
            gb = grad.sum(axis=axes) if self.needs_input_grad[2] else None
        gx = None
        if self.needs_input_grad[0]:
            gxhat = grad if self.weight is None else grad * self.weight
            if self.batch_stats:
                mean_g = gxhat.mean(axis=axes, keepdims=True)
                mean_gx = (gxhat * xhat).mean(axis=axes, keepdims=True)
                gx = (gxhat - mean_g - xhat * mean_gx) * self.invstd
            else:
                gx = gxhat * self.invstd
        return (gx,) if self.weight is None else (gx, gw, gb)


def batch_norm(x: Tensor, running_mean: Any, running_var: Any, weight: Tensor | None = None,
               bias: Tensor | None = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5) -> Tensor:
    """Normalise each channel of (N, C) or (N, C, ...) ``x``, then scale and shift.

    In training the batch statistics normalise and update ``running_mean``/``running_var`` in
    place (unbiased variance, ``new = (1 - momentum) * old + momentum * batch``); in evaluation the
    running statistics normalise.
    """
    x = _tensor(x, "x")
    if x.ndim < 2:
        raise ValueError(f"batch_norm: x must be (N, C) or (N, C, ...), got shape {x.shape}")
    rm = running_mean.data if isinstance(running_mean, Tensor) else running_mean
    rv = running_var.data if isinstance(running_var, Tensor) else running_var
    if (weight is None) != (bias is None):
        raise ValueError("batch_norm: give both weight and bias, or neither")
    affine = () if weight is None else (_tensor(weight, "weight"), _tensor(bias, "bias"))
    if training:
        count = x.size // x.shape[1]
        if count < 2:
            raise ValueError(f"batch_norm: training needs more than one value per channel, got "
                             f"input shape {x.shape}")
        mean, var = _batch_stats(x.data)
        if rm is not None:
            rm *= 1 - momentum
            rm += momentum * mean
            rv *= 1 - momentum
            rv += (momentum * count / (count - 1)) * var
        return BatchNorm.apply(x, *affine, mean=mean, var=var, batch_stats=True, eps=eps)
    if rm is None or rv is None:
        raise ValueError("batch_norm: evaluation mode needs running_mean and running_var")
    return BatchNorm.apply(x, *affine, mean=rm, var=rv, batch_stats=False, eps=eps)


def _batch_stats(x: Any) -> tuple[Any, Any]:
    axes = (0,) + tuple(range(2, x.ndim))
    return x.mean(axis=axes), x.var(axis=axes)


class Dropout(Function):
    def forward(self, x, mask):
        self.mask = mask
        return x * mask

    def backward(self, grad):
        return grad * self.mask


def dropout(x: Tensor, p: float = 0.5, training: bool = True,
            rng: np.random.Generator | None = None) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by 1/(1-p) (training only)."""
    x = _tensor(x, "x")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must lie in [0, 1], not {p!r}")
    if not training or p == 0.0:
        return x
    xp = get_array_module(x.data)
    if p == 1.0:
        mask = xp.zeros(x.shape, x.dtype)
    else:
        uniform = (rng or _default_rng).random(x.shape, dtype=np.float32)
        keep = xp.asarray(uniform) >= p
        mask = keep.astype(x.dtype) * (1.0 / (1.0 - p))
    return Dropout.apply(x, mask=mask)


def flatten(x: Tensor, start_dim: int = 1) -> Tensor:
    """``x`` with the axes from ``start_dim`` on merged into one."""
    x = _tensor(x, "x")
    start = start_dim % max(x.ndim, 1)
    return x.reshape(x.shape[:start] + (-1,))

"""Neural-network operations on Tensors: activations, losses and layers (``import ... as F``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mpdl.autograd import amp, fused, kernels
from mpdl.autograd.tensor import Function, ReLU, Sigmoid, Tanh, Tensor, unbroadcast
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
    return ReLU.apply(_tensor(x, "x"))


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)), elementwise."""
    return Sigmoid.apply(_tensor(x, "x"))


def tanh(x: Tensor) -> Tensor:
    """Hyperbolic tangent, elementwise."""
    return Tanh.apply(_tensor(x, "x"))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


class GELU(Function):
    def forward(self, x, approximate):
        xp = get_array_module(x)
        self.x, self.approximate = x, approximate
        if approximate == "tanh":
            self.t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
            return 0.5 * x * (1 + self.t)
        return fused.gelu(x)

    def backward(self, grad):
        x = self.x
        if self.approximate == "tanh":
            t = self.t
            inner = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
            return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * inner)
        return fused.gelu_backward(grad, x)


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
    def forward(self, logits, labels, reduction, ignore_index):
        xp = get_array_module(logits)
        n = logits.shape[0]
        self.keep = None if ignore_index is None else labels != ignore_index
        if self.keep is not None:
            labels = xp.where(self.keep, labels, 0)
        losses, self.lse = fused.cross_entropy(logits, labels, self.keep)
        self.logits, self.labels, self.reduction = logits, labels, reduction
        if reduction == "none":
            return losses
        total = losses.sum()
        self.count = n if self.keep is None else int(self.keep.sum())
        if reduction == "sum":
            return total
        return total * (1.0 / self.count) if self.count else xp.full((), xp.nan, logits.dtype)

    def backward(self, grad):
        xp = get_array_module(grad)
        logits = self.logits
        if self.reduction == "none":
            scale = grad
        else:
            if self.reduction == "mean":
                grad = grad * (1.0 / max(self.count, 1))
            scale = xp.ones(logits.shape[0], dtype=logits.dtype) * grad
        if self.keep is not None:
            scale = scale * self.keep
        return fused.cross_entropy_backward(logits, self.labels, self.lse,
                                            scale.astype(logits.dtype, copy=False))


def cross_entropy(logits: Tensor, labels: Any, reduction: str = "mean",
                  ignore_index: int | None = -100) -> Tensor:
    """Softmax cross-entropy of ``logits`` against integer class ``labels``.

    ``logits`` is (N, C) with ``labels`` (N,), or (N, T, C) with ``labels`` (N, T): the class
    axis is always the LAST one (the layout of a language model's output, as llm.c and nanoGPT
    use it; PyTorch's own 3-D layout is (N, C, T)). Positions whose label equals ``ignore_index``
    contribute no loss and no gradient ("none" gives them 0); "mean" averages over the other
    positions (NaN when none is left). ``ignore_index=None`` ignores no label.
    """
    logits = _tensor(logits, "logits")
    labels = labels.data if isinstance(labels, Tensor) else labels
    xp = get_array_module(logits.data)
    labels = xp.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise TypeError(f"cross_entropy: labels must be an integer array, not {labels.dtype}")
    if logits.ndim not in (2, 3):
        raise ValueError(f"cross_entropy: logits must be (N, C) or (N, T, C), got shape "
                         f"{logits.shape}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: labels shape {tuple(labels.shape)} does not match "
                         f"logits shape {logits.shape}; expected {logits.shape[:-1]}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {_REDUCTIONS}, "
                         f"not {reduction!r}")
    classes = logits.shape[-1]
    valid = labels if ignore_index is None else labels[labels != ignore_index]
    if valid.size and (int(valid.min()) < 0 or int(valid.max()) >= classes):
        raise ValueError(f"cross_entropy: labels must lie in [0, {classes}) or equal "
                         f"ignore_index ({ignore_index})")
    if ignore_index is not None and not bool((labels == ignore_index).any()):
        ignore_index = None
    if logits.ndim == 2:
        return CrossEntropy.apply(logits, labels=labels, reduction=reduction,
                                  ignore_index=ignore_index)
    flat = CrossEntropy.apply(logits.reshape(-1, classes), labels=labels.reshape(-1),
                              reduction=reduction, ignore_index=ignore_index)
    return flat.reshape(labels.shape) if reduction == "none" else flat


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
        self.x, self.w, self.dtype = x, w, amp.compute_dtype(w)
        # one GEMM over all leading axes (a stacked matmul is slower)
        out = amp.matmul(_fold(x), w.T, self.dtype)
        if bias:
            out += bias[0]
        return out.reshape(x.shape[:-1] + (w.shape[0],))

    def backward(self, grad):
        x, w = self.x, self.w
        g2, dtype = _fold(grad), self.dtype
        gx = amp.matmul(g2, w, dtype).reshape(x.shape) if self.needs_input_grad[0] else None
        gw = amp.matmul(g2.T, x.reshape(-1, x.shape[-1]), dtype) if self.needs_input_grad[1] \
            else None
        if len(self.needs_input_grad) == 2:
            return gx, gw
        gb = g2.sum(axis=0) if self.needs_input_grad[2] else None
        return gx, gw, gb


def _fold(x: Any) -> Any:
    """``x`` with its leading axes merged: (..., n) -> (m, n); 1-D and 2-D arrays unchanged."""
    return x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, with weight of shape (out_features, in_features)."""
    args = (_tensor(x, "x"), _tensor(weight, "weight"))
    if bias is not None:
        args += (_tensor(bias, "bias"),)
    return Linear.apply(*args)


def _check_image(x: Tensor, op: str, argument: str = "x") -> None:
    if x.ndim != 4:
        raise ValueError(f"{op}: {argument} must be 4-D (N, C, H, W), got shape {x.shape}")


_GW_CHUNK = 4096  # columns per GEMM in the weight gradient: a block that stays in cache


class Conv2d(Function):
    def forward(self, x, w, *bias, stride, padding):
        o, c, kh, kw = w.shape
        n = x.shape[0]
        self.dtype = dtype = amp.compute_dtype(w)
        cols, (oh, ow, row) = kernels.im2col(amp.operand(x, dtype), kh, kw, stride, padding)
        # one (O, K) @ (K, OH·R) product per image, read in place from the (K, N, OH·R) columns
        out = amp.rounded(amp.operand(w.reshape(o, -1), dtype) @ cols.transpose(1, 0, 2), dtype)
        out = out.reshape(n, o, oh, row)[..., :ow]
        out = out + bias[0][:, None, None] if bias else get_array_module(x).ascontiguousarray(out)
        self.cols, self.w, self.stride, self.padding = cols, w, stride, padding
        self.geometry, self.x_shape = (oh, ow, row), x.shape
        return out

    def backward(self, grad):
        xp = get_array_module(grad)
        w, cols = self.w, self.cols
        o, c, kh, kw = w.shape
        n = grad.shape[0]
        oh, ow, row = self.geometry
        # the gradient in the columns' (O, N, OH·R) layout, zero in the junk columns
        dtype = self.dtype
        g = xp.zeros((o, n, oh, row), dtype=grad.dtype if dtype is None else np.float32)
        g[..., :ow] = amp.operand(grad, dtype).transpose(1, 0, 2, 3)
        g = g.reshape(o, n * oh * row)
        gx = gw = gb = None
        if self.needs_input_grad[0]:
            gcols = amp.rounded(amp.operand(w.reshape(o, -1), dtype).T @
                                g.reshape(o, n, -1).transpose(1, 0, 2), dtype)
            gx = kernels.col2im(gcols, self.x_shape, kh, kw, self.stride, self.padding, row)
        if self.needs_input_grad[1]:
            flat = cols.reshape(cols.shape[0], -1)
            gwt = flat[:, :_GW_CHUNK] @ g[:, :_GW_CHUNK].T
            for start in range(_GW_CHUNK, flat.shape[1], _GW_CHUNK):
                gwt += flat[:, start:start + _GW_CHUNK] @ g[:, start:start + _GW_CHUNK].T
            gw = amp.rounded(gwt, dtype).T.reshape(w.shape)
        if len(self.needs_input_grad) == 2:
            return gx, gw
        if self.needs_input_grad[2]:
            gb = grad.sum(axis=(0, 2, 3))
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
        out, self.argmax = kernels.max_pool(x, *kernel, stride, padding)
        self.kernel, self.stride, self.padding, self.x_shape = kernel, stride, padding, x.shape
        return out

    def backward(self, grad):
        return kernels.max_pool_scatter(grad, self.argmax, self.x_shape, *self.kernel, self.stride,
                                        self.padding)


class AvgPool2d(Function):
    def forward(self, x, kernel, stride, padding):
        self.kernel, self.stride, self.padding, self.x_shape = kernel, stride, padding, x.shape
        return kernels.window_sum(x, *kernel, stride, padding) * (1.0 / (kernel[0] * kernel[1]))

    def backward(self, grad):
        kh, kw = self.kernel
        return kernels.window_sum_adjoint(grad * (1.0 / (kh * kw)), self.x_shape, kh, kw,
                                          self.stride, self.padding)


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


# ---------------------------------------------------------------------- transformer ops
def _index_array(indices: Any, like: Any, argument: str) -> Any:
    """Integer ``indices`` (Tensor, array or list) as an array on ``like``'s module."""
    xp = get_array_module(like)
    data = indices.data if isinstance(indices, Tensor) else indices
    data = xp.asarray(data)
    if data.dtype.kind not in "iu":
        raise TypeError(f"{argument}: expected integer indices, not dtype {data.dtype}")
    return data


def scatter_add_rows(indices: Any, values: Any, num_rows: int) -> Any:
    """A (num_rows, D) array whose row r is the sum of the rows of ``values`` (M, D) whose index
    in ``indices`` (M,) is r."""
    xp = get_array_module(values)
    out = xp.zeros((num_rows, values.shape[1]), dtype=values.dtype)
    if indices.size == 0:
        return out
    if xp is not np:
        xp.add.at(out, indices, values)
        return out
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    out[ordered[starts]] = np.add.reduceat(values[order], starts, axis=0)
    return out


class Embedding(Function):
    def forward(self, weight, indices):
        self.indices, self.num_rows = indices, weight.shape[0]
        return amp.operand(weight[indices], amp.compute_dtype(weight))

    def backward(self, grad):
        d = grad.shape[-1]
        return scatter_add_rows(self.indices.reshape(-1), grad.reshape(-1, d), self.num_rows)


def embedding(indices: Any, weight: Tensor) -> Tensor:
    """The rows of ``weight`` (num_embeddings, embedding_dim) picked by integer ``indices`` of
    any shape: output shape ``indices.shape + (embedding_dim,)``. Gradients of repeated indices
    add up in the same row."""
    weight = _tensor(weight, "weight")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (num_embeddings, embedding_dim), got "
                         f"shape {weight.shape}")
    idx = _index_array(indices, weight.data, "embedding: indices")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= weight.shape[0]):
        raise ValueError(f"embedding: indices must lie in [0, {weight.shape[0]}), got values in "
                         f"[{int(idx.min())}, {int(idx.max())}]")
    return Embedding.apply(weight, indices=idx)


class LayerNorm(Function):
    def forward(self, x, *affine, axes, eps):
        xp = get_array_module(x)
        self.shape = x.shape[x.ndim - len(axes):]
        width = math.prod(self.shape)
        rows = x.reshape(-1, width)
        if affine:
            self.weight, bias = affine[0].reshape(-1), affine[1].reshape(-1)
        else:
            self.weight, bias = xp.ones(width, x.dtype), xp.zeros(width, x.dtype)
        y, self.mean, self.rstd = fused.layer_norm(rows, self.weight, bias, eps)
        self.rows, self.affine = rows, bool(affine)
        return y.reshape(x.shape)

    def backward(self, grad):
        rows = self.rows
        gx, gw, gb = fused.layer_norm_backward(grad.reshape(rows.shape), rows, self.weight,
                                               self.mean, self.rstd)
        gx = gx.reshape(grad.shape) if self.needs_input_grad[0] else None
        if not self.affine:
            return (gx,)
        return (gx, gw.reshape(self.shape) if self.needs_input_grad[1] else None,
                gb.reshape(self.shape) if self.needs_input_grad[2] else None)


def layer_norm(x: Tensor, normalized_shape: int | tuple[int, ...], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """Normalise ``x`` over its trailing ``normalized_shape`` axes to zero mean and unit (biased)
    variance, then scale by ``weight`` and shift by ``bias`` (both of ``normalized_shape``)."""
    x = _tensor(x, "x")
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(n, int) and n > 0 for n in shape):
        raise ValueError(f"layer_norm: normalized_shape must be a positive int or a non-empty "
                         f"tuple of them, not {normalized_shape!r}")
    if x.shape[x.ndim - len(shape):] != shape or x.ndim < len(shape):
        raise ValueError(f"layer_norm: normalized_shape {shape} does not match the trailing axes "
                         f"of x, shape {x.shape}")
    if (weight is None) != (bias is None):
        raise ValueError("layer_norm: give both weight and bias, or neither")
    if not eps > 0:
        raise ValueError(f"layer_norm: eps must be > 0, not {eps!r}")
    affine = () if weight is None else (_tensor(weight, "weight"), _tensor(bias, "bias"))
    for name, t in zip(("weight", "bias"), affine, strict=False):
        if t.shape != shape:
            raise ValueError(f"layer_norm: {name} shape {t.shape} must equal normalized_shape "
                             f"{shape}")
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    return LayerNorm.apply(x, *affine, axes=axes, eps=float(eps))


class ScaledDotProductAttention(Function):
    def forward(self, q, k, v, is_causal, scale):
        xp = get_array_module(q)
        probs = fused.softmax_(q @ xp.swapaxes(k, -1, -2), scale, is_causal)
        out = probs @ v
        self.q, self.k, self.v, self.probs, self.scale = q, k, v, probs, scale
        self.is_causal = is_causal
        return out

    def backward(self, grad):
        xp = get_array_module(grad)
        p, need_q, need_k, need_v = self.probs, *self.needs_input_grad
        gv = xp.swapaxes(p, -1, -2) @ grad if need_v else None
        gq = gk = None
        if need_q or need_k:
            gs = fused.softmax_backward_(grad @ xp.swapaxes(self.v, -1, -2), p, self.scale,
                                         self.is_causal)
            gq = gs @ self.k if need_q else None
            gk = xp.swapaxes(gs, -1, -2) @ self.q if need_k else None
        return _reduce_to(gq, self.q.shape), _reduce_to(gk, self.k.shape), \
            _reduce_to(gv, self.v.shape)


def _reduce_to(grad: Any, shape: tuple[int, ...]) -> Any:
    return None if grad is None else unbroadcast(grad, shape)


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """softmax(q @ kᵀ · scale) @ v over (..., T, head_dim) queries and (..., S, head_dim) keys and
    values (e.g. (batch, heads, time, head_dim)); ``scale`` defaults to 1/√head_dim and
    ``is_causal`` lets query i attend to keys 0..i only (PyTorch's top-left aligned mask)."""
    q, k, v = _tensor(q, "q"), _tensor(k, "k"), _tensor(v, "v")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim < 2:
            raise ValueError(f"scaled_dot_product_attention: {name} must have at least 2 axes "
                             f"(..., time, head_dim), got shape {t.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"scaled_dot_product_attention: k's last axis {k.shape[-1]} must equal "
                         f"q's head_dim {q.shape[-1]}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: v has {v.shape[-2]} positions but k has "
                         f"{k.shape[-2]}")
    try:
        np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"scaled_dot_product_attention: leading axes of q {q.shape}, k {k.shape} "
                         f"and v {v.shape} do not broadcast") from None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return ScaledDotProductAttention.apply(q, k, v, is_causal=bool(is_causal), scale=scale)

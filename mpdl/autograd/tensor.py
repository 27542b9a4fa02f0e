"""Tensor, the differentiable primitives it is built from, and the backward engine.

A ``Tensor`` wraps a NumPy or CuPy array. Every differentiable operation is a ``Function``:
``forward`` maps input arrays to an output array and ``backward`` maps the output's gradient to one
gradient per input. ``Tensor.backward`` walks the recorded graph in reverse topological order,
accumulates gradients into the leaves (``p.grad += g``), fires each leaf's grad-ready hooks as soon
as its gradient is final, and frees the graph unless ``retain_graph=True``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.backend import cupy_module, get_array_module, is_floating, to_host

_state = threading.local()


def is_grad_enabled() -> bool:
    """Whether operations on this thread record a graph for backward."""
    return getattr(_state, "grad_enabled", True)


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Context in which operations record no graph (evaluation, optimizer updates)."""
    previous = is_grad_enabled()
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = previous


@contextlib.contextmanager
def enable_grad() -> Iterator[None]:
    """Context in which operations record a graph, even inside ``no_grad``."""
    previous = is_grad_enabled()
    _state.grad_enabled = True
    try:
        yield
    finally:
        _state.grad_enabled = previous


class Function:
    """One differentiable primitive with a single output.

    Subclasses implement ``forward(self, *arrays, **params) -> array`` and
    ``backward(self, grad) -> array | tuple``, giving one gradient (or None) per positional input.
    ``self`` is the context: forward stores what backward needs on it, and may consult
    ``self.needs_input_grad`` to skip work. Backward returns new arrays or views of ``grad``, never
    arrays it saved in forward (the engine may accumulate into a returned array in place).
    """

    inputs: tuple[Tensor, ...] | None
    needs_input_grad: tuple[bool, ...]

    @classmethod
    def apply(cls, *inputs: Tensor, **params: Any) -> Tensor:
        """Run forward on the inputs' arrays and record the node if any input requires grad."""
        ctx = cls()
        needs = tuple(t.requires_grad for t in inputs)
        record = any(needs) and is_grad_enabled()
        ctx.needs_input_grad = needs if record else (False,) * len(inputs)
        out = ctx.forward(*(t.data for t in inputs), **params)
        result = Tensor._wrap(out, record)
        if record:
            ctx.inputs = inputs
            result._ctx = ctx
            ledger = memory.current()
            if ledger is not None:  # what the node keeps: its saved arrays (attributes or in
                # a tuple attribute) and its inputs' data
                kept = [a for v in vars(ctx).values() for a in (v if isinstance(v, tuple) else (v,))]
                ctx._saved = ledger.save([*kept, *(t.data for t in inputs)])
        return result

    def forward(self, *arrays: Any, **params: Any) -> Any:
        raise NotImplementedError

    def backward(self, grad: Any) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the inputs and saved buffers; the node can no longer run backward."""
        self.__dict__.clear()
        self.inputs = None


class HookHandle:
    """Returned by ``register_grad_ready_hook``; ``remove()`` unregisters the hook."""

    def __init__(self, hooks: list, fn: Callable) -> None:
        self._hooks = hooks
        self._fn = fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


def _device_of(data: Any) -> str:
    return "cpu" if get_array_module(data) is np else "gpu"


def _as_array(value: Any, like: Any) -> Any:
    """A constant operand as an array on ``like``'s module, keeping ``like``'s float dtype."""
    if isinstance(value, Tensor):
        return value.data
    xp = get_array_module(like)
    if isinstance(value, (bool, int, float)) and is_floating(like.dtype):
        return xp.asarray(value, dtype=like.dtype)
    return xp.asarray(value)


class Tensor:
    """An n-dimensional array with an optional gradient and the graph that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "_ctx", "_hooks", "__weakref__")
    __array_ufunc__ = None  # make NumPy defer ``array + tensor`` to Tensor.__radd__

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if isinstance(data, Tensor):
            data = data.data
        elif isinstance(data, (list, tuple, int, float, bool)) or np.isscalar(data):
            python_values = not isinstance(data, np.generic)
            data = np.asarray(data)
            if data.dtype == np.float64 and python_values:
                data = data.astype(np.float32)
        elif not hasattr(data, "dtype") or not hasattr(data, "shape"):
            raise TypeError(f"Tensor: data must be an array, a number or a list, not "
                            f"{type(data).__name__}")
        if requires_grad and not (is_floating(data.dtype) or data.dtype.kind == "c"):
            raise TypeError(f"Tensor: requires_grad needs a floating dtype, not {data.dtype}")
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._ctx: Function | None = None
        self._hooks: list[Callable] | None = None

    @classmethod
    def _wrap(cls, data: Any, requires_grad: bool) -> Tensor:
        t = object.__new__(Tensor)
        t.data = data
        t.grad = None
        t.requires_grad = requires_grad
        t._ctx = None
        t._hooks = None
        return t

    # ------------------------------------------------------------------ array-like attributes
    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: int(self.data.size))
    device = property(lambda self: _device_of(self.data))
    is_leaf = property(lambda self: self._ctx is None)

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({to_host(self.data)!r}{grad})"

    __hash__ = object.__hash__

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array (the data itself on CPU, a host copy on GPU)."""
        return to_host(self.data)

    def item(self) -> float | int | bool:
        """The single value of a one-element tensor as a Python number."""
        if self.data.size != 1:
            raise ValueError(f"item(): tensor has {self.data.size} elements, expected 1")
        return self.data.reshape(-1)[0].item()

    def detach(self) -> Tensor:
        """A tensor sharing this data, cut from the graph."""
        return Tensor._wrap(self.data, False)

    def to(self, device: str) -> Tensor:
        """This tensor on ``device`` ("cpu" or "gpu"); differentiable."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f"to(): device must be 'cpu' or 'gpu', not {device!r}")
        if device == self.device:
            return self
        return ToDevice.apply(self, device=device)

    # ------------------------------------------------------------------ backward
    def register_grad_ready_hook(self, fn: Callable[[Tensor], None]) -> HookHandle:
        """Call ``fn(self)`` once per backward, right after ``self.grad`` is final for it."""
        if self._ctx is not None or not self.requires_grad:
            raise RuntimeError("register_grad_ready_hook: only leaf tensors that require grad "
                               "have grad-ready hooks")
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(fn)
        return HookHandle(self._hooks, fn)

    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``; ``grad`` seeds non-scalars."""
        _run_backward(self, self._seed(grad), retain_graph)

    def backward_split(self, grad: Any = None, weights: Any = ()) -> WeightGradients:
        """The first half of ``backward()``: every gradient but those of the leaves in
        ``weights`` now, theirs when the returned `WeightGradients` runs (the same values as one
        ``backward()``; the graph is kept until then)."""
        later = WeightGradients({id(w) for w in weights})
        _run_backward(self, self._seed(grad), False, later)
        return later

    def _seed(self, grad: Any) -> Any:
        """The gradient backward starts from (ones for a scalar)."""
        if not self.requires_grad:
            raise RuntimeError("backward(): tensor does not require grad and has no graph")
        xp = get_array_module(self.data)
        if grad is None:
            if self.data.size != 1:
                raise RuntimeError(f"backward(): grad must be given for a non-scalar output of "
                                   f"shape {self.shape}")
            grad = xp.ones_like(self.data)
        else:
            grad = xp.array(grad.data if isinstance(grad, Tensor) else grad, dtype=self.dtype)
            if grad.shape != self.data.shape:
                raise ValueError(f"backward(): grad shape {tuple(grad.shape)} does not match "
                                 f"tensor shape {self.shape}")
        return grad

    # ------------------------------------------------------------------ operators
    def __add__(self, other: Any) -> Tensor:
        return Add.apply(self, _lift(other, self))

    def __radd__(self, other: Any) -> Tensor:
        return Add.apply(_lift(other, self), self)

    def __sub__(self, other: Any) -> Tensor:
        return Sub.apply(self, _lift(other, self))

    def __rsub__(self, other: Any) -> Tensor:
        return Sub.apply(_lift(other, self), self)

    def __mul__(self, other: Any) -> Tensor:
        return Mul.apply(self, _lift(other, self))

    def __rmul__(self, other: Any) -> Tensor:
        return Mul.apply(_lift(other, self), self)

    def __truediv__(self, other: Any) -> Tensor:
        return Div.apply(self, _lift(other, self))

    def __rtruediv__(self, other: Any) -> Tensor:
        return Div.apply(_lift(other, self), self)

    def __matmul__(self, other: Any) -> Tensor:
        return MatMul.apply(self, _lift(other, self))

    def __rmatmul__(self, other: Any) -> Tensor:
        return MatMul.apply(_lift(other, self), self)

    def __pow__(self, exponent: Any) -> Tensor:
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
            return PowScalar.apply(self, exponent=exponent)
        return Pow.apply(self, _lift(exponent, self))

    def __rpow__(self, base: Any) -> Tensor:
        return Pow.apply(_lift(base, self), self)

    def __neg__(self) -> Tensor:
        return Neg.apply(self)

    def __getitem__(self, index: Any) -> Tensor:
        return GetItem.apply(self, index=_plain_index(index))

    def _compare(self, other: Any, op: str) -> Tensor:
        return Tensor._wrap(getattr(self.data, op)(_as_array(other, self.data)), False)

    def __lt__(self, other: Any) -> Tensor:
        return self._compare(other, "__lt__")

    def __le__(self, other: Any) -> Tensor:
        return self._compare(other, "__le__")

    def __gt__(self, other: Any) -> Tensor:
        return self._compare(other, "__gt__")

    def __ge__(self, other: Any) -> Tensor:
        return self._compare(other, "__ge__")

    def __eq__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, "__eq__")

    def __ne__(self, other: Any) -> Tensor:  # type: ignore[override]
        return self._compare(other, "__ne__")

    # ------------------------------------------------------------------ reductions and shape
    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        n = self.data.size if axis is None else int(np.prod(
            [self.data.shape[a] for a in np.atleast_1d(axis)]))
        return Sum.apply(self, axis=axis, keepdims=keepdims) * (1.0 / max(n, 1))

    def max(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        return Max.apply(self, axis=axis, keepdims=keepdims)

    def reshape(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return Reshape.apply(self, shape=shape)

    def transpose(self, *axes: Any) -> Tensor:
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return Transpose.apply(self, axes=axes or None)

    T = property(lambda self: Transpose.apply(self, axes=None))

    def exp(self) -> Tensor:
        return Exp.apply(self)

    def log(self) -> Tensor:
        return Log.apply(self)

    def tanh(self) -> Tensor:
        return Tanh.apply(self)

    def sigmoid(self) -> Tensor:
        return Sigmoid.apply(self)

    def relu(self) -> Tensor:
        return ReLU.apply(self)


def _lift(value: Any, like: Tensor) -> Tensor:
    """An operand as a Tensor: tensors pass through, constants become non-grad tensors."""
    if isinstance(value, Tensor):
        return value
    return Tensor._wrap(_as_array(value, like.data), False)


def _plain_index(index: Any) -> Any:
    """An index with Tensors replaced by their arrays."""
    if isinstance(index, Tensor):
        return index.data
    if isinstance(index, tuple):
        return tuple(i.data if isinstance(i, Tensor) else i for i in index)
    return index


# ---------------------------------------------------------------------- backward engine
def _consumer_counts(root: Tensor) -> dict[int, int]:
    """For every tensor that leads to ``root`` through grad-requiring edges, the number of such
    edges that leave it: how many gradient contributions it will receive in this backward."""
    counts = {id(root): 0}
    stack = [root]
    while stack:
        ctx = stack.pop()._ctx
        if ctx is None:
            continue
        if ctx.inputs is None:
            raise RuntimeError("backward(): the graph was freed by an earlier backward; pass "
                               "retain_graph=True to the first backward to run it again")
        for inp, need in zip(ctx.inputs, ctx.needs_input_grad, strict=True):
            if need:
                if id(inp) not in counts:
                    counts[id(inp)] = 0
                    stack.append(inp)
                counts[id(inp)] += 1
    return counts


class WeightGradients:
    """The second half of a split backward (`Tensor.backward_split`): the nodes that have a
    weight among their inputs, each with the gradient of its output, to run again for the
    weights' gradients alone."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights
        #: (node, its output's gradient, which inputs are weights), in the backward's order
        self.nodes: list[tuple[Function, Any, tuple[bool, ...]]] = []

    def input_grads(self, ctx: Function, grad: Any) -> tuple:
        """The node's gradients for its inputs that are not weights; the node is kept for
        `run` when some are."""
        mask = tuple(need and id(t) in self.weights
                     for t, need in zip(ctx.inputs, ctx.needs_input_grad, strict=True))
        if not any(mask):
            return _as_tuple(ctx.backward(grad))
        # a copy: the output's gradient may be an array the engine adds into afterwards
        self.nodes.append((ctx, grad.copy(), mask))
        now = tuple(need and not w for need, w in zip(ctx.needs_input_grad, mask, strict=True))
        if not any(now):
            return (None,) * len(mask)
        return _as_tuple(_backward_for(ctx, grad, now))

    def run(self) -> None:
        """Accumulate the weights' gradients into their ``.grad`` (summed per weight in the
        order one backward adds them, then its grad-ready hooks fire) and free the nodes."""
        grads: dict[int, Any] = {}
        leaves: dict[int, Tensor] = {}
        owned: set[int] = set()
        for ctx, grad, mask in self.nodes:
            for t, w, g in zip(ctx.inputs, mask, _as_tuple(_backward_for(ctx, grad, mask)),
                               strict=True):
                if not w or g is None:
                    continue
                key = id(t)
                leaves[key] = t
                if key not in grads:
                    grads[key] = g
                elif key in owned:
                    grads[key] += g
                else:
                    grads[key] = grads[key] + g
                    owned.add(key)
            ctx.release()
        self.nodes = []
        handed: set[int] = set()
        for key, leaf in leaves.items():
            _finish_leaf(leaf, grads[key], key in owned, handed)


def _backward_for(ctx: Function, grad: Any, needs: tuple[bool, ...]) -> Any:
    """The node's backward for the inputs in ``needs`` only."""
    full = ctx.needs_input_grad
    ctx.needs_input_grad = needs
    try:
        return ctx.backward(grad)
    finally:
        ctx.needs_input_grad = full


def _as_tuple(grads: Any) -> tuple:
    return grads if isinstance(grads, tuple) else (grads,)


def _run_backward(root: Tensor, grad: Any, retain_graph: bool,
                  later: WeightGradients | None = None) -> None:
    """Kahn's algorithm from the output: a tensor's backward runs once all of its consumers have
    added their contribution to its gradient (its pending count reached zero), so every gradient
    is complete before it is used, however many paths of whatever lengths lead to it. With
    `later`, the gradients of its weights are left to it."""
    pending = _consumer_counts(root)
    grads: dict[int, Any] = {id(root): grad}
    owned = {id(root)}  # tensors whose accumulated gradient array the engine created
    handed: set[int] = set()  # arrays given to leaves in this backward
    if root._ctx is None:
        _finish_leaf(root, grads.pop(id(root)), True, handed)
        return
    ready = [root]  # non-leaf tensors whose gradient is complete
    while ready:
        t = ready.pop()
        ctx = t._ctx
        g = grads.pop(id(t), None)
        if g is None:
            in_grads: tuple = (None,) * len(ctx.inputs)
        elif later is None:
            in_grads = _as_tuple(ctx.backward(g))
        else:
            in_grads = later.input_grads(ctx, g)
        for inp, need, gi in zip(ctx.inputs, ctx.needs_input_grad, in_grads, strict=True):
            if not need or (later is not None and id(inp) in later.weights):
                continue
            key = id(inp)
            if gi is not None:
                previous = grads.get(key)
                if previous is None:
                    grads[key] = gi
                elif key in owned:
                    previous += gi
                else:
                    grads[key] = previous + gi
                    owned.add(key)
            pending[key] -= 1
            if pending[key] == 0:
                if inp._ctx is None:  # a leaf: its gradient is final, fire its hooks now
                    _finish_leaf(inp, grads.pop(key, None), key in owned, handed)
                else:
                    ready.append(inp)
        if not retain_graph and not (later is not None and later.nodes
                                     and later.nodes[-1][0] is ctx):
            ctx.release()


def _finish_leaf(leaf: Tensor, g: Any, owned: bool, handed: set[int]) -> None:
    """Accumulate the final gradient of this backward into ``leaf.grad`` and fire its hooks."""
    if g is not None:
        if g.dtype != leaf.data.dtype:
            with np.errstate(over="ignore"):  # a float16 leaf: overflow is inf, as it should be
                g = g.astype(leaf.data.dtype)
            owned = True
        if g.shape != leaf.data.shape:
            raise RuntimeError(f"backward(): gradient of shape {tuple(g.shape)} for a leaf of "
                               f"shape {leaf.shape}")
        if leaf.grad is None:
            exclusive = owned or (g.base is None and id(g) not in handed)
            leaf.grad = g if exclusive else g.copy()
            handed.add(id(leaf.grad))
        else:
            leaf.grad += g
    if leaf._hooks:
        for hook in list(leaf._hooks):
            hook(leaf)
    if leaf.grad is not None:  # where the gradient is kept, once the hooks have moved it
        memory.hold(leaf.grad, "gradients")


# ---------------------------------------------------------------------- primitives
def unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """``grad`` summed over the axes along which an operand of ``shape`` was broadcast."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


class ToDevice(Function):
    def forward(self, x, device):
        self.source = _device_of(x)
        return _move(x, device)

    def backward(self, grad):
        return _move(grad, self.source)


def _move(x: Any, device: str) -> Any:
    if device == "cpu":
        return to_host(x)
    cp = cupy_module()
    if cp is None:
        raise RuntimeError("to('gpu'): CuPy is not installed or sees no GPU")
    return cp.asarray(x)


class Add(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return a + b

    def backward(self, grad):
        return unbroadcast(grad, self.shapes[0]), unbroadcast(grad, self.shapes[1])


class Sub(Function):
    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return a - b

    def backward(self, grad):
        gb = unbroadcast(-grad, self.shapes[1]) if self.needs_input_grad[1] else None
        return unbroadcast(grad, self.shapes[0]), gb


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, grad):
        need_a, need_b = self.needs_input_grad
        ga = unbroadcast(grad * self.b, self.a.shape) if need_a else None
        gb = unbroadcast(grad * self.a, self.b.shape) if need_b else None
        return ga, gb


class Div(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return a / b

    def backward(self, grad):
        need_a, need_b = self.needs_input_grad
        ga = unbroadcast(grad / self.b, self.a.shape) if need_a else None
        gb = unbroadcast(-grad * self.a / (self.b * self.b), self.b.shape) if need_b else None
        return ga, gb


class Neg(Function):
    def forward(self, a):
        return -a

    def backward(self, grad):
        return -grad


class PowScalar(Function):
    def forward(self, a, exponent):
        self.a, self.exponent = a, exponent
        return a**exponent

    def backward(self, grad):
        p = self.exponent
        if p == 2:
            return grad * (2.0 * self.a)
        return grad * (p * self.a ** (p - 1))


class Pow(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        self.out = a**b
        return self.out

    def backward(self, grad):
        xp = get_array_module(grad)
        need_a, need_b = self.needs_input_grad
        ga = unbroadcast(grad * self.b * self.a ** (self.b - 1), self.a.shape) if need_a else None
        gb = None
        if need_b:
            log_a = xp.log(xp.where(self.a > 0, self.a, 1))
            gb = unbroadcast(grad * self.out * log_a, self.b.shape)
        return ga, gb


class MatMul(Function):
    def forward(self, a, b):
        inner_b = b.shape[0] if b.ndim == 1 else b.shape[-2] if b.ndim > 1 else None
        if a.ndim == 0 or b.ndim == 0 or a.shape[-1] != inner_b:
            raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} are not "
                             f"aligned (last axis of the first must match the second-to-last "
                             f"of the second)")
        self.a, self.b = a, b
        if b.ndim == 2 and a.ndim > 2:  # one GEMM over the stack (a stacked matmul is slower)
            return (a.reshape(-1, a.shape[-1]) @ b).reshape(a.shape[:-1] + (b.shape[1],))
        return a @ b

    def backward(self, grad):
        xp = get_array_module(grad)
        a, b = self.a, self.b
        if b.ndim == 2 and a.ndim > 2:  # a stack of matrices times one matrix: fold the stack
            need_a, need_b = self.needs_input_grad
            g2 = grad.reshape(-1, grad.shape[-1])
            ga = (g2 @ b.T).reshape(a.shape) if need_a else None
            gb = a.reshape(-1, a.shape[-1]).T @ g2 if need_b else None
            return ga, gb
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
        g = grad.reshape(batch + (a2.shape[-2], b2.shape[-1]))
        need_a, need_b = self.needs_input_grad
        ga = gb = None
        if need_a:
            ga = unbroadcast(g @ xp.swapaxes(b2, -1, -2), a2.shape).reshape(a.shape)
        if need_b:
            gb = unbroadcast(xp.swapaxes(a2, -1, -2) @ g, b2.shape).reshape(b.shape)
        return ga, gb


class Sum(Function):
    def forward(self, a, axis, keepdims):
        self.shape, self.axis, self.keepdims = a.shape, axis, keepdims
        return a.sum(axis=axis, keepdims=keepdims)

    def backward(self, grad):
        xp = get_array_module(grad)
        if not self.keepdims and self.axis is not None:
            axes = tuple(ax % len(self.shape) for ax in np.atleast_1d(self.axis))
            grad = xp.expand_dims(grad, axes)
        return xp.broadcast_to(grad, self.shape)


class Max(Function):
    def forward(self, a, axis, keepdims):
        self.axis, self.keepdims = axis, keepdims
        out = a.max(axis=axis, keepdims=True)
        self.mask = a == out
        if keepdims:
            return out
        if axis is None:
            return out.reshape(())
        return out.squeeze(axis=tuple(ax % a.ndim for ax in np.atleast_1d(axis)))

    def backward(self, grad):
        xp = get_array_module(grad)
        if not self.keepdims and self.axis is not None:
            axes = tuple(ax % self.mask.ndim for ax in np.atleast_1d(self.axis))
            grad = xp.expand_dims(grad, axes)
        elif not self.keepdims:
            grad = grad.reshape((1,) * self.mask.ndim)
        count = self.mask.sum(axis=self.axis, keepdims=True).astype(grad.dtype)
        return self.mask * (grad / count)


class Reshape(Function):
    def forward(self, a, shape):
        self.shape = a.shape
        return a.reshape(shape)

    def backward(self, grad):
        return grad.reshape(self.shape)


class Transpose(Function):
    def forward(self, a, axes):
        self.axes = axes
        return a.transpose(axes)

    def backward(self, grad):
        if self.axes is None:
            return grad.transpose()
        return grad.transpose(np.argsort(self.axes))


class GetItem(Function):
    def forward(self, a, index):
        self.shape, self.dtype, self.index = a.shape, a.dtype, index
        return a[index]

    def backward(self, grad):
        xp = get_array_module(grad)
        if _is_basic_index(self.index):
            out = xp.zeros(self.shape, self.dtype)
            out[self.index] = grad
            return out
        size = int(np.prod(self.shape))
        positions = xp.arange(size).reshape(self.shape)[self.index]
        flat = xp.bincount(positions.reshape(-1), weights=grad.reshape(-1), minlength=size)
        return flat.astype(self.dtype, copy=False).reshape(self.shape)


def _is_basic_index(index: Any) -> bool:
    """True when ``index`` selects each element at most once (slices, ints, None, Ellipsis)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(p, (slice, int, type(None), type(Ellipsis))) for p in parts)


class Exp(Function):
    def forward(self, a):
        self.out = get_array_module(a).exp(a)
        return self.out

    def backward(self, grad):
        return grad * self.out


class Log(Function):
    def forward(self, a):
        self.a = a
        return get_array_module(a).log(a)

    def backward(self, grad):
        return grad / self.a


class Tanh(Function):
    def forward(self, a):
        self.out = get_array_module(a).tanh(a)
        return self.out

    def backward(self, grad):
        return grad * (1 - self.out * self.out)


class Sigmoid(Function):
    def forward(self, a):
        xp = get_array_module(a)
        z = xp.exp(-xp.abs(a))
        self.out = xp.where(a >= 0, 1 / (1 + z), z / (1 + z))
        return self.out

    def backward(self, grad):
        return grad * self.out * (1 - self.out)


class ReLU(Function):
    """max(a, 0); the gradient passes where the output is positive."""

    def forward(self, a):
        out = get_array_module(a).maximum(a, 0)
        self.mask = out > 0
        return out

    def backward(self, grad):
        return grad * self.mask

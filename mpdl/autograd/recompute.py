"""Activation recomputation (gradient checkpointing; Chen et al. 2016): keep a function's inputs
instead of everything its operations save, and run it again during backward.

    y = checkpoint(block, x)       # forward without a graph inside block; y's node keeps x only
    y.sum().backward()             # block runs again (graph on), then its backward

The random generators the function draws from are put back, for the second run, in the state
they had before the first, so dropout draws the same masks and the gradients are bit-identical to
those without recomputation; afterwards they continue from where the first run left them. By
default these are the generators of every module reachable from `fn` (a Module, or a bound method
of one: attributes that are `numpy.random.Generator`s, as `nn.Dropout.rng`) and the generator
`functional.dropout` uses when given none.

The parameters inside `fn` receive their gradients (and fire their grad-ready hooks) during the
second run's backward, once per call: a parameter used by `fn` must not also be used outside it in
the same graph (as with PyTorch's reentrant checkpoint).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad

_state = threading.local()


def recomputing() -> bool:
    """Whether this thread is running a checkpointed function again, in backward (a module that
    gathers its parameters for forward, as ZeRO-3's units, then keeps them for the backward that
    follows)."""
    return getattr(_state, "recomputing", False)


@contextlib.contextmanager
def _recomputing() -> Iterator[None]:
    previous = recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous


def module_generators(fn: Any) -> list[np.random.Generator]:
    """The random generators `fn` may draw from: those held by the modules under it (fn itself,
    or the object of a bound method) and functional's default one, each once."""
    owner = getattr(fn, "__self__", fn)
    found: dict[int, np.random.Generator] = {}
    if hasattr(owner, "named_modules"):
        for _, module in owner.named_modules():
            for value in vars(module).values():
                if isinstance(value, np.random.Generator):
                    found.setdefault(id(value), value)
    found.setdefault(id(F._default_rng), F._default_rng)
    return list(found.values())


class _Capture(Function):
    """Identity whose backward hands the gradient to `box` instead of to its input (so that a
    recomputed input's gradient is passed on, not kept as a leaf's)."""

    def forward(self, x, box):
        self.box = box
        return x.view()

    def backward(self, grad):
        self.box.append(grad)
        return None


class Recompute(Function):
    """The node of a checkpointed call: keeps the inputs and the generators' states; its backward
    runs the function again and backward through it."""

    def backward(self, grad: Any) -> tuple:
        current = [g.bit_generator.state for g in self.generators]
        for g, state in zip(self.generators, self.states, strict=True):
            g.bit_generator.state = state
        boxes: list[list[Any]] = [[] for _ in self.inputs]
        try:
            with enable_grad(), _recomputing():
                args = [_Capture.apply(Tensor._wrap(t.data, True), box=box) if need
                        else Tensor._wrap(t.data, False)
                        for t, need, box in zip(self.inputs, self.needs_input_grad, boxes,
                                                strict=True)]
                out = self.fn(*args)
        finally:
            for g, state in zip(self.generators, current, strict=True):
                g.bit_generator.state = state
        if out.requires_grad:
            out.backward(grad)
        return tuple(box[0] if box else None for box in boxes)


def checkpoint(fn: Callable[..., Tensor], *inputs: Any,
               generators: Sequence[np.random.Generator] | None = None) -> Tensor:
    """`fn(*inputs)`, keeping for backward only `inputs` (Tensors or arrays) and running `fn`
    again in backward; `generators`: the random generators to put back for that run (default:
    `module_generators(fn)`). Without grad recording, simply `fn(*inputs)`."""
    tensors = tuple(x if isinstance(x, Tensor) else Tensor(x) for x in inputs)
    if not is_grad_enabled():
        return fn(*tensors)
    gens = module_generators(fn) if generators is None else list(generators)
    states = [g.bit_generator.state for g in gens]
    with no_grad():
        out = fn(*tensors)
    if not isinstance(out, Tensor):
        raise TypeError(f"checkpoint: fn must return a Tensor, got {type(out).__name__}")
    ctx = Recompute()
    ctx.fn, ctx.generators, ctx.states = fn, gens, states
    ctx.needs_input_grad = tuple(t.requires_grad for t in tensors)
    ctx.inputs = tensors
    result = Tensor._wrap(out.data, True)
    result._ctx = ctx
    ledger = memory.current()
    if ledger is not None:
        ctx._saved = ledger.save([t.data for t in tensors])
    return result

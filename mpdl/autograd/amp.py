"""Mixed precision: 16-bit compute copies of the parameters, float32 master weights in the
optimizer, products accumulated in float32, and dynamic loss scaling for float16.

What lives in which dtype (see docs/precision.md):

- the model's parameters (the *compute copy*) and their gradients: float16 or bfloat16, so the
  gradients are communicated in 16 bits;
- the optimizer's master weights and its state (momentum, Adam's moments): float32, in
  `MixedPrecisionOptimizer`, which writes the rounded master weights back into the compute copy
  after every update;
- the matrix products of the layers with a 16-bit weight (linear, convolution): both operands are
  rounded to the 16-bit dtype, multiplied with float32 accumulation (NumPy has no 16-bit matmul;
  a GPU's tensor cores accumulate in float32 too) and the product is rounded to the 16-bit dtype
  (`matmul`). The activations between the layers are kept as float32 arrays (holding those
  16-bit values after a product), so the other operations (softmax, layer norm, the loss) run in
  float32, as PyTorch's autocast runs them.

Loss scaling (`LossScaler`, PyTorch GradScaler's rules): the loss is multiplied by the scale
before backward, so that small float16 gradients do not flush to zero; the optimizer divides the
gradients by it. A step whose gradients hold an inf or NaN is skipped and the scale halved (not
below 1); after 2000 clean steps in a row it doubles. bfloat16 has float32's exponent range and
needs no scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import numpy as np

from mpdl import blas, memory
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module, is_low_precision, to_host

#: PyTorch GradScaler's defaults
INITIAL_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
#: the lowest loss scale backing off reaches (Megatron-LM's min_loss_scale), unless the first is lower
MIN_SCALE = 1.0


# -- the products -----------------------------------------------------------------------------------
def compute_dtype(weight: Any) -> np.dtype | None:
    """The 16-bit dtype a layer with this weight array computes its products in; None for
    float32 and float64 weights (products as they are)."""
    return weight.dtype if is_low_precision(weight.dtype) else None


def operand(a: Any, dtype: np.dtype | None) -> Any:
    """a rounded to `dtype` and held in float32, ready for a float32 product (a itself without a
    dtype)."""
    if dtype is None:
        return a
    with np.errstate(over="ignore"):  # float16 overflow is inf, for the loss scaler to see
        narrow = a if a.dtype == dtype else a.astype(dtype)
    return narrow.astype(np.float32)


def rounded(a: Any, dtype: np.dtype | None) -> Any:
    """A float32 result rounded to `dtype` and held in float32 (a itself without a dtype)."""
    if dtype is None:
        return a
    with np.errstate(over="ignore"):
        return a.astype(dtype).astype(np.float32)


def matmul(a: Any, b: Any, dtype: np.dtype | None) -> Any:
    """a @ b computed as a 16-bit `dtype` product: operands rounded to dtype, float32
    accumulation, result rounded to dtype (held in float32). Plain a @ b without a dtype."""
    if dtype is None:
        return blas.matmul(a, b)
    with np.errstate(invalid="ignore"):  # inf - inf inside an overflowed product: NaN
        return rounded(blas.matmul(operand(a, dtype), operand(b, dtype)), dtype)


# -- loss scaling --------------------------------------------------------------------------------------
class LossScaler:
    """Dynamic loss scaling: `scale` multiplies the loss; `update(finite)` after each step halves
    it on a step with inf/NaN gradients (down to `min_scale`, or the first scale if lower) and
    doubles it after `growth_interval` clean steps."""

    def __init__(self, initial: float = INITIAL_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR,
                 growth_interval: int = GROWTH_INTERVAL, min_scale: float = MIN_SCALE) -> None:
        if not initial > 0 or not np.isfinite(initial):
            raise ValueError(f"initial: expected a finite loss scale > 0, got {initial!r}")
        self.scale = float(initial)
        self.min_scale = min(float(min_scale), self.scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.skipped_steps = 0
        self.backoffs = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            self.backoffs += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    @property
    def at_floor(self) -> bool:
        """Whether backing off can lower the scale no further."""
        return self.scale <= self.min_scale

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps,
                "skipped_steps": self.skipped_steps, "backoffs": self.backoffs}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.backoffs = int(state["backoffs"])


# -- master weights -------------------------------------------------------------------------------
class MixedPrecisionOptimizer:
    """An optimizer (built by `make_optimizer` over float32 master copies) for 16-bit parameters.

    `step()` reads the 16-bit gradients, skips the step when one holds an inf or NaN (with a
    `scaler`, which then backs off), otherwise unscales them into float32, lets the inner optimizer
    update the master weights and writes them, rounded, into the parameters. `agree(finite)` turns
    this rank's verdict into every rank's: the identity where every rank holds the same reduced
    gradients (data parallelism), an all-reduce where they are sharded (ZeRO sets it).

    `state` maps each parameter to its inner optimizer state plus "master" (its float32 master
    weight), so a strategy that shards or checkpoints optimizer state handles the master weights
    as it handles the moments.
    """

    def __init__(self, params: list[Any], make_optimizer: Callable[[list[Any]], Any],
                 scaler: LossScaler | None = None) -> None:
        self.params = list(params)
        self.masters = [Tensor(p.data.astype(np.float32), requires_grad=True) for p in self.params]
        memory.hold_all([m.data for m in self.masters], "master_weights")
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters, strict=True)}
        self.inner = make_optimizer(self.masters)
        if hasattr(self.inner, "split"):  # a master's whole parameter is its parameter
            self.split()
        self.scaler = scaler
        self.agree: Callable[[bool], bool] = lambda finite: finite
        self._state = _MasterState(self)

    @property
    def state(self) -> MutableMapping:
        return self._state

    @state.setter
    def state(self, entries: dict[Any, dict[str, Any]]) -> None:
        self._state.clear()
        for p, e in entries.items():
            self._state[p] = e

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def lr(self) -> float:
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without a scaler)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    @property
    def skipped_steps(self) -> int:
        return 0 if self.scaler is None else self.scaler.skipped_steps

    def shard(self, ndims: dict[int, int],
              sum_squares: Callable[[list[Tensor], list[list[Any]]], list[list[Any]]]) -> None:
        """`Optimizer.shard` for the parameters (passed on for their master weights)."""
        param_of = {id(m): p for p, m in zip(self.params, self.masters, strict=True)}
        self.inner.shard({id(self._master_of[k]): v for k, v in ndims.items()
                          if k in self._master_of},
                         lambda masters, sums: sum_squares([param_of[id(m)] for m in masters], sums))

    def global_norm(self, total: Callable[[list[Tensor], list[float]], float]) -> None:
        """`Optimizer.global_norm` for the parameters (passed on for their master weights, whose
        gradients are clipped once unscaled)."""
        param_of = {id(m): p for p, m in zip(self.params, self.masters, strict=True)}
        self.inner.global_norm(lambda masters, sums: total([param_of[id(m)] for m in masters],
                                                           sums))

    @property
    def grad_norm(self) -> float | None:
        """The last step's global norm of the unscaled gradients before clipping (None without
        clipping, or when the step was skipped)."""
        return getattr(self.inner, "grad_norm", None)

    def split(self, whole_map: Callable[..., dict[int, Any]] | None = None,
              parents: dict[int, Any] | None = None) -> None:
        """`Optimizer.split` for the parameters (passed on for their master weights, whose
        whole parameters are the parameters' own)."""
        param_of = {id(m): p for p, m in zip(self.params, self.masters, strict=True)}

        def masters_map(parts: dict[int, Any], fn: Any, select: Any) -> dict[int, Any]:
            out = whole_map({id(param_of[k]): v for k, v in parts.items()}, fn, select)
            return {id(self._master_of[k]): v for k, v in out.items()}

        whole = parents or {}
        self.inner.split(None if whole_map is None else masters_map,
                         {id(m): whole.get(id(p), p) for p, m in
                          zip(self.params, self.masters, strict=True)})

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad()

    def step(self) -> None:
        """Update the master weights from the (scaled) 16-bit gradients and round them into the
        parameters; or skip, on every rank alike, when a gradient is not finite."""
        finite = all(bool(get_array_module(p.grad).isfinite(p.grad).all())
                     for p in self.params if p.grad is not None)
        finite = self.agree(finite)
        if self.scaler is not None:
            unscale = 1.0 / self.scaler.scale
            self.scaler.update(finite)
        else:
            unscale = 1.0
        if not finite:
            if hasattr(self.inner, "grad_norm"):
                self.inner.grad_norm = None
            return
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is None:
                m.grad = None
                continue
            m.grad = p.grad.astype(np.float32)
            if unscale != 1.0:
                m.grad *= np.float32(unscale)
        self.inner.step()
        for p, m in zip(self.params, self.masters, strict=True):
            if p.grad is not None:
                p.data[...] = m.data
            m.grad = None  # the float32 gradient lives only for the update

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict with each parameter's "master" weight, and the loss
        scaler's state."""
        state = self.inner.state_dict()
        for i, m in enumerate(self.masters):
            state["state"].setdefault(i, {})["master"] = np.array(to_host(m.data), copy=True)
        if self.scaler is not None:
            state["loss_scale"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (or a plain optimizer's state_dict: the master
        weights then start from the parameters)."""
        inner = {"param_groups": state_dict["param_groups"], "state": {}}
        for p, m in zip(self.params, self.masters, strict=True):
            m.data[...] = p.data
        for key, entries in state_dict["state"].items():
            entries = dict(entries)
            master = entries.pop("master", None)
            if master is not None:
                m = self.masters[int(key)]
                m.data[...] = get_array_module(m.data).asarray(np.asarray(master, np.float32))
            if entries:
                inner["state"][key] = entries
        self.inner.load_state_dict(inner)
        for p, m in zip(self.params, self.masters, strict=True):
            p.data[...] = m.data
        if self.scaler is not None and "loss_scale" in state_dict:
            self.scaler.load_state_dict(state_dict["loss_scale"])


class _MasterState(MutableMapping):
    """Per-parameter optimizer state of a MixedPrecisionOptimizer, keyed by the 16-bit parameter:
    the inner optimizer's entries of its master weight, plus "master" (that weight's array)."""

    def __init__(self, owner: MixedPrecisionOptimizer) -> None:
        self._owner = owner

    def _master(self, p: Any) -> Tensor:
        return self._owner._master_of[id(p)]

    def __getitem__(self, p: Any) -> dict[str, Any]:
        m = self._master(p)
        return {**self._owner.inner.state.get(m, {}), "master": m.data}

    def __setitem__(self, p: Any, entries: dict[str, Any]) -> None:
        m = self._master(p)
        entries = dict(entries)
        master = entries.pop("master", None)
        m.data[...] = p.data if master is None else master
        self._owner.inner.state[m] = entries

    def __delitem__(self, p: Any) -> None:
        self._owner.inner.state.pop(self._master(p), None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._owner.params)

    def __len__(self) -> int:
        return len(self._owner.params)

    def clear(self) -> None:
        self._owner.inner.state.clear()

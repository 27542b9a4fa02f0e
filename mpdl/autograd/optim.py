"""Optimizers (SGD, Adam, AdamW, LARS, LAMB, Muon), clipping by the global gradient norm,
and learning-rate schedules.

Updates happen in place on ``p.data`` so that references to parameter arrays stay valid, and in
the parameters' own dtype (hyper-parameters are Python floats, which never upcast float32).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd import fused
from mpdl.autograd.muon import is_hidden_matrix, newton_schulz, rms_scale
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module, to_host

#: what torch.nn.utils.clip_grad_norm_ adds to the norm it divides by
CLIP_EPS = 1e-6
#: whole_map(parts, fn, select): for each of this rank's parts of a matrix ({id(parameter): its
#: array}), its part of fn(the whole matrix); `select(whole parameter)` names the matrices taking
#: part. A collective over the ranks that hold the parts (see `Optimizer.split`).
WholeMap = Callable[[dict[int, Any], Callable[[Any], Any], Callable[[Tensor], bool]],
                    dict[int, Any]]


class Optimizer:
    """Base class: parameter groups (dicts with ``params`` and hyper-parameters) and per-parameter
    state; subclasses implement ``_update(p, grad, state, group)``."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        groups = params if isinstance(params[0], dict) else [{"params": params}]
        self.defaults = defaults
        self.param_groups: list[dict[str, Any]] = []
        for group in groups:
            unknown = set(group) - set(defaults) - {"params"}
            if unknown:
                raise ValueError(f"{type(self).__name__}: unknown option(s) {sorted(unknown)}; "
                                 f"allowed: {sorted(defaults)}")
            merged = {**defaults, **group, "params": list(group["params"])}
            for p in merged["params"]:
                if not isinstance(p, Tensor) or not p.requires_grad:
                    raise TypeError(f"{type(self).__name__}: parameters must be Tensors that "
                                    f"require grad, got {type(p).__name__}")
            self.param_groups.append(merged)
        self.state: dict[Tensor, dict[str, Any]] = {}
        self._ndims: dict[int, int] = {}
        self._sum_squares: Callable[[list[Tensor], list[list[Any]]], list[list[Any]]] | None = None
        #: clip the gradients to this global norm before each step (None: no clipping)
        self.max_grad_norm: float | None = None
        #: the last step's global gradient norm before clipping (None without clipping)
        self.grad_norm: float | None = None
        self._norm_total: Callable[[list[Tensor], list[float]], float] | None = None
        self._parents: dict[int, Tensor] = {}
        self._whole_map: WholeMap | None = None

    def shard(self, ndims: dict[int, int],
              sum_squares: Callable[[list[Tensor], list[list[Any]]], list[list[Any]]]) -> None:
        """Declare the parameters to be shards (flat pieces) of larger tensors, as sharded data
        parallelism (ZeRO) hands them over. `ndims[id(p)]` is the whole tensor's number of
        dimensions; `sum_squares(params, sums)` turns, for each parameter, the sums of squares of
        its local piece (of weight, gradient or update) into those of the whole tensor: a
        collective, called once per step by the optimizers that need whole-tensor norms (LARS,
        LAMB), on every rank, even one with nothing to update."""
        self._ndims, self._sum_squares = dict(ndims), sum_squares

    def global_norm(self, total: Callable[[list[Tensor], list[float]], float]) -> None:
        """Declare how the gradients this optimizer holds make the whole model's, for clipping
        (`max_grad_norm`): `total(params, sums)` turns the sum of squares of each parameter's
        gradient on this rank into the whole model's sum of squares, each distinct element
        counted once. A collective, called once per clipped step on every rank, even one with
        nothing to update. Without it the parameters are the whole model."""
        self._norm_total = total

    def _clip(self, params: list[Tensor]) -> None:
        """With `max_grad_norm`: clip the gradients (`clip_grad_norm`), their norm in
        `grad_norm`."""
        if self.max_grad_norm is not None:
            self.grad_norm = clip_grad_norm(params, self.max_grad_norm, self._norm_total)

    def split(self, whole_map: WholeMap | None, parents: dict[int, Tensor] | None = None
              ) -> None:
        """Declare the parameters to be parts of whole matrices held over several ranks (ZeRO's
        flat pieces, tensor parallelism's slices): `whole_map` (see WholeMap) runs a function on
        whole matrices, called once per step by the optimizers that need them (Muon) on every
        rank, even one with nothing to update; `parents[id(p)]` is the whole parameter p is a
        piece of (absent: p itself; whole_map None: only that)."""
        self._whole_map, self._parents = whole_map, dict(parents or {})

    def _ndim(self, p: Tensor) -> int:
        return self._ndims.get(id(p), p.data.ndim)

    def _whole(self, params: list[Tensor], sums: list[list[Any]]) -> list[list[Any]]:
        """The sums of squares of whole tensors from those of the pieces (unchanged unless
        sharded)."""
        return sums if self._sum_squares is None else self._sum_squares(params, sums)

    def _items(self) -> list[tuple[Tensor, dict[str, Any], dict[str, Any]]]:
        """(parameter, state, hyper-parameters) of every parameter that has a gradient."""
        items = []
        for group in self.param_groups:
            hyper = {k: float(v) if isinstance(v, (int, float, np.floating)) and
                     not isinstance(v, bool) else v for k, v in group.items() if k != "params"}
            items += [(p, self.state.setdefault(p, {}), hyper) for p in group["params"]
                      if p.grad is not None]
        return items

    @property
    def lr(self) -> float:
        """The learning rate (of the first group); setting it sets every group's."""
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.param_groups:
            group["lr"] = float(value)

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self) -> None:
        """Set every parameter's gradient to None."""
        for p in self._params():
            p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient (clipped first, with `max_grad_norm`)."""
        items = self._items()
        self._clip([p for p, _, _ in items])
        for p, state, hyper in items:
            self._update(p, p.grad, state, hyper)

    def _update(self, p: Tensor, grad: Any, state: dict[str, Any], group: dict[str, Any]
                ) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Hyper-parameters and per-parameter state (NumPy arrays and plain Python values),
        parameters referred to by their position across groups."""
        index = {id(p): i for i, p in enumerate(self._params())}
        state = {}
        for p, entries in self.state.items():
            state[index[id(p)]] = {k: np.array(to_host(v), copy=True) if hasattr(v, "shape")
                                   else v for k, v in entries.items()}
        groups = []
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g["params"] = [index[id(p)] for p in group["params"]]
            groups.append(g)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (keys may be ints or their strings)."""
        groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in groups]
        if sizes != [len(own["params"]) for own in self.param_groups]:
            raise ValueError("load_state_dict: the saved parameter groups do not match this "
                             "optimizer's groups in number or size")
        params = self._params()
        for group, own in zip(groups, self.param_groups, strict=True):
            own.update({k: v for k, v in group.items() if k != "params"})
        self.state = {}
        for key, entries in state_dict["state"].items():
            p = params[int(key)]
            xp = get_array_module(p.data)
            restored = {}
            for k, v in entries.items():
                if hasattr(v, "shape") and np.ndim(v) > 0:
                    if tuple(np.shape(v)) != p.shape:
                        raise ValueError(f"load_state_dict: state {k!r} of parameter {key} has "
                                         f"shape {np.shape(v)}, the parameter {p.shape}")
                    restored[k] = xp.asarray(np.asarray(v, dtype=p.dtype))
                else:
                    restored[k] = v.item() if hasattr(v, "item") else v
            self.state[p] = restored
            memory.hold_all(restored.values(), "optimizer_state")


def _check(name: str, value: float, low: float = 0.0) -> None:
    if not value >= low:
        raise ValueError(f"{name} must be >= {low}, not {value!r}")


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum and L2 weight decay,
    following PyTorch: v = μv + (1-dampening)(g + λw); w -= lr·(g + μv if nesterov else v)."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
                 ) -> None:
        _check("lr", lr)
        _check("momentum", momentum)
        _check("weight_decay", weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _update(self, p, grad, state, group):
        d = grad
        if group["weight_decay"]:
            d = d + group["weight_decay"] * p.data
        mu = group["momentum"]
        if mu:
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = d.copy()
                memory.hold(buf, "optimizer_state")
            else:
                buf *= mu
                buf += (1 - group["dampening"]) * d
            d = d + mu * buf if group["nesterov"] else buf
        p.data -= group["lr"] * d


class Adam(Optimizer):
    """Adam (Kingma & Ba) with bias correction; ``weight_decay`` adds λw to the gradient."""

    decoupled = False

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        _check_adam(lr, eps, weight_decay, betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def _update(self, p, grad, state, group):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        if wd and self.decoupled:
            if self._decays(p):
                p.data *= 1 - lr * wd
        elif wd:
            grad = grad + wd * p.data
        m, v, t = _advance(state, p.data)
        fused.adam_(p.data, grad, m, v, (b1, b2), t, lr, group["eps"])

    def _decays(self, p: Tensor) -> bool:
        """Whether the decoupled weight decay applies to p (AdamW chooses)."""
        return True


#: AdamW's choices of the parameters it decays
DECAY_RULES = ("all", "matrices")


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, as torch.optim.AdamW): w -= lr·λ·w
    before the step, on the parameters `decay` names: "all" (torch's default), "matrices" (those
    whose whole tensor has at least 2 dimensions, as nanoGPT: weights and embeddings, not biases
    or norms; a shard follows its whole tensor, see `shard`), or one flag per parameter of
    `params` (across its groups, in order)."""

    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, decay: str | Sequence[bool] = "all") -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.decay, self._flags = decay, None
        if isinstance(decay, str) and decay not in DECAY_RULES:
            raise ValueError(f"AdamW: decay must be one of {', '.join(DECAY_RULES)} or a flag per "
                             f"parameter, not {decay!r}")
        if not isinstance(decay, str):
            flags, params = [bool(f) for f in decay], self._params()
            if len(flags) != len(params):
                raise ValueError(f"AdamW: decay has {len(flags)} flags for {len(params)} "
                                 f"parameters")
            self._flags = {id(p): f for p, f in zip(params, flags, strict=True)}

    def _decays(self, p: Tensor) -> bool:
        """Whether the weight decay applies to p."""
        if self._flags is not None:
            return self._flags[id(p)]
        return self.decay == "all" or self._ndim(p) >= 2


def clip_grad_norm(params: list[Tensor], max_norm: float,
                   total: Callable[[list[Tensor], list[float]], float] | None = None) -> float:
    """Scale the gradients of `params` by min(1, max_norm / (norm + 1e-6)), as
    torch.nn.utils.clip_grad_norm_, and return the norm before clipping: the root of
    `total(params, sums)` (see `Optimizer.global_norm`), by default of the sums of squares."""
    xp = get_array_module(params[0].grad) if params else np
    squares = to_host(xp.stack([_grad_sumsq(p.grad) for p in params])) if params else []
    sums = [float(v) for v in squares]
    norm = math.sqrt(math.fsum(sums) if total is None else total(params, sums))
    coef = max_norm / (norm + CLIP_EPS)
    if coef < 1.0:
        for p in params:
            p.grad *= p.grad.dtype.type(coef)
    return norm


def _grad_sumsq(a: Any) -> Any:
    """The sum of squares of a gradient's elements, a dot product in its dtype (one pass, no
    copy; a 0-d array, no host sync)."""
    flat = a.reshape(-1)
    return get_array_module(a).dot(flat, flat)


def _sumsq(a: Any) -> Any:
    """The sum of squares of a's elements (a 0-d array, no host sync): a squared norm."""
    return (a * a).sum()


def _trust(xp: Any, numerator: Any, denominator: Any) -> Any:
    """numerator / denominator where both are positive, else 1 (a 0-d array, no host sync)."""
    ok = (numerator > 0) & (denominator > 0)
    return xp.where(ok, numerator / xp.where(ok, denominator, 1), 1)


class LARS(Optimizer):
    """Layer-wise adaptive rate scaling (You et al. 2017) on top of momentum SGD.

    Each adapted parameter's step g + λw is scaled by the trust ratio η‖w‖/(‖g‖ + λ‖w‖).
    Parameters with ndim ≤ 1 (biases, norm scales) skip adaptation and weight decay unless
    ``exclude_1d=False``.
    """

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, eta: float = 0.001, exclude_1d: bool = True) -> None:
        _check("lr", lr)
        _check("momentum", momentum)
        _check("weight_decay", weight_decay)
        _check("eta", eta)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      eta=eta, exclude_1d=exclude_1d))

    def step(self) -> None:
        """Two passes: the norms of every adapted parameter (one `sum_squares` when sharded),
        then the updates."""
        items = self._items()
        self._clip([p for p, _, _ in items])
        adapted = [it for it in items if not (it[2]["exclude_1d"] and self._ndim(it[0]) <= 1)]
        sums = self._whole([p for p, _, _ in adapted],
                           [[_sumsq(p.data), _sumsq(p.grad)] for p, _, _ in adapted])
        norms = {id(p): s for (p, _, _), s in zip(adapted, sums, strict=True)}
        for p, state, group in items:
            self._update(p, p.grad, state, group, norms.get(id(p)))

    def _update(self, p, grad, state, group, sums=None):
        xp = get_array_module(p.data)
        wd = group["weight_decay"]
        if sums is None:
            d = grad
        else:
            w_norm, g_norm = xp.sqrt(sums[0]), xp.sqrt(sums[1])
            trust = _trust(xp, group["eta"] * w_norm, g_norm + wd * w_norm).astype(p.dtype)
            d = (grad + wd * p.data) * trust
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = xp.array(d, copy=True)
            memory.hold(buf, "optimizer_state")
        else:
            buf *= group["momentum"]
            buf += d
        p.data -= group["lr"] * buf


class LAMB(Optimizer):
    """Layer-wise adaptive moments (You et al. 2019): the Adam direction r + λw, scaled by the
    trust ratio ‖w‖/‖r + λw‖. Parameters with ndim ≤ 1 skip adaptation and weight decay unless
    ``exclude_1d=False``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, exclude_1d: bool = True) -> None:
        _check_adam(lr, eps, weight_decay, betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, exclude_1d=exclude_1d))

    def step(self) -> None:
        """Two passes: the Adam direction of every parameter and the norms of the adapted ones
        (one `sum_squares` when sharded), then the updates."""
        updates, items = [], self._items()
        self._clip([p for p, _, _ in items])
        for p, state, group in items:
            xp = get_array_module(p.data)
            b1, b2 = group["betas"]
            m, v, t = _moments(state, p.data, p.grad, b1, b2)
            update = (m * (1.0 / (1 - b1**t))) / (xp.sqrt(v * (1.0 / (1 - b2**t))) + group["eps"])
            if group["exclude_1d"] and self._ndim(p) <= 1:
                p.data -= group["lr"] * update
                continue
            if group["weight_decay"]:
                update += group["weight_decay"] * p.data
            updates.append((p, group, update))
        sums = self._whole([p for p, _, _ in updates],
                           [[_sumsq(p.data), _sumsq(u)] for p, _, u in updates])
        for (p, group, update), (w_sq, u_sq) in zip(updates, sums, strict=True):
            xp = get_array_module(p.data)
            trust = _trust(xp, xp.sqrt(w_sq), xp.sqrt(u_sq)).astype(p.dtype)
            p.data -= group["lr"] * trust * update


class Muon(Optimizer):
    """Muon on the 2-D hidden weights, AdamW on the other parameters (`mpdl.autograd.muon`:
    Nesterov momentum, NS₅, Moonlight's 0.2·√max(A, B), decoupled weight decay λ on every 2-D
    parameter). On parts of matrices (`split`) the orthogonalization runs on whole matrices."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, momentum: float = 0.95,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        _check_adam(lr, eps, weight_decay, betas)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), not {momentum!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def _whole(self, p: Tensor) -> Tensor:
        return self._parents.get(id(p), p)

    def step(self) -> None:
        """Two passes: AdamW's steps and the Nesterov directions of the matrices, then their
        orthogonalized steps (one `whole_map` when split)."""
        matrices, directions = [], {}
        items = self._items()
        self._clip([p for p, _, _ in items])
        for p, state, group in items:
            whole = self._whole(p)
            if len(whole.shape) >= 2:
                p.data *= 1 - group["lr"] * group["weight_decay"]
            if not is_hidden_matrix(whole):
                m, v, t = _advance(state, p.data)
                fused.adam_(p.data, p.grad, m, v, group["betas"], t, group["lr"], group["eps"])
                continue
            if self._whole_map is None and p.data.ndim != 2:
                raise ValueError("Muon: a matrix arrived flattened (a shard) without the "
                                 "strategy's whole_map; this layout does not support muon")
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = get_array_module(p.data).zeros_like(p.data)
                memory.hold(buf, "optimizer_state")
            buf *= group["momentum"]
            buf += p.grad
            matrices.append((p, group, rms_scale(whole.shape)))
            directions[id(p)] = p.grad + group["momentum"] * buf
        if self._whole_map is None:
            updates = {k: newton_schulz(u) for k, u in directions.items()}
        else:
            updates = self._whole_map(directions, newton_schulz, is_hidden_matrix)
        for p, group, scale in matrices:
            p.data -= (group["lr"] * scale * updates[id(p)]).astype(p.dtype, copy=False)


class WarmupSchedule:
    """Learning rate by step: linear warmup to ``base_lr`` over ``warmup_steps``, then
    ``"constant"``, ``"cosine"`` (to ``min_lr`` at ``total_steps``) or ``"step"`` (× ``gamma`` at
    each of ``milestones``, counted in steps from the start)."""

    def __init__(self, base_lr: float, warmup_steps: int = 0, total_steps: int | None = None,
                 kind: str = "cosine", milestones: Sequence[int] = (), gamma: float = 0.1,
                 min_lr: float = 0.0) -> None:
        if kind not in ("cosine", "step", "constant"):
            raise ValueError(f"WarmupSchedule: kind must be 'cosine', 'step' or 'constant', "
                             f"not {kind!r}")
        if warmup_steps < 0:
            raise ValueError(f"WarmupSchedule: warmup_steps must be >= 0, not {warmup_steps}")
        if kind == "cosine" and (total_steps is None or total_steps <= warmup_steps):
            raise ValueError("WarmupSchedule: kind='cosine' needs total_steps > warmup_steps")
        self.base_lr, self.warmup_steps, self.total_steps = float(base_lr), warmup_steps, total_steps
        self.kind, self.milestones = kind, sorted(milestones)
        self.gamma, self.min_lr = float(gamma), float(min_lr)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        if self.kind == "step":
            return self.base_lr * self.gamma ** sum(step >= m for m in self.milestones)
        span = self.total_steps - self.warmup_steps
        progress = min(step - self.warmup_steps, span) / span
        return self.min_lr + (self.base_lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


class CosineSchedule:
    """Learning rate by step as nanoGPT's get_lr: a linear warmup to ``base_lr`` over
    ``warmup_steps`` (step s gets base_lr·(s+1)/(warmup_steps+1)), then a cosine from ``base_lr``
    to ``min_lr`` ending at step ``decay_steps`` (counted from step 0, so the warmup lies inside
    it), ``min_lr`` after."""

    def __init__(self, base_lr: float, warmup_steps: int, decay_steps: int,
                 min_lr: float = 0.0) -> None:
        if warmup_steps < 0:
            raise ValueError(f"CosineSchedule: warmup_steps must be >= 0, not {warmup_steps}")
        if decay_steps < warmup_steps:
            raise ValueError(f"CosineSchedule: decay_steps {decay_steps} must not be below "
                             f"warmup_steps {warmup_steps}")
        if not 0 <= min_lr <= base_lr:
            raise ValueError(f"CosineSchedule: min_lr must lie in [0, base_lr {base_lr}], not "
                             f"{min_lr}")
        self.base_lr, self.min_lr = float(base_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / (self.warmup_steps + 1)
        if step >= self.decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (self.base_lr - self.min_lr)


def scale_lr(lr: float, global_batch: int, base_batch: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): lr × global_batch / base_batch."""
    if global_batch <= 0 or base_batch <= 0:
        raise ValueError(f"scale_lr: batch sizes must be positive, got global_batch="
                         f"{global_batch}, base_batch={base_batch}")
    return float(lr) * global_batch / base_batch


def _advance(state: dict, data: Any) -> tuple[Any, Any, int]:
    """Count one more step in Adam's state (made on the first); return (m, v, step)."""
    if not state:
        xp = get_array_module(data)
        state.update(step=0, exp_avg=xp.zeros_like(data), exp_avg_sq=xp.zeros_like(data))
        memory.hold_all(state.values(), "optimizer_state")
    state["step"] += 1
    return state["exp_avg"], state["exp_avg_sq"], state["step"]


def _moments(state: dict, data: Any, grad: Any, b1: float, b2: float) -> tuple[Any, Any, int]:
    """Advance Adam's first and second moment estimates in state; return (m, v, step)."""
    m, v, step = _advance(state, data)
    m *= b1
    m += (1 - b1) * grad
    v *= b2
    v += (1 - b2) * (grad * grad)
    return m, v, step


def _check_adam(lr: float, eps: float, weight_decay: float, betas: tuple[float, float]) -> None:
    """The argument checks Adam-family optimizers share."""
    _check("lr", lr)
    _check("eps", eps)
    _check("weight_decay", weight_decay)
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must lie in [0, 1), not {betas!r}")

"""Mixture-of-experts: a router and E expert MLPs in place of a transformer block's MLP.

`MoE` maps the N tokens it is given (every leading axis is a token axis) as follows:

    p      = softmax(x Wᵣᵀ)             router in float32 (float64 for a float64 model), over E
    e(n,j) = the j-th most likely expert of token n, j < k       (ties: the lower expert index)
    g(n,j) = p(n, e(n,j))               k = 1: the Switch gate, not renormalised
           = p(n, e(n,j)) / Σⱼ p(n,e(n,j))    k ≥ 2: renormalised over the chosen k
    y(n)   = Σⱼ g(n,j) · expert_e(n,j)(x(n))  over the routings that were kept

Gates: with k ≥ 2 they are renormalised over the chosen k, as GShard (top-2), Mixtral (softmax
over the top-k logits, the same thing) and Megatron-Core's default router do; the output is then
a convex combination of the chosen experts whatever the router's confidence. With k = 1 a
renormalised gate would always be 1 and the router would learn from the load-balancing loss
alone, so the gate is Switch Transformer's p(n, e) (Megatron-Core gets the same with
`--moe-router-pre-softmax`).

Capacity: each expert takes at most C = ⌈N·k/E · cf⌉ of the N·k routings of the tokens given to
one call (the tokens a rank routes); `capacity_factor` cf = 0 is dropless. Overflow is dropped
deterministically **by position**: an expert keeps the routings of the earliest tokens, in the
order of the flattened input (batch-major, then time), and drops the rest (Megatron-Core's
"position" drop policy). A dropped routing contributes nothing, so a token whose every routing
was dropped leaves the layer as zeros and the block's residual carries it on unchanged.

Load-balancing loss, Switch Transformer's generalised to top-k as Megatron-Core does:

    L_aux = α · E · Σᵢ fᵢ · Pᵢ,   fᵢ = (routings sent to expert i) / (N·k),   Pᵢ = mean_n p(n, i)

fᵢ counts the routings before capacity drops them and is a constant (no gradient); Pᵢ carries
the gradient to the router. `dispatcher.routed_counts` may sum the counts over data-parallel
ranks (Megatron-Core's global-batch load balancing): fᵢ is then that of the whole global batch,
and the data-parallel average of the ranks' losses is exactly the loss of one process on the
global batch. The loss is not returned: it enters backward at the layer's output (Megatron-Core's
MoEAuxLossAutoScaler), with gradient `aux_loss_scale()` (1 by default; a pipeline sets each
microbatch's share), so that any training loop that calls `loss.backward()` trains it.

Who runs the experts is the `dispatcher`'s business: `LocalExperts` runs all E on this process;
expert parallelism (`mpdl.parallel.expert`) swaps in one that sends rows to other ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd.nn import Linear, Module, ModuleList, make_rng
from mpdl.autograd.tensor import Function, Tensor, is_grad_enabled
from mpdl.backend import get_array_module, to_host

_scale = threading.local()


def current_aux_loss_scale() -> float:
    """The gradient the load-balancing losses enter backward with on this thread."""
    return getattr(_scale, "value", 1.0)


@contextlib.contextmanager
def aux_loss_scale(scale: float) -> Iterator[None]:
    """Within the block, MoE layers add their load-balancing loss to backward times `scale`
    (the factor the training loss of the same forward is multiplied by)."""
    previous = current_aux_loss_scale()
    _scale.value = float(scale)
    try:
        yield
    finally:
        _scale.value = previous


# ---------------------------------------------------------------------- differentiable pieces
class Cast(Function):
    """x in another floating dtype; the gradient goes back in x's dtype."""

    def forward(self, x, dtype):
        self.dtype = x.dtype
        return x.astype(dtype)

    def backward(self, grad):
        return grad.astype(self.dtype)


class GatherRows(Function):
    """Rows `index` of a 2-D x (repeats allowed); backward adds each row's gradient back."""

    def forward(self, x, index):
        self.index, self.rows = index, x.shape[0]
        return x[index]

    def backward(self, grad):
        return F.scatter_add_rows(self.index, grad, self.rows)


class ScatterRows(Function):
    """A (rows, D) array of zeros with row index[i] = y[i] (distinct indices)."""

    def forward(self, y, index, rows):
        self.index = index
        out = get_array_module(y).zeros((rows, y.shape[1]), dtype=y.dtype)
        out[index] = y
        return out

    def backward(self, grad):
        return grad[self.index]


class ConcatRows(Function):
    """The inputs stacked along their first axis."""

    def forward(self, *parts):
        self.bounds = np.cumsum([0] + [len(p) for p in parts])
        return get_array_module(parts[0]).concatenate(parts, axis=0)

    def backward(self, grad):
        return tuple(grad[a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True))


class AddAuxLoss(Function):
    """Identity on `out`; backward also gives the scalar `aux` the gradient `scale`, as if
    `scale · aux` had been added to the loss."""

    def forward(self, out, aux, scale):
        self.aux_shape, self.aux_dtype, self.scale = aux.shape, aux.dtype, scale
        return out

    def backward(self, grad):
        xp = get_array_module(grad)
        return grad, xp.full(self.aux_shape, self.scale, dtype=self.aux_dtype)


def concat_rows(parts: list[Tensor]) -> Tensor:
    """Tensors stacked along their first axis (differentiable)."""
    return parts[0] if len(parts) == 1 else ConcatRows.apply(*parts)


# ---------------------------------------------------------------------- routing
@dataclasses.dataclass
class Routing:
    """Where one call's N·k routings go. Routing r = n·k + j is token n's j-th choice."""

    #: (N, k) the chosen experts of each token, most likely first
    chosen: np.ndarray
    #: (E,) routings sent to each expert, before capacity
    counts: np.ndarray
    #: (E,) routings each expert keeps
    kept: np.ndarray
    #: the kept routings, sorted by expert and within an expert by position
    order: np.ndarray
    #: the most routings an expert keeps (0: no limit)
    capacity: int

    @property
    def dropped(self) -> int:
        return int(self.counts.sum() - self.kept.sum())


def expert_capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """⌈tokens·k/E · cf⌉: the routings an expert keeps of one call (0: dropless, cf = 0)."""
    if capacity_factor == 0:
        return 0
    return math.ceil(tokens * top_k / experts * capacity_factor)


def route(probs: np.ndarray, top_k: int, capacity: int) -> Routing:
    """The top-k experts of each row of (N, E) router probabilities, and which routings each
    expert keeps under `capacity` (0: all): those of the earliest rows."""
    n, e = probs.shape
    chosen = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    experts = chosen.reshape(-1)
    counts = np.bincount(experts, minlength=e).astype(np.int64)
    order = np.argsort(experts, kind="stable")  # by expert, then by routing (token) position
    if capacity:
        starts = np.cumsum(counts) - counts
        place = np.arange(order.size) - np.repeat(starts, counts)  # position within its expert
        order = order[place < capacity]
        kept = np.minimum(counts, capacity)
    else:
        kept = counts.copy()
    return Routing(chosen, counts, kept, order, capacity)


# ---------------------------------------------------------------------- experts and dispatch
class Expert(Module):
    """One expert: Linear(C, 4C) → GELU → Linear(4C, C), the GPT's MLP without dropout."""

    def __init__(self, n_embd: int, rng: np.random.Generator, dtype: Any = np.float32) -> None:
        super().__init__()
        self.fc = Linear(n_embd, 4 * n_embd, rng=rng, dtype=dtype)
        self.proj = Linear(4 * n_embd, n_embd, rng=rng, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


def run_experts(experts: list[Module], rows: Tensor, counts: Any) -> Tensor:
    """Rows sorted by expert (counts[i] rows for experts[i], in turn) through their experts."""
    outs, start = [], 0
    for expert, c in zip(experts, counts, strict=True):
        c = int(c)
        if c:
            outs.append(expert(rows[start:start + c]))
            start += c
    return concat_rows(outs) if outs else rows * 0.0


class Dispatcher(Protocol):
    """Who runs the experts of a MoE layer."""

    def routed_counts(self, counts: np.ndarray) -> np.ndarray:
        """The routings per expert that the load-balancing loss counts, from this call's."""

    def __call__(self, moe: MoE, rows: Tensor, counts: np.ndarray) -> Tensor:
        """The expert outputs of `rows` (sorted by expert, counts[i] for expert i), in order."""


class LocalExperts:
    """Every expert runs here, on this process's tokens."""

    def routed_counts(self, counts: np.ndarray) -> np.ndarray:
        return counts

    def __call__(self, moe: MoE, rows: Tensor, counts: np.ndarray) -> Tensor:
        return run_experts(list(moe.experts), rows, counts)


@dataclasses.dataclass(frozen=True)
class MoESettings:
    """Where a model puts MoE layers and how they route: `experts` E per layer (0: none), in
    every block whose index is a multiple of `every`; `top_k`, `capacity_factor` and
    `aux_loss_coef` as `MoE` takes them."""

    experts: int = 0
    top_k: int = 2
    capacity_factor: float = 0.0
    aux_loss_coef: float = 0.01
    every: int = 1

    def in_block(self, index: int) -> bool:
        """Whether block `index` has a MoE layer in place of its MLP."""
        return self.experts > 0 and index % self.every == 0


@dataclasses.dataclass
class MoEStats:
    """Sums over the training forwards since the last reset: routings per expert (before
    capacity), routings dropped, routings made, load-balancing loss (α included), forwards."""

    tokens_per_expert: np.ndarray
    dropped: int = 0
    routings: int = 0
    aux_loss: float = 0.0
    calls: int = 0


class MoE(Module):
    """A mixture of `num_experts` expert MLPs with a top-k router (see the module docstring)."""

    def __init__(self, n_embd: int, num_experts: int, top_k: int = 2,
                 capacity_factor: float = 0.0, aux_loss_coef: float = 0.01, *,
                 rng: np.random.Generator | None = None, seed: int | None = None,
                 dtype: Any = np.float32) -> None:
        super().__init__()
        for name, value in (("n_embd", n_embd), ("num_experts", num_experts)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE: {name} must be a positive int, not {value!r}")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k not in (1, 2):
            raise ValueError(f"MoE: top_k must be 1 or 2, not {top_k!r}")
        if top_k > num_experts:
            raise ValueError(f"MoE: top_k ({top_k}) must not exceed num_experts ({num_experts})")
        if not capacity_factor >= 0:
            raise ValueError(f"MoE: capacity_factor must be >= 0 (0: dropless), not "
                             f"{capacity_factor!r}")
        if not aux_loss_coef >= 0:
            raise ValueError(f"MoE: aux_loss_coef must be >= 0, not {aux_loss_coef!r}")
        g = make_rng(rng, seed)
        self.n_embd, self.num_experts, self.top_k = n_embd, num_experts, top_k
        self.capacity_factor, self.aux_loss_coef = float(capacity_factor), float(aux_loss_coef)
        self.router_dtype = np.promote_types(np.float32, dtype)
        self.router = Linear(n_embd, num_experts, bias=False, rng=g, dtype=self.router_dtype)
        self.experts = ModuleList(Expert(n_embd, g, dtype) for _ in range(num_experts))
        self.dispatcher: Dispatcher = LocalExperts()
        self.stats = MoEStats(np.zeros(num_experts, np.int64))
        #: the routing and the load-balancing loss (α included, a scalar Tensor in the graph of
        #: the router's probabilities) of the last forward
        self.last_routing: Routing | None = None
        self.last_aux_loss: Tensor | None = None

    def reset_stats(self) -> None:
        self.stats = MoEStats(np.zeros(self.num_experts, np.int64))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        c, k, e = self.n_embd, self.top_k, self.num_experts
        h = x.reshape(-1, c)
        n = h.shape[0]
        xp = get_array_module(h.data)
        router_in = h if h.dtype == self.router_dtype else Cast.apply(h, dtype=self.router_dtype)
        probs = F.softmax(self.router(router_in), axis=-1)
        r = route(np.asarray(to_host(probs.data)), k,
                  expert_capacity(n, k, e, self.capacity_factor))
        self.last_routing = r
        chosen = xp.asarray(r.chosen)
        gates = probs[xp.arange(n)[:, None], chosen]
        if k > 1:
            gates = gates / gates.sum(axis=1, keepdims=True)
        if gates.dtype != h.dtype:
            gates = Cast.apply(gates, dtype=h.dtype)
        order = xp.asarray(r.order)
        rows = GatherRows.apply(h, index=order // k)
        out_rows = self.dispatcher(self, rows, r.kept)
        per_routing = ScatterRows.apply(out_rows, index=order, rows=n * k).reshape(n, k, c)
        y = (per_routing * gates.reshape(n, k, 1)).sum(axis=1)
        counts = np.asarray(self.dispatcher.routed_counts(r.counts), dtype=np.float64)
        fraction = counts / max(counts.sum(), 1.0)
        scale = self.aux_loss_coef * e
        aux = (probs.mean(axis=0) * Tensor(xp.asarray(fraction, dtype=probs.dtype))).sum() * scale
        self.last_aux_loss = aux
        if self.training and n:  # an empty call (a rank's empty microbatch) counts nothing
            self.stats.tokens_per_expert += r.counts
            self.stats.dropped += r.dropped
            self.stats.routings += n * k
            self.stats.aux_loss += float(aux.item())
            self.stats.calls += 1
        if self.aux_loss_coef and y.requires_grad and is_grad_enabled():
            y = AddAuxLoss.apply(y, aux, scale=current_aux_loss_scale())
        return y.reshape(shape)

    def inactive_parameters(self) -> int:
        """Parameters a token does not use: those of the E - k experts it is not routed to."""
        return (self.num_experts - self.top_k) * sum(p.size for p in self.experts[0].parameters())

    def extra_repr(self) -> str:
        return (f"n_embd={self.n_embd}, experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor:g}, aux_loss_coef={self.aux_loss_coef:g}")

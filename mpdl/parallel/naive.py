"""The naive versions, to read first.

`NaiveDataParallel`, before DDP (`ddp.py`): every rank holds the whole model, runs forward and
backward on its slice of the batch, and after backward all-reduces every gradient, one call per
parameter. DDP sends the same sums in a few buckets and starts each while backward still runs.

`NaiveZero`, before `zero.py`: ZeRO stage 1 as the paper draws it, each rank stepping the
optimizer on its block of the parameters only.

`NaiveDiLoCo`, before `diloco.py`: every H inner steps, one all-reduce per parameter of the
change since the last outer step, then an outer Nesterov step. `diloco.DiLoCo` packs the
parameters, cuts them into fragments synchronised at staggered steps, overlaps each fragment's
all-reduce with the next inner step and can compress the outer gradients."""

from __future__ import annotations

from typing import Any

from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce, reduce_scatter
from mpdl.collectives.ops import block_bounds
from mpdl.comm import Communicator, as_communicator
from mpdl.parallel import flat
from mpdl.parallel.flat import broadcast_model
from mpdl.parallel.strategy import MakeOptimizer


class NaiveDataParallel:
    """`module` replicated on every rank of `comm`; `sync_gradients()` after each backward."""

    def __init__(self, module: Any, comm: Any = None, algorithm: str = "auto") -> None:
        self.module, self.comm, self.algorithm = module, as_communicator(comm), algorithm
        #: this rank's share of the global batch (1/p for equal slices)
        self.grad_weight = 1.0 / self.comm.size
        broadcast_model(module, self.comm)  # every replica starts from rank 0's values

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    def set_local_batch(self, local: int, global_: int) -> None:
        """Weight this rank's gradient by its share of the global batch (slices of unequal size)."""
        self.grad_weight = local / global_

    def sync_gradients(self) -> None:
        """Replace every gradient by the sum over the ranks of grad_weight × it: the gradient of
        the global batch's mean loss (a rank without samples adds zeros)."""
        for p in self.module.parameters():
            if not p.requires_grad:
                continue
            grad = p.grad if p.grad is not None else get_array_module(p.data).zeros_like(p.data)
            p.grad = allreduce(grad * p.data.dtype.type(self.grad_weight), op="sum",
                               algorithm=self.algorithm, comm=self.comm)


class NaiveZero:
    """ZeRO stage 1 as the paper draws it, for reading and as a reference: after backward, all
    gradients (packed per dtype, times `weight`) are reduce-scattered, the optimizer steps on
    this rank's block of the flat parameters, and the blocks are all-gathered. No buckets, no
    overlap. Call `step()` after `loss.backward()`."""

    def __init__(self, model: Any, make_optimizer: MakeOptimizer, comm: Communicator) -> None:
        self.comm, self.model = comm, model
        broadcast_model(model, comm)
        self.groups = flat.by_kind([p for p in model.parameters() if p.requires_grad])
        self.shards = []
        for group in self.groups:
            bounds = block_bounds(sum(p.data.size for p in group), comm.size)
            lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
            self.shards.append((Tensor(flat.pack([p.data for p in group])[lo:hi].copy(),
                                       requires_grad=True), lo, hi))
        self.optimizer = make_optimizer([t for t, _, _ in self.shards])
        self.weight = 1.0 / comm.size

    def step(self) -> None:
        for group, (t, _, _) in zip(self.groups, self.shards, strict=True):
            xp = get_array_module(group[0].data)
            grads = flat.pack([p.grad if p.grad is not None else xp.zeros_like(p.data)
                               for p in group]) * self.weight
            t.grad = reduce_scatter(grads, op="sum", comm=self.comm)
        self.optimizer.step()
        for group, (t, _, _) in zip(self.groups, self.shards, strict=True):
            whole = allgather(t.data, comm=self.comm, count=sum(p.data.size for p in group))
            for p, piece in zip(group, flat.unpack(whole, group), strict=True):
                p.data[...] = piece
                p.grad = None


class NaiveDiLoCo:
    """DiLoCo as its paper draws it: call `step()` after each inner optimizer step; every
    `sync_every` steps the workers average their outer gradient Δ = θ_global − θ_local and take
    an outer Nesterov step (`outer_lr`, `outer_momentum`) from θ_global, which every rank then
    continues from."""

    def __init__(self, module: Any, comm: Any = None, sync_every: int = 50, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, algorithm: str = "auto") -> None:
        self.comm, self.algorithm = as_communicator(comm), algorithm
        self.sync_every, self.outer_lr, self.mu = sync_every, outer_lr, outer_momentum
        self.params = [p for p in module.parameters() if p.requires_grad]
        broadcast_model(module, self.comm)
        self.global_ = [p.data.copy() for p in self.params]
        self.momentum = [get_array_module(p.data).zeros_like(p.data) for p in self.params]
        self.steps = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.sync_every:
            return
        for p, g, m in zip(self.params, self.global_, self.momentum, strict=True):
            delta = allreduce(g - p.data, op="sum", algorithm=self.algorithm, comm=self.comm)
            delta /= delta.dtype.type(self.comm.size)
            m *= self.mu
            m += delta
            g -= self.outer_lr * (delta + self.mu * m)
            p.data[...] = g

"""Local SGD: every rank takes optimizer steps on its own gradients and the ranks average their
parameters every H steps (Stich 2019; Lin et al. 2020's post-local SGD starts with
`warmup_steps` ordinary synchronous steps, gradients all-reduced every step).

Per step::

    loss.backward()
    if not local_sgd.local:          # during the warmup (or with DDP: skip no_sync())
        local_sgd.reduce_gradients()
    optimizer.step()
    local_sgd.step()                 # averages the parameters when H local steps have passed

Parameter averaging uses the mpdl all-reduce of one flat buffer per dtype; the average is
bit-identical on every rank, so the replicas agree exactly after every synchronisation.
Optimizer state (momentum) stays local.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl.backend import get_array_module
from mpdl.collectives import allreduce, broadcast
from mpdl.comm import Communicator, as_communicator
from mpdl.parallel import flat


def _average(tensors: list[Any], comm: Communicator, algorithm: str, grads: bool) -> int:
    """Replace each tensor's data (or grad) by its mean over the ranks; return bytes reduced."""
    total = 0
    for group in flat.by_kind(tensors):
        xp = get_array_module(group[0].data)
        arrays = [(t.grad if t.grad is not None else xp.zeros_like(t.data)) if grads else t.data
                  for t in group]
        packed = flat.pack(arrays)
        mean = allreduce(packed, op="avg", algorithm=algorithm, comm=comm)
        total += int(packed.nbytes)
        for t, piece in zip(group, flat.unpack(mean, group), strict=True):
            if grads:
                t.grad = piece.copy()
            else:
                t.data[...] = piece
    return total


class LocalSGD:
    """Average `module`'s parameters over `comm` every `sync_every` steps, after `warmup_steps`
    synchronous steps. Construction broadcasts rank 0's parameters and buffers."""

    def __init__(self, module: Any, comm: Any = None, sync_every: int = 4, warmup_steps: int = 0,
                 algorithm: str = "auto", broadcast_initial: bool = True) -> None:
        if not isinstance(sync_every, int | np.integer) or sync_every < 1:
            raise ValueError(f"sync_every: expected a positive number of steps, got {sync_every!r}")
        if not isinstance(warmup_steps, int | np.integer) or warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected a number of steps >= 0, got {warmup_steps!r}")
        self.module = module
        self.comm = as_communicator(comm)
        self.sync_every, self.warmup_steps = int(sync_every), int(warmup_steps)
        self.algorithm = algorithm
        self.steps = 0
        #: parameter averagings and gradient all-reduces so far, and the bytes they reduced
        self.syncs = self.gradient_reductions = 0
        self.bytes_reduced = 0
        self.params = [p for p in module.parameters() if p.requires_grad]
        if broadcast_initial and self.comm.size > 1:
            for t in [p for _, p in module.named_parameters()] + module.buffers():
                t.data[...] = broadcast(t.data, root=0, comm=self.comm)

    @property
    def local(self) -> bool:
        """True once the warmup is over: this step's gradients stay local."""
        return self.steps >= self.warmup_steps

    def reduce_gradients(self) -> None:
        """Average the gradients over the ranks (a synchronous step of the warmup)."""
        if self.comm.size > 1:
            self.bytes_reduced += _average(self.params, self.comm, self.algorithm, grads=True)
        self.gradient_reductions += 1

    def step(self) -> bool:
        """Call after each optimizer step; averages the parameters (and returns True) when
        `sync_every` local steps have passed since the warmup or the last averaging."""
        was_local = self.local
        self.steps += 1
        if not was_local or (self.steps - self.warmup_steps) % self.sync_every:
            return False
        self.average()
        return True

    def average(self) -> None:
        """Average the parameters and buffers now (also use at the end of training)."""
        if self.comm.size > 1:
            tensors = self.params + [b for b in self.module.buffers() if b.data.dtype.kind == "f"]
            self.bytes_reduced += _average(tensors, self.comm, self.algorithm, grads=False)
        self.syncs += 1

"""ZeRO-1 on the data-parallel axis of a process grid: the optimizer state of one set of parameters
(a pipeline stage's, a tensor-parallel rank's shards) sharded over the dp sub-communicator.

The parameters are packed per dtype into flat units (each parameter's data becomes a view of its
unit), each split over the dp ranks like `reduce_scatter` splits an array
(`mpdl.parallel.zero.Unit`); dp rank r owns block r and runs the
optimizer on it only, as one flat piece per (parameter, block) overlap, so it holds 1/dp of the
optimizer state. `step()` reduce-scatters the summed gradients (each rank gets the sum of its
block), steps the optimizer on the block and all-gathers the blocks into the parameters: the same
update a whole optimizer takes after an all-reduce, elementwise (the all-gather, on buffers kept
between steps, through a persistent plan per unit); whole-tensor norms (LARS, LAMB)
are completed with one small all-reduce (`Optimizer.shard`).

`ShardedOptimizer` stands where a plain optimizer over the parameters stood: `lr`, `zero_grad()`,
`param_groups`, and `state_dict()` / `load_state_dict()` in that plain optimizer's layout (whole
tensors, one entry per parameter; collective over dp). `pieces()` gives this rank's blocks for a
checkpoint that every rank writes its own part of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.backend import get_array_module
from mpdl.collectives import allreduce, reduce_scatter
from mpdl.comm import Communicator
from mpdl.parallel import flat
from mpdl.parallel.owners import MatrixOwners
from mpdl.parallel.shards import (
    Piece,
    Unit,
    gather_optimizer_state,
    keep_state_pieces,
    make_pieces,
    optimizer_state_nbytes,
)
from mpdl.parallel.strategy import MakeOptimizer
from mpdl.tuning import allgather_init


class ShardedOptimizer:
    """An optimizer over `params` whose state is sharded over `comm` (a dp axis)."""

    def __init__(self, params: list[Any], make_optimizer: MakeOptimizer, comm: Communicator,
                 algorithm: str = "auto") -> None:
        self.params, self.comm, self.algorithm = list(params), comm, algorithm
        self.index = {id(p): k for k, p in enumerate(self.params)}
        self.units = [Unit(i, group, comm.rank, comm.size)
                      for i, group in enumerate(flat.by_kind(self.params))]
        for u in self.units:
            u.full = flat.pack([p.data for p in u.params])  # the parameters live in it,
            memory.hold(u.full, "parameters")
            u.shard = u.full[u.lo:u.hi]                      # so a load reaches the shard
            for p, view in zip(u.params, u.views(u.full), strict=True):
                p.data = view
            u.gather_plan = allgather_init(u.shard, algorithm=algorithm, comm=comm, count=u.count,
                                           out=u.full)
        self.entries: list[Piece]
        self.entries, ndims = make_pieces(self.units)
        self.optimizer = make_optimizer([piece.tensor for piece in self.entries])
        self.optimizer.shard(ndims, self._sum_squares)
        if hasattr(self.optimizer, "split"):  # whole matrices (Muon): on their owners
            self.owners = MatrixOwners(self.units, self.entries, comm)
            self.optimizer.split(self.owners, self.owners.parents)

    # -- what a plain optimizer offers -----------------------------------------------------------
    @property
    def lr(self) -> float:
        return self.optimizer.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.optimizer.lr = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward: the inner optimizer's (mixed precision
        in fp16), else 1."""
        return getattr(self.optimizer, "loss_scale", 1.0)

    @property
    def scaler(self) -> Any:
        """The inner optimizer's loss scaler (mixed precision in fp16), else None."""
        return getattr(self.optimizer, "scaler", None)

    @property
    def grad_norm(self) -> float | None:
        """The inner optimizer's last global gradient norm before clipping."""
        return getattr(self.optimizer, "grad_norm", None)

    def global_norm(self, total: Callable[[list[Any], list[float]], float]) -> None:
        """`Optimizer.global_norm` for `params`: `total` sees the parameter of each piece."""
        param_of = {id(piece.tensor): piece.param for piece in self.entries}
        self.optimizer.global_norm(lambda pieces, sums: total([param_of[id(t)] for t in pieces],
                                                              sums))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()

    def step(self) -> None:
        """Reduce-scatter the gradients (summed over dp), step on this rank's blocks, all-gather
        the blocks into the parameters."""
        self.reduce()
        self.update()

    def reduce(self) -> None:
        """Reduce-scatter the gradients: each piece's gradient is its block of the sum over dp."""
        shards = []
        for u in self.units:
            grads = flat.pack([p.grad if p.grad is not None else u.xp.zeros_like(p.data)
                               for p in u.params])
            shards.append(reduce_scatter(grads, op="sum", algorithm=self.algorithm,
                                         comm=self.comm, in_place=True))
        mine = {u.index: s for u, s in zip(self.units, shards, strict=True)}
        for piece in self.entries:
            piece.tensor.grad = mine[piece.unit.index][piece.in_shard]

    def update(self) -> None:
        """Step on this rank's blocks (after `reduce`), all-gather them into the parameters."""
        self.optimizer.step()
        for u in self.units:
            u.gather_plan()

    def state_nbytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return optimizer_state_nbytes(self.optimizer)

    def pieces(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's part of the state: (parameter position k, start, end in the parameter's
        flat elements, {key: array of end - start elements, or a scalar})."""
        out = []
        for piece in self.entries:
            state = self.optimizer.state.get(piece.tensor)
            if state and piece.end > piece.start:
                out.append((self.index[id(piece.param)], piece.in_param.start,
                            piece.in_param.stop, state))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state of a plain optimizer over `params` (whole tensors); collective over dp."""
        return gather_optimizer_state(self.optimizer, self.units, self.entries, self.index,
                                      self.comm, self.algorithm)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's blocks of a plain optimizer's state over `params`."""
        keep_state_pieces(self.optimizer, state,
                          [piece for piece in self.entries if piece.end != piece.start], self.index)

    def _sum_squares(self, params: list[Any], sums: list[list[Any]]) -> list[list[Any]]:
        """Whole-tensor sums of squares from the pieces' (one all-reduce over dp)."""
        where = {id(piece.tensor): self.index[id(piece.param)] for piece in self.entries}
        k = len(sums[0]) if sums else 2
        total = np.zeros((len(self.params), k))
        for t, s in zip(params, sums, strict=True):
            total[where[id(t)]] += [float(v) for v in s]
        total = allreduce(total, op="sum", algorithm="auto", comm=self.comm)
        return [[get_array_module(t.data).asarray(v, dtype=t.data.dtype)
                 for v in total[where[id(t)]]] for t in params]

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

from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module, to_host
from mpdl.collectives import allgather, allgather_init, allreduce, reduce_scatter
from mpdl.comm import Communicator
from mpdl.parallel import flat
from mpdl.parallel.strategy import MakeOptimizer
from mpdl.parallel.zero import Unit, keep_state_pieces


class ShardedOptimizer:
    """An optimizer over `params` whose state is sharded over `comm` (a dp axis)."""

    def __init__(self, params: list[Any], make_optimizer: MakeOptimizer, comm: Communicator,
                 algorithm: str = "auto") -> None:
        self.params, self.comm, self.algorithm = list(params), comm, algorithm
        self.index = {id(p): k for k, p in enumerate(self.params)}
        self.units = [Unit(i, group, comm.rank, comm.size)
                      for i, group in enumerate(flat.by_kind(self.params))]
        entries, ndims = [], {}
        for u in self.units:
            u.full = flat.pack([p.data for p in u.params])  # the parameters live in it,
            memory.hold(u.full, "parameters")
            u.shard = u.full[u.lo:u.hi]                      # so a load reaches the shard
            for p, view in zip(u.params, u.views(u.full), strict=True):
                p.data = view
            u.gather_plan = allgather_init(u.shard, algorithm=algorithm, comm=comm, count=u.count,
                                           out=u.full)
            for i, a, b in u.pieces():
                t = Tensor(u.shard[a - u.lo:b - u.lo], requires_grad=True)
                entries.append((t, u, i, a, b))
                ndims[id(t)] = len(u.params[i].shape)
        if not entries:  # fewer elements than dp ranks: an empty piece keeps the optimizer valid
            u = self.units[0]
            entries.append((Tensor(u.shard[:0], requires_grad=True), u, 0, u.lo, u.lo))
        self.entries = entries
        self.optimizer = make_optimizer([t for t, *_ in entries])
        self.optimizer.shard(ndims, self._sum_squares)

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

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()

    def step(self) -> None:
        """Reduce-scatter the gradients (summed over dp), step on this rank's blocks, all-gather
        the blocks into the parameters."""
        shards = []
        for u in self.units:
            grads = flat.pack([p.grad if p.grad is not None else u.xp.zeros_like(p.data)
                               for p in u.params])
            shards.append(reduce_scatter(grads, op="sum", algorithm=self.algorithm,
                                         comm=self.comm, in_place=True))
        mine = {u.index: s for u, s in zip(self.units, shards, strict=True)}
        for t, u, _, a, b in self.entries:
            t.grad = mine[u.index][a - u.lo:b - u.lo]
        self.optimizer.step()
        for u in self.units:
            u.gather_plan()

    def state_nbytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return sum(int(v.nbytes) for s in self.optimizer.state.values() for v in s.values()
                   if hasattr(v, "nbytes") and np.ndim(v) > 0)

    def pieces(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's part of the state: (parameter position k, start, end in the parameter's
        flat elements, {key: array of end - start elements, or a scalar})."""
        out = []
        for t, u, i, a, b in self.entries:
            state = self.optimizer.state.get(t)
            if state and b > a:
                o = u.offsets[i]
                out.append((self.index[id(u.params[i])], a - o, b - o, state))
        return out

    def state_dict(self) -> dict[str, Any]:
        """The state of a plain optimizer over `params` (whole tensors); collective over dp."""
        mine = [s for t, *_ in self.entries if (s := self.optimizer.state.get(t))]
        keys = sorted({k for s in mine for k, v in s.items() if np.ndim(v) > 0})
        keys = sorted(set().union(*self.comm.allgather_object(keys)))
        scalars = next(({k: v for k, v in s.items() if np.ndim(v) == 0} for s in mine), {})
        scalars = next((s for s in self.comm.allgather_object(scalars) if s), {})
        state: dict[int, dict[str, Any]] = {}
        for u in self.units:
            for key in keys:
                local = u.xp.zeros(u.hi - u.lo, dtype=u.dtype)
                for t, pu, _, a, b in self.entries:
                    if pu is u and key in self.optimizer.state.get(t, {}):
                        local[a - u.lo:b - u.lo] = self.optimizer.state[t][key]
                whole = allgather(local, algorithm=self.algorithm, comm=self.comm, count=u.count)
                for p, view in zip(u.params, u.views(whole), strict=True):
                    state.setdefault(self.index[id(p)], dict(scalars))[key] = \
                        np.array(to_host(view))
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return {"state": state if keys else {},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's blocks of a plain optimizer's state over `params`."""
        keep_state_pieces(self.optimizer, state, [e for e in self.entries if e[4] != e[3]],
                          self.index)

    def _sum_squares(self, params: list[Any], sums: list[list[Any]]) -> list[list[Any]]:
        """Whole-tensor sums of squares from the pieces' (one all-reduce over dp)."""
        where = {id(t): self.index[id(u.params[i])] for t, u, i, _, _ in self.entries}
        k = len(sums[0]) if sums else 2
        total = np.zeros((len(self.params), k))
        for t, s in zip(params, sums, strict=True):
            total[where[id(t)]] += [float(v) for v in s]
        total = allreduce(total, op="sum", algorithm="auto", comm=self.comm)
        return [[get_array_module(t.data).asarray(v, dtype=t.data.dtype)
                 for v in total[where[id(t)]]] for t in params]

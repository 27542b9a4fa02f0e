"""Flat parameters sharded over ranks, as ZeRO (`mpdl.parallel.zero`) and the data-parallel axis of a
process grid (`mpdl.parallel.dpshard`) hold them.

A *unit* is a run of parameters of one dtype, flattened and split over p ranks like
`reduce_scatter` splits an array (block_bounds: the first count % p blocks one element longer, so
no count needs to divide by p). Rank r owns block r of every unit: its *shard*. The optimizer runs
on the shard only: it gets one flat *piece* tensor per (parameter, shard) overlap, so each rank
holds 1/p of the optimizer state.

This module holds that layout (`Unit`, `Piece`) and the optimizer state of the pieces: the whole
state as a replica's optimizer would have it (`gather_optimizer_state`), this rank's block of it
(`optimizer_state_shard`), and this rank's pieces of a whole state (`keep_state_pieces`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module, is_low_precision, to_host
from mpdl.collectives import allgather, allreduce
from mpdl.collectives.ops import block_bounds
from mpdl.comm import Communicator
from mpdl.comm.handles import Handle
from mpdl.parallel.buckets import FlatLayout
from mpdl.tuning import Plan


def state_dtype(dtype: Any) -> np.dtype:
    """The dtype of the optimizer state of parameters of `dtype`: float32 for 16-bit parameters
    (their master weights and moments, see mpdl.autograd.amp), dtype otherwise."""
    return np.dtype(np.float32) if is_low_precision(dtype) else np.dtype(dtype)


def placeholder(p: Any) -> Any:
    """The data of a parameter this rank does not hold now: a read-only array of p's shape and
    dtype that takes no memory and is all NaN, so that a use of it shows at once."""
    xp = get_array_module(p.data)
    return xp.broadcast_to(xp.full((), np.nan, dtype=p.data.dtype), p.shape)


class Unit(FlatLayout):
    """A run of parameters of one dtype, flattened and split over `size` ranks; this rank owns
    elements [lo, hi) of the flat buffer."""

    def __init__(self, index: int, params: list[Any], rank: int, size: int,
                 module: Any = None) -> None:
        super().__init__(params)
        self.index, self.module = index, module
        self.xp = get_array_module(params[0].data)
        self.dtype = params[0].data.dtype
        self.bounds = block_bounds(self.count, size)
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.itemsize = int(self.dtype.itemsize)
        self.full: Any = None         # the whole flat parameters while this rank holds them
        self.shard: Any = None        # this rank's block of the parameters
        self.grad: Any = None         # the full-size gradient buffer while it exists
        self.grad_shard: Any = None   # this rank's block of the summed gradient
        self.ready: set[int] = set()
        self.reduce: Handle | None = None
        #: persistent plans of the step's collectives on buffers kept between steps (ZeroStrategy
        #: makes them): the in-place reduce-scatter of `grad` (stage 1), the sum of its result
        #: over the replicas (hybrid), the in-place all-gather of `shard` into `full` (stages 1-2)
        self.reduce_plan: Plan | None = None
        self.replica_plan: Plan | None = None
        self.gather_plan: Plan | None = None

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def shard_nbytes(self) -> int:
        return (self.hi - self.lo) * self.itemsize


@dataclasses.dataclass(eq=False)
class Piece:
    """What the optimizer steps on for one (parameter, shard) overlap: `tensor`, a view of elements
    [start, end) (unit offsets) of `unit`'s shard, the part of the unit's parameter number
    `index` that this rank owns."""

    tensor: Tensor
    unit: Unit
    index: int
    start: int
    end: int

    @property
    def param(self) -> Any:
        """The whole parameter the piece is part of."""
        return self.unit.params[self.index]

    @property
    def in_shard(self) -> slice:
        """Where the piece lies in the unit's shard (and in any shard-sized buffer)."""
        return slice(self.start - self.unit.lo, self.end - self.unit.lo)

    @property
    def in_param(self) -> slice:
        """Where the piece lies in its parameter's flat elements."""
        offset = self.unit.offsets[self.index]
        return slice(self.start - offset, self.end - offset)


def make_pieces(units: list[Unit]) -> tuple[list[Piece], dict[int, int]]:
    """The pieces of this rank's shards (their tensors are views of `unit.shard`, which must be
    set), and {id(piece tensor): ndim of its whole parameter} for `Optimizer.shard`. A rank
    whose shards hold no element (fewer elements than ranks) gets one empty piece, which keeps
    its optimizer valid."""
    pieces, ndims = [], {}
    for u in units:
        for i, (o, p) in enumerate(zip(u.offsets, u.params, strict=True)):
            start, end = max(o, u.lo), min(o + p.data.size, u.hi)
            if start < end:
                t = Tensor(u.shard[start - u.lo:end - u.lo], requires_grad=True)
                pieces.append(Piece(t, u, i, start, end))
                ndims[id(t)] = len(p.shape)
    if not pieces:
        u = units[0]
        pieces.append(Piece(Tensor(u.shard[:0], requires_grad=True), u, 0, u.lo, u.lo))
    return pieces, ndims


def keep_state_pieces(optimizer: Any, state: dict[str, Any], pieces: list[Piece],
                      position: dict[int, int]) -> None:
    """Give `optimizer` this rank's pieces of a whole-tensor optimizer state_dict: `position`
    maps id(parameter) to its number in `state`; the hyperparameters of its first param group go
    to every group."""
    saved = {int(k): v for k, v in state["state"].items()}
    optimizer.state = {}
    for piece in pieces:
        entries = saved.get(position[id(piece.param)])
        if not entries:
            continue
        u = piece.unit
        optimizer.state[piece.tensor] = {
            k: (u.xp.asarray(np.asarray(v, dtype=state_dtype(u.dtype)).reshape(-1)[piece.in_param])
                .copy()
                if np.ndim(v) > 0 else (v.item() if hasattr(v, "item") else v))
            for k, v in entries.items()}
    hyper = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    for group in optimizer.param_groups:
        group.update(hyper)


def optimizer_state_keys(optimizer: Any, comm: Communicator) -> tuple[list[str], dict[str, Any]]:
    """The names of the optimizer's array state on any rank of comm (a rank whose pieces never
    stepped has none), and its scalar state (a step count) from the first rank that has any.
    Collective over comm."""
    mine = [s for s in optimizer.state.values() if s]
    keys = sorted({k for s in mine for k, v in s.items() if np.ndim(v) > 0})
    keys = sorted(set().union(*comm.allgather_object(keys)))
    scalars = next(({k: v for k, v in s.items() if np.ndim(v) == 0} for s in mine), {})
    scalars = next((s for s in comm.allgather_object(scalars) if s), {})
    return keys, scalars


def optimizer_state_shard(optimizer: Any, unit: Unit, pieces: list[Piece], key: str) -> Any:
    """This rank's block of `unit`'s optimizer state `key`, shaped like its shard: each piece's
    entry in its place, zeros where a piece has none."""
    block = unit.xp.zeros(unit.hi - unit.lo, dtype=state_dtype(unit.dtype))
    for piece in pieces:
        if piece.unit is unit and key in optimizer.state.get(piece.tensor, {}):
            block[piece.in_shard] = optimizer.state[piece.tensor][key]
    return block


def whole_param_groups(optimizer: Any, count: int) -> list[dict[str, Any]]:
    """The param_groups of a replica's optimizer state_dict over `count` parameters: the
    hyperparameters of the optimizer's first group."""
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return [{**hyper, "params": list(range(count))}]


def gather_optimizer_state(optimizer: Any, units: list[Unit], pieces: list[Piece],
                           position: dict[int, int], comm: Communicator,
                           algorithm: str = "auto") -> dict[str, Any]:
    """The optimizer's state_dict as a replica's optimizer would have it (whole tensors, one entry
    per parameter, numbered by `position`: id(parameter) -> number), all-gathered over comm from
    every rank's pieces, unit by unit and key by key. Collective over comm."""
    keys, scalars = optimizer_state_keys(optimizer, comm)
    state: dict[int, dict[str, Any]] = {}
    for u in units:
        for key in keys:
            whole = allgather(optimizer_state_shard(optimizer, u, pieces, key),
                              algorithm=algorithm, comm=comm, count=u.count)
            for p, view in zip(u.params, u.views(whole), strict=True):
                state.setdefault(position[id(p)], dict(scalars))[key] = np.array(to_host(view))
    return {"state": state if keys else {},
            "param_groups": whole_param_groups(optimizer, len(position))}


def optimizer_state_nbytes(optimizer: Any) -> int:
    """Bytes of the optimizer's array state on this rank."""
    return sum(int(v.nbytes) for s in optimizer.state.values() for v in s.values()
               if hasattr(v, "nbytes") and np.ndim(v) > 0)


class ZeroCheckpoint:
    """The part of `mpdl.parallel.zero.ZeroStrategy` that gives the whole model and optimizer
    state from the shards, and writes and reads this rank's part of a checkpoint."""

    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Iterator[None]:
        """Within the block every rank holds the whole model (stage 3 gathers it; values
        written into it are kept); with `optimizer_state`, `state_dict()` gives the whole
        optimizer state. Collective over comm; also agrees on the accounting figures."""
        owners = getattr(self, "owners", None)  # Muon's exchanges with the matrices' owners
        sent = self.meter.sent_bytes_per_step() + (owners.sent_bytes if owners else 0)
        figures = allreduce(np.array([self.step_peak_bytes, sent], dtype=np.float64), op="max",
                            comm=self.comm)
        self.model_state_bytes, self.sent_bytes_per_step = int(figures[0]), float(figures[1])
        self._full_state = self.gather_optimizer_state() if optimizer_state else None
        with self.parameters.whole():
            yield

    def gather_optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state_dict as a replica's optimizer would have it (one entry per
        parameter of the model, whole tensors): gathered from the shards. Collective over the
        shard group."""
        return gather_optimizer_state(self.optimizer, self.units, self.pieces, self._positions(),
                                      self.shard_comm, self.algorithm)

    def _positions(self) -> dict[int, int]:
        """id(parameter) -> its number in a replica's optimizer state_dict."""
        return {id(p): n for n, p in enumerate(p for p in self.model.parameters()
                                               if p.requires_grad)}

    def checkpoint_shard(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """This rank's shard for a sharded checkpoint (None on a replica of another node: hybrid)
        and the manifest `mpdl.training.checkpoint` reassembles whole tensors with. Collective
        over the shard group."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        position = self._positions()
        keys, scalars = optimizer_state_keys(self.optimizer, self.shard_comm)
        manifest = {"format": "zero", "stage": self.stage, "ranks": self.shard_comm.size,
                    "units": [{"dtype": str(u.dtype), "count": u.count,
                               "params": [[names[id(p)], position[id(p)], list(p.shape), o]
                                          for p, o in zip(u.params, u.offsets, strict=True)]}
                              for u in self.units],
                    "state_keys": keys, "scalars": scalars,
                    "param_groups": whole_param_groups(self.optimizer, len(position))}
        if self.replica_comm is not None and self.replica_comm.rank != 0:
            return None, manifest
        arrays: dict[str, Any] = {}
        for u in self.units:
            arrays[f"unit{u.index}/param"] = np.array(to_host(u.shard))
            for key in keys:
                arrays[f"unit{u.index}/state/{key}"] = to_host(
                    optimizer_state_shard(self.optimizer, u, self.pieces, key))
        if self.shard_comm.rank == 0:  # the model's other arrays: buffers, frozen parameters
            sharded = {id(p) for u in self.units for p in u.params}
            arrays.update({f"other/{n}": np.array(to_host(t.data)) for n, t in
                           [*self.model.named_parameters(), *self.model.named_buffers()]
                           if id(t) not in sharded})
        return arrays, manifest

    def state_dict(self) -> dict[str, Any]:
        if getattr(self, "_full_state", None) is None:
            raise RuntimeError("ZeroStrategy.state_dict: call it inside gathered("
                               "optimizer_state=True) (the whole state is gathered from shards)")
        return self._full_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a replica's optimizer state_dict (whole tensors, one entry per parameter; as
        `state_dict` writes it, from any number of ranks and any stage) and keep this rank's
        pieces of it."""
        keep_state_pieces(self.optimizer, state, self.pieces, self._positions())
        self._count_optimizer_state()

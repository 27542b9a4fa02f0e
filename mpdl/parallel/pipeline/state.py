"""The whole model and its checkpoints from a pipeline's stages: `gathered()` broadcasts each
stage's parameters along the pipeline (and all-gathers the tensor-parallel shards) for evaluation
and checkpoints; `checkpoint_shard` writes this rank's part of a checkpoint, `load_state_dict`
reads its part of any layout's optimizer state.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl.backend import get_array_module, to_host
from mpdl.collectives import allreduce, broadcast
from mpdl.parallel.tensor_parallel import gather_array


def runs(positions: Any) -> Any:
    """(start, length) rows of the runs of consecutive integers in `positions`, in order."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    if not positions.size:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    return np.stack([positions[starts], ends - starts], axis=1)


class PipelineState:
    """The part of `PipelineStrategy` that gathers the whole model (and optimizer state) and
    writes and reads this rank's part of a checkpoint."""

    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Any:
        """The whole model current on every rank (a broadcast per stage along pp, then an
        all-gather of the tensor-parallel shards); with `optimizer_state`, `state_dict()` gives
        the optimizer state of the whole model in a one-rank optimizer's layout. On leaving, the
        shards are taken from the whole model again (which a checkpoint may have replaced)."""
        figures = allreduce(np.array([self.rank_parameter_bytes, self.rank_state_bytes],
                                     dtype=np.float64), op="max", comm=self.comm)
        self.parameter_bytes, self.model_state_bytes = int(figures[0]), int(figures[1])
        self.measure()
        for s in range(self.pp):
            params = self._rank_params(s)
            if not params:
                continue
            xp = get_array_module(params[0].data)
            if s == self.stage:
                flat = xp.concatenate([p.data.reshape(-1) for p in params])
            else:
                flat = xp.empty(sum(p.size for p in params),
                                dtype=np.result_type(*[p.data.dtype for p in params]))
            flat = broadcast(flat, root=s, comm=self.grid.pp_comm)
            if s == self.stage:
                continue
            offset = 0
            for p in params:
                piece = flat[offset:offset + p.size].reshape(p.shape)
                if id(p) in self._owned:  # the tied embedding on the last stage
                    p.data[...] = piece
                else:
                    p.data = piece
                offset += p.size
        if self.tp_model is not None:
            self.tp_model.gather_into_model()
        if optimizer_state:
            self._whole_state = self._gather_optimizer_state()
        try:
            yield
        finally:
            self._whole_state = None
            if self.tp_model is not None:
                self.tp_model.scatter_from_model()
            self._release_others()

    def _entries(self) -> list[tuple[int, int, Any, Any]]:
        """For each parameter this rank's optimizer steps (position k): (k, the index of the
        whole model's parameter it is or is a shard of, that parameter, the shard's index(t) or
        None)."""
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        shards = {id(s): (full, where) for s, full, where in
                  (self.tp_model.shards if self.tp_model is not None else [])}
        entries = []
        for k, p in enumerate(self.stage_params):
            full, where = shards.get(id(p), (p, None))
            entries.append((k, index[id(full)], full, where))
        return entries

    def _gather_optimizer_state(self) -> dict[str, Any]:
        """Every rank's optimizer state, shards all-gathered over tp, as the state of one
        optimizer over the whole model's parameters (collective; small models: the states
        travel as Python objects)."""
        local = self.optimizer.state_dict()
        mine: dict[int, Any] = {}
        for k, i, full, where in self._entries():
            state = local["state"].get(k)
            if state is None:
                continue
            if where is not None:
                state = {key: gather_array(v, full.shape, where, self.grid.tp_comm)
                         if getattr(v, "shape", ()) == self.stage_params[k].shape else v
                         for key, v in state.items()}
            if self._writes(k) and self.grid.t == 0:
                mine[i] = state
        merged: dict[int, Any] = {}
        for part in self.comm.allgather_object(mine):
            for i, state in part.items():
                merged.setdefault(i, state)
        group = {k: v for k, v in local["param_groups"][0].items() if k != "params"}
        n = len(self.model.parameters())
        return {"state": merged, "param_groups": [{**group, "params": list(range(n))}]}

    def state_dict(self) -> dict[str, Any]:
        if self._whole_state is None:
            raise RuntimeError("pipeline: state_dict() is given inside gathered("
                               "optimizer_state=True)")
        return self._whole_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's part of a whole-model optimizer state (any layout wrote it)."""
        whole = state["state"]
        local = {}
        for k, i, full, where in self._entries():
            entry = whole.get(i, whole.get(str(i)))
            if entry is None:
                continue
            if where is not None:
                entry = {key: v[where(self.grid.t)]
                         if getattr(v, "shape", ()) == full.shape else v
                         for key, v in entry.items()}
            local[k] = entry
        group = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
        self.optimizer.load_state_dict({"state": local, "param_groups": [
            {**group, "params": list(range(len(self.stage_params)))}]})

    def _writes(self, k: int) -> bool:
        """Whether this rank writes stage parameter k to a checkpoint (and, without ZeRO, its
        optimizer state): the first replica of the stage (d = 0, c = 0) does."""
        return self.grid.d == 0 and self.grid.c == 0

    def checkpoint_shard(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """This rank's part of a checkpoint (None when it writes none) and the manifest: each
        stage's dp-rank-0 writes its parameters (each tp rank its shards, tp rank 0 the
        replicated ones; the last stage leaves the tied embedding to the first), the optimizer
        state beside them (with ZeRO-1 every dp rank its block of it), rank 0 the buffers.
        Each array is stored flat with the runs (start, length) of the whole tensor's flat
        elements it holds (`assemble_parts` in mpdl.training.checkpoint puts them together).
        Collective (the optimizer's scalar state is agreed)."""
        g = self.grid
        names = {id(p): n for n, p in self.model.named_parameters()}
        arrays: dict[str, Any] = {}
        meta: list[list[Any]] = []

        def add(target: str, name: str, key: Any, full: Any, positions: Any, values: Any) -> None:
            n = len(meta)
            arrays[f"a{n}"] = flat = np.ascontiguousarray(to_host(values)).reshape(-1)
            arrays[f"r{n}"] = runs(positions)
            # the values' dtype: a 16-bit parameter's float32 master weight and moments stay so
            meta.append([target, name, key, list(full.shape), str(flat.dtype)])

        positions: dict[int, Any] = {}
        for k, _, full, where in self._entries():
            p = self.stage_params[k]
            if p is self.tied or (where is None and g.t != 0):
                continue  # written by the first stage / by tp rank 0
            index = np.arange(full.size).reshape(full.shape)
            positions[k] = (index[where(g.t)] if where is not None else index).reshape(-1)
            if self._writes(k):
                add("model", names[id(full)], None, full, positions[k], p.data)
        if self.zero:
            parts = self.optimizer.pieces()
        else:
            parts = [(k, 0, self.stage_params[k].size, st) for k, st in
                     ((int(k), st) for k, st in self.optimizer.state_dict()["state"].items())
                     if self._writes(k)]
        scalars: dict[str, Any] = {}
        entries = {k: (i, full) for k, i, full, _ in self._entries()}
        for k, a, b, st in parts:
            i, full = entries[k]
            for key, v in st.items():
                if np.ndim(v) == 0:
                    scalars[key] = v.item() if hasattr(v, "item") else v
                elif k in positions:
                    add("state", str(i), key, full, positions[k][a:b], v)
        if self.comm.rank == 0:
            for n, t in [*self.model.named_buffers(),
                         *((n, p) for n, p in self.model.named_parameters()
                           if not p.requires_grad)]:
                add("model", n, None, t.data, np.arange(t.data.size), t.data)
        scalars = next((s for s in self.comm.allgather_object(scalars) if s), {})
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        manifest = {"format": "parts", "ranks": self.comm.size, "scalars": scalars,
                    "param_groups": [{**group,
                                      "params": list(range(len(self.model.parameters())))}],
                    "layout": {"dp": g.dp, "pp": self.pp, "cp": self.cp, "tp": g.tp,
                               "zero": self.zero}}
        if not meta:
            return None, manifest
        arrays["meta"] = np.array(json.dumps(meta))
        return arrays, manifest

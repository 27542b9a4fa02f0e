"""Deterministic expert parallelism (`mpdl train --deterministic --ep P`): the parameters one
rank's `DeterministicStrategy` gives, to the last bit, with each MoE layer's experts split over
groups of P ranks as `mpdl.parallel.expert` splits them.

One rank's deterministic step runs each atom (`mpdl.parallel.deterministic`) on its own: every
expert takes that atom's rows in one GEMM, and the atom's gradient of every tensor is rounded to
an integer grid before any sum. Here the ranks run their atoms in rounds (round r: each rank's
r-th atom, or an empty batch, so that every rank of a group sends the same all-to-alls), and:

1. an expert's rank runs the rows of each source rank (one atom) through a twin of the expert (the
   same weight arrays, its own gradients): the same GEMMs on the same rows as one rank, and each
   atom's expert gradient kept apart;
2. the load-balancing loss of a layer counts the routings of the atom (as one rank's does) and
   joins backward with the atom's share of the global batch;
3. the dense gradients (attention, routers, embeddings, LayerNorms) are summed exactly over all
   ranks, the experts' over their replicas (`exact_sum`, the same grid as one rank's); updates
   are elementwise, so each rank updates the parameters it holds to one rank's bits.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd.nn import Module, Parameter
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.models.moe import MoE, aux_loss_scale, concat_rows, run_experts
from mpdl.parallel.deterministic import DEFAULT_ATOMS, exact_sum
from mpdl.parallel.expert import AllToAllExperts, ExpertGroups, ExpertParallelStrategy
from mpdl.parallel.strategy import (
    Batch,
    MakeOptimizer,
    Span,
    StepResult,
    correct_predictions,
)


def twin(module: Module) -> Module:
    """`module` with new parameters over the same arrays: the same outputs, its own gradients."""
    double = copy.copy(module)
    object.__setattr__(double, "_parameters", {
        name: None if p is None else Parameter(p.data, requires_grad=p.requires_grad)
        for name, p in module._parameters.items()})
    object.__setattr__(double, "_modules", {name: twin(m) for name, m in module._modules.items()})
    return double


class ExactAllToAllExperts(AllToAllExperts):
    """The dispatcher of one MoE layer under deterministic expert parallelism: each source's rows
    through twins of this rank's experts (`twins`: (source, twins) of the forwards since the
    strategy last took them); the load-balancing loss counts this call's routings only."""

    def __init__(self, experts: list[Any], ep_comm: Any, dp_comm: Any,
                 algorithm: str = "auto") -> None:
        super().__init__(experts, ep_comm, dp_comm, algorithm)
        self.twins: list[tuple[int, list[Module]]] = []

    def routed_counts(self, counts: np.ndarray) -> np.ndarray:
        return counts

    def run(self, received: Tensor, from_source: np.ndarray) -> Tensor:
        outputs, start = [], 0
        for source, counts in enumerate(from_source):
            rows = int(counts.sum())
            if not rows:
                continue
            twins = [twin(expert) for expert in self.experts]
            self.twins.append((source, twins))
            outputs.append(run_experts(twins, received[start:start + rows], counts))
            start += rows
        return concat_rows(outputs) if outputs else received * 0.0


def _flat_grads(params: list[Any]) -> np.ndarray:
    """The gradients of `params` end to end (zeros for a parameter without one)."""
    return np.concatenate([np.zeros(p.size, dtype=p.data.dtype) if p.grad is None
                           else p.grad.reshape(-1) for p in params])


class ExactExpertStrategy(ExpertParallelStrategy):
    """`--deterministic` with `--ep`: data parallelism over all ranks with the experts split over
    groups of `ep` (see the module docstring); `algorithm` names the exact sums' all-reduce,
    `atoms` the pieces every global batch is cut into (the same on any layout)."""

    mode = "deterministic"

    def __init__(self, comm: Any, ep: int = 1, algorithm: str = "auto", alltoall: str = "auto",
                 atoms: int = DEFAULT_ATOMS) -> None:
        super().__init__(comm, ep=ep, algorithm=algorithm, alltoall=alltoall)
        self.atoms = int(atoms)

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.moes = [m for _, m in model.named_modules() if isinstance(m, MoE)]
        if not self.moes:
            raise ValueError("ep: the model has no mixture-of-experts layer (moe_experts)")
        self.groups = ExpertGroups(self.moes, self.comm, self.ep, self.alltoall,
                                   dispatcher=ExactAllToAllExperts)
        self.ep_comm, self.replica_comm = self.groups.ep_comm, self.groups.replica_comm
        self.dispatchers = self.groups.dispatchers
        self.groups.install()
        params = [p for p in model.parameters() if p.requires_grad]
        self.dense = [p for p in params if id(p) not in self.groups.expert_ids]
        # in the order of each layer's twins: layer, then expert, then the expert's parameters
        self.owned = [p for group in self.groups.local_experts for ex in group
                      for p in ex.parameters()]
        self.trained = [p for p in params if id(p) in self.groups.owned_ids
                        or id(p) not in self.groups.expert_ids]
        self.optimizer = make_optimizer(self.trained)
        self.groups.release()

    def _take_twin_grads(self) -> list[np.ndarray]:
        """Per source rank that sent rows since the last call: its atom's gradient of this
        rank's experts (every layer's, in `owned` order)."""
        by_source: dict[int, dict[int, list[Module]]] = {}
        for layer, d in enumerate(self.dispatchers):
            for source, twins in d.twins:
                by_source.setdefault(source, {})[layer] = twins
            d.twins = []
        dtype = self.owned[0].data.dtype
        grads = []
        for source in sorted(by_source):
            parts = []
            for layer, group in enumerate(self.groups.local_experts):
                twins = by_source[source].get(layer)
                parts.append(_flat_grads([p for ex in twins for p in ex.parameters()]) if twins
                             else np.zeros(sum(p.size for ex in group for p in ex.parameters()),
                                           dtype=dtype))
            grads.append(np.concatenate(parts))
        return grads

    def _atom(self, part: Batch, result: StepResult) -> None:
        """Forward and backward of one atom (an empty one still sends every all-to-all)."""
        with aux_loss_scale(len(part.y) / part.global_size):
            logits = self.model(Tensor(part.x))
            if not len(part.y):
                (logits.sum() * 0.0).backward()
                return
            loss = F.cross_entropy(logits, part.y, reduction="sum")
            loss.backward(1.0 / part.count)
        result.loss += float(loss.item()) * part.global_size / part.count
        result.correct += correct_predictions(logits.data, part.y)
        result.samples += len(part.y)

    def step(self, batch: Batch) -> StepResult:
        if batch.atoms is None or batch.count <= 0:
            raise ValueError("ExactExpertStrategy.step: expected a batch with its atoms and the "
                             "global count of targets")
        self.optimizer.lr = batch.lr
        self.groups.take_spans()
        result = StepResult()
        start = time.perf_counter()
        mine = list(batch.atoms)
        rounds = int(allreduce(np.array([len(mine)], np.int64), op="max", comm=self.ep_comm)[0])
        dense_grads, expert_grads, offset = [], [], 0
        for r in range(rounds):
            size = mine[r] if r < len(mine) else 0
            part = Batch(batch.x[offset:offset + size], batch.y[offset:offset + size],
                         batch.global_size, batch.lr, count=batch.count)
            offset += size
            self._atom(part, result)
            if size:
                dense_grads.append(_flat_grads(self.dense))
            expert_grads += self._take_twin_grads()
            self.model.zero_grad()
        computed = time.perf_counter()
        dtype = self.dense[0].data.dtype
        for params, grads, comm in ((self.dense, dense_grads, self.comm),
                                    (self.owned, expert_grads, self.replica_comm)):
            sizes = [p.size for p in params]
            total = exact_sum(grads, sizes, self.atoms, comm, self.algorithm, dtype=dtype)
            for p, piece in zip(params, np.split(total, np.cumsum(sizes)[:-1]), strict=True):
                p.grad = piece.reshape(p.shape)
        summed = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = time.perf_counter()
        exchanges = self.groups.take_spans()
        a2a = sum(e - s for _, s, e, _ in exchanges)
        result.comm_s = result.exposed_s = a2a + (summed - computed)
        result.compute_s = (end - start) - result.comm_s
        self._a2a_s += a2a
        self.step_count += 1
        result.spans += [Span(name, s, e, cat="communication", args={"bytes": nbytes})
                         for name, s, e, nbytes in exchanges]
        result.spans += [Span("exact sum", computed, summed, cat="communication"),
                         Span("optimizer step", summed, end)]
        return result

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        return (f"deterministic expert parallel over {self.ep} rank(s): {self.atoms} atoms a "
                f"batch, exact int64 sums over {self.algorithm}")

    def report(self, final: bool = False) -> dict[str, Any]:
        return {**super().report(final), "atoms": self.atoms}

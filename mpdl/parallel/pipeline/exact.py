"""A deterministic pipeline: the parameters one rank's `DeterministicStrategy` gives, to the last
bit, on pp stages × dp replicas (`mpdl train --deterministic --pp`).

Each atom is one microbatch (1F1B), so each stage computes an atom's gradient of its parameters
with the shapes one rank uses. After each atom's backward the stage keeps that gradient; at the
end of the step the last stage hands its half of the tied embedding's gradient to the first,
which adds it to its own half per atom in float32, as one rank's backward adds the two. The sums
over atoms and dp replicas are then `exact_sum`'s integers, one exponent per tensor as on one rank,
and the last stage receives the tied embedding's sum from the first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import broadcast
from mpdl.comm import Communicator
from mpdl.parallel.deterministic import DEFAULT_ATOMS, exact_sum
from mpdl.parallel.pipeline.driver import Microbatches
from mpdl.parallel.pipeline.executor import PipelineStrategy
from mpdl.parallel.pipeline.meter import PipelineMeter
from mpdl.parallel.strategy import Batch, StepResult, correct_predictions


class ExactPipeline(PipelineStrategy):
    """A 1F1B pipeline whose gradients are exact sums over atoms (one microbatch each) and dp
    replicas, the tied embedding's halves added per atom first."""

    def __init__(self, comm: Communicator, dp: int, pp: int, microbatches: int = 1,
                 algorithm: str = "auto", atoms: int = DEFAULT_ATOMS) -> None:
        super().__init__(comm, dp=dp, pp=pp, microbatches=microbatches, algorithm=algorithm)
        self.atoms = int(atoms)
        self.microbatches = self.atoms  # one per atom: the receive cache keeps a step's receives
        #: this step's gradients of the stage's parameters, one flat array per atom
        self.atom_grads: list[np.ndarray] = []

    def _parts(self, batch: Batch) -> list[Any]:
        if batch.atoms is None or batch.count <= 0:
            raise ValueError("ExactPipeline.step: expected a batch with its atoms and the global "
                             "count of targets")
        ends = np.cumsum([0, *batch.atoms])
        return [np.arange(lo, hi) for lo, hi in zip(ends[:-1], ends[1:], strict=True) if hi > lo]

    def _microbatches(self, batch: Batch) -> Microbatches:
        mb = super()._microbatches(batch)
        mb.seed = 1.0 / batch.count  # each atom's summed loss over the step's count of targets
        self.atom_grads = []
        return mb

    def _microbatch_loss(self, logits: Tensor, mb: Microbatches, j: int,
                         result: StepResult) -> Tensor:
        y = mb.rows(mb.batch.y, j)
        loss = F.cross_entropy(logits, y, reduction="sum")
        result.loss += float(loss.item()) * mb.batch.global_size / mb.batch.count
        result.correct += correct_predictions(logits.data, y)
        result.samples += len(y)
        return loss

    def _backward(self, mb: Microbatches, j: int, s: int, meter: PipelineMeter) -> None:
        super()._backward(mb, j, s, meter)
        self.atom_grads.append(np.concatenate([
            np.zeros(p.size, dtype=p.data.dtype) if p.grad is None else p.grad.reshape(-1)
            for p in self.stage_params]))
        for p in self.stage_params:
            p.grad = None

    def _synchronise(self) -> None:
        params = list(self.stage_params)
        grads = self.atom_grads
        tied = self.model.token_embedding.weight if self.tied_comm is not None else None
        if tied is not None:
            k = next(i for i, p in enumerate(params) if p is tied)
            lo = sum(p.size for p in params[:k])
            hi = lo + tied.size
            halves = np.stack([g[lo:hi] for g in grads]) if self.last else \
                np.empty((len(grads), tied.size), dtype=tied.data.dtype)
            halves = broadcast(halves, root=1, algorithm=self.algorithm, comm=self.tied_comm)
            if self.last:  # the first stage sums the tied embedding
                grads = [np.concatenate([g[:lo], g[hi:]]) for g in grads]
                del params[k]
            else:
                for g, half in zip(grads, halves, strict=True):
                    g[lo:hi] = g[lo:hi] + half
        total = exact_sum(grads, [p.size for p in params], self.atoms, self.grid.dp_comm,
                          self.algorithm, dtype=self.stage_params[0].data.dtype)
        offset = 0
        for p in params:
            p.grad = total[offset:offset + p.size].reshape(p.shape)
            offset += p.size
        if tied is not None:
            g = tied.grad if not self.last else np.empty_like(tied.data)
            tied.grad = broadcast(g, root=0, algorithm=self.algorithm, comm=self.tied_comm)

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        return (f"{super().describe()}; deterministic: {self.atoms} atoms a batch, one "
                f"microbatch each, exact int64 sums over {self.algorithm}")

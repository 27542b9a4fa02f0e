"""Expert parallelism on a process grid: the MoE layers of each pipeline stage spread over groups
of `ep` of that stage's data-parallel ranks, with pipeline (`--pp`) and tensor (`--tp`)
parallelism around them.

On a (dp, pp, tp) grid the ranks of stage i with tensor-parallel rank t form that stage's
data-parallel axis (`ProcessGrid.dp_comm`, coordinates d = 0 … dp−1). `ep` consecutive ones
(d = g·ep + j) share the E experts of each MoE layer of the stage, E/ep each, as
`ExpertParallelStrategy` shares them over plain data-parallel ranks (`ExpertGroups`): a
microbatch's MoE layer on stage i sends its rows by all-to-all among the ranks of its group (the
same stage, the same t) and gets the experts' outputs back.

**Tensor parallelism: experts replicated over tp.** The MoE layer's input is the same on every tp
rank of a stage (the attention's row-parallel output is all-reduced before it; sequence
parallelism is refused with MoE), so every tp rank t routes the same tokens, runs the same
experts in its own group (ranks with the same t) and gets the same expert gradients: no
communication over tp, and the ep groups of the tp ranks run side by side. Splitting each expert
over tp would cut its weights and FLOPs by tp at the cost of an all-reduce over tp per MoE layer
and direction; `ep` already divides the experts' memory, and the experts here are small.

**Gradients.** The stage's experts' gradients are summed over their replicas (the stage's
dp/ep ranks with the same j and t), the rest of the stage over all its dp ranks; with ZeRO-1 each
group by a `ShardedOptimizer` over those ranks. The all-to-all weights nothing: the pipeline
scales each microbatch's loss by its share of the global batch, so every row's gradient carries
its weight already.

**Load balancing.** The routing counts of microbatch j of a MoE layer are summed over the stage's
dp ranks (as `ExpertParallelStrategy` sums those of the global batch): with one microbatch, the
loss of every step is that of one process on the global batch. So every dp rank runs all
`microbatches` microbatches, in the same order, empty ones too (a slice shorter than the number
of microbatches, or none): each takes part in every count all-reduce and all-to-all.

With ep = 1 the same code runs with groups of one rank (the all-to-alls are local copies).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpdl.comm import Communicator
from mpdl.models.moe import MoE
from mpdl.parallel.dpshard import ShardedOptimizer
from mpdl.parallel.expert import ExpertGroups, ShardedOptimizers, check_ep, epoch_figures
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategy import Batch, MakeOptimizer, Span, StepResult


class ExpertPipelineStrategy(PipelineStrategy):
    """`PipelineStrategy` for a model with MoE layers, their experts shared by groups of `ep`
    data-parallel ranks of each stage (see the module docstring); `alltoall` names the token
    all-to-all's algorithm. The other arguments are `PipelineStrategy`'s."""

    lockstep_microbatches = True

    def __init__(self, comm: Communicator, dp: int, pp: int, tp: int = 1, ep: int = 1,
                 alltoall: str = "auto", **pipeline: Any) -> None:
        super().__init__(comm, dp, pp, tp, **pipeline)
        check_ep(ep, dp)
        if self.cp > 1 or self.sp:
            raise ValueError("ep: experts on a grid do not combine with cp > 1 or sp (a "
                             "replicated MoE layer would see a slice of the sequence)")
        self.ep, self.alltoall = ep, alltoall
        self.steps, self.alltoall_s = 0, 0.0
        self._epoch: dict[str, Any] = {}

    def _stage_optimizer(self, make_optimizer: MakeOptimizer) -> Any:
        """Share the stage's MoE layers over the groups of its dp ranks (`groups`), keep this
        rank's experts only in `stage_params`, and give them their optimizer (with ZeRO-1 and
        ep > 1 the experts' state sharded over their replicas)."""
        seen: dict[int, MoE] = {}
        for piece in self.pieces:
            for _, m in piece.named_modules():
                if isinstance(m, MoE):
                    seen.setdefault(id(m), m)
        self.groups = ExpertGroups(list(seen.values()), self.grid.dp_comm, self.ep,
                                   self.alltoall)
        self.groups.install()
        self.stage_params = [p for p in self.stage_params if id(p) not in self.groups.expert_ids
                             or id(p) in self.groups.owned_ids]
        dense, experts = self.groups.split(self.stage_params)
        if not self.zero or self.ep == 1 or not experts:
            return super()._stage_optimizer(make_optimizer)
        return ShardedOptimizers(
            self.stage_params,
            ShardedOptimizer(dense, make_optimizer, self.grid.dp_comm, self.algorithm),
            ShardedOptimizer(experts, make_optimizer, self.groups.replica_comm, self.algorithm))

    def _counted_over_dp(self, p: Any) -> bool:
        """This rank's experts are summed over their replicas, not over all dp ranks."""
        if id(p) in self.groups.owned_ids and not self.zero:
            return self.groups.replica_comm.rank == 0
        return super()._counted_over_dp(p)

    def _sum_data_parallel(self) -> None:
        dense, experts = self.groups.split(self.stage_params)
        self._sum_gradients(dense, self.grid.dp_comm, "dp")
        if self.groups.replica_comm.size > 1:
            self._sum_gradients(experts, self.groups.replica_comm, "expert replicas")

    def _boundary_shapes(self, x: Any) -> list[tuple[tuple[int, ...], Any]]:
        with self.groups.local():  # a shape probe of one sample: no all-to-all
            return super()._boundary_shapes(x)

    def step(self, batch: Batch) -> StepResult:
        self.groups.take_spans()
        result = super().step(batch)
        exchanges = self.groups.take_spans()
        a2a = sum(end - start for _, start, end, _ in exchanges)
        result.spans += [Span(name, start, end, cat="communication", args={"bytes": nbytes})
                         for name, start, end, nbytes in exchanges]
        result.comm_s += a2a
        result.exposed_s += a2a
        result.compute_s -= a2a
        self.steps += 1
        self.alltoall_s += a2a
        return result

    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Iterator[None]:
        """`PipelineStrategy.gathered`, each stage's experts first all-gathered over their
        groups (with `optimizer_state`, each expert's state comes from the rank of the first
        group that holds it); within the block every MoE layer runs all its experts locally."""
        layers = [m for _, m in self.model.named_modules() if isinstance(m, MoE)]
        if layers:
            self._epoch = epoch_figures(layers, self.groups.moes if self.grid.t == 0 else [],
                                        self.alltoall_s, self.steps, self.comm)
        self.groups.gather()
        with self.groups.local(), super().gathered(optimizer_state):
            yield

    def _writes(self, k: int) -> bool:
        """An expert is written by the rank of the first group that holds it (d = j)."""
        if id(self.stage_params[k]) in self.groups.expert_ids:
            return self.grid.d == self.groups.ep_rank
        return super()._writes(k)

    def checkpoint_shard(self) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        arrays, manifest = super().checkpoint_shard()
        manifest["layout"]["ep"] = self.ep
        return arrays, manifest

    def describe(self, final: bool = False) -> str:
        text = super().describe(final)
        if final or not self.groups.moes:
            return text
        e = self.groups.moes[0].num_experts
        return (f"{text}; this stage's {len(self.groups.moes)} MoE layer(s) of {e} experts over "
                f"groups of {self.ep} dp rank(s) ({e // self.ep} experts each), all-to-all "
                f"{self.alltoall}")

    def report(self, final: bool = False) -> dict[str, Any]:
        """`PipelineStrategy.report`, with `ep` and (but at the end) the experts' figures since
        the last report, as `ExpertParallelStrategy` gives them: the all-to-all seconds per
        step are the mean over all ranks (those of stages without MoE layers count 0)."""
        fields = {**super().report(final), "ep": self.ep}
        if not final:
            fields.update(self._epoch)
            for m in self.groups.moes:
                m.reset_stats()
            self.steps, self.alltoall_s = 0, 0.0
        return fields

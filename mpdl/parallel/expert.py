"""Expert parallelism: the data-parallel ranks split into groups of `ep` that share the E experts
of every MoE layer (`mpdl.autograd.moe`), each rank holding E/ep of them.

Ranks r = g·ep + j: group g (ranks g·ep … g·ep+ep−1, the `ep_comm`) holds one copy of all the
experts, rank j of the group experts j·E/ep … (j+1)·E/ep − 1. Ranks with the same j in different
groups hold the same experts: their `replica_comm` (dp/ep ranks).

A MoE layer's forward on one rank (`AllToAllExperts`):

1. the router sorts the rank's kept routings by expert (`MoE.forward`);
2. counts first: an all-to-all over `ep_comm` of how many rows go to each expert of each rank, so
   every rank knows how many rows each source sends each of its experts;
3. dispatch: `alltoallv` of the rows over `ep_comm` (mpdl's own all-to-all, `algorithm`);
4. the received rows, grouped by source, are regrouped by local expert and run through them;
5. combine: `alltoallv` back, reversed counts; the router un-permutes the rows to their tokens and
   weights them by their gates.

Dispatch and combine are autograd Functions (`AllToAll`): backward sends the gradient of each row
back the way the row came. Gradients: the experts' are summed over `replica_comm` only, the rest
(attention, router, embeddings, LayerNorms) over all data-parallel ranks, each by its own
`DistributedDataParallel` (or, with ZeRO-1, its own `ShardedOptimizer`). Data-parallel weighting
stays exact for slices of unequal size: the rest is weighted by the rank's share w of the global
batch as DDP does; an expert sees rows of several ranks, so each rank's row gradients enter the
experts (combine's backward) times w and leave them (dispatch's backward) divided by w, and the
experts' gradients are summed unweighted.

The gradient reductions run after backward on the main thread (no overlap): backward itself sends
(the all-to-alls), and two threads must not send over the same communicator at once.

`gathered()` (evaluation, checkpoints) all-gathers every rank's experts over `ep_comm`, so each
rank holds all E and runs them locally (`LocalExperts`); on leaving, the others' are dropped again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl.autograd.moe import GatherRows, LocalExperts, MoE, ScatterRows, run_experts
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce, alltoall, alltoallv
from mpdl.comm import Communicator
from mpdl.parallel import flat
from mpdl.parallel.ddp import DistributedDataParallel
from mpdl.parallel.dpshard import ShardedOptimizer
from mpdl.parallel.shards import placeholder as _placeholder
from mpdl.parallel.strategy import Batch, MakeOptimizer, Span, StepResult, Strategy


class AllToAll(Function):
    """Rows over `comm`: send_counts[j] rows to rank j, recv_counts[i] from rank i. Backward sends
    each row's gradient back to where the row came from; `grad_scale` multiplies the gradient of
    this rank's own rows: the output's before it is sent back (`scale_output`), else the
    input's once it has come back. Each exchange is timed into `spans` as (name, start, end,
    bytes sent)."""

    def forward(self, x, send_counts, recv_counts, comm, algorithm, grad_scale, scale_output,
                name, spans):
        self.send_counts, self.recv_counts = send_counts, recv_counts
        self.comm, self.algorithm, self.grad_scale = comm, algorithm, grad_scale
        self.scale_output, self.name, self.spans = scale_output, name, spans
        return self._exchange(x, send_counts, recv_counts, name)

    def backward(self, grad):
        scale = grad.dtype.type(self.grad_scale)
        if self.scale_output and self.grad_scale != 1.0:
            grad = grad * scale
        grad = self._exchange(grad, self.recv_counts, self.send_counts, f"{self.name} backward")
        if not self.scale_output and self.grad_scale != 1.0:
            grad *= scale
        return grad

    def _exchange(self, x, send, recv, name):
        start = time.perf_counter()
        rows, _ = alltoallv(get_array_module(x).ascontiguousarray(x), send, comm=self.comm,
                            algorithm=self.algorithm, recv_counts=recv)
        self.spans.append((name, start, time.perf_counter(), int(x.nbytes)))
        return rows


class AllToAllExperts:
    """The dispatcher of one MoE layer under expert parallelism: this rank runs `experts` (the
    layer's experts first … first + len(experts) − 1) on the rows every rank of `ep_comm` routes
    to them; `dp_comm` (all data-parallel ranks) sums the routing counts of the load-balancing
    loss."""

    def __init__(self, experts: list[Any], ep_comm: Communicator, dp_comm: Communicator,
                 algorithm: str = "auto") -> None:
        self.experts, self.ep_comm, self.dp_comm = experts, ep_comm, dp_comm
        self.algorithm = algorithm
        #: this rank's share of the global batch (see the module docstring)
        self.grad_weight = 1.0
        #: (name, start, end, bytes) of each all-to-all since the strategy last took them
        self.spans: list[tuple[str, float, float, int]] = []
        #: the rows the last dispatch sent each rank of ep_comm
        self.last_send_counts: list[int] = []

    def routed_counts(self, counts: np.ndarray) -> np.ndarray:
        return allreduce(np.asarray(counts, dtype=np.int64), op="sum", comm=self.dp_comm)

    def __call__(self, moe: MoE, rows: Tensor, counts: np.ndarray) -> Tensor:
        p, local = self.ep_comm.size, len(self.experts)
        per_expert = np.asarray(counts, dtype=np.int64).reshape(p, local)
        start = time.perf_counter()
        from_source = alltoall(per_expert, comm=self.ep_comm)  # [s, l]: rows s sends expert l
        self.spans.append(("dispatch counts", start, time.perf_counter(), int(per_expert.nbytes)))
        send, recv = per_expert.sum(axis=1), from_source.sum(axis=1)
        self.last_send_counts = send.tolist()
        w = self.grad_weight
        received = AllToAll.apply(rows, send_counts=send.tolist(), recv_counts=recv.tolist(),
                                  comm=self.ep_comm, algorithm=self.algorithm,
                                  grad_scale=1.0 / w if w else 0.0, scale_output=False,
                                  name="dispatch", spans=self.spans)
        xp = get_array_module(rows.data)
        by_expert = xp.asarray(_source_to_expert_order(from_source))
        outputs = run_experts(self.experts, GatherRows.apply(received, index=by_expert),
                              from_source.sum(axis=0))
        back = ScatterRows.apply(outputs, index=by_expert, rows=int(recv.sum()))
        return AllToAll.apply(back, send_counts=recv.tolist(), recv_counts=send.tolist(),
                              comm=self.ep_comm, algorithm=self.algorithm, grad_scale=w,
                              scale_output=True, name="combine", spans=self.spans)


def _source_to_expert_order(from_source: np.ndarray) -> np.ndarray:
    """For rows laid out by source then expert (from_source[s, l] rows each), the row positions
    in expert-then-source order."""
    sources, local = from_source.shape
    expert_of_row = np.repeat(np.tile(np.arange(local), sources), from_source.reshape(-1))
    return np.argsort(expert_of_row, kind="stable").astype(np.int64)


class _Parameters:
    """Some of a model's parameters, with the part of the Module interface DDP reads."""

    def __init__(self, named: list[tuple[str, Any]]) -> None:
        self.named = named

    def named_parameters(self) -> Iterator[tuple[str, Any]]:
        return iter(self.named)

    def parameters(self) -> list[Any]:
        return [p for _, p in self.named]

    def named_buffers(self) -> Iterator[tuple[str, Any]]:
        return iter(())

    def buffers(self) -> list[Any]:
        return []


class _TwoOptimizers:
    """ZeRO-1 under expert parallelism: the dense parameters' optimizer state sharded over the
    data-parallel ranks, the experts' over their replicas."""

    def __init__(self, dense: ShardedOptimizer, experts: ShardedOptimizer) -> None:
        self.parts = (dense, experts)

    @property
    def lr(self) -> float:
        return self.parts[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for part in self.parts:
            part.lr = value

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError("ep with zero 1: the optimizer state is not checkpointed")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError("ep with zero 1: the optimizer state is not checkpointed")


class ExpertParallelStrategy(Strategy):
    """Data parallelism over all ranks with the MoE layers' experts split over groups of `ep`
    (see the module docstring); `algorithm` names the gradient all-reduce (or with `zero` 1 the
    reduce-scatter and all-gather), `alltoall` the token all-to-all."""

    mode = "expert"

    def __init__(self, comm: Communicator, ep: int = 1, algorithm: str = "auto",
                 alltoall: str = "auto", bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 zero: int = 0) -> None:
        super().__init__(comm)
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ValueError(f"ep: expected a positive number of ranks, got {ep!r}")
        if comm.size % ep:
            raise ValueError(f"ep: {ep} must divide the {comm.size} data-parallel ranks")
        if zero not in (0, 1):
            raise ValueError(f"zero: expert parallelism combines with stage 1 only, got {zero!r}")
        self.ep, self.zero = ep, zero
        self.algorithm, self.alltoall = algorithm, alltoall
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        group, self.ep_rank = divmod(comm.rank, ep)
        self.ep_comm = comm.sub(range(group * ep, (group + 1) * ep))
        self.replica_comm = comm.sub(range(self.ep_rank, comm.size, ep))
        self.moes: list[MoE] = []
        self.dispatchers: list[AllToAllExperts] = []
        self.step_count = 0
        self._a2a_s = 0.0
        self._epoch: dict[str, Any] = {}

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.moes = [m for _, m in model.named_modules() if isinstance(m, MoE)]
        if not self.moes:
            raise ValueError("ep: the model has no mixture-of-experts layer (moe_experts)")
        experts = self.moes[0].num_experts
        if experts % self.ep:
            raise ValueError(f"ep: {self.ep} must divide the {experts} experts of each MoE layer")
        local = experts // self.ep
        mine = range(self.ep_rank * local, (self.ep_rank + 1) * local)
        self.local_experts = [[moe.experts[i] for i in mine] for moe in self.moes]
        self.expert_params = {id(p) for moe in self.moes for p in moe.experts.parameters()}
        local_ids = {id(p) for group in self.local_experts for ex in group
                     for p in ex.parameters()}
        named = list(model.named_parameters())
        dense = [(n, p) for n, p in named if id(p) not in self.expert_params]
        owned = [(n, p) for n, p in named if id(p) in local_ids]
        self.dispatchers = [AllToAllExperts(group, self.ep_comm, self.comm, self.alltoall)
                            for group in self.local_experts]
        self._use_dispatchers()
        self.owned_ids = local_ids
        trained = [p for n, p in named if id(p) in local_ids or id(p) not in self.expert_params]
        if self.zero:
            self.dense_ddp = self.expert_ddp = None
            self.dense_params = [p for _, p in dense]
            self.optimizer = _TwoOptimizers(
                ShardedOptimizer(self.dense_params, make_optimizer, self.comm, self.algorithm),
                ShardedOptimizer([p for _, p in owned], make_optimizer, self.replica_comm,
                                 self.algorithm))
        else:
            common = dict(algorithm=self.algorithm, bucket_mb=self.bucket_mb,
                          first_bucket_mb=self.first_bucket_mb, overlap=False)
            self.dense_ddp = DistributedDataParallel(_Parameters(dense), comm=self.comm, **common)
            self.expert_ddp = DistributedDataParallel(_Parameters(owned), comm=self.replica_comm,
                                                      **common)
            self.expert_ddp.set_local_batch(1, 1)  # weighted inside the all-to-all (docstring)
            self.optimizer = make_optimizer(trained)
        self._release_others()

    def _use_dispatchers(self) -> None:
        for moe, dispatcher in zip(self.moes, self.dispatchers, strict=True):
            moe.dispatcher = dispatcher

    def _others(self) -> list[Any]:
        return [p for moe in self.moes for p in moe.experts.parameters()
                if id(p) not in self.owned_ids]

    def _release_others(self) -> None:
        """Drop the values of the experts other ranks hold (zero-byte placeholders)."""
        for p in self._others():
            p.data = _placeholder(p)

    # -- one step --------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        self.optimizer.lr = batch.lr
        share = len(batch.y) / batch.global_size
        for d in self.dispatchers:
            d.grad_weight = share
            d.spans = []
        result = StepResult()
        start = time.perf_counter()
        if self.zero:
            backward_end = self.forward_backward(batch, result)
            for p in self.dense_params:
                if p.grad is not None:
                    p.grad *= p.grad.dtype.type(share)
            waited = backward_end
        else:
            self.dense_ddp.set_local_batch(len(batch.y), batch.global_size)
            backward_end = self.forward_backward(batch, result)
            self.dense_ddp.finish()
            self.expert_ddp.finish()
            waited = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = time.perf_counter()
        exchanges = [s for d in self.dispatchers for s in d.spans]
        a2a = sum(e - s for _, s, e, _ in exchanges)
        reduce_s = 0.0 if self.zero else (self.dense_ddp.last_exposed_s
                                          + self.expert_ddp.last_exposed_s)
        result.comm_s = result.exposed_s = a2a + reduce_s
        result.compute_s = (end - start) - result.exposed_s
        self._a2a_s += a2a
        self.step_count += 1
        result.spans += [Span(name, s, e, cat="communication", args={"bytes": nbytes})
                         for name, s, e, nbytes in exchanges]
        if not self.zero:
            result.spans.append(Span("gradient all-reduce (dense, experts)", backward_end, waited,
                                     cat="communication"))
        result.spans.append(Span("reduce-scatter, optimizer step, all-gather" if self.zero
                                 else "optimizer step", waited, end))
        return result

    def forward_backward(self, batch: Batch, result: StepResult) -> float:
        if len(batch.y):
            return super().forward_backward(batch, result)
        # a rank without samples still takes part in every all-to-all, forward and backward
        logits = self.model(Tensor(batch.x))
        (logits.sum() * 0.0).backward()
        return time.perf_counter()

    # -- the whole model and the figures ---------------------------------------------------------
    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Iterator[None]:
        """Every rank holds all the experts and runs them locally within the block; the epoch's
        routing figures are summed over the ranks for `report`."""
        self._sum_figures()
        if self.ep > 1:
            mine = [p for group in self.local_experts for ex in group for p in ex.parameters()]
            whole = allgather(flat.pack([p.data for p in mine]), comm=self.ep_comm)
            size = sum(p.size for p in mine)
            per_rank = len(self.local_experts[0])
            for s in range(self.ep):
                theirs = [p for moe in self.moes
                          for ex in moe.experts[s * per_rank:(s + 1) * per_rank]
                          for p in ex.parameters()]
                for p, piece in zip(theirs, flat.unpack(whole[s * size:(s + 1) * size], theirs),
                                    strict=True):
                    if id(p) not in self.owned_ids:
                        p.data = piece.copy()
        for moe in self.moes:
            moe.dispatcher = LocalExperts()
        try:
            yield
        finally:
            self._use_dispatchers()
            if self.ep > 1:
                self._release_others()

    def _sum_figures(self) -> None:
        e = self.moes[0].num_experts
        local = np.concatenate([np.concatenate([m.stats.tokens_per_expert,
                                                [m.stats.dropped, m.stats.routings,
                                                 m.stats.aux_loss, m.stats.calls]])
                                for m in self.moes] + [[self._a2a_s, self.step_count]])
        total = allreduce(local.astype(np.float64), op="sum", comm=self.comm)
        layers = total[:-2].reshape(len(self.moes), e + 4)
        steps = max(total[-1], 1.0)
        self._epoch = {
            "tokens_per_expert": [[int(v) for v in row[:e]] for row in layers],
            "dropped_fraction": float(layers[:, e].sum() / max(layers[:, e + 1].sum(), 1.0)),
            "aux_loss": float(sum(row[e + 2] / max(row[e + 3], 1.0) for row in layers)),
            "alltoall_s": float(total[-2] / steps)}

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        moe = self.moes[0]
        cf = f"capacity factor {moe.capacity_factor:g}" if moe.capacity_factor else "dropless"
        return (f"{len(self.moes)} MoE layer(s) of {moe.num_experts} experts, top-{moe.top_k}, "
                f"{cf}; expert parallel over {self.ep} rank(s) ({moe.num_experts // self.ep} "
                f"experts each), all-to-all {self.alltoall}; gradients "
                f"{'ZeRO-1 ' if self.zero else ''}{self.algorithm} (dense over "
                f"{self.comm.size} ranks, experts over {self.replica_comm.size})")

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": self.algorithm, "mode": self.mode, "ep": self.ep,
                                  "moe_experts": self.moes[0].num_experts,
                                  "moe_top_k": self.moes[0].top_k, "zero_stage": self.zero}
        if not final:
            fields.update(self._epoch)
            for m in self.moes:
                m.reset_stats()
            self._a2a_s, self.step_count = 0.0, 0
        return fields

"""Expert parallelism: the data-parallel ranks split into groups of `ep` that share the E experts
of every MoE layer (`mpdl.models.moe`), each rank holding E/ep of them.

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

Gradient accumulation (`grad_accum` N): each rank cuts its slice into N microbatches
(`strategy.microbatches`) and runs them in turn, the first N − 1 without reducing (`no_sync`);
every rank runs N forwards and backwards, empty microbatches too, since each sends all-to-alls.
The load-balancing loss is that of each microbatch (fᵢ counts the routings of microbatch j of
every data-parallel rank), joining backward with the microbatch's share, as a pipeline's
microbatches and Megatron-Core's do: fᵢ of the whole step is not known before the first
microbatch's backward. The routing itself is per token, so dropless the cross-entropy gradient
and the tokens per expert are those of the large batch.

`gathered()` (evaluation, checkpoints) all-gathers every rank's experts over `ep_comm`, so each
rank holds all E and runs them locally (`LocalExperts`); on leaving, the others' are dropped again.
With `optimizer_state` it also assembles the optimizer state of the whole model in one rank's
layout (each expert's from the rank of the group that holds it), which a checkpoint stores and
any layout loads.

`ExpertGroups` is the layout itself (the groups, the dispatchers, the all-gather);
`mpdl.parallel.expert_pipeline` uses it on each stage of a pipeline and tensor-parallel grid.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl.autograd import optim
from mpdl.autograd.amp import compute_dtype
from mpdl.autograd.tensor import Function, Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allgather, allreduce, alltoall, alltoallv
from mpdl.comm import Communicator
from mpdl.models.moe import (
    GatherRows,
    LocalExperts,
    MoE,
    ScatterRows,
    aux_loss_scale,
    run_experts,
)
from mpdl.parallel import flat
from mpdl.parallel.ddp import DistributedDataParallel
from mpdl.parallel.dpshard import ShardedOptimizer
from mpdl.parallel.shards import placeholder as _placeholder
from mpdl.parallel.strategy import (
    Batch,
    MakeOptimizer,
    Span,
    StepResult,
    Strategy,
    counted_once,
    grad_norm,
    microbatches,
)


class AllToAll(Function):
    """Rows over `comm`: send_counts[j] rows to rank j, recv_counts[i] from rank i. Backward sends
    each row's gradient back to where the row came from; `grad_scale` multiplies the gradient of
    this rank's own rows: the output's before it is sent back (`scale_output`), else the
    input's once it has come back. With a `wire_dtype` (the experts' 16-bit compute dtype) the
    rows and their gradients travel in it and arrive in x's dtype. Each exchange is timed into
    `spans` as (name, start, end, bytes sent)."""

    def forward(self, x, send_counts, recv_counts, comm, algorithm, grad_scale, scale_output,
                name, spans, wire_dtype=None):
        self.send_counts, self.recv_counts = send_counts, recv_counts
        self.comm, self.algorithm, self.grad_scale = comm, algorithm, grad_scale
        self.scale_output, self.name, self.spans = scale_output, name, spans
        self.wire_dtype = wire_dtype
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
        xp = get_array_module(x)
        wire = x if self.wire_dtype is None or x.dtype == self.wire_dtype else _narrow(
            x, self.wire_dtype)
        rows, _ = alltoallv(xp.ascontiguousarray(wire), send, comm=self.comm,
                            algorithm=self.algorithm, recv_counts=recv)
        self.spans.append((name, start, time.perf_counter(), int(wire.nbytes)))
        return rows if rows.dtype == x.dtype else rows.astype(x.dtype)


def _narrow(x: Any, dtype: Any) -> Any:
    """x rounded to a 16-bit dtype (float16 overflow is inf, for the loss scaler to see)."""
    with np.errstate(over="ignore"):
        return x.astype(dtype)


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
        w, wire = self.grad_weight, self.wire_dtype()
        received = AllToAll.apply(rows, send_counts=send.tolist(), recv_counts=recv.tolist(),
                                  comm=self.ep_comm, algorithm=self.algorithm,
                                  grad_scale=1.0 / w if w else 0.0, scale_output=False,
                                  name="dispatch", spans=self.spans, wire_dtype=wire)
        back = self.run(received, from_source)
        return AllToAll.apply(back, send_counts=recv.tolist(), recv_counts=send.tolist(),
                              comm=self.ep_comm, algorithm=self.algorithm, grad_scale=w,
                              scale_output=True, name="combine", spans=self.spans,
                              wire_dtype=wire)

    def run(self, received: Tensor, from_source: np.ndarray) -> Tensor:
        """The expert outputs of the received rows (from_source[s, l] rows of source s for
        local expert l, by source then expert), in the same order."""
        xp = get_array_module(received.data)
        by_expert = xp.asarray(_source_to_expert_order(from_source))
        outputs = run_experts(self.experts, GatherRows.apply(received, index=by_expert),
                              from_source.sum(axis=0))
        return ScatterRows.apply(outputs, index=by_expert, rows=int(from_source.sum()))

    def wire_dtype(self) -> Any:
        """The 16-bit dtype the experts compute in (their parameters' under mixed precision),
        in which the rows travel; None for float32 and float64 experts."""
        weights = [p for ex in self.experts for p in ex.parameters()]
        return compute_dtype(weights[0].data) if weights else None


def _source_to_expert_order(from_source: np.ndarray) -> np.ndarray:
    """For rows laid out by source then expert (from_source[s, l] rows each), the row positions
    in expert-then-source order."""
    sources, local = from_source.shape
    expert_of_row = np.repeat(np.tile(np.arange(local), sources), from_source.reshape(-1))
    return np.argsort(expert_of_row, kind="stable").astype(np.int64)


class ExpertGroups:
    """The experts of `moes` spread over groups of `ep` ranks of `dp_comm` (ranks d = g·ep + j;
    see the module docstring): the experts this rank holds, the dispatchers that bring it the
    rows of its group, and the all-gather that makes every layer whole again. A list of no
    layers (a pipeline stage without MoE blocks) holds nothing. `dispatcher` is the class of
    the layers' dispatchers (`AllToAllExperts` by default)."""

    def __init__(self, moes: list[MoE], dp_comm: Communicator, ep: int,
                 alltoall: str = "auto", dispatcher: type[AllToAllExperts] | None = None
                 ) -> None:
        check_ep(ep, dp_comm.size)
        for moe in moes:
            if moe.num_experts % ep:
                raise ValueError(f"ep: {ep} must divide the {moe.num_experts} experts of each "
                                 f"MoE layer")
        self.moes, self.ep = moes, ep
        group, self.ep_rank = divmod(dp_comm.rank, ep)
        self.ep_comm = dp_comm.sub(range(group * ep, (group + 1) * ep))
        self.replica_comm = dp_comm.sub(range(self.ep_rank, dp_comm.size, ep))
        self.local_experts = [self._experts_of(moe, self.ep_rank) for moe in moes]
        self.expert_ids = {id(p) for moe in moes for p in moe.experts.parameters()}
        self.owned_ids = {id(p) for group in self.local_experts for ex in group
                          for p in ex.parameters()}
        make = dispatcher or AllToAllExperts
        self.dispatchers = [make(group, self.ep_comm, dp_comm, alltoall)
                            for group in self.local_experts]

    def _experts_of(self, moe: MoE, j: int) -> list[Any]:
        """The experts rank j of a group holds of `moe`."""
        local = moe.num_experts // self.ep
        return [moe.experts[i] for i in range(j * local, (j + 1) * local)]

    def split(self, params: list[Any]) -> tuple[list[Any], list[Any]]:
        """`params` without the experts of other ranks: (the rest, this rank's experts)."""
        return ([p for p in params if id(p) not in self.expert_ids],
                [p for p in params if id(p) in self.owned_ids])

    def install(self) -> None:
        """The layers send their rows to the experts' ranks."""
        for moe, dispatcher in zip(self.moes, self.dispatchers, strict=True):
            moe.dispatcher = dispatcher

    @contextmanager
    def local(self) -> Iterator[None]:
        """Within the block every layer runs its experts here (all of them must be held)."""
        for moe in self.moes:
            moe.dispatcher = LocalExperts()
        try:
            yield
        finally:
            self.install()

    def set_grad_weight(self, weight: float) -> None:
        """This rank's share of the global batch, by which the experts weight its rows'
        gradients (1: the loss is already scaled by it)."""
        for d in self.dispatchers:
            d.grad_weight = weight

    def take_spans(self) -> list[tuple[str, float, float, int]]:
        """The all-to-alls since the last call: (name, start, end, bytes sent)."""
        spans = [s for d in self.dispatchers for s in d.spans]
        for d in self.dispatchers:
            d.spans = []
        return spans

    def gather(self) -> None:
        """Every rank of the group gets the other ranks' experts (an all-gather over
        `ep_comm`); collective."""
        if self.ep == 1 or not self.moes:
            return
        mine = [p for group in self.local_experts for ex in group for p in ex.parameters()]
        whole = allgather(flat.pack([p.data for p in mine]), comm=self.ep_comm)
        size = sum(p.size for p in mine)
        for s in range(self.ep):
            theirs = [p for moe in self.moes for ex in self._experts_of(moe, s)
                      for p in ex.parameters()]
            for p, piece in zip(theirs, flat.unpack(whole[s * size:(s + 1) * size], theirs),
                                strict=True):
                if id(p) not in self.owned_ids:
                    p.data = piece.copy()

    def release(self) -> None:
        """Drop the values of the experts other ranks hold (zero-byte placeholders)."""
        for moe in self.moes:
            for p in moe.experts.parameters():
                if id(p) not in self.owned_ids:
                    p.data = _placeholder(p)


def check_ep(ep: Any, ranks: int) -> None:
    """Raise ValueError unless `ep` is a positive int dividing the `ranks` data-parallel ranks."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep: expected a positive number of ranks, got {ep!r}")
    if ranks % ep:
        raise ValueError(f"ep: {ep} must divide the {ranks} data-parallel ranks")


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


class ShardedOptimizers:
    """ZeRO-1 under expert parallelism: an optimizer over `params` made of `ShardedOptimizer`s,
    each over some of them and sharded over the ranks that sum their gradients (the dense
    parameters' over the data-parallel ranks, the experts' over their replicas). Its state is
    that of one optimizer over `params`."""

    def __init__(self, params: list[Any], *parts: ShardedOptimizer) -> None:
        where = {id(p): k for k, p in enumerate(params)}
        self.parts, self.count = parts, len(params)
        #: for each part, the position in `params` of each of its parameters
        self.positions = [[where[id(p)] for p in part.params] for part in parts]
        # the parts' gradients are clipped together, by the norm of all of them
        self.max_grad_norm = getattr(parts[0].optimizer, "max_grad_norm", None)
        for part in parts:
            part.optimizer.max_grad_norm = None
        self.grad_norm: float | None = None
        self._total: Any = None
        self._param_of = {id(piece.tensor): piece.param for part in parts
                          for piece in part.entries}

    def global_norm(self, total: Any) -> None:
        """`Optimizer.global_norm` for `params`: `total` sees the parameter of each piece."""
        self._total = total

    def _pieces_total(self, tensors: list[Any], sums: list[float]) -> float:
        return self._total([self._param_of[id(t)] for t in tensors], sums)

    @property
    def lr(self) -> float:
        return self.parts[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for part in self.parts:
            part.lr = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.parts[0].param_groups

    def step(self) -> None:
        """Every part's reduce-scatter, the clipping of all their pieces by one norm, then
        every part's update."""
        for part in self.parts:
            part.reduce()
        if self.max_grad_norm is not None:
            pieces = [piece.tensor for part in self.parts for piece in part.entries
                      if piece.tensor.grad is not None]
            self.grad_norm = optim.clip_grad_norm(pieces, self.max_grad_norm,
                                                  self._total and self._pieces_total)
        for part in self.parts:
            part.update()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_nbytes(self) -> int:
        """Bytes of the optimizer state this rank holds."""
        return sum(part.state_nbytes() for part in self.parts)

    def pieces(self) -> list[tuple[int, int, int, dict[str, Any]]]:
        """This rank's part of the state, as `ShardedOptimizer.pieces`, by position in `params`."""
        return [(positions[k], a, b, state) for part, positions in
                zip(self.parts, self.positions, strict=True) for k, a, b, state in part.pieces()]

    def state_dict(self) -> dict[str, Any]:
        """The state of a plain optimizer over `params` (whole tensors); collective over each
        part's ranks."""
        state: dict[int, Any] = {}
        for part, positions in zip(self.parts, self.positions, strict=True):
            for k, entries in part.state_dict()["state"].items():
                state[positions[int(k)]] = entries
        return {"state": state, "param_groups": [{**_hyper(self.param_groups),
                                                  "params": list(range(self.count))}]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep this rank's blocks of a plain optimizer's state over `params`."""
        saved = {int(k): v for k, v in state["state"].items()}
        for part, positions in zip(self.parts, self.positions, strict=True):
            part.load_state_dict({"state": {k: saved[i] for k, i in enumerate(positions)
                                            if i in saved},
                                  "param_groups": state["param_groups"]})


def _hyper(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The hyper-parameters of the first parameter group."""
    return {k: v for k, v in param_groups[0].items() if k != "params"}


def epoch_figures(layers: list[MoE], counted: list[MoE], alltoall_s: float, steps: int,
                  comm: Communicator) -> dict[str, Any]:
    """The JSON figures of the MoE `layers` (all of the model's, in order) since their stats were
    reset, summed over `comm`: each rank adds the stats of the layers in `counted` and its
    all-to-all seconds over `steps` steps (collective)."""
    e = layers[0].num_experts
    mine = {id(m) for m in counted}
    rows = np.zeros((len(layers), e + 4))
    for row, m in zip(rows, layers, strict=True):
        if id(m) in mine:
            s = m.stats
            row[:] = [*s.tokens_per_expert, s.dropped, s.routings, s.aux_loss, s.calls]
    total = allreduce(np.concatenate([rows.reshape(-1), [alltoall_s, steps]]), op="sum",
                      comm=comm)
    rows = total[:-2].reshape(len(layers), e + 4)
    return {"tokens_per_expert": [[int(v) for v in row[:e]] for row in rows],
            "dropped_fraction": float(rows[:, e].sum() / max(rows[:, e + 1].sum(), 1.0)),
            "aux_loss": float(sum(row[e + 2] / max(row[e + 3], 1.0) for row in rows)),
            "alltoall_s": float(total[-2] / max(total[-1], 1.0))}


class ExpertParallelStrategy(Strategy):
    """Data parallelism over all ranks with the MoE layers' experts split over groups of `ep`
    (see the module docstring); `algorithm` names the gradient all-reduce (or with `zero` 1 the
    reduce-scatter and all-gather), `alltoall` the token all-to-all; `grad_accum` microbatches
    make a step."""

    mode = "expert"

    def __init__(self, comm: Communicator, ep: int = 1, algorithm: str = "auto",
                 alltoall: str = "auto", bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 zero: int = 0, grad_accum: int = 1) -> None:
        super().__init__(comm)
        check_ep(ep, comm.size)
        if zero not in (0, 1):
            raise ValueError(f"zero: expert parallelism combines with stage 1 only, got {zero!r}")
        if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
            raise ValueError(f"grad_accum: expected a positive number of microbatches, got "
                             f"{grad_accum!r}")
        self.ep, self.zero, self.grad_accum = ep, zero, grad_accum
        self.algorithm, self.alltoall = algorithm, alltoall
        self.bucket_mb, self.first_bucket_mb = bucket_mb, first_bucket_mb
        self.moes: list[MoE] = []
        self.step_count = 0
        self._a2a_s = 0.0
        self._epoch: dict[str, Any] = {}
        self._whole_state: dict[str, Any] | None = None

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.moes = [m for _, m in model.named_modules() if isinstance(m, MoE)]
        if not self.moes:
            raise ValueError("ep: the model has no mixture-of-experts layer (moe_experts)")
        self.groups = ExpertGroups(self.moes, self.comm, self.ep, self.alltoall)
        self.ep_comm, self.replica_comm = self.groups.ep_comm, self.groups.replica_comm
        self.dispatchers = self.groups.dispatchers
        named = list(model.named_parameters())
        dense, owned = self.groups.split([p for _, p in named])
        names = {id(p): n for n, p in named}
        self.groups.install()
        if self.zero:
            self.dense_ddp = self.expert_ddp = None
            self.dense_params = dense
            self.trained = dense + owned
            self.optimizer = ShardedOptimizers(
                self.trained, ShardedOptimizer(dense, make_optimizer, self.comm, self.algorithm),
                ShardedOptimizer(owned, make_optimizer, self.replica_comm, self.algorithm))
            # the dense pieces are disjoint over the ranks, the experts' over their replicas
            self.optimizer.global_norm(counted_once(self.comm, lambda p: True))
        else:
            common = dict(algorithm=self.algorithm, bucket_mb=self.bucket_mb,
                          first_bucket_mb=self.first_bucket_mb, overlap=False)
            self.dense_ddp = DistributedDataParallel(
                _Parameters([(names[id(p)], p) for p in dense]), comm=self.comm, **common)
            self.expert_ddp = DistributedDataParallel(
                _Parameters([(names[id(p)], p) for p in owned]), comm=self.replica_comm, **common)
            self.expert_ddp.set_local_batch(1, 1)  # weighted inside the all-to-all (docstring)
            self.trained = [p for _, p in named if id(p) in self.groups.owned_ids
                            or id(p) not in self.groups.expert_ids]
            self.optimizer = make_optimizer(self.trained)
            owned = self.groups.owned_ids  # an expert counts on its first replica, the rest on rank 0
            self.optimizer.global_norm(counted_once(self.comm, lambda p: (
                self.replica_comm.rank if id(p) in owned else self.comm.rank) == 0))
            if hasattr(self.optimizer, "agree"):  # mixed precision: skip on every rank alike
                self.optimizer.agree = self._all_finite
        self.groups.release()

    def _all_finite(self, finite: bool) -> bool:
        """Whether this rank's gradients and every other rank's are finite (one all-reduce of a
        found-inf flag: the experts' gradients differ from rank to rank)."""
        flags = allreduce(np.array([0 if finite else 1], np.int32), op="max", comm=self.comm)
        return not int(flags[0])

    # -- one step --------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        self.optimizer.lr = batch.lr
        share = len(batch.y) / batch.global_size
        self.groups.set_grad_weight(share)
        self.groups.take_spans()
        result = StepResult()
        start = time.perf_counter()
        parts = microbatches(batch, self.grad_accum)
        if self.zero:
            for part, weight in parts:
                backward_end = self.forward_backward(part, result, weight)
            for p in self.dense_params:
                if p.grad is not None:
                    p.grad *= p.grad.dtype.type(share)
            waited = backward_end
        else:
            self.dense_ddp.set_local_batch(len(batch.y), batch.global_size)
            with self.dense_ddp.no_sync(), self.expert_ddp.no_sync():
                for part, weight in parts[:-1]:
                    self.forward_backward(part, result, weight)
            backward_end = self.forward_backward(parts[-1][0], result, parts[-1][1])
            self.dense_ddp.finish()
            self.expert_ddp.finish()
            waited = time.perf_counter()
        self.optimizer.step()
        result.grad_norm = grad_norm(self.optimizer)
        self.optimizer.zero_grad()
        end = time.perf_counter()
        exchanges = self.groups.take_spans()
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

    def forward_backward(self, batch: Batch, result: StepResult, weight: float = 1.0) -> float:
        with aux_loss_scale(weight * getattr(self.optimizer, "loss_scale", 1.0)):
            if len(batch.y):
                return super().forward_backward(batch, result, weight)
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
        self.groups.gather()
        if optimizer_state:
            self._whole_state = self._whole_optimizer_state()
        try:
            with self.groups.local():
                yield
        finally:
            self._whole_state = None
            self.groups.release()

    def _whole_optimizer_state(self) -> dict[str, Any]:
        """The optimizer state of the whole model in a one-rank optimizer's layout: the dense
        parameters' from this rank, the experts' from the ranks of the group that hold them
        (collective; small models: the experts' states travel as Python objects)."""
        local = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        state, experts = {}, {}
        for k, entries in local["state"].items():
            p = self.trained[int(k)]
            (experts if id(p) in self.groups.expert_ids else state)[index[id(p)]] = entries
        for part in self.ep_comm.allgather_object(experts):
            state.update(part)
        whole = {"state": state, "param_groups": [{**_hyper(local["param_groups"]),
                                                   "params": list(range(len(index)))}]}
        if "loss_scale" in local:
            whole["loss_scale"] = local["loss_scale"]
        return whole

    def state_dict(self) -> dict[str, Any]:
        if self._whole_state is None:
            raise RuntimeError("expert parallelism: state_dict() is given inside gathered("
                               "optimizer_state=True)")
        return self._whole_state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's part of a whole-model optimizer state (any layout wrote it)."""
        whole = {int(k): v for k, v in state["state"].items()}
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        self.optimizer.load_state_dict({
            "state": {k: whole[index[id(p)]] for k, p in enumerate(self.trained)
                      if index[id(p)] in whole},
            "param_groups": [{**_hyper(state["param_groups"]),
                              "params": list(range(len(self.trained)))}],
            **({"loss_scale": state["loss_scale"]} if "loss_scale" in state else {})})

    def _sum_figures(self) -> None:
        self._epoch = epoch_figures(self.moes, self.moes, self._a2a_s, self.step_count, self.comm)

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

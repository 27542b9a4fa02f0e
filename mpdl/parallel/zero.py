"""ZeRO: sharded data parallelism (Rajbhandari et al. 2020; PyTorch FSDP), stages 1, 2 and 3.

The parameters are cut into *units*, each a flat buffer of one dtype split over the p ranks like
`reduce_scatter` splits an array (block_bounds: the first count % p blocks one element longer, so
no count needs to divide by p). Rank r owns block r of every unit: its *shard*. The optimizer runs
on the shard only: it gets one flat *piece* tensor per (parameter, unit block) overlap, so each
rank holds 1/p of the optimizer state.

- **Stage 1** (optimizer state sharded). Units are DDP's buckets (reverse parameter order, a small
  first one). Backward's grad-ready hooks copy each gradient, times local/global batch, into its
  unit's full-size gradient buffer (kept between steps) and drop `p.grad`; a full unit is
  reduce-scattered in place on the communication thread, in unit order. The optimizer steps on
  the shard; each unit's parameters are then all-gathered in place.
- **Stage 2** (gradients sharded too): as stage 1, but a unit's full-size gradient buffer exists
  only from its first gradient until its reduce-scatter is done; then only the shard is kept.
- **Stage 3** (parameters sharded, FSDP's FULL_SHARD). Units are the modules inside containers
  (the blocks of a ModuleList, the layers of a Sequential); a unit's parameters are all-gathered
  just before its forward and again before its backward, and freed after each
  (`mpdl.parallel.zero_params.ShardedParameters`); once its gradients are all in, they are
  reduce-scattered, the blocks' as backward finishes them and the root unit's last.

The stage is chosen once, at setup: how the parameters are held (`zero_params`: whole on every
rank for stages 1-2, sharded for stage 3) and whether the full-size gradient buffers are kept
(stage 1); the step below is the same for every stage. The shard layout (`Unit`, `Piece`) and the
gather of the whole optimizer state live in `mpdl.parallel.shards`; the step's timings and
counters in `mpdl.parallel.zero_meter`.

Collectives on buffers kept between steps (stage 1's gradient buffers, stages 1-2's flat
parameters) run through persistent plans made once per unit (`mpdl.tuning.plan`; with
algorithm "auto" they verify its choice on their first runs, `mpdl.tuning.verify`); buffers
made afresh each step go through the ordinary calls.

The accounting (`model_state_bytes`) counts the model state the strategy holds: parameters,
gradients and optimizer state; `mpdl.memory`'s ledger counts every buffer.

Whole-tensor norms (LARS, LAMB): a piece knows its whole tensor's ndim, and the optimizer's sums
of squares of all pieces are completed with one small all-reduce per step (`Optimizer.shard`).

Checkpoints: `checkpoint_shard()` gives this rank's blocks of every unit (parameters and
optimizer state) and the manifest of the layout; `mpdl.training.checkpoint` writes one file per
rank and reassembles whole tensors on load, so a run resumes on any number of ranks and any stage.
`gathered(optimizer_state=True)` and `state_dict()` give the whole optimizer state instead.

`NaiveZero` beside it is the textbook version of stage 1 in a few lines (one all-reduce-free
reduce-scatter of all gradients after backward, optimizer on the shard, one all-gather), kept as
the reference the tests compare the fast one with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.backend import get_array_module
from mpdl.collectives import algorithms, allreduce, reduce_scatter
from mpdl.comm import Communicator
from mpdl.comm.handles import Handle, comm_thread_for
from mpdl.parallel import buckets, flat
from mpdl.parallel.buckets import MB
from mpdl.parallel.flat import broadcast_model
from mpdl.parallel.owners import MatrixOwners
from mpdl.parallel.shards import (
    Piece,
    Unit,
    ZeroCheckpoint,
    make_pieces,
    optimizer_state_nbytes,
    state_dtype,
)
from mpdl.parallel.strategy import (
    Batch,
    MakeOptimizer,
    StepResult,
    Strategy,
    counted_once,
    grad_norm,
)
from mpdl.parallel.zero_meter import ZeroMeter
from mpdl.parallel.zero_params import (
    UNITS_PER_MODEL,
    ReplicatedParameters,
    ShardedParameters,
    UnitParameters,
    module_units,
)
from mpdl.tuning import allreduce_init, reduce_scatter_init

STAGES = (1, 2, 3)
#: stages 2 and 3: reduce-scatters in flight before backward waits for the oldest
MAX_IN_FLIGHT = 2
#: by default a unit holds at most 1/UNITS_PER_MODEL of the model (stages 1-2: and at most
#: DEFAULT_BUCKET_MB MiB, DDP's bucket; stage 3: a module larger than that is split into its
#: children), so that the buffers in flight (stage 3: two units' gathered parameters and up to
#: MAX_IN_FLIGHT + 1 units' gradient buffers) stay a small part of the model at any size
DEFAULT_BUCKET_MB = 25.0
#: the collective algorithms ZeRO can run: auto (which chooses among all of them, per size) and
#: those reduce_scatter and allgather both have; the hybrid replicas' all-reduce runs the same one
#: where all-reduce has it, auto's otherwise
ALGORITHMS = ("auto", *(a for a in algorithms("reduce_scatter") if a in algorithms("allgather")))


class ZeroStrategy(ZeroCheckpoint, Strategy):
    """ZeRO stage 1, 2 or 3 over `comm` (see the module docstring); `algorithm` names the
    reduce-scatter and all-gather (auto, ring, tree or mpi); `bucket_mb` and `first_bucket_mb`
    size stages 1-2's units (`bucket_mb` None: at most 1/UNITS_PER_MODEL of the model's bytes
    and at most DEFAULT_BUCKET_MB); `units` names stage 3's (submodules, in forward order;
    default: the members of every ModuleList and Sequential, split while larger than
    1/UNITS_PER_MODEL of the model); `hybrid` shards within nodes only."""

    mode = "zero"
    sharded_checkpoint = True

    def __init__(self, comm: Communicator, stage: int, algorithm: str = "auto",
                 bucket_mb: float | None = None, first_bucket_mb: float = 1.0,
                 overlap: bool = True, prefetch: bool = True, hybrid: bool = False,
                 units: Sequence[str] | None = None) -> None:
        if stage not in STAGES:
            raise ValueError(f"stage: expected one of 1, 2, 3, got {stage!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: expected one of {', '.join(ALGORITHMS)} (a reduce-"
                             f"scatter and all-gather), got {algorithm!r}")
        super().__init__(comm)
        if hybrid:
            sizes = [len(g) for g in comm.node_groups()]
            if len(set(sizes)) > 1:
                raise ValueError(f"hybrid sharding needs the same number of ranks on every node, "
                                 f"got {sizes}")
        self.stage, self.algorithm = stage, algorithm
        self.replica_algorithm = algorithm if algorithm in algorithms("allreduce") else "auto"
        self.bucket_mb = None if bucket_mb is None else float(bucket_mb)
        self.first_bucket_mb = float(first_bucket_mb)
        self.overlap, self.prefetch, self.hybrid = bool(overlap), bool(prefetch), bool(hybrid)
        self.unit_names = None if units is None else list(units)
        self.shard_comm: Communicator = comm
        self.replica_comm: Communicator | None = None
        self.units: list[Unit] = []
        #: how the units' parameters are held (set up with them): whole on every rank (stages
        #: 1-2) or sharded and gathered around each unit's use (stage 3)
        self.parameters: UnitParameters | None = None
        #: stage 1 keeps each unit's full-size gradient buffer between steps; stages 2-3 keep
        #: only its shard (the full buffer lives from a unit's first gradient to its
        #: reduce-scatter)
        self.keeps_gradient_buffers = stage == 1
        self.weight = 1.0 / comm.size
        self._next = 0
        #: the step's timings and counters: bytes held, waits, collectives, bytes sent
        self.meter = ZeroMeter(comm)
        self.model_state_bytes = 0
        self.sent_bytes_per_step = 0.0

    @property
    def step_peak_bytes(self) -> int:
        """The most model-state bytes held within a step so far."""
        return self.meter.step_peak_bytes

    @property
    def last_gather_s(self) -> float:
        """Seconds of the last step's all-gathers (communication thread)."""
        return self.meter.gather_s

    @property
    def last_gather_wait_s(self) -> float:
        """Seconds the last step's main thread waited for stage 3's gathers: 1 - wait / gather
        is the share prefetch hid."""
        return self.meter.gather_wait_s

    # -- setup -------------------------------------------------------------------------------------
    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self._communicators()
        broadcast_model(model, self.comm)
        self.units = self._make_units(model)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        held = dict(units=self.units, comm=self.shard_comm, algorithm=self.algorithm,
                    submit=self._submit, meter=self.meter)
        self.parameters = (ShardedParameters(**held, prefetch=self.prefetch) if self.stage == 3
                           else ReplicatedParameters(**held))
        for u in self.units:
            self.parameters.place(u)
            self._place_gradients(u)
        self.pieces: list[Piece]
        self.pieces, ndims = make_pieces(self.units)
        self.optimizer = make_optimizer([piece.tensor for piece in self.pieces])
        self.optimizer.shard(ndims, self._sum_squares)
        # the pieces of a shard group are disjoint (a hybrid run's replicas hold the same ones)
        self.optimizer.global_norm(counted_once(self.shard_comm, lambda piece: True))
        if hasattr(self.optimizer, "split"):  # whole matrices (Muon): on their owners
            self.owners = MatrixOwners(self.units, self.pieces, self.shard_comm)
            self.optimizer.split(self.owners, self.owners.parents)
        if hasattr(self.optimizer, "agree"):  # mixed precision: skip a step on every rank alike
            self.optimizer.agree = self._all_finite
        self._hooks = [p.register_grad_ready_hook(self._on_grad) for u in self.units
                       for p in u.params]
        self._order = self.parameters.reduce_order()
        self._plan_units()

    def _make_units(self, model: Any) -> list[Unit]:
        """Stage 3: the modules of `module_units` (each cut by dtype); stages 1-2: DDP's buckets."""
        if self.stage == 3:
            groups = [(m, g) for m, ps in module_units(model, self.unit_names)
                      for g in flat.by_kind(ps)]
        else:
            groups = [(None, ps) for ps in self._buckets(model)]
        rank, size = self.shard_comm.rank, self.shard_comm.size
        return [Unit(i, ps, rank, size, m) for i, (m, ps) in enumerate(groups)]

    def _place_gradients(self, u: Unit) -> None:
        """The unit's summed gradient: a kept full-size buffer whose block is the shard (stage 1),
        or the shard only."""
        if self.keeps_gradient_buffers:
            u.grad = u.xp.zeros(u.count, dtype=u.dtype)
            u.grad_shard = u.grad[u.lo:u.hi]
            memory.hold(u.grad, "gradients")
            self.meter.hold(u.nbytes)
        else:
            u.grad_shard = u.xp.zeros(u.hi - u.lo, dtype=u.dtype)
            memory.hold(u.grad_shard, "gradients")
            self.meter.hold(u.shard_nbytes)

    def _plan_units(self) -> None:
        """Persistent plans of the collectives whose arrays are the same every step, made in unit
        order on every rank: stage 1's reduce-scatter of the kept gradient buffer (and, hybrid,
        the all-reduce of its result over the replicas), stages 1-2's all-gather into the flat
        parameters. Stage 2-3 gradient buffers and stage 3's gathered parameters are made afresh
        each step, and go through the ordinary calls."""
        for u in self.units:
            if self.keeps_gradient_buffers:
                u.reduce_plan = reduce_scatter_init(u.grad, op="sum", algorithm=self.algorithm,
                                                    comm=self.shard_comm, in_place=True)
                if self.replica_comm is not None:
                    mine = u.reduce_plan.result
                    u.replica_plan = allreduce_init(mine, op="sum",
                                                    algorithm=self.replica_algorithm,
                                                    comm=self.replica_comm, out=mine)
            self.parameters.plan(u)

    def _communicators(self) -> None:
        """shard_comm: the ranks that share the shards (all, or hybrid: this node's);
        replica_comm (hybrid): the ranks holding the same shard on the other nodes."""
        self.shard_comm, self.replica_comm = self.comm, None
        if not self.hybrid:
            return
        groups = self.comm.node_groups()
        node = next(g for g in groups if self.comm.rank in g)
        local = node.index(self.comm.rank)
        self.shard_comm = self.comm.sub(node)
        if len(groups) > 1:
            self.replica_comm = self.comm.sub([g[local] for g in groups])

    def _buckets(self, model: Any) -> list[list[Any]]:
        """DDP's buckets (`mpdl.parallel.buckets`), at most `bucket_mb` each, or by default at
        most 1/UNITS_PER_MODEL of the model and DEFAULT_BUCKET_MB."""
        params = [p for p in model.parameters() if p.requires_grad]
        largest = (self.bucket_mb * MB if self.bucket_mb is not None else
                   min(DEFAULT_BUCKET_MB * MB, sum(p.data.nbytes for p in params) / UNITS_PER_MODEL))
        return buckets.by_size(params, largest, min(self.first_bucket_mb * MB, largest))

    def _submit(self, work: Callable[[], Any]) -> Handle:
        """Run `work` on the communication thread (at once on one rank)."""
        if self.comm.size == 1:
            handle = Handle()
            handle._finish(work())
            return handle
        return comm_thread_for(self.comm).submit(work)

    # -- gradients ---------------------------------------------------------------------------------
    def _on_grad(self, p: Any) -> None:
        unit = self._unit_of[id(p)]
        self._fill(unit, p)
        if len(unit.ready) == len(unit.params):
            self.parameters.gradients_done(unit)
            if self.overlap:
                self._launch_ready()

    def _fill(self, unit: Unit, p: Any) -> None:
        if unit.grad is None:
            self._limit()
            unit.grad = unit.xp.empty(unit.count, dtype=unit.dtype)
            memory.hold(unit.grad, "gradients")
            self.meter.hold(unit.nbytes)
        slot = unit.slot(unit.grad, p)
        if p.grad is None:
            slot[...] = 0
        else:
            unit.xp.multiply(p.grad, slot.dtype.type(self.weight), out=slot)
            p.grad = None
        unit.ready.add(id(p))

    def _limit(self) -> None:
        """Before another full-size gradient buffer is made: wait until at most MAX_IN_FLIGHT - 1
        reduce-scatters are running (a bound on the gradient memory of stages 2 and 3)."""
        running = [u for u in self._order[:self._next] if u.reduce is not None
                   and not u.reduce.test()]
        while len(running) >= MAX_IN_FLIGHT:
            with self.meter.waiting():
                running.pop(0).reduce.wait()

    def _launch_ready(self) -> None:
        while self._next < len(self._order):
            unit = self._order[self._next]
            if len(unit.ready) < len(unit.params):
                return
            self._launch(unit)
            self._next += 1

    def _launch(self, unit: Unit) -> None:
        buf = unit.grad

        def work() -> None:
            with self.meter.communicating(unit, "reduce-scatter"):
                if unit.reduce_plan is not None:  # stage 1: the kept buffer's persistent plans
                    mine = unit.reduce_plan()
                    if unit.replica_plan is not None:  # hybrid: sum the shard over the nodes
                        unit.replica_plan()
                else:
                    mine = reduce_scatter(buf, op="sum", algorithm=self.algorithm,
                                          comm=self.shard_comm, in_place=True)
                    if self.replica_comm is not None:
                        allreduce(mine, op="sum", algorithm=self.replica_algorithm,
                                  comm=self.replica_comm, out=mine)
                if not self.keeps_gradient_buffers:  # keep the shard; the full buffer goes
                    unit.xp.copyto(unit.grad_shard, mine)
                    unit.grad = None
                    self.meter.release(unit.nbytes)

        unit.reduce = self._submit(work)

    def _finish_gradients(self) -> None:
        """Zeros for the gradients that never came, the reduce-scatters left, and the wait."""
        for unit in self._order[self._next:]:
            for p in unit.params:
                if id(p) not in unit.ready:
                    self._fill(unit, p)
        self._launch_ready()
        with self.meter.waiting():
            for unit in self._order:
                unit.reduce.wait()
                unit.reduce = None
                unit.ready.clear()
        self._next = 0

    def _sum_squares(self, params: list[Any], sums: list[list[Any]]) -> list[list[Any]]:
        """Whole-tensor sums of squares from the pieces': one all-reduce of a (parameters, k)
        float64 array, every rank contributing its pieces' rows."""
        index = {id(piece.tensor): (piece.unit.index, piece.index) for piece in self.pieces}
        rows = {key: n for n, key in enumerate((u.index, i) for u in self.units
                                               for i in range(len(u.params)))}
        k = len(sums[0]) if sums else 2
        total = np.zeros((len(rows), k))
        for t, s in zip(params, sums, strict=True):
            total[rows[index[id(t)]]] += [float(v) for v in s]
        total = allreduce(total, op="sum", algorithm="auto", comm=self.shard_comm)
        return [[get_array_module(t.data).asarray(v, dtype=state_dtype(t.data.dtype))
                 for v in total[rows[index[id(t)]]]] for t in params]

    # -- a step ------------------------------------------------------------------------------------
    def step(self, batch: Batch) -> StepResult:
        self.optimizer.lr = batch.lr
        self.weight = len(batch.y) / batch.global_size
        result = StepResult()
        self.meter.begin()
        self.parameters.before_forward()  # stage 3: gather the root unit, kept for the step
        if len(batch.y) or not self.parameters.gathers_in_forward:
            backward_end = self.forward_backward(batch, result)
        else:  # a rank without samples still takes part in every gather: one zero sample
            backward_end = self.forward_backward(_ghost(batch), StepResult())
        with self.meter.phase("finish (wait for reduce-scatter)", cat="wait", start=backward_end):
            self._finish_gradients()
            self.parameters.after_backward()  # stage 3: free every unit
        with self.meter.phase("optimizer step"):
            for piece in self.pieces:
                piece.tensor.grad = piece.unit.grad_shard[piece.in_shard]
            self.optimizer.step()
            result.grad_norm = grad_norm(self.optimizer)
            self._count_optimizer_state()
        self.parameters.after_optimizer_step()  # stages 1-2: all-gather the updated shards
        return self.meter.finish(result, self.units)

    def _count_optimizer_state(self) -> None:
        self.meter.optimizer_state(optimizer_state_nbytes(self.optimizer))

    def _all_finite(self, finite: bool) -> bool:
        """Whether every rank's gradient shard is finite (one tiny all-reduce)."""
        flags = allreduce(np.array([0 if finite else 1], np.int32), op="max", comm=self.comm)
        return not flags[0]

    # -- reporting ---------------------------------------------------------------------------------
    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        sizes = ", ".join(f"{u.nbytes / 1024:.0f} KiB" for u in self.units)
        extra = f", prefetch {'on' if self.prefetch else 'off'}" if self.stage == 3 else ""
        if self.hybrid:
            nodes = self.replica_comm.size if self.replica_comm is not None else 1
            extra += (f", hybrid: sharded over the {self.shard_comm.size} ranks of a node, "
                      f"replicated over {nodes} node(s)")
        return (f"ZeRO stage {self.stage}, reduce-scatter/all-gather {self.algorithm}, units "
                f"[{sizes}]{extra}")

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": self.algorithm, "mode": self.mode,
                                  "zero_stage": self.stage,
                                  "model_state_bytes": self.model_state_bytes,
                                  "sent_bytes_per_step": self.sent_bytes_per_step}
        if final:
            fields.update(units=len(self.units), unit_bytes=[u.nbytes for u in self.units])
        return fields


def _ghost(batch: Batch) -> Batch:
    """One zero sample shaped like the batch's (its gradient is weighted 0: the batch is empty)."""
    xp = get_array_module(batch.x)
    return Batch(xp.zeros((1, *batch.x.shape[1:]), dtype=batch.x.dtype),
                 xp.zeros((1, *batch.y.shape[1:]), dtype=batch.y.dtype), batch.global_size,
                 batch.lr)

"""Pipeline parallelism: the model cut into `pp` stages (pp·v with v chunks per rank), the batch
into microbatches, and a schedule of `mpdl.parallel.pipeline.schedule` (afab, 1f1b, interleaved,
zb-h1, zb-v, dualpipev) run op by op, on a process grid.

With several chunks per rank the ops name their stage (`F j s`, `B j s`, `W j s`): messages go to
the rank of the neighbouring stage (received in the order that rank sent them: a receive keeps
the earlier ones for their ops), two stages of one rank hand activations and gradients over
without a message, and a B that has a W runs `Tensor.backward_split`, its weight gradients left
to the W. What follows is written for one chunk per rank.

A step on stage i of pipeline d: the slice of the global batch of data-parallel rank d, split into
m microbatches; for each op of the schedule, `F j`: receive microbatch j's activation from stage
i−1 (stage 0 reads the batch), run the stage, send the output to stage i+1 (the last stage
computes the loss, scaled by the microbatch's share of the global batch); `B j`: receive the
gradient of the output from stage i+1 (the last stage starts from its loss), run backward, send
the input's gradient to stage i−1. Sends are non-blocking (waited for at the end of the step),
receives block: the order of the ops alone makes the schedule. Each receive lands in a buffer kept
from step to step, one persistent receive (`Communicator.recv_init`) per microbatch and kind;
sends stay ordinary sends of the arrays backward and forward made (a persistent send would need
a copy into a kept buffer, which costs more than it saves from 64 KiB: benchmarks/bench_p2p.py).
Gradients add up over the microbatches and are then all-reduced over the data-parallel axis
(mpdl's all-reduce, any algorithm). Every message is an mpdl point-to-point message or
collective, so the message log, the flight recorder and the timeline see them; `verbose` prints
each one (picotron's VERBOSE). The ops and their messages are run by `ScheduleRunner`
(`mpdl.parallel.pipeline.driver`: `_forward`: receive, run the stage, loss or send; `_backward`:
receive, backward, send), which the strategy extends; the step's timeline spans, idle and compute
seconds and peaks of activations held are kept by a `PipelineMeter`
(`mpdl.parallel.pipeline.meter`).

With tp > 1, the pieces are those of `TensorParallelGPT` (each block split over the tp axis,
`mpdl.parallel.tensor_parallel`): the tp ranks of a stage run the same schedule in lockstep, each
exchanging activations with the rank of the same t on the neighbouring stages, and `gathered()`
also all-gathers the shards into the whole GPT.

With cp > 1 (`mpdl.parallel.context`), the cp ranks of a replica read the same batch and each
feeds its positions of every sequence (zigzag or contiguous): the embedding adds their global
positions, every block's attention runs over cp_comm, each rank's loss is its positions' part
of the sequences' mean, and the gradients are summed over dp × cp. With sp (Megatron sequence
parallelism, `mpdl.parallel.tensor_parallel`), the embedding's output enters the tp ranks' sequence
slices and the final LayerNorm's output leaves them."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd import no_grad
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allreduce, broadcast
from mpdl.comm import Communicator, PersistentRequest
from mpdl.parallel.context import shard_sequence
from mpdl.parallel.grid import ProcessGrid
from mpdl.parallel.pipeline.driver import Microbatches, ScheduleRunner
from mpdl.parallel.pipeline.meter import PipelineMeter
from mpdl.parallel.pipeline.schedule import (
    SCHEDULES,
    Schedule,
    allowed,
    fill_drain,
    generate,
    placement,
    schedule_bubble,
)
from mpdl.parallel.pipeline.stage import PipelineStage
from mpdl.parallel.pipeline.state import PipelineState
from mpdl.parallel.strategy import Batch, StepResult, Strategy, correct_predictions, grad_norm


# -- the strategy --------------------------------------------------------------------------------
class PipelineStrategy(ScheduleRunner, PipelineStage, PipelineState, Strategy):
    """Pipeline parallelism over the pp axis of a (dp, pp, cp, tp) grid, tensor parallelism of
    the GPT's blocks over tp (`mpdl.parallel.tensor_parallel`), context parallelism of its attention over
    cp (`mpdl.parallel.context`: each cp rank holds a slice of every sequence and its part of
    the loss, gradients are summed over dp × cp), data parallelism over dp."""

    mode = "pipeline"
    sharded_checkpoint = True
    #: every data-parallel rank runs all `microbatches`, empty ones too (a layout whose forward
    #: and backward send over the data-parallel axis: mpdl.parallel.expert_pipeline)
    lockstep_microbatches = False

    def __init__(self, comm: Communicator, dp: int, pp: int, tp: int = 1, microbatches: int = 1,
                 schedule: str = "1f1b", algorithm: str = "auto", verbose: bool = False,
                 zero: int = 0, cp: int = 1, cp_mode: str = "ring",
                 cp_balance: str = "zigzag", sp: bool = False, virtual_stages: int = 1) -> None:
        super().__init__(comm)
        if zero not in (0, 1):
            raise ValueError(f"zero: with a pipeline or tensor parallelism only stage 1 (the "
                             f"optimizer state sharded over dp) is supported, got {zero!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches: must be a positive int, not {microbatches!r}")
        #: model chunks per rank (a V of two for zb-v and dualpipev)
        self.v = 2 if schedule in ("zb-v", "dualpipev") and virtual_stages == 1 else virtual_stages
        why = allowed(schedule, pp, microbatches, self.v)
        if why:
            raise ValueError(why)
        self.grid = ProcessGrid(comm, dp, pp, tp, cp)
        self.cp, self.cp_mode, self.cp_balance = cp, cp_mode, cp_balance
        self.sp = sp and tp > 1
        self.pp, self.stage = pp, self.grid.p
        self.microbatches, self.schedule, self.algorithm = microbatches, schedule, algorithm
        self.verbose, self.zero = verbose, zero
        #: the rank of each of the pp·v stages, and this rank's stages in forward order
        self.rank_of = placement(schedule, pp, self.v)
        self.chunks = [s for s, r in enumerate(self.rank_of) if r == self.stage]
        self.first, self.last = 0 in self.chunks, len(self.rank_of) - 1 in self.chunks
        self.tied_comm: Communicator | None = None
        self._shapes: dict[Any, list[tuple[tuple[int, ...], Any]]] = {}
        self._receives: dict[tuple, PersistentRequest] = {}
        #: the last step's op order ((kind, j), or (kind, j, stage) with chunks), its peak of
        #: microbatches in flight and of their stage outputs bytes (the activations a stage holds
        #: for backward grow with both), seconds idle (waiting on receives) and the step's seconds
        self.last_order: list[Any] = []
        self.last_peak = self.last_peak_bytes = 0
        self.idle_s = self.step_s = 0.0
        self.messages = self.bytes_sent = 0
        #: since the last report: seconds of the ops' compute and from each step's start to its
        #: last op (the first step, which compiles and probes shapes, left out)
        self.busy_s = self.ops_s = 0.0
        self.steps_seen = self.peak_seen = self.peak_bytes_seen = 0
        #: the measured bubble since the last epoch's report (`measure`)
        self.measured: dict[str, Any] = {}
        self._schedules: dict[int, Schedule] = {}
        self._whole_state: dict[str, Any] | None = None
        #: bytes of parameters and of model state (parameters, gradients, optimizer state) this
        #: rank holds after a step, and their maxima over the ranks (agreed in gathered())
        self.rank_parameter_bytes = self.rank_state_bytes = 0
        self.parameter_bytes = self.model_state_bytes = 0

    @property
    def data_comm(self) -> Communicator:
        return self.grid.dp_comm

    def roles(self) -> list[tuple[str, int]]:
        dp = self.grid.dp
        return [("replica", dp)]


    def _message(self, a: Any) -> Any:
        """An activation or gradient as it travels: contiguous, in the message dtype."""
        if self.message_dtype is None:
            return get_array_module(a).ascontiguousarray(a)
        with np.errstate(over="ignore"):  # float16 overflow is inf, for the loss scaler to see
            return a.astype(self.message_dtype)


    def _local(self, a: Any) -> Any:
        """This rank's slice of (N, T) inputs or labels along the sequence (all of it at cp 1)."""
        if self.cp == 1:
            return a
        return shard_sequence(a, self.grid.c, self.cp, self.cp_balance, axis=1)

    def _loss(self, logits: Tensor, y: Any) -> tuple[Tensor, float]:
        """The microbatch's loss and correct predictions; with cp, this rank's part of them:
        its positions' summed loss over the positions of the whole sequences that have a
        target (the parts of the cp ranks add up to the whole sequences' mean)."""
        if self.cp == 1:
            return F.cross_entropy(logits, y), correct_predictions(logits.data, y)
        mine = self._local(y)
        counted = max(int((y >= 0).sum()), 1)
        loss = F.cross_entropy(logits, mine, reduction="sum") * (1.0 / counted)
        xp = get_array_module(logits.data)
        hits = (logits.data.argmax(axis=-1) == xp.asarray(mine)) & xp.asarray(mine >= 0)
        return loss, len(y) * float(hits.sum()) / counted


    # -- one step ------------------------------------------------------------------------------
    def _boundary_shapes(self, x: Any) -> list[tuple[tuple[int, ...], Any]]:
        """Each stage's output (per-sample shape, dtype), from one sample run through the whole
        model without a graph in evaluation mode (so that no dropout draw is consumed)."""
        key = (x.shape[1:], str(x.dtype))
        if key not in self._shapes:
            was = self.model.training
            self.model.eval()
            shapes = []
            # the other stages' parameters are NaN placeholders: only the shapes count here
            with no_grad(), np.errstate(invalid="ignore"):
                h = Tensor(x[:1])
                for s in range(len(self.rank_of)):
                    for piece in self.all_pieces[self.bounds[s]:self.bounds[s + 1]]:
                        h = piece(h)
                    shapes.append((tuple(h.shape[1:]), h.data.dtype))
            self.model.train(was)
            self._shapes[key] = shapes
        return self._shapes[key]

    def _schedule(self, m: int) -> Schedule:
        """The step's schedule for m microbatches (a short batch whose count the schedule does
        not allow runs all forwards, then all backwards, on the same stages)."""
        if m not in self._schedules:
            runs = allowed(self.schedule, self.pp, m, self.v) is None
            self._schedules[m] = (generate if runs else fill_drain)(self.schedule, self.pp, m,
                                                                    self.v)
        return self._schedules[m]

    def step(self, batch: Batch) -> StepResult:
        """The schedule's ops over this step's microbatches, then the gradients' sums and the
        optimizer step; a `PipelineMeter` keeps the step's figures."""
        meter = PipelineMeter()
        self.optimizer.lr = batch.lr
        mb = self._microbatches(batch)
        order = list(mb.schedule.ranks[self.stage]) if mb.parts else []
        self._run(mb, order, meter)
        self._update(mb, meter)
        self._share_metrics(meter.result)
        result = meter.close()
        result.grad_norm = grad_norm(self.optimizer)
        self.last_order = [(op.kind, op.mb) if self.v == 1 else (op.kind, op.mb, op.stage)
                           for op in order]
        self.last_peak, self.last_peak_bytes = meter.peak, meter.peak_bytes
        self.idle_s, self.step_s = meter.idle_s, meter.step_s
        if self.steps_seen:
            self.busy_s += meter.busy_s
            self.ops_s += meter.ops_s
        self.peak_seen = max(self.peak_seen, meter.peak)
        self.peak_bytes_seen = max(self.peak_bytes_seen, meter.peak_bytes)
        self.steps_seen += 1
        self.messages += meter.messages
        self.bytes_sent += meter.bytes_sent
        self._account()
        return result

    def _microbatches(self, batch: Batch) -> Microbatches:
        """The batch cut into `microbatches` parts (the empty ones dropped, unless
        `lockstep_microbatches`)."""
        parts = self._parts(batch)
        xp = get_array_module(self.stage_params[0].data) if self.stage_params else np
        shapes = self._boundary_shapes(self._local(batch.x)) if parts and self.pp > 1 else []
        mb = Microbatches(batch, parts, xp, shapes)
        if parts:
            mb.schedule = self._schedule(len(parts))
            for op in mb.schedule.rank_ops(self.stage):  # the senders' order, per channel
                if op.kind == "recv":
                    mb.incoming.setdefault(op.peer, collections.deque())
            for peer in mb.incoming:
                mb.incoming[peer].extend((op.what, op.mb, op.stage)
                                         for op in mb.schedule.rank_ops(peer)
                                         if op.kind == "send" and op.peer == self.stage)
        return mb

    def _parts(self, batch: Batch) -> list[Any]:
        """Each microbatch's rows of the batch (the empty ones dropped, unless
        `lockstep_microbatches`)."""
        return [p for p in np.array_split(np.arange(len(batch.y)), self.microbatches)
                if len(p) or self.lockstep_microbatches]

    def _update(self, mb: Microbatches, meter: PipelineMeter) -> None:
        """Wait for the step's sends, sum the gradients and take the optimizer step."""
        meter.synchronising()
        self.grid.pp_comm.waitall([request for request, _ in mb.sends])
        self._synchronise()
        meter.optimizer_step()
        self.optimizer.step()
        self.optimizer.zero_grad()
        meter.stepped("reduce-scatter, optimizer step, all-gather over dp" if self.zero
                       else "optimizer step")

    def _synchronise(self) -> None:
        """Sum the tied embedding's two parts (first and last stage), then all-reduce the stage's
        gradients over the data-parallel axis."""
        if self.tied_comm is not None:
            w = self.model.token_embedding.weight
            if w.grad is None:
                w.grad = get_array_module(w.data).zeros_like(w.data)
            self._say("all-reduce tied embedding gradient with the other end of the pipeline")
            w.grad = allreduce(w.grad, op="sum", algorithm=self.algorithm, comm=self.tied_comm)
        if self.sp:  # the sliced regions' parameters hold a part of the gradient per tp rank
            self._sum_gradients([p for p in self.tp_model.sequence_parallel_params()
                                 if id(p) in self._owned], self.grid.tp_comm, "tp")
        if self.grid.dp * self.cp == 1 or not self.stage_params or self.zero:
            return  # ZeRO-1: the optimizer's step reduce-scatters over dp
        self._sum_data_parallel()

    def _sum_data_parallel(self) -> None:
        """Sum the stage's gradients over the ranks that hold the same parameters (dp × cp)."""
        self._sum_gradients(self.stage_params, self.grid.dcp_comm, "dp x cp")

    def _sum_gradients(self, params: list[Any], comm: Communicator, axis: str) -> None:
        """Replace the gradients of `params` by their sum over `comm` (one flat all-reduce)."""
        if not params:
            return
        xp = get_array_module(params[0].data)
        grads = [p.grad if p.grad is not None else xp.zeros_like(p.data) for p in params]
        flat = xp.concatenate([g.reshape(-1) for g in grads])
        self._say(f"all-reduce {flat.nbytes} bytes of gradients over {axis}")
        allreduce(flat, op="sum", algorithm=self.algorithm, comm=comm, out=flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.size].reshape(p.shape)
            offset += p.size

    def _share_metrics(self, result: StepResult) -> None:
        """The last stage's loss, correct predictions and samples on every stage, averaged over
        the cp ranks' slices of the sequences."""
        vec = np.array([result.loss, result.correct, result.samples], dtype=np.float64)
        if self.cp > 1 and self.last:  # each cp rank's part of the sequences' loss
            vec[:2] = allreduce(vec[:2], op="sum", comm=self.grid.cp_comm)
            result.loss, result.correct = float(vec[0]), float(vec[1])
        if self.pp == 1:
            return
        vec = broadcast(vec, root=self.rank_of[-1], comm=self.grid.pp_comm)
        result.loss, result.correct, result.samples = float(vec[0]), float(vec[1]), int(vec[2])


    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        sizes = [sum(p.size for p in self._rank_params(r)) for r in range(self.pp)]
        tp = f"tensor parallel over {self.grid.tp} ranks, " if self.grid.tp > 1 else ""
        if self.sp:
            tp = f"tensor and sequence parallel over {self.grid.tp} ranks, "
        if self.cp > 1:
            tp += (f"context parallel over {self.cp} ranks ({self.cp_mode}, "
                   f"{self.cp_balance}), ")
        chunks = f" x {self.v} chunks" if self.v > 1 else ""
        return (f"{tp}pipeline {self.schedule}, {self.pp} stages{chunks} (pieces {self.bounds}, "
                f"parameters "
                f"{sizes}), {self.microbatches} microbatches, "
                f"{f'dp x cp {self.grid.dp} x {self.cp}' if self.cp > 1 else f'dp {self.grid.dp}'} "
                f"{'ZeRO-1 reduce-scatter/all-gather' if self.zero else 'all-reduce'} "
                f"{self.algorithm}; bubble formula "
                f"{self._bubble_formula():.1%}")

    def measure(self) -> None:
        """The bubble measured since the last call, per stage: its idle share of the pipeline's
        step, one minus its ops' compute seconds over the longest stage's seconds from the
        step's start to its last op; and each stage's most chunk activations and bytes of stage
        outputs held at once (collective over pp)."""
        figures = np.zeros((self.pp, 4))
        figures[self.stage] = self.busy_s, self.ops_s, self.peak_seen, self.peak_bytes_seen
        figures = allreduce(figures, op="sum", comm=self.grid.pp_comm)
        longest = figures[:, 1].max()
        if self.pp > 1 and longest > 0:
            stages = [max(0.0, 1.0 - busy / longest) for busy in figures[:, 0]]
            self.measured = {"bubble": float(np.mean(stages)),
                             "bubble_stages": [round(b, 4) for b in stages],
                             "peak_in_flight_stages": [int(k) for k in figures[:, 2]],
                             "peak_activation_bytes_stages": [int(k) for k in figures[:, 3]]}
        self.busy_s = self.ops_s = 0.0
        self.peak_seen = self.peak_bytes_seen = 0

    def _bubble_formula(self) -> float:
        return schedule_bubble(self.schedule, self.pp, self.microbatches, self.v) \
            if self.pp > 1 else 0.0

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": self.algorithm,
                                  "mode": self.mode if self.pp > 1 else
                                  ("tensor" if self.grid.tp > 1 else "context"),
                                  "dp": self.grid.dp, "pp": self.pp, "cp": self.cp,
                                  "tp": self.grid.tp, "cp_mode": self.cp_mode,
                                  "cp_balance": self.cp_balance, "sp": self.sp,
                                  "schedule": self.schedule, "microbatches": self.microbatches,
                                  "virtual_stages": self.v, "zero_stage": self.zero,
                                  "bubble_formula": self._bubble_formula(),
                                  **self.measured}
        if final:
            fields.update(stage=self.stage, p2p_messages=self.messages,
                          parameter_bytes=self.parameter_bytes,
                          model_state_bytes=self.model_state_bytes,
                          p2p_bytes=self.bytes_sent, peak_in_flight=self.last_peak,
                          peak_output_bytes=self.last_peak_bytes)
        return fields

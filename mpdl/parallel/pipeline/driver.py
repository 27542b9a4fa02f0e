"""One rank's part of a pipeline schedule: the ops F, B and W of its stages in the schedule's
order, the messages between stages (non-blocking sends, receives into persistent buffers kept
from step to step, received in the order the sending rank sent them) and the hand-over between
two stages of one rank. `ScheduleRunner` is the part of `PipelineStrategy`
(`mpdl.parallel.pipeline.executor`) that runs a step's ops; the strategy builds the model's
stages, cuts the batch and sums the gradients."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd.tensor import Tensor
from mpdl.models.moe import aux_loss_scale
from mpdl.parallel.pipeline.meter import PipelineMeter
from mpdl.parallel.pipeline.schedule import Schedule
from mpdl.parallel.strategy import Batch, StepResult

#: what a receive's verbose line calls each kind of message
_WHAT = {"act": "activation", "grad": "gradient"}


@dataclasses.dataclass
class Microbatches:
    """One step's batch cut into microbatches on one stage, and what each microbatch holds from
    its forward to its backward."""

    batch: Batch
    #: each microbatch's rows of the batch (contiguous)
    parts: list[Any]
    #: the stage's array module
    xp: Any
    #: each stage's output (per-sample shape, dtype): what the next stage receives
    shapes: list[tuple[tuple[int, ...], Any]]
    #: the received activations (leaves: their gradients go back to the previous stage)
    inputs: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    #: the stage outputs (on the last stage the scaled loss) until their backward
    outputs: dict[int, Tensor] = dataclasses.field(default_factory=dict)
    #: the sends' (request, buffer), kept alive until the end of the step
    sends: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    #: the step's schedule, and for each peer the messages it sends this rank, in order
    schedule: Schedule | None = None
    incoming: dict[int, Any] = dataclasses.field(default_factory=dict)
    #: messages received before the op that needs them (sent earlier on the same channel)
    early: dict[tuple[str, int, int], Any] = dataclasses.field(default_factory=dict)
    #: outputs and input gradients passed between two stages of this rank
    handed: dict[tuple[str, int, int], Any] = dataclasses.field(default_factory=dict)
    #: the weight-gradient halves of split backwards, until their W
    later: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    #: the gradient each loss's backward starts from (None: one)
    seed: Any = None

    def rows(self, a: Any, j: int) -> Any:
        """Microbatch j's rows of `a` (the batch's inputs or labels)."""
        idx = self.parts[j]
        return a[idx[0]:idx[-1] + 1] if len(idx) else a[:0]

    def share(self, j: int) -> float:
        """Microbatch j's share of the global batch (the scale of its loss)."""
        return len(self.parts[j]) / self.batch.global_size


class ScheduleRunner:
    """The ops of one rank's stages and their messages, for `PipelineStrategy`: it supplies the
    grid, the stages' pieces (`all_pieces`, `bounds`, `rank_of`), the loss and the optimizer."""

    def _run(self, mb: Microbatches, order: list[Any], meter: PipelineMeter) -> None:
        """This rank's ops of the step's schedule, in order."""
        for op in order:
            if op.kind == "F":
                self._forward(mb, op.mb, op.stage, meter)
            elif op.kind == "B":
                self._backward(mb, op.mb, op.stage, meter)
            else:
                self._weights(mb, op.mb, op.stage, meter)

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"[rank {self.comm.rank} stage {self.stage} dp {self.grid.d}] {text}",
                  file=sys.stderr, flush=True)

    def _send(self, buf: Any, s: int, what: str, j: int, mb: Microbatches,
              meter: PipelineMeter) -> None:
        """Start sending microbatch j's activation (the output of stage s) or gradient (of stage
        s's input) to the rank of the next or previous stage (non-blocking: the request and its
        buffer are kept in `mb.sends` until the end of the step)."""
        rank = self.rank_of[s + 1 if what == "act" else s - 1]
        self._say(f"send {what} mb {j} of stage {s} -> rank {rank} ({buf.nbytes} bytes)")
        meter.send(what, j, rank, buf.nbytes)
        mb.sends.append((self.grid.pp_comm.isend(buf, rank, step=(what, j, s)), buf))

    def _take(self, mb: Microbatches, what: str, j: int, s: int) -> Any:
        """Microbatch j's activation (the output of stage s) or gradient (of stage s's input),
        received from the rank of that stage: the messages its rank sent before it on the same
        channel are received first and kept for their own ops."""
        want = (what, j, s)
        peer = self.rank_of[s]
        while want not in mb.early:
            kind, i, t = mb.incoming[peer].popleft()
            shape, dtype = mb.shapes[t if kind == "act" else t - 1]
            mb.early[(kind, i, t)] = self._recv(mb.xp, (len(mb.parts[i]), *shape),
                                                self.message_dtype or dtype, peer, kind, i, t)
        return mb.early.pop(want)

    def _recv(self, xp: Any, shape: tuple[int, ...], dtype: Any, rank: int, what: str,
              j: int, s: int) -> Any:
        """Receive microbatch j's activation or gradient of stage s from `rank` into this rank's
        buffer for it: one persistent receive per (what, j, s, shape, dtype), kept from step to
        step (a step's inputs and output gradients are done with before the next step
        receives)."""
        self._say(f"recv {_WHAT[what]} mb {j} of stage {s} <- rank {rank}")
        key = (what, j, s, shape, np.dtype(dtype).str, rank)
        request = self._receives.get(key)
        if request is None:
            # those of two batch sizes are kept (an epoch's batches and its short last one)
            if len(self._receives) >= 4 * self.microbatches * self.v:
                for r in self._receives.values():
                    r.free()
                self._receives.clear()
            buf = xp.empty(shape, dtype=dtype)
            memory.hold(buf, "communication")
            request = self._receives[key] = self.grid.pp_comm.recv_init(buf, rank,
                                                                        step=(what, j, s))
        self.grid.pp_comm.waitall([request.start()])
        return request.buf

    def _forward(self, mb: Microbatches, j: int, s: int, meter: PipelineMeter) -> None:
        """Op F j s: microbatch j's input through stage s's pieces; the last stage takes the
        loss, the others hand the output to the next stage (a send unless this rank holds it)."""
        meter.op_begins()
        h = self._stage_input(mb, j, s)
        meter.compute_begins()
        # as the loss (MoE layers), times fp16's loss scale
        with aux_loss_scale(mb.share(j) * getattr(self.optimizer, "loss_scale", 1.0)):
            for piece in self.all_pieces[self.bounds[s]:self.bounds[s + 1]]:
                h = piece(h)
        meter.compute_ends()
        mb.outputs[(j, s)] = h
        if s == len(self.rank_of) - 1:
            mb.outputs[(j, s)] = self._microbatch_loss(h, mb, j, meter.result)
        elif self.rank_of[s + 1] == self.stage:
            mb.handed[("act", j, s)] = h.data
        else:
            self._send(self._message(h.data), s, "act", j, mb, meter)
        received = s > 0 and self.rank_of[s - 1] != self.stage
        meter.forward_done(j, h.data.nbytes, self.rank_of[s - 1] if received else None,
                            self._chunk(s))

    def _chunk(self, s: int) -> int | None:
        """Stage s as the timeline names it: None where a rank holds one stage."""
        return None if self.v == 1 else s

    def _stage_input(self, mb: Microbatches, j: int, s: int) -> Tensor:
        """Microbatch j's input to stage s: its rows of the batch on the first stage, else the
        previous stage's output, received or handed on by this rank (a leaf whose gradient goes
        back)."""
        if s == 0:
            return Tensor(self._local(mb.rows(mb.batch.x, j)))
        dtype = mb.shapes[s - 1][1]
        if self.rank_of[s - 1] == self.stage:
            buf = mb.handed.pop(("act", j, s - 1))
        else:
            buf = self._take(mb, "act", j, s - 1)
        mb.inputs[(j, s)] = Tensor(buf.astype(dtype, copy=False), requires_grad=True)
        return mb.inputs[(j, s)]

    def _microbatch_loss(self, logits: Tensor, mb: Microbatches, j: int,
                         result: StepResult) -> Tensor:
        """Microbatch j's loss scaled by its share of the global batch (backward starts from
        it); its loss, correct predictions and samples add up in `result`."""
        n = len(mb.parts[j])
        if not n:  # an empty microbatch's backward still runs (lockstep_microbatches)
            return logits.sum() * 0.0
        loss, correct = self._loss(logits, mb.rows(mb.batch.y, j))
        result.loss += float(loss.item()) * n
        result.correct += correct
        result.samples += n
        return loss * (mb.share(j) * getattr(self.optimizer, "loss_scale", 1.0))

    def _backward(self, mb: Microbatches, j: int, s: int, meter: PipelineMeter) -> None:
        """Op B j s: backward from microbatch j's output of stage s (the last stage's from its
        loss, the others' with the gradient from the next stage), then its input's gradient to
        the previous stage; where the schedule has a W for it, the weights' gradients wait."""
        out = mb.outputs.pop((j, s))
        split = mb.schedule.split(self.stage, j, s)
        received = s < len(self.rank_of) - 1 and self.rank_of[s + 1] != self.stage
        grad = mb.seed
        if s < len(self.rank_of) - 1:
            meter.op_begins()
            grad = self._take(mb, "grad", j, s + 1) if received else \
                mb.handed.pop(("grad", j, s + 1))
            grad = grad.astype(out.data.dtype, copy=False)
        meter.compute_begins()
        if split:
            mb.later[(j, s)] = out.backward_split(grad, self._stage_weights(s))
        else:
            out.backward(grad)
        meter.compute_ends()
        if s > 0:
            g = mb.inputs.pop((j, s)).grad
            if self.rank_of[s - 1] == self.stage:
                mb.handed[("grad", j, s)] = g
            else:
                self._send(self._message(g), s, "grad", j, mb, meter)
        meter.backward_done(j, self.rank_of[s + 1] if received else None, self._chunk(s),
                             weights_later=split)

    def _weights(self, mb: Microbatches, j: int, s: int, meter: PipelineMeter) -> None:
        """Op W j s: the weight gradients of microbatch j's backward through stage s."""
        meter.compute_begins()
        mb.later.pop((j, s)).run()
        meter.compute_ends()
        meter.weights_done(j, self._chunk(s))

    def _stage_weights(self, s: int) -> list[Any]:
        """The parameters stage s's pieces use (the head its tied embedding too)."""
        pieces = self.all_pieces[self.bounds[s]:self.bounds[s + 1]]
        tied = [t for t in (getattr(piece, "tied", None) for piece in pieces) if t is not None]
        return [*self._params_of(s), *tied]

"""Pipeline parallelism: the model cut into `pp` stages, the batch into microbatches, and the
schedules AFAB (all forward, all backward: GPipe) and 1F1B (PipeDream-flush), on a process grid.

The model is a sequence of pieces (`model_pieces`): the children of an `nn.Sequential`, or for a
GPT the embedding piece (token + position embedding), each block, and the head (final LayerNorm
and the output projection, tied to the token embedding). `partition` cuts the pieces into `pp`
contiguous stages **balanced by parameter count** (the head counts the tied matrix it multiplies
by), minimising the largest stage.

Every rank builds only the parameters of its stage (`build`, through `mpdl.autograd.partial`: the
constructor makes the whole model's draws from the same seed, so the values equal one rank's,
but every other parameter is a zero-byte placeholder and each of its drawn values is dropped at
once), so that a stage's setup holds its share; with tp > 1 a rank builds the whole model, keeps
its shards of its stage and drops the rest. A rank holds about 1/(pp·tp) of the blocks'
parameters while it trains; `gathered()` broadcasts each stage's parameters along the pipeline
(and all-gathers the shards), so that evaluation sees the whole up-to-date model on every rank,
and drops them again on leaving. The tied embedding lives
on the first stage (lookup) and the last (output projection): both hold a copy, each adds its
part of the gradient, the two parts are summed by an all-reduce between the two stages, and both
copies take the same optimizer step, so they stay equal.

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
collective, so the recorder, the flight recorder and the timeline see them; `verbose` prints each
one (picotron's VERBOSE). `step` reads as the algorithm (`_forward`: receive, run the stage, loss
or send; `_backward`: receive, backward, send); the step's timeline spans, idle and compute
seconds and peaks of activations held are kept by a `PipelineRecorder`
(`mpdl.parallel.pipeline.recorder`).

With tp > 1, the pieces are those of `TensorParallelGPT` (each block split over the tp axis,
`mpdl.parallel.tensor_parallel`): the tp ranks of a stage run the same schedule in lockstep, each
exchanging activations with the rank of the same t on the neighbouring stages, and `gathered()`
also all-gathers the shards into the whole GPT.

With cp > 1 (`mpdl.parallel.context`), the cp ranks of a replica read the same batch and each
feeds its positions of every sequence (zigzag or contiguous): the embedding adds their global
positions, every block's attention runs over cp_comm, each rank's loss is its positions' part
of the sequences' mean, and the gradients are summed over dp × cp. With sp (Megatron sequence
parallelism, `mpdl.parallel.tensor_parallel`), the embedding's output enters the tp ranks' sequence
slices and the final LayerNorm's output leaves them.

Bubble: with unit-time forwards and backwards, a stage of a p-stage pipeline with m microbatches
is idle (p−1)/(m+p−1) of the step under either schedule (`slot_bubble` replays an executed order
on that clock; `timed_bubble` on a clock of measured op times: each forward and backward span
carries its thread CPU time as `cpu_s`); AFAB holds up to m microbatches' activations, 1F1B at
most p−i on stage i.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd import amp, nn, no_grad, partial
from mpdl.autograd import functional as F
from mpdl.autograd.moe import aux_loss_scale
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module, to_host
from mpdl.collectives import allreduce, broadcast
from mpdl.comm import Communicator, PersistentRequest
from mpdl.parallel.context import context_attention, positions, shard_sequence
from mpdl.parallel.dpshard import ShardedOptimizer
from mpdl.parallel.grid import ProcessGrid
from mpdl.parallel.pipeline.recorder import PipelineRecorder
from mpdl.parallel.shards import placeholder as _placeholder
from mpdl.parallel.strategy import Batch, MakeOptimizer, StepResult, Strategy, correct_predictions
from mpdl.parallel.tensor_parallel import TensorParallelGPT, gather_array

SCHEDULES = ("afab", "1f1b")


# -- the model as a sequence of pieces ---------------------------------------------------------
class Embed(nn.Module):
    """The GPT's input: token embedding + position embedding (+ dropout)."""

    def __init__(self, gpt: Any) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = gpt.token_embedding, gpt.position_embedding, gpt.dropout
        #: (rank, cp, balance) when the input is a context-parallel slice of each sequence: its
        #: tokens then take their global positions
        self.sequence_shard: tuple[int, int, str] | None = None
        #: into the sequence-parallel region (this tp rank's slice), when there is one
        self.enter: Any = None

    def forward(self, idx: Any) -> Tensor:
        xp = get_array_module(self.tok.weight.data)
        idx = xp.asarray(idx.data if isinstance(idx, Tensor) else idx)
        where = xp.arange(idx.shape[1])
        if self.sequence_shard is not None:
            rank, cp, balance = self.sequence_shard
            where = xp.asarray(positions(rank, cp, idx.shape[1] * cp, balance))
        x = self.tok(idx) + self.pos(where)
        return self.drop(x if self.enter is None else self.enter(x))


class Head(nn.Module):
    """The GPT's output: final LayerNorm, then the projection on the (tied) token embedding."""

    def __init__(self, gpt: Any) -> None:
        super().__init__()
        self.ln_f = gpt.ln_f
        self.__dict__["tied"] = gpt.token_embedding.weight  # not a parameter of this piece
        #: out of the sequence-parallel region (the whole sequence), when there is one
        self.leave: Any = None

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln_f(x)
        return F.linear(x if self.leave is None else self.leave(x), self.tied)


def model_pieces(model: Any) -> list[tuple[nn.Module, int]]:
    """(piece, parameter count for balancing) in forward order: a Sequential's children (each
    layer with parameters, with the parameter-free layers around it: Flatten, ReLU), or a GPT's
    embedding, blocks and head (counted with the tied matrix)."""
    if isinstance(model, nn.Sequential):
        groups: list[list[nn.Module]] = []
        pending: list[nn.Module] = []  # parameter-free children go with a neighbour that has some
        for child in model:
            if child.parameters():
                groups.append([*pending, child])
                pending = []
            elif groups:
                groups[-1].append(child)
            else:
                pending.append(child)
        pieces = [nn.Sequential(*g) for g in groups] or [nn.Sequential(*pending)]
        return [(m, sum(p.size for p in m.parameters())) for m in pieces]
    if all(hasattr(model, a) for a in ("token_embedding", "position_embedding", "blocks", "ln_f")):
        embed, head = Embed(model), Head(model)
        return [(embed, sum(p.size for p in embed.parameters())),
                *((b, sum(p.size for p in b.parameters())) for b in model.blocks),
                (head, sum(p.size for p in head.parameters()) + head.tied.size)]
    raise ValueError(f"pipeline: the model must be an nn.Sequential or a GPT, not "
                     f"{type(model).__name__}")


def partition(weights: list[int], stages: int) -> list[int]:
    """Bounds b (len stages + 1) cutting `weights` into contiguous non-empty stages, stage s =
    weights[b[s]:b[s+1]], with the largest stage sum as small as possible (ties: the earliest
    cut)."""
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"pp: {stages} stages need at least as many model pieces, the model has "
                         f"{n}")
    prefix = np.concatenate([[0], np.cumsum(weights)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][k]: first k pieces in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for k in range(s, n + 1):
            for j in range(s - 1, k):
                cost = max(best[s - 1][j], prefix[k] - prefix[j])
                if cost < best[s][k]:
                    best[s][k], cut[s][k] = cost, j
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


# -- schedules -----------------------------------------------------------------------------------
def schedule_ops(kind: str, m: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The order of stage `stage`'s ops ("F", j) / ("B", j) over m microbatches: AFAB runs every
    forward then every backward; 1F1B runs pp−stage−1 forwards (warm-up), then alternates one
    forward and one backward, then runs the remaining backwards (cool-down)."""
    if kind == "afab":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind != "1f1b":
        raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    warmup = min(pp - stage - 1, m)
    ops = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        ops += [("F", warmup + j), ("B", j)]
    return ops + [("B", j) for j in range(m - warmup, m)]


def peak_in_flight(ops: list[tuple[str, int]]) -> int:
    """The most microbatches forwarded and not yet backwarded at once (activations held)."""
    live = peak = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def slot_bubble(orders: list[list[tuple[str, int]]]) -> tuple[int, list[int]]:
    """Replay each stage's executed op order on a clock where every forward and backward takes one
    slot and waits for its input (F j on stage i after F j on i−1; B j after B j on i+1, or after
    F j on the last stage): (the step's length in slots, each stage's idle slots)."""
    length, idle = timed_bubble(orders)
    return int(length), [int(i) for i in idle]


def timed_bubble(orders: list[list[tuple[str, int]]],
                 durations: list[dict[tuple[str, int], float]] | None = None
                 ) -> tuple[float, list[float]]:
    """`slot_bubble` on a clock where op (kind, j) of stage i takes `durations[i][(kind, j)]`
    (default: 1 each), every stage runs on a core of its own and messages take no time: (the
    step's length, each stage's idle time, i.e. length − the sum of its ops)."""
    pp = len(orders)
    if durations is None:
        durations = [dict.fromkeys(order, 1) for order in orders]
    done: dict[tuple[str, int, int], float] = {}
    free, pos = [0] * pp, [0] * pp
    while any(pos[i] < len(orders[i]) for i in range(pp)):
        progressed = False
        for i in range(pp):
            if pos[i] == len(orders[i]):
                continue
            kind, j = orders[i][pos[i]]
            need = (("F", j, i - 1) if i > 0 else None) if kind == "F" else \
                (("B", j, i + 1) if i < pp - 1 else ("F", j, i))
            if need is not None and need not in done:
                continue
            start = max(free[i], done[need] if need else 0)
            done[(kind, j, i)] = free[i] = start + durations[i][(kind, j)]
            pos[i] += 1
            progressed = True
        if not progressed:
            raise ValueError("slot_bubble: the orders deadlock")
    length = max(free)
    return length, [length - sum(durations[i][op] for op in orders[i]) for i in range(pp)]


def _is_placeholder(a: Any) -> bool:
    """Whether a parameter's data is a dropped value (`_placeholder`: no bytes behind it)."""
    return a.size > 1 and not any(a.strides)


def runs(positions: Any) -> Any:
    """(start, length) rows of the runs of consecutive integers in `positions`, in order."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    if not positions.size:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [positions.size]])
    return np.stack([positions[starts], ends - starts], axis=1)


def bubble_formula(pp: int, m: int) -> float:
    """The idle share of a pipeline step: (p−1)/(m+p−1)."""
    return (pp - 1) / (m + pp - 1)


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

    def rows(self, a: Any, j: int) -> Any:
        """Microbatch j's rows of `a` (the batch's inputs or labels)."""
        idx = self.parts[j]
        return a[idx[0]:idx[-1] + 1] if len(idx) else a[:0]

    def share(self, j: int) -> float:
        """Microbatch j's share of the global batch (the scale of its loss)."""
        return len(self.parts[j]) / self.batch.global_size


# -- the strategy --------------------------------------------------------------------------------
class PipelineStrategy(Strategy):
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
                 cp_balance: str = "zigzag", sp: bool = False) -> None:
        super().__init__(comm)
        if zero not in (0, 1):
            raise ValueError(f"zero: with a pipeline or tensor parallelism only stage 1 (the "
                             f"optimizer state sharded over dp) is supported, got {zero!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: expected one of {', '.join(SCHEDULES)}, got {schedule!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches: must be a positive int, not {microbatches!r}")
        self.grid = ProcessGrid(comm, dp, pp, tp, cp)
        self.cp, self.cp_mode, self.cp_balance = cp, cp_mode, cp_balance
        self.sp = sp and tp > 1
        self.pp, self.stage = pp, self.grid.p
        self.microbatches, self.schedule, self.algorithm = microbatches, schedule, algorithm
        self.verbose, self.zero = verbose, zero
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.tied_comm: Communicator | None = None
        self._shapes: dict[Any, list[tuple[tuple[int, ...], Any]]] = {}
        self._receives: dict[tuple, PersistentRequest] = {}
        #: the last step's op order, its peak of microbatches in flight and of their stage outputs
        #: bytes (the activations a stage holds for backward grow with both), seconds idle
        #: (waiting on receives) and the step's seconds
        self.last_order: list[tuple[str, int]] = []
        self.last_peak = self.last_peak_bytes = 0
        self.idle_s = self.step_s = 0.0
        self.messages = self.bytes_sent = 0
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
        return [("replica lead", dp), ("replica rank", self.comm.size - dp)]

    def build(self, make_model: Callable[[], Any]) -> Any:
        """The model with the parameters of this rank's stage only (the tied embedding on the
        first and last stages), each equal to the whole model's; with tp > 1 the whole model
        (each tp rank cuts its shards from it)."""
        if self.grid.tp > 1:
            return make_model()
        skeleton, index = partial.skeleton(make_model)
        pieces = model_pieces(skeleton)
        bounds = partition([w for _, w in pieces], self.pp)
        keep = set()
        for piece, _ in pieces[bounds[self.stage]:bounds[self.stage + 1]]:
            keep |= {index[id(p)] for p in piece.parameters()}
            tied = getattr(piece, "tied", None)
            if tied is not None:
                keep.add(index[id(tied)])
        return partial.build(make_model, keep, _placeholder)

    def setup(self, model: Any, make_optimizer: MakeOptimizer) -> None:
        self.model = model
        self.tp_model = None
        if self.grid.tp > 1 or self.cp > 1:
            if not hasattr(model, "blocks"):
                raise ValueError(f"{'tp' if self.grid.tp > 1 else 'cp'}: tensor and context "
                                 f"parallelism need the GPT")
            self.tp_model = TensorParallelGPT(model, self.grid.tp_comm, self.algorithm,
                                              sequence_parallel=self.sp)
        pieces = model_pieces(self.tp_model or model)
        if self.sp:
            pieces[0][0].enter = self.tp_model.enter_sequence
            pieces[-1][0].leave = self.tp_model.leave_sequence
        if self.cp > 1:  # each rank holds a slice of every sequence
            pieces[0][0].sequence_shard = (self.grid.c, self.cp, self.cp_balance)
            for block in self.tp_model.blocks:
                block.attn.attend = self._context_attention
        self.bounds = partition([w for _, w in pieces], self.pp)
        self.all_pieces = [piece for piece, _ in pieces]
        self.pieces = self.all_pieces[self.bounds[self.stage]:self.bounds[self.stage + 1]]
        self.stage_params = self._params_of(self.stage)
        tied = getattr(self.pieces[-1], "tied", None) if self.last else None
        self.tied = tied if tied is not None and self.pp > 1 else None
        if self.tied is not None:
            self.stage_params.append(self.tied)
        if self.first or self.last:  # every pipeline: the stages that hold the tied embedding
            tied_pieces = self.all_pieces[-1]
            if getattr(tied_pieces, "tied", None) is not None and self.pp > 1:
                self.tied_comm = self.grid.pp_comm.sub([0, self.pp - 1])
        self.optimizer = self._stage_optimizer(make_optimizer)
        self._owned = {id(p) for p in self.stage_params}
        self._release_others()
        memory.hold_all([p.data for p in self.stage_params], "parameters")
        self._mixed_precision(self.optimizer.optimizer
                              if isinstance(self.optimizer, ShardedOptimizer) else self.optimizer)

    def _mixed_precision(self, optimizer: Any) -> None:
        """With 16-bit parameters (`mpdl.training.precision`): activations and their gradients
        travel between stages in that dtype, and `optimizer` (over float32 master weights) skips
        a step on every rank of the grid when a gradient on any rank is not finite."""
        params = self.model.parameters()
        #: the dtype of the messages between stages (None: the activations' own)
        self.message_dtype = amp.compute_dtype(params[0].data) if params else None
        if hasattr(optimizer, "agree"):
            optimizer.agree = self._all_finite

    def _all_finite(self, finite: bool) -> bool:
        """Whether this rank's gradients and every other rank's are finite (one all-reduce of a
        flag over the whole grid)."""
        flags = allreduce(np.array([0 if finite else 1], np.int32), op="max", comm=self.comm)
        return not flags[0]

    def _message(self, a: Any) -> Any:
        """An activation or gradient as it travels: contiguous, in the message dtype."""
        if self.message_dtype is None:
            return get_array_module(a).ascontiguousarray(a)
        with np.errstate(over="ignore"):  # float16 overflow is inf, for the loss scaler to see
            return a.astype(self.message_dtype)

    def _stage_optimizer(self, make_optimizer: MakeOptimizer) -> Any:
        """The optimizer of `stage_params` (with ZeRO-1 its state sharded over dp)."""
        if self.zero:
            return ShardedOptimizer(self.stage_params, make_optimizer, self.grid.dp_comm,
                                    self.algorithm)
        return make_optimizer(self.stage_params)

    def _context_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return context_attention(q, k, v, self.grid.cp_comm, self.cp_mode, self.cp_balance)

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

    def _all_params(self) -> list[Any]:
        """Every trainable parameter of the model and of its tensor-parallel pieces, once."""
        seen: dict[int, Any] = {}
        for p in [*self.model.parameters(), *(self.tp_model.parameters() if self.tp_model
                                              is not None else [])]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _release_others(self) -> None:
        """Drop the values of the parameters this rank does not train (other stages', the whole
        tensors behind tensor-parallel shards): each becomes a zero-byte placeholder."""
        for p in self._all_params():
            if id(p) not in self._owned:
                p.data = _placeholder(p)

    def _account(self) -> None:
        """This rank's bytes of parameters held, and of model state (parameters, their
        gradients, optimizer state)."""
        params = sum(int(p.data.nbytes) for p in self._all_params() if not _is_placeholder(p.data))
        grads = sum(int(p.data.nbytes) for p in self.stage_params)
        optim = self.optimizer.state_nbytes() if self.zero else sum(
            int(v.nbytes) for st in self.optimizer.state.values() for v in st.values()
            if hasattr(v, "nbytes") and np.ndim(v) > 0)
        self.rank_parameter_bytes, self.rank_state_bytes = params, params + grads + optim

    def _params_of(self, stage: int) -> list[Any]:
        seen: dict[int, Any] = {}
        for piece in self.all_pieces[self.bounds[stage]:self.bounds[stage + 1]]:
            for p in piece.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

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
                for s in range(self.pp):
                    for piece in self.all_pieces[self.bounds[s]:self.bounds[s + 1]]:
                        h = piece(h)
                    shapes.append((tuple(h.shape[1:]), h.data.dtype))
            self.model.train(was)
            self._shapes[key] = shapes
        return self._shapes[key]

    def _say(self, text: str) -> None:
        if self.verbose:
            print(f"[rank {self.comm.rank} stage {self.stage} dp {self.grid.d}] {text}",
                  file=sys.stderr, flush=True)

    def _send(self, buf: Any, stage: int, what: str, j: int, mb: Microbatches,
              record: PipelineRecorder) -> None:
        """Start sending microbatch j's activation or gradient to `stage` (non-blocking: the
        request and its buffer are kept in `mb.sends` until the end of the step)."""
        self._say(f"send {what} mb {j} -> stage {stage} ({buf.nbytes} bytes)")
        record.send(what, j, stage, buf.nbytes)
        mb.sends.append((self.grid.pp_comm.isend(buf, stage, step=(what, j)), buf))

    def _recv(self, xp: Any, shape: tuple[int, ...], dtype: Any, stage: int, what: str,
              j: int) -> Any:
        """Receive microbatch j's activation or gradient from `stage` into this rank's buffer for
        it: one persistent receive per (what, j, shape, dtype), kept from step to step (a
        step's inputs and output gradients are done with before the next step receives)."""
        self._say(f"recv {_WHAT[what]} mb {j} <- stage {stage}")
        key = (what, j, shape, np.dtype(dtype).str, stage)
        request = self._receives.get(key)
        if request is None:
            # those of two batch sizes are kept (an epoch's batches and its short last one)
            if len(self._receives) >= 4 * self.microbatches:
                for r in self._receives.values():
                    r.free()
                self._receives.clear()
            buf = xp.empty(shape, dtype=dtype)
            memory.hold(buf, "communication")
            request = self._receives[key] = self.grid.pp_comm.recv_init(buf, stage, step=(what, j))
        self.grid.pp_comm.waitall([request.start()])
        return request.buf

    def step(self, batch: Batch) -> StepResult:
        """The schedule's ops over this step's microbatches, then the gradients' sums and the
        optimizer step; a `PipelineRecorder` keeps the step's figures."""
        record = PipelineRecorder()
        self.optimizer.lr = batch.lr
        mb = self._microbatches(batch)
        order = schedule_ops(self.schedule, len(mb.parts), self.pp, self.stage)
        for kind, j in order:
            if kind == "F":
                self._forward(mb, j, record)
            else:
                self._backward(mb, j, record)
        self._update(mb, record)
        self._share_metrics(record.result)
        result = record.close()
        self.last_order, self.last_peak, self.last_peak_bytes = order, record.peak, record.peak_bytes
        self.idle_s, self.step_s = record.idle_s, record.step_s
        self.messages += record.messages
        self.bytes_sent += record.bytes_sent
        self._account()
        return result

    def _microbatches(self, batch: Batch) -> Microbatches:
        """The batch cut into `microbatches` parts (the empty ones dropped, unless
        `lockstep_microbatches`)."""
        parts = [p for p in np.array_split(np.arange(len(batch.y)), self.microbatches)
                 if len(p) or self.lockstep_microbatches]
        xp = get_array_module(self.stage_params[0].data) if self.stage_params else np
        shapes = self._boundary_shapes(self._local(batch.x)) if parts and self.pp > 1 else []
        return Microbatches(batch, parts, xp, shapes)

    def _forward(self, mb: Microbatches, j: int, record: PipelineRecorder) -> None:
        """Op F j: microbatch j's input through this stage's pieces; the last stage takes the
        loss, the others send the output to the next stage."""
        record.op_begins()
        h = self._stage_input(mb, j)
        record.compute_begins()
        # as the loss (MoE layers), times fp16's loss scale
        with aux_loss_scale(mb.share(j) * getattr(self.optimizer, "loss_scale", 1.0)):
            for piece in self.pieces:
                h = piece(h)
        record.compute_ends()
        if self.last:
            mb.outputs[j] = self._microbatch_loss(h, mb, j, record.result)
        else:
            mb.outputs[j] = h
            self._send(self._message(h.data), self.stage + 1, "act", j, mb, record)
        record.forward_done(j, h.data.nbytes, None if self.first else self.stage - 1)

    def _stage_input(self, mb: Microbatches, j: int) -> Tensor:
        """Microbatch j's input to this stage: its rows of the batch on the first stage, else the
        previous stage's output, received (a leaf whose gradient is sent back)."""
        if self.first:
            return Tensor(self._local(mb.rows(mb.batch.x, j)))
        shape, dtype = mb.shapes[self.stage - 1]
        buf = self._recv(mb.xp, (len(mb.parts[j]), *shape), self.message_dtype or dtype,
                         self.stage - 1, "act", j)
        mb.inputs[j] = Tensor(buf.astype(dtype, copy=False), requires_grad=True)
        return mb.inputs[j]

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

    def _backward(self, mb: Microbatches, j: int, record: PipelineRecorder) -> None:
        """Op B j: backward from microbatch j's output (on the last stage its loss, elsewhere with
        the gradient received from the next stage), then its input's gradient to the previous
        stage."""
        out = mb.outputs.pop(j)
        if self.last:
            record.compute_begins()
            out.backward()
        else:
            record.op_begins()
            grad = self._recv(mb.xp, out.shape, self.message_dtype or out.data.dtype,
                              self.stage + 1, "grad", j)
            record.compute_begins()
            out.backward(grad.astype(out.data.dtype, copy=False))
        record.compute_ends()
        if not self.first:
            self._send(self._message(mb.inputs.pop(j).grad), self.stage - 1, "grad", j, mb,
                       record)
        record.backward_done(j, None if self.last else self.stage + 1)

    def _update(self, mb: Microbatches, record: PipelineRecorder) -> None:
        """Wait for the step's sends, sum the gradients and take the optimizer step."""
        record.synchronising()
        self.grid.pp_comm.waitall([request for request, _ in mb.sends])
        self._synchronise()
        record.optimizer_step()
        self.optimizer.step()
        self.optimizer.zero_grad()
        record.stepped("reduce-scatter, optimizer step, all-gather over dp" if self.zero
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
        vec = broadcast(vec, root=self.pp - 1, comm=self.grid.pp_comm)
        result.loss, result.correct, result.samples = float(vec[0]), float(vec[1]), int(vec[2])

    # -- the whole model -------------------------------------------------------------------------
    @contextmanager
    def gathered(self, optimizer_state: bool = False) -> Any:
        """The whole model current on every rank (a broadcast per stage along pp, then an
        all-gather of the tensor-parallel shards); with `optimizer_state`, `state_dict()` gives
        the optimizer state of the whole model in a one-rank optimizer's layout. On leaving, the
        shards are taken from the whole model again (which a checkpoint may have replaced)."""
        figures = allreduce(np.array([self.rank_parameter_bytes, self.rank_state_bytes],
                                     dtype=np.float64), op="max", comm=self.comm)
        self.parameter_bytes, self.model_state_bytes = int(figures[0]), int(figures[1])
        for s in range(self.pp):
            params = self._params_of(s)
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

    def describe(self, final: bool = False) -> str:
        if final:
            return ""
        sizes = [sum(p.size for p in self._params_of(s)) for s in range(self.pp)]
        tp = f"tensor parallel over {self.grid.tp} ranks, " if self.grid.tp > 1 else ""
        if self.sp:
            tp = f"tensor and sequence parallel over {self.grid.tp} ranks, "
        if self.cp > 1:
            tp += (f"context parallel over {self.cp} ranks ({self.cp_mode}, "
                   f"{self.cp_balance}), ")
        return (f"{tp}pipeline {self.schedule}, {self.pp} stages (pieces {self.bounds}, parameters "
                f"{sizes}), {self.microbatches} microbatches, "
                f"{f'dp x cp {self.grid.dp} x {self.cp}' if self.cp > 1 else f'dp {self.grid.dp}'} "
                f"{'ZeRO-1 reduce-scatter/all-gather' if self.zero else 'all-reduce'} "
                f"{self.algorithm}; bubble formula "
                f"{bubble_formula(self.pp, self.microbatches):.1%}")

    def report(self, final: bool = False) -> dict[str, Any]:
        fields: dict[str, Any] = {"algorithm": self.algorithm,
                                  "mode": self.mode if self.pp > 1 else
                                  ("tensor" if self.grid.tp > 1 else "context"),
                                  "dp": self.grid.dp, "pp": self.pp, "cp": self.cp,
                                  "tp": self.grid.tp, "cp_mode": self.cp_mode,
                                  "cp_balance": self.cp_balance, "sp": self.sp,
                                  "schedule": self.schedule, "microbatches": self.microbatches,
                                  "zero_stage": self.zero,
                                  "bubble_formula": bubble_formula(self.pp, self.microbatches)}
        if final:
            fields.update(stage=self.stage, p2p_messages=self.messages,
                          parameter_bytes=self.parameter_bytes,
                          model_state_bytes=self.model_state_bytes,
                          p2p_bytes=self.bytes_sent, peak_in_flight=self.last_peak,
                          peak_output_bytes=self.last_peak_bytes)
        return fields

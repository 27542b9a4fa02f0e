"""A rank's stage of the pipeline: the model cut into pieces and stages, and built.

The model is a sequence of pieces (`model_pieces`): the children of an `nn.Sequential`, or for a
GPT the embedding piece (token + position embedding), each block, and the head (final LayerNorm
and the output projection, tied to the token embedding). `partition_by_weight` cuts the pieces
into `pp` contiguous stages **balanced by parameter count** (the head counts the tied matrix it
multiplies by), minimising the largest stage.

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
copies take the same optimizer step, so they stay equal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import memory
from mpdl.autograd import amp, nn, partial
from mpdl.autograd import functional as F
from mpdl.autograd.tensor import Tensor
from mpdl.backend import get_array_module
from mpdl.collectives import allreduce
from mpdl.parallel.context import context_attention, positions
from mpdl.parallel.dpshard import ShardedOptimizer
from mpdl.parallel.shards import placeholder as _placeholder
from mpdl.parallel.strategy import MakeOptimizer, counted_once
from mpdl.parallel.tensor_parallel import TensorParallelGPT


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


def partition_by_weight(weights: list[int], stages: int) -> list[int]:
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


def _is_placeholder(a: Any) -> bool:
    """Whether a parameter's data is a dropped value (`_placeholder`: no bytes behind it)."""
    return a.size > 1 and not any(a.strides)


class PipelineStage:
    """The part of `PipelineStrategy` that builds and sets up this rank's stage: its pieces, its
    parameters (the others dropped) and its optimizer."""

    def build(self, make_model: Callable[[], Any]) -> Any:
        """The model with the parameters of this rank's stage only (the tied embedding on the
        first and last stages), each equal to the whole model's; with tp > 1 the whole model
        (each tp rank cuts its shards from it)."""
        if self.grid.tp > 1:
            return make_model()
        skeleton, index = partial.skeleton(make_model)
        pieces = model_pieces(skeleton)
        bounds = self._partition([w for _, w in pieces])
        keep = set()
        for piece, _ in [x for s in self.chunks for x in pieces[bounds[s]:bounds[s + 1]]]:
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
        self.bounds = self._partition([w for _, w in pieces])
        self.all_pieces = [piece for piece, _ in pieces]
        self.pieces = [piece for s in self.chunks
                       for piece in self.all_pieces[self.bounds[s]:self.bounds[s + 1]]]
        self.stage_params = self._rank_params(self.stage)
        ends = sorted({self.rank_of[0], self.rank_of[-1]})  # the ranks of the first and last stage
        tied = getattr(self.all_pieces[-1], "tied", None) if len(ends) == 2 else None
        # the tied embedding is on two ranks: each holds a copy and adds its part of the gradient
        self.tied = tied if self.last else None
        if self.tied is not None:
            self.stage_params.append(self.tied)
        if tied is not None and (self.first or self.last):  # every pipeline's two ends
            self.tied_comm = self.grid.pp_comm.sub(ends)
        self.optimizer = self._stage_optimizer(make_optimizer)
        if hasattr(self.optimizer, "global_norm"):
            self._tp_shards = {id(shard) for shard, _, _ in (self.tp_model.shards
                                                             if self.tp_model else [])}
            self.optimizer.global_norm(counted_once(self.comm, self._counted))
        if self.tp_model is not None and not self.zero and hasattr(self.optimizer, "split"):
            self.optimizer.split(self.tp_model.whole_map,  # Muon: the split matrices gathered
                                 {id(shard): full for shard, full, _ in self.tp_model.shards})
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

    def _counted(self, p: Any) -> bool:
        """Whether this rank counts p's gradient in the global norm, so that each element of
        the model counts once over the grid: the tied embedding on the first stage, a part
        replicated over tp on tp rank 0, over cp on cp rank 0, over dp (unless ZeRO shards it)
        on dp rank 0."""
        if p is self.tied or (self.grid.t and id(p) not in self._tp_shards) or self.grid.c:
            return False
        return self._counted_over_dp(p)

    def _counted_over_dp(self, p: Any) -> bool:
        """Whether p's gradient, summed over the data-parallel ranks, counts on this one."""
        return bool(self.zero) or self.grid.d == 0

    def _stage_optimizer(self, make_optimizer: MakeOptimizer) -> Any:
        """The optimizer of `stage_params` (with ZeRO-1 its state sharded over dp)."""
        if self.zero:
            return ShardedOptimizer(self.stage_params, make_optimizer, self.grid.dp_comm,
                                    self.algorithm)
        return make_optimizer(self.stage_params)

    def _context_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return context_attention(q, k, v, self.grid.cp_comm, self.cp_mode, self.cp_balance)

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

    def _partition(self, weights: list[int]) -> list[int]:
        """The bounds of the pp·v stages (`partition_by_weight`), or a one-line error naming the
        flags."""
        stages = len(self.rank_of)
        if self.v > 1 and len(weights) < stages:
            raise ValueError(f"virtual-stages: pp x {self.v} = {stages} stages need at least as "
                             f"many model pieces, the model has {len(weights)}")
        return partition_by_weight(weights, stages)

    def _rank_params(self, rank: int) -> list[Any]:
        """The parameters of the stages of `rank`, once each."""
        seen: dict[int, Any] = {}
        for s, r in enumerate(self.rank_of):
            if r == rank:
                for p in self._params_of(s):
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _params_of(self, stage: int) -> list[Any]:
        seen: dict[int, Any] = {}
        for piece in self.all_pieces[self.bounds[stage]:self.bounds[stage + 1]]:
            for p in piece.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

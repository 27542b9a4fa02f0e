"""Continuous batching over a paged KV cache: requests join and leave the running batch at every
step (the scheduling of Orca and vLLM).

Each `Engine.step`:

1. **admits** waiting requests while the batch has room (`max_batch`) and the pool has the pages
   they may come to hold (prompt and max_tokens, at most a block) beside those the running ones
   may still take; a prompt takes the shared pages of its longest computed prefix first, and
   every sequence takes its pages one at a time as it grows;
2. **schedules** within a token budget: one decode token for every running sequence whose prompt
   is computed, then the rest of the budget for prompt tokens (chunked prefill: a long prompt
   takes several steps while the others keep decoding);
3. runs the decode rows and the prefill rows (`mpdl.inference.paged.forward`), samples a token for
   every sequence whose last known token was computed, and **retires** the sequences that reached
   max_tokens or a stop string, freeing their pages.

A sequence draws from its own generator `numpy.random.default_rng((seed, 0))` with
`mpdl generate`'s sampling, so its text does not depend on what else runs (temperature 0 or
top_k = 1 is greedy). **At the block size** a sequence is started again from its last block_size
tokens, as `mpdl generate` does. Should the pool run out of pages all the same (shared pages
counted once for several sequences), the youngest sequence is **preempted**: its pages are freed
and it waits again, keeping its tokens, to be computed anew.

`static=True` admits only into an empty batch (static batching: the batch runs until its longest
sequence ends), and `contiguous=True` gives every sequence the pages of a whole block at
admission (a contiguous cache's memory): the baselines benchmarks/bench_serve.py measures against.
Every rank of a replica runs the same engine on the same admissions and cancellations (`plan`)
and so takes the same steps and tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpdl.backend import to_host
from mpdl.comm import MPIComm
from mpdl.inference.inference import Decoder
from mpdl.inference.paged import OutOfPages, PagePool, forward, last_positions, prefix_key
from mpdl.inference.serving import blocks_by_count, tp_communicator
from mpdl.models.gpt import _sample
from mpdl.parallel.grid import ProcessGrid


@dataclass
class SamplingParams:
    """How a request samples: max_tokens new tokens at temperature (0: greedy), among the top_k
    most likely, within top_p of the probability; stop strings; a seed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0


@dataclass(eq=False)
class Seq:
    """One request's state: its tokens (prompt then new), the pages of its block table, how many
    of its tokens are computed, from which token its window starts."""

    rid: Any
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    computed: int = 0
    window: int = 0
    text: str = ""
    finish: str | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        self.rng = np.random.default_rng((self.params.seed, 0))

    @property
    def new(self) -> int:
        return len(self.tokens) - len(self.prompt)


class Pipe:
    """This rank's pipeline stage among `comm`'s (an mpi4py communicator of the replica's stages,
    stage i its rank i): hidden states come from the stage before and go to the next; the last
    stage's sampled tokens go to every stage."""

    def __init__(self, comm: Any) -> None:
        self.comm, self.stage, self.stages = comm, comm.Get_rank(), comm.Get_size()
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1

    def hidden_in(self, shape: tuple[int, ...], dtype: Any) -> Any:
        if self.first:
            return None
        x = np.empty(shape, dtype=dtype)
        self.comm.Recv(x, source=self.stage - 1, tag=1)
        return x

    def hidden_out(self, x: Any) -> None:
        if not self.last:
            self.comm.Send(np.ascontiguousarray(to_host(x)), dest=self.stage + 1, tag=1)

    def tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        buf = np.array(tokens if self.last else [0] * count, dtype=np.int64)
        self.comm.Bcast(buf, root=self.stages - 1)
        return buf.tolist()


class Engine:
    """Continuous batching of requests on one replica's `decoder` with a `pool` of pages;
    `vocab`: the characters of the token ids; `pipe`: this rank's pipeline stage (the decoder
    then holds that stage's blocks; without it, all of them, the embeddings and the head)."""

    def __init__(self, decoder: Decoder, pool: PagePool, vocab: str, max_batch: int = 64,
                 token_budget: int = 512, static: bool = False, contiguous: bool = False,
                 pipe: Pipe | None = None) -> None:
        self.decoder, self.pool, self.vocab, self.pipe = decoder, pool, vocab, pipe
        self.max_batch, self.token_budget = max_batch, token_budget
        self.static, self.contiguous = static, contiguous
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.steps = 0

    # -- requests ------------------------------------------------------------------------------
    def add(self, rid: Any, prompt: list[int], params: SamplingParams) -> None:
        self.waiting.append(Seq(rid, prompt, params))

    def cancel(self, rid: Any) -> None:
        """Drop a request (waiting or running) and free its pages."""
        for s in [s for s in (*self.running, *self.waiting) if s.rid == rid]:
            if s in self.running:
                self.running.remove(s)
            self.pool.release(s.table)
            s.table = []
        self.waiting = deque(s for s in self.waiting if s.rid != rid)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- a step --------------------------------------------------------------------------------
    def step(self) -> list[tuple[Seq, str]]:
        """One scheduling step; returns (sequence, new text) for every sequence that got a token
        (its `finish` set when it is done)."""
        self.steps += 1
        self._admit()
        decode = [s for s in self.running if s.computed == len(s.tokens) - s.window - 1]
        budget = max(0, self.token_budget - len(decode))
        prefill = []
        for s in self.running:
            left = len(s.tokens) - s.window - s.computed
            if s not in decode and left > 0 and budget > 0:
                prefill.append((s, min(left, budget)))
                budget -= prefill[-1][1]
        out = []
        for group in ([(s, 1) for s in decode], prefill):
            group = [(s, n) for s, n in group if self._grow(s, s.computed + n)]
            group = [(s, n) for s, n in group if s in self.running]  # none preempted meanwhile
            if not group:
                continue
            rows = [(s.table, s.computed, s.tokens[s.window + s.computed:
                                                    s.window + s.computed + n]) for s, n in group]
            hidden = self._forward(rows)
            for s, n in group:
                s.computed += n
                self._register(s)
            ready = [b for b, (s, _) in enumerate(group)
                     if s.computed == len(s.tokens) - s.window]
            if ready:
                tokens = None
                if self.pipe is None or self.pipe.last:
                    logits = to_host(self.decoder.logits(last_positions(hidden, rows)[ready]))
                    tokens = [next_token(logits[i], group[b][0].params, group[b][0].rng)
                              for i, b in enumerate(ready)]
                if self.pipe is not None:
                    tokens = self.pipe.tokens(tokens, len(ready))
                emitted = [self._emit(group[b][0], token) for b, token in zip(ready, tokens,
                                                                               strict=True)]
                for s, _ in emitted:  # retired now: the next group's pages may not preempt them
                    if s.finish is not None:
                        self.running.remove(s)
                        self.pool.release(s.table)
                out += emitted
        return out

    def _admit(self) -> None:
        """Admit waiting sequences while the pages free, less those the running sequences may
        still take up to their max_tokens (or a block), hold what the next one may take."""
        if self.static and self.running:
            return
        outstanding = sum(self._need(s) - len(s.table) for s in self.running)
        while self.waiting and len(self.running) < self.max_batch:
            s = self.waiting[0]
            if not s.table and s.window == 0:
                self._share(s)
            if len(self.pool.free) - outstanding < self._need(s) - len(s.table):
                break
            self._grow(s, self.decoder.block_size if self.contiguous else s.computed + 1,
                       preempt=False)
            outstanding += self._need(s) - len(s.table)
            self.running.append(self.waiting.popleft())

    def _need(self, s: Seq) -> int:
        """The pages s holds at most: a block's for a contiguous cache, else those of its
        prompt and max_tokens up to a block."""
        size, block = self.pool.page_size, self.decoder.block_size
        if self.contiguous:
            return math.ceil(block / size)
        return math.ceil(min(len(s.prompt) + s.params.max_tokens, block) / size)

    def _share(self, s: Seq) -> None:
        """Take the shared pages of s's longest computed prompt prefix (never its last token,
        whose logits it needs)."""
        size = self.pool.page_size
        for end in range(size, len(s.prompt), size):
            page = self.pool.share(prefix_key(s.prompt, end))
            if page is None:
                break
            s.table.append(page)
            s.computed = end

    def _register(self, s: Seq) -> None:
        size = self.pool.page_size
        if s.window:
            return
        for i in range(min(s.computed, len(s.prompt)) // size):
            self.pool.register(prefix_key(s.prompt, (i + 1) * size), s.table[i])

    def _grow(self, s: Seq, positions: int, preempt: bool = True) -> bool:
        """Give s pages for `positions` positions, preempting the youngest other sequence when
        the pool is empty; False when s itself had to wait."""
        while len(s.table) * self.pool.page_size < positions:
            try:
                s.table.append(self.pool.take())
            except OutOfPages:
                others = [o for o in self.running if o is not s]
                if not preempt or not others:
                    return False
                self._preempt(others[-1])
        return True

    def _preempt(self, s: Seq) -> None:
        self.running.remove(s)
        self.pool.release(s.table)
        s.table, s.computed = [], 0
        self.waiting.appendleft(s)

    def _forward(self, rows: list) -> Any:
        """The rows through this rank's blocks: from the stage before and on to the next one
        on a pipeline."""
        if self.pipe is None:
            return forward(self.decoder, self.pool, rows)
        shape = (len(rows), max(len(r[2]) for r in rows), self.decoder.n_embd)
        x = forward(self.decoder, self.pool, rows, self.pipe.hidden_in(shape, self.decoder.dtype))
        self.pipe.hidden_out(x)
        return x

    def _emit(self, s: Seq, token: int) -> tuple[Seq, str]:
        s.tokens.append(token)
        piece = self.vocab[token]
        s.text += piece
        p = s.params
        if len(s.tokens) - s.window > self.decoder.block_size:
            self.pool.release(s.table)
            s.table, s.computed = [], 0
            s.window = len(s.tokens) - self.decoder.block_size
        for stop in p.stop:
            at = s.text.find(stop, max(0, len(s.text) - len(piece) - len(stop) + 1))
            if at >= 0:
                piece = piece[:max(0, len(piece) - (len(s.text) - at))]
                s.text, s.finish = s.text[:at], "stop"
                return s, piece
        if s.new >= p.max_tokens:
            s.finish = "length"
        return s, piece


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One token from a row of logits: greedy at temperature 0 or top_k 1, else `mpdl generate`'s
    draw, restricted to the smallest set of tokens holding top_p of the probability when
    top_p < 1."""
    if params.temperature == 0 or params.top_k == 1:
        return int(np.argmax(logits))
    logits = np.asarray(logits, dtype=np.float64)[None]
    if params.top_p >= 1:
        return int(_sample(logits, params.temperature, params.top_k, rng)[0, 0])
    z = logits[0] / params.temperature
    if params.top_k is not None and params.top_k < len(z):
        z = np.where(z < np.partition(z, -params.top_k)[-params.top_k], -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = order[:int(np.searchsorted(np.cumsum(p[order]), params.top_p)) + 1]
    q = np.zeros_like(p)
    q[keep] = p[keep] / p[keep].sum()
    return int(min((q.cumsum() < rng.random()).sum(), len(q) - 1))


def replica_engine(comm: Any, gpt: Any, vocab: str, dp: int, pp: int, tp: int, page_size: int,
                   pages: int, **options: Any) -> tuple[Engine, Any, Any]:
    """This rank's engine on the (dp, pp, tp) grid over `comm` (collective): stage p of its
    replica holds the blocks `blocks_by_count(n_layer, pp, p)` and their pages, a tp rank its heads.
    Returns the engine, the replica's mpi4py communicator (the first rank's commands go over it;
    None for a replica of one rank) and the grid."""
    grid = ProcessGrid(comm, dp, pp, tp)
    decoder = Decoder(gpt, blocks_by_count(gpt.n_layer, pp, grid.p),
                      tp_communicator(comm, grid) if tp > 1 else None,
                      embed=grid.p == 0, head=grid.p == pp - 1)
    pool = PagePool(len(decoder.layers), decoder.heads, decoder.head_dim, pages, page_size,
                    decoder.dtype, decoder.xp)
    mpi = comm.mpi if isinstance(comm, MPIComm) else None
    group = mpi.Split(grid.d, grid.p * tp + grid.t) if mpi is not None and pp * tp > 1 else None
    pipe = Pipe(mpi.Split(grid.d * tp + grid.t, grid.p)) if mpi is not None and pp > 1 else None
    return Engine(decoder, pool, vocab, pipe=pipe, **options), group, grid

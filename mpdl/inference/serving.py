"""Batched generation from a GPT on a (dp, pp, tp) grid of ranks, with each sequence's timings.

    world = dp × pp × tp        (`mpdl.parallel.grid.ProcessGrid`: tp ranks neighbours)

**Data parallel:** the prompts are cut into dp contiguous parts, one per replica (a replica may
get none). **Pipeline:** a replica's prompts are cut into micro-batches; stage s runs the blocks
`blocks_by_count(n_layer, pp, s)` of every micro-batch in turn and sends its hidden states to stage
s+1, the last stage samples the next tokens and sends them back to stage 0, which embeds them at
the next step. While the last stage samples micro-batch j, stage 0 already runs micro-batch j+1:
with m ≥ pp micro-batches every stage has work at every step. **Tensor parallel:** every stage's
blocks are split over its tp ranks (`mpdl.inference.inference.Decoder`); all tp ranks of a stage
run the same steps and sample the same tokens.

A step of a micro-batch is either a **prefill** or a one-token **decode** step over the KV cache.
The first step prefills the prompts. **At the block size:** the GPT has learned positions
0..block_size-1 only; once a sequence of the micro-batch is longer than block_size, each further
step prefills again the last block_size tokens of every sequence (a sliding window, as
`GPT.generate` feeds the last block_size tokens), so the tokens stay those of the uncached path,
and those steps cost a prefill each.

Sampling: sequence i (its index among all prompts) draws from its own generator
`numpy.random.default_rng((seed, i))`, so its tokens do not depend on the layout; `top_k=1` is
greedy decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpdl.backend import to_host
from mpdl.comm import Communicator, MPIComm, as_communicator
from mpdl.inference.inference import Decoder
from mpdl.models.gpt import _sample
from mpdl.parallel.grid import ProcessGrid


@dataclass
class Sequence:
    """One prompt's generation: its index among the prompts, its length, its tokens (prompt
    then new) and when each new token was ready (seconds from the start)."""

    index: int
    prompt_len: int
    tokens: list[int]
    token_times: list[float] = field(default_factory=list)

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def ttft_s(self) -> float:
        """Time to first token: from the start to the first new token (NaN when none)."""
        return self.token_times[0] if self.token_times else float("nan")

    @property
    def latencies_s(self) -> list[float]:
        """The times between consecutive new tokens."""
        return list(np.diff(self.token_times))

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the time from the start to the last one."""
        return len(self.token_times) / self.token_times[-1] if self.token_times else 0.0


@dataclass
class RankFigures:
    """What one rank did: its grid coordinates, its replica's prompts and new tokens, its wall
    time and its share of the tokens per second."""

    rank: int
    coords: tuple[int, int, int]
    prompts: int
    new_tokens: int
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


def check_layout(world: int, n_head: int, n_layer: int, dp: int | None, pp: int,
                 tp: int) -> tuple[int, int, int]:
    """(dp, pp, tp) for `world` ranks (dp by default world / (pp·tp)); ValueError naming the
    flag when a degree is not positive, tp does not divide the heads, pp exceeds the blocks or
    the product is not the world size."""
    for name, value in (("--pp", pp), ("--tp", tp), ("--dp", dp)):
        if value is not None and value < 1:
            raise ValueError(f"{name}: expected a positive number, got {value}")
    if n_head % tp:
        raise ValueError(f"--tp: {tp} tensor-parallel ranks must divide the model's {n_head} heads")
    if pp > n_layer:
        raise ValueError(f"--pp: {pp} pipeline stages need at least as many blocks, the model "
                         f"has {n_layer}")
    if dp is None:
        if world % (pp * tp):
            raise ValueError(f"--pp × --tp = {pp} × {tp} must divide the {world} ranks")
        dp = world // (pp * tp)
    if dp * pp * tp != world:
        raise ValueError(f"--dp × --pp × --tp = {dp} × {pp} × {tp} = {dp * pp * tp} must equal "
                         f"the {world} ranks")
    return dp, pp, tp


def blocks_by_count(n_layer: int, pp: int, stage: int) -> range:
    """The blocks of pipeline stage `stage`, cut by count: contiguous, as even as can be (earlier
    stages one more), so the stages hold even shares of the KV cache (training's pipeline cuts by
    parameter count instead: `pipeline.partition_by_weight`)."""
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class _MicroBatch:
    """The state of a micro-batch on one stage: its sequences, lengths and KV cache."""

    def __init__(self, decoder: Decoder, indices: list[int], prompts: list[list[int]]) -> None:
        self.indices = indices
        self.sequences = [Sequence(i, len(p), list(p)) for i, p in zip(indices, prompts,
                                                                         strict=True)]
        self.lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        self.cache = decoder.new_cache(len(prompts))

    def window_ids(self, windows: np.ndarray) -> np.ndarray:
        """Right-padded token ids (B, max windows) of each sequence's last windows[b] tokens."""
        ids = np.zeros((len(windows), int(windows.max())), dtype=np.int64)
        for b, (s, n) in enumerate(zip(self.sequences, windows.tolist(), strict=True)):
            ids[b, :n] = s.tokens[len(s.tokens) - n:]
        return ids


def generate_replica(decoder: Decoder, prompts: list[list[int]], indices: list[int],
                     max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                     seed: int = 0, pp_comm: Communicator | None = None, microbatches: int = 1,
                     start: float | None = None) -> list[Sequence]:
    """Generate `max_new_tokens` tokens after each prompt (token ids; `indices`: their places
    among all prompts) on one replica: this rank's `decoder` is stage pp_comm.rank of pp_comm.size
    (one stage without `pp_comm`). The prompts run in `microbatches` groups streamed through the
    stages. Returns the sequences on the last stage, [] on the others; token times count from
    `start` (a `time.perf_counter()`, default now)."""
    start = time.perf_counter() if start is None else start
    pp = 1 if pp_comm is None else pp_comm.size
    stage = 0 if pp_comm is None else pp_comm.rank
    first, last = stage == 0, stage == pp - 1
    groups = [g for g in np.array_split(np.arange(len(prompts)), max(1, microbatches)) if len(g)]
    batches = [_MicroBatch(decoder, [indices[i] for i in g], [prompts[i] for i in g])
               for g in groups]
    rngs = {i: np.random.default_rng((seed, i)) for i in indices} if last else {}
    xp, block, width = decoder.xp, decoder.block_size, decoder.n_embd
    pending: dict[tuple[str, int], tuple[Any, Any]] = {}

    def send(kind: str, j: int, buf: Any, dest: int) -> None:
        previous = pending.pop((kind, j), None)
        if previous is not None:
            pp_comm.waitall([previous[0]])
        pending[(kind, j)] = (pp_comm.isend(buf, dest, step=(kind, j)), buf)

    for step in range(max_new_tokens):
        for j, mb in enumerate(batches):
            n = len(mb.lengths)
            prefill = step == 0 or int(mb.lengths.max()) > block
            windows = np.minimum(mb.lengths, block)
            shape = (n, int(windows.max()) if prefill else 1, width)
            if first:
                if step > 0 and not last:
                    new = np.empty(n, dtype=np.int64)
                    pp_comm.recv(new, pp - 1, step=("tokens", j))
                    for s, token in zip(mb.sequences, new.tolist(), strict=True):
                        s.tokens.append(token)
                if prefill:
                    x = decoder.embed(mb.window_ids(windows))
                else:
                    x = decoder.embed([[s.tokens[-1]] for s in mb.sequences], mb.lengths - 1)
            else:
                x = xp.empty(shape, dtype=decoder.dtype)
                pp_comm.recv(x, stage - 1, step=("hidden", j))
            x = decoder.prefill(x, mb.cache) if prefill else decoder.step(x, mb.lengths - 1,
                                                                             mb.cache)
            if last:
                hidden = x[xp.arange(n), xp.asarray(windows - 1)] if prefill else x[:, 0]
                new = _next_tokens(to_host(decoder.logits(hidden)), mb.indices, rngs,
                                   temperature, top_k)
                now = time.perf_counter() - start
                for s, token in zip(mb.sequences, new.tolist(), strict=True):
                    s.tokens.append(token)
                    s.token_times.append(now)
                if not first and step + 1 < max_new_tokens:
                    send("tokens", j, new, 0)
            else:
                send("hidden", j, xp.ascontiguousarray(x), stage + 1)
            mb.lengths += 1
    if pending:
        pp_comm.waitall([r for r, _ in pending.values()])
    return [s for mb in batches for s in mb.sequences] if last else []


def _next_tokens(logits: np.ndarray, indices: list[int], rngs: dict[int, np.random.Generator],
                 temperature: float, top_k: int | None) -> np.ndarray:
    """One token per row of (B, V) logits: the argmax for top_k=1, else a draw from sequence
    indices[b]'s generator (`GPT.generate`'s sampling)."""
    if top_k == 1:
        return logits.argmax(axis=-1).astype(np.int64)
    logits = np.asarray(logits, dtype=np.float64)
    return np.array([int(_sample(logits[b:b + 1], temperature, top_k, rngs[i])[0, 0])
                     for b, i in enumerate(indices)], dtype=np.int64)


def tp_communicator(comm: Communicator, grid: ProcessGrid) -> Communicator:
    """The grid's tp axis as a communicator of its own (collective over comm): over MPI a split
    of comm (MPI_Comm_split), on which an all-reduce plan takes the persistent small-message path
    (a few microseconds per decode step's message on 2 ranks, against tens over the grid's view
    of comm); elsewhere the grid's `tp_comm`."""
    if not isinstance(comm, MPIComm):
        return grid.tp_comm
    return as_communicator(comm.mpi.Split(grid.d * grid.pp + grid.p, grid.t))


def serve(comm: Communicator, gpt: Any, prompts: list[list[int]], max_new_tokens: int,
          dp: int, pp: int, tp: int, temperature: float = 1.0, top_k: int | None = None,
          seed: int = 0, microbatches: int | None = None, algorithm: str = "auto"
          ) -> tuple[list[Sequence], list[RankFigures]]:
    """Generate after every prompt on the (dp, pp, tp) grid over `comm` (collective; every rank
    holds the whole `gpt` and takes its part of it). Micro-batches per replica: default pp.
    Returns every sequence in prompt order and every rank's figures, on every rank."""
    grid = ProcessGrid(comm, dp, pp, tp)
    decoder = Decoder(gpt, blocks_by_count(gpt.n_layer, pp, grid.p),
                      tp_communicator(comm, grid) if tp > 1 else None, algorithm,
                      embed=grid.p == 0, head=grid.p == pp - 1)
    part = np.array_split(np.arange(len(prompts)), dp)[grid.d]
    mine = [prompts[i] for i in part]
    comm.barrier()
    start = time.perf_counter()
    sequences = generate_replica(decoder, mine, part.tolist(), max_new_tokens, temperature,
                                 top_k, seed, grid.pp_comm if pp > 1 else None,
                                 microbatches or pp, start) if mine else []
    wall = time.perf_counter() - start
    figures = RankFigures(comm.rank, (grid.d, grid.p, grid.t), len(mine),
                          len(mine) * max_new_tokens, wall)
    keep = sequences if grid.t == 0 else []
    gathered = comm.allgather_object((keep, figures))
    everything = sorted((s for seqs, _ in gathered for s in seqs), key=lambda s: s.index)
    return everything, [f for _, f in gathered]


def summary(sequences: list[Sequence], figures: list[RankFigures]) -> dict[str, Any]:
    """The run's figures: prompts, new tokens, wall time (the slowest rank's), tokens per second
    in total, time to first token (p50, max) and per-token latency (p50, p99) over every
    sequence, in seconds."""
    new = sum(len(s.token_times) for s in sequences)
    wall = max((f.wall_s for f in figures), default=0.0)
    ttft = [s.ttft_s for s in sequences if s.token_times]
    gaps = [g for s in sequences for g in s.latencies_s]

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values else None

    return {"prompts": len(sequences), "new_tokens": new, "wall_s": wall,
            "tokens_per_s": new / wall if wall > 0 else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_max_s": max(ttft, default=None),
            "latency_p50_s": pct(gaps, 50), "latency_p99_s": pct(gaps, 99)}

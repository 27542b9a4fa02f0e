"""The schedules of a pipeline step as plain data: for p ranks, m microbatches and v model chunks
per rank, the list of ops each rank runs, and a checker that replays them.

The model is cut into S = p·v stages. A rank holds v of them, its chunks: stage c·p + r on rank r
(`afab`, `1f1b`, `interleaved`, `zb-h1`), or a V for `zb-v` and `dualpipev` (v = 2): rank r holds
stage r and stage 2p−1−r, so the first and the last stage sit on rank 0 and the turn from stage p−1
to stage p stays on rank p−1. The ops:

- `F j s`: microbatch j's forward through stage s (its input from stage s−1, or the batch);
- `B j s`: its backward through stage s (the gradient of its output from stage s+1, or the loss):
  the whole backward, or only the input's gradient when the schedule also has `W j s`;
- `W j s`: the weight gradients of that backward (after its B; the activations stay held until);
- `send`/`recv` of an activation ("act") or a gradient ("grad") to or from the rank of the
  neighbouring stage (`rank_ops`: put next to the compute ops; none between two stages of a rank).

The kinds:

- `afab` (GPipe): every forward, then every backward; holds m microbatches.
- `1f1b` (PipeDream-flush): p−r−1 forwards, then one forward and one backward in turn, then the
  remaining backwards; holds min(p−r, m).
- `interleaved` (Megatron): v chunks per rank, forwards in groups of p microbatches per chunk, warm-up
  2(p−r−1) + (v−1)p chunk forwards; the bubble shrinks v-fold, (p−1)/(v·m+p−1); m a multiple of p.
- `zb-h1` (zero bubble, Qi et al. 2024): 1F1B with each backward split into B and W, rank r
  putting off its W's by r microbatches into the cool-down's waits; holds min(p, m) (1F1B's most)
  for a bubble of (p−1)/(3m+p−1) when F, B and W take a unit each.
- `zb-v`: the V placement with split backwards, ordered by a list scheduler on a clock where F, B and
  W take one unit: a ready B first, then a ready forward (the later stage first) while fewer than
  2p chunk activations are held (1F1B's peak), else the oldest W; holds min(2p, 2m) chunks.
- `dualpipev` (DeepSeek): the V placement; after the warm-up each rank runs a forward of one chunk
  beside the backward of the other (DualPipe overlaps the two on a GPU), and splits the backwards
  into B and W where that fills a wait; holds 2p+1 chunks; m ≥ 2p.

`generate` builds any of them, `check` replays one (receives block on a channel per pair of ranks,
sends do not) and `run_on_threads` runs it on the in-process world; the executor
(`mpdl.parallel.pipeline.executor`) runs the same ops. The older helpers of one chunk per rank:
`schedule_ops` (a stage's ("F", j) / ("B", j) order), `slot_bubble` (an executed order replayed on
a unit clock), `timed_bubble` (on a clock of measured op times) and `bubble_formula`,
(p−1)/(m+p−1) for afab and 1f1b.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any

import numpy as np

from mpdl.threadworld import ThreadWorld

KINDS = ("afab", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev")
#: the kinds a pipeline runs (all of them)
SCHEDULES = KINDS
#: the kinds whose ranks hold two chunks in a V
V_KINDS = ("zb-v", "dualpipev")


@dataclasses.dataclass(frozen=True)
class Op:
    """One op of a rank: kind F, B, W (compute) or send, recv (of `what`, to or from `peer`)."""

    kind: str
    mb: int
    stage: int
    what: str = ""
    peer: int = -1

    def __str__(self) -> str:
        if self.kind in ("send", "recv"):
            arrow = "->" if self.kind == "send" else "<-"
            return f"{self.kind} {self.what} {self.mb}.{self.stage} {arrow} {self.peer}"
        return f"{self.kind}{self.mb}.{self.stage}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The compute ops of each rank, in order (`rank_ops` adds the messages)."""

    kind: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Op, ...], ...]
    #: per rank, the index of each op that DualPipe runs overlapped with the next one (a forward
    #: of one chunk beside a backward of the other, `check(overlap=True)`)
    pairs: tuple[frozenset[int], ...] = ()

    @property
    def stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        """The rank that holds `stage`."""
        return self._placement()[stage]

    def _placement(self) -> list[int]:
        cache = self.__dict__.get("_p")
        if cache is None:
            cache = placement(self.kind, self.p, self.v)
            object.__setattr__(self, "_p", cache)
        return cache

    def stages_of(self, rank: int) -> list[int]:
        """The stages (chunks) of `rank`, in forward order."""
        return [s for s in range(self.stages) if self.rank_of(s) == rank]

    def split(self, rank: int, mb: int, stage: int) -> bool:
        """Whether the backward of (mb, stage) on `rank` is split into B and W."""
        return Op("W", mb, stage) in self._weights()[rank]

    def _weights(self) -> list[set[Op]]:
        cache = self.__dict__.get("_w")
        if cache is None:
            cache = [{op for op in ops if op.kind == "W"} for ops in self.ranks]
            object.__setattr__(self, "_w", cache)
        return cache

    def rank_ops(self, rank: int) -> list[Op]:
        """`rank`'s ops with its messages: a receive right before the op that needs it, a send
        right after the op that made it. Messages between two ranks arrive in the order they were
        sent (one channel per pair, as MPI's with one tag), which need not be the order the
        receiver needs them in: a receive takes the messages sent before the one it waits for
        off the channel and keeps them for their own receives (they were sent, so this never
        waits longer)."""
        out: list[Op] = []
        last = self.stages - 1
        for op in self.ranks[rank]:
            if op.kind == "F" and op.stage > 0 and self.rank_of(op.stage - 1) != rank:
                out.append(Op("recv", op.mb, op.stage - 1, "act", self.rank_of(op.stage - 1)))
            if op.kind == "B" and op.stage < last and self.rank_of(op.stage + 1) != rank:
                out.append(Op("recv", op.mb, op.stage + 1, "grad", self.rank_of(op.stage + 1)))
            out.append(op)
            if op.kind == "F" and op.stage < last and self.rank_of(op.stage + 1) != rank:
                out.append(Op("send", op.mb, op.stage, "act", self.rank_of(op.stage + 1)))
            if op.kind == "B" and op.stage > 0 and self.rank_of(op.stage - 1) != rank:
                out.append(Op("send", op.mb, op.stage, "grad", self.rank_of(op.stage - 1)))
        return out

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(op) for op in ops)
                         for r, ops in enumerate(self.ranks))


def placement(kind: str, p: int, v: int) -> list[int]:
    """The rank of each of the p·v stages: stage s on rank s mod p, or a V (zb-v, dualpipev)."""
    if kind in V_KINDS:
        return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    return [s % p for s in range(p * v)]


def fill_drain(kind: str, p: int, m: int, v: int) -> Schedule:
    """Every forward, then every backward, on the stages `kind` places (what a short batch whose
    microbatch count `kind` does not allow runs)."""
    where = placement(kind, p, v)
    ranks = []
    for r in range(p):
        mine = [s for s, q in enumerate(where) if q == r]
        ranks.append(tuple([Op("F", j, s) for s in mine for j in range(m)]
                           + [Op("B", j, s) for s in reversed(mine) for j in range(m)]))
    return Schedule(kind, p, m, v, tuple(ranks))


def allowed(kind: str, p: int, m: int, v: int) -> str | None:
    """None when `kind` runs with p ranks, m microbatches and v chunks per rank, else why not."""
    if kind not in KINDS:
        return f"schedule: expected one of {', '.join(KINDS)}, got {kind!r}"
    if p < 1 or m < 1 or v < 1:
        return f"schedule: p, m and v must be positive, got p={p}, m={m}, v={v}"
    if kind in V_KINDS and v != 2:
        return f"virtual-stages: {kind} runs 2 chunks per rank (a V), got {v}"
    if kind in ("afab", "1f1b", "zb-h1") and v != 1:
        return f"virtual-stages: {kind} runs 1 chunk per rank, got {v} (use interleaved)"
    if kind == "interleaved" and v > 1 and m % p:
        return (f"microbatches: interleaved runs groups of pp microbatches, so {m} must be a "
                f"multiple of pp = {p}")
    if kind == "dualpipev" and m < 2 * p:
        return f"microbatches: dualpipev needs at least 2·pp = {2 * p}, got {m}"
    return None


def generate(kind: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule of `kind` for p ranks, m microbatches and v chunks per rank (zb-v and
    dualpipev: v = 2, whatever is given as 1)."""
    if kind in V_KINDS and v == 1:
        v = 2
    why = allowed(kind, p, m, v)
    if why:
        raise ValueError(why)
    if kind == "dualpipev":
        orders = _dualpipev(p, m, v)
        return Schedule(kind, p, m, v, tuple(tuple(o.ops) for o in orders),
                        tuple(frozenset(o.pairs) for o in orders))
    make = {"afab": _afab, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1,
            "zb-v": _zb_v}[kind]
    return Schedule(kind, p, m, v, tuple(tuple(ops) for ops in make(p, m, v)))


def _afab(p: int, m: int, v: int) -> list[list[Op]]:
    return [[Op("F", j, r) for j in range(m)] + [Op("B", j, r) for j in range(m)]
            for r in range(p)]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Op]]:
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [Op("F", j, r) for j in range(warmup)]
        for j in range(m - warmup):
            ops += [Op("F", warmup + j, r), Op("B", j, r)]
        out.append(ops + [Op("B", j, r) for j in range(m - warmup, m)])
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Op]]:
    if v == 1:
        return _one_f_one_b(p, m, v)
    total = m * v

    def forward(r: int, k: int) -> Op:  # the k-th chunk forward of rank r
        chunk = (k % (p * v)) // p
        return Op("F", (k // (p * v)) * p + k % p, chunk * p + r)

    def backward(r: int, k: int) -> Op:
        chunk = v - 1 - (k % (p * v)) // p
        return Op("B", (k // (p * v)) * p + k % p, chunk * p + r)

    out = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        ops = [forward(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            ops += [forward(r, warmup + k), backward(r, k)]
        out.append(ops + [backward(r, k) for k in range(total - warmup, total)])
    return out


def _zb_h1(p: int, m: int, v: int) -> list[list[Op]]:
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [Op("F", j, r) for j in range(warmup)]
        weights = 0
        for k in range(m):
            if k < m - warmup:
                ops.append(Op("F", warmup + k, r))
            ops.append(Op("B", k, r))
            if k >= r:  # rank r puts off each W by r microbatches
                ops.append(Op("W", k - r, r))
                weights += 1
        out.append(ops + [Op("W", j, r) for j in range(weights, m)])
    return out


def _zb_v(p: int, m: int, v: int) -> list[list[Op]]:
    """A list scheduler on a unit clock (see the module's docstring)."""
    stages = 2 * p
    rank_of = [s if s < p else stages - 1 - s for s in range(stages)]
    mine = [[s for s in range(stages) if rank_of[s] == r] for r in range(p)]
    done: dict[tuple[str, int, int], int] = {}
    out: list[list[Op]] = [[] for _ in range(p)]
    free, held = [0] * p, [0] * p
    waiting: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    next_f, next_b = [0] * stages, [0] * stages
    left = [3 * m * len(mine[r]) for r in range(p)]

    def ready(key: tuple[str, int, int], t: int) -> bool:
        return done.get(key, t + 1) <= t

    while any(left):
        r = min((x for x in range(p) if left[x]), key=lambda x: (free[x], x))
        t = free[r]
        forwards = [s for s in mine[r] if next_f[s] < m
                    and (s == 0 or ready(("F", next_f[s], s - 1), t))]
        backwards = [s for s in mine[r] if next_b[s] < m and ready(("F", next_b[s], s), t)
                     and (s == stages - 1 or ready(("B", next_b[s], s + 1), t))]
        if backwards:
            s = max(backwards)
            op = Op("B", next_b[s], s)
            next_b[s] += 1
            waiting[r].append((op.mb, s))
        elif forwards and held[r] < 2 * p:
            s = max(forwards)
            op = Op("F", next_f[s], s)
            next_f[s] += 1
            held[r] += 1
        elif waiting[r]:
            op = Op("W", *waiting[r].popleft())
            held[r] -= 1
        else:
            free[r] += 1  # nothing to run: wait a unit
            continue
        done[(op.kind, op.mb, op.stage)] = free[r] = t + 1
        left[r] -= 1
        out[r].append(op)
    return out


class _Orders:
    """One rank's ops as DualPipeV builds them: the next forward or backward of a phase (chunk),
    its W put off to a first-in first-out queue or not, and the pairs it overlaps."""

    def __init__(self, chunks: tuple[int, int]) -> None:
        self.chunks, self.ops = chunks, []
        self.nf, self.nb = [0, 0], [0, 0]
        self.deferred: deque[Op] = deque()
        self.pairs: list[int] = []

    def pair(self) -> None:
        """The last two ops (a forward, then a backward of the other chunk) overlap."""
        self.pairs.append(len(self.ops) - 2)

    def f(self, phase: int) -> None:
        self.ops.append(Op("F", self.nf[phase], self.chunks[phase]))
        self.nf[phase] += 1

    def b(self, phase: int, split: bool = False) -> None:
        self.ops.append(Op("B", self.nb[phase], self.chunks[phase]))
        if split:
            self.deferred.append(Op("W", self.nb[phase], self.chunks[phase]))
        self.nb[phase] += 1

    def w(self) -> None:
        self.ops.append(self.deferred.popleft())


def _dualpipev(p: int, m: int, v: int) -> list[_Orders]:
    """DeepSeek's DualPipeV order, its eight steps per rank."""
    out = []
    for r in range(p):
        o = _Orders((r, 2 * p - 1 - r))  # phase 0 runs down the ranks, phase 1 back up
        for _ in range(2 * (p - r - 1)):  # 1: forwards of phase 0
            o.f(0)
        for _ in range(r + 1):  # 2: forwards of both phases
            o.f(0)
            o.f(1)
        for _ in range(p - r - 1):  # 3: B, W, F of phase 1
            o.b(1, split=True)
            o.w()
            o.f(1)
        for i in range(m - 2 * p + r + 1):  # 4: the steady state, a forward beside a backward
            o.f(0)
            o.b(1)
            if i or r < p - 1:  # the last rank's first two run apart (a smaller bubble)
                o.pair()
            o.f(1)
            o.b(0)
            o.pair()
        for _ in range(p - r - 1):  # 5: backward of phase 1, a forward of 1 beside a backward of 0
            o.b(1)
            o.f(1)
            o.b(0)
            o.pair()
        split = False
        for i in range(r + 1):  # 6: backwards of both phases, their second half split
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            o.b(1, split)
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            o.b(0, split)
        for _ in range(p - r - 1):  # 7: a W, a split backward of phase 0
            o.w()
            o.b(0, split=True)
        while o.deferred:  # 8: the remaining W's
            o.w()
        out.append(o)
    return out


# -- the formulas ------------------------------------------------------------------------------
def peak_formula(kind: str, p: int, m: int, v: int, rank: int) -> int:
    """The most chunk activations rank `rank` holds at once (forwarded, backward not finished):
    the closed forms of the module's docstring."""
    if kind == "afab":
        return m
    if kind == "1f1b" or (kind == "interleaved" and v == 1):
        return min(p - rank, m)
    if kind == "interleaved":
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v)
    if kind == "zb-h1":
        return min(p, m)
    if kind == "zb-v":
        return min(2 * p, 2 * m)
    return 2 * p + 1


def schedule_bubble(kind: str, p: int, m: int, v: int = 1, overlap: bool = False) -> float:
    """The idle share of a step when a forward, an input gradient and a weight gradient each take
    the same time (a fused backward two of them): (p−1)/(m+p−1) for afab and 1f1b, v-fold less for
    interleaved, (p−1)/(3m+p−1) for zb-h1; zb-v and dualpipev: their unit-clock replay (with
    `overlap`, DualPipe's pairs overlapped, `check`)."""
    if kind in ("afab", "1f1b"):
        return (p - 1) / (m + p - 1)
    if kind == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if kind == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return check(generate(kind, p, m, v), overlap).bubble


# -- the checker -------------------------------------------------------------------------------
@dataclasses.dataclass
class Replay:
    """What a replay of a schedule found: each rank's peak of held chunk activations, the step's
    length on the unit clock, each rank's idle time in it, and when each compute op ran (rank,
    start, duration, op), the data of a drawing."""

    peaks: list[int]
    length: float
    idle: list[float]
    timeline: list[tuple[int, float, float, Op]] = dataclasses.field(default_factory=list)

    @property
    def bubble(self) -> float:
        """The largest idle share of the step over the ranks."""
        return max(self.idle) / self.length if self.length else 0.0


def needs(schedule: Schedule, op: Op) -> list[tuple[str, int, int]]:
    """The compute ops (kind, mb, stage) that must be done before `op`."""
    if op.kind == "F":
        return [("F", op.mb, op.stage - 1)] if op.stage > 0 else []
    if op.kind == "B":
        after = [("B", op.mb, op.stage + 1)] if op.stage < schedule.stages - 1 else []
        return [("F", op.mb, op.stage), *after]
    return [("B", op.mb, op.stage)]


def unit_cost(schedule: Schedule, rank: int, op: Op) -> int:
    """An op's time on the unit clock: F, B and W one unit each, a fused backward two."""
    if op.kind == "B" and not schedule.split(rank, op.mb, op.stage):
        return 2
    return 1 if op.kind in ("F", "B", "W") else 0


def check(schedule: Schedule, overlap: bool = False) -> Replay:
    """Replay `schedule` as the ranks would run it (receives block on a first-in first-out channel
    per pair of ranks, sends do not): raise ValueError unless every F and B of every (microbatch,
    stage) runs once on the stage's rank, a W at most once after its B, every op after what it
    needs, every message received, and nothing deadlocks. With `overlap`, each of the schedule's
    `pairs` runs as DualPipe runs it, the two ops overlapped on the GPU: the pair starts only when
    the inputs of both have arrived."""
    p, m = schedule.p, schedule.m
    ops = [schedule.rank_ops(r) for r in range(p)]
    for r in range(p):
        seen = [(op.kind, op.mb, op.stage) for op in schedule.ranks[r]]
        if len(seen) != len(set(seen)):
            raise ValueError(f"rank {r} runs an op twice")
        want = {(k, j, s) for s in schedule.stages_of(r) for j in range(m) for k in "FB"}
        if {x for x in seen if x[0] != "W"} != want:
            raise ValueError(f"rank {r} does not run each F and B of its stages once")
        if any(x[0] == "W" and not 0 <= x[1] < m or schedule.rank_of(x[2]) != r for x in seen):
            raise ValueError(f"rank {r} runs a W that is not of its stages")
    channels: dict[tuple[int, int], deque[tuple[Op, float]]] = {}
    #: the messages taken off a channel before the one a receive waits for (see `rank_ops`)
    stash: dict[tuple[int, int], dict[tuple[str, int, int], float]] = {}
    done: dict[tuple[str, int, int], float] = {}
    pos, free, live, peaks = [0] * p, [0.0] * p, [0] * p, [0] * p
    busy, computed = [0.0] * p, [0] * p
    timeline: list[tuple[int, float, float, Op]] = []
    while any(pos[r] < len(ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                op = ops[r][pos[r]]
                if op.kind == "send":
                    channels.setdefault((r, op.peer), deque()).append((op, free[r]))
                elif op.kind == "recv":
                    queue, early = channels.get((op.peer, r)), stash.setdefault((op.peer, r), {})
                    want = (op.what, op.mb, op.stage)
                    while want not in early and queue:
                        sent, when = queue.popleft()
                        early[(sent.what, sent.mb, sent.stage)] = when
                    if want not in early:
                        break
                    free[r] = max(free[r], early.pop(want))
                else:
                    missing = [n for n in needs(schedule, op) if n not in done]
                    if missing:
                        local = [n for n in missing if schedule.rank_of(n[2]) == r]
                        if local:
                            raise ValueError(f"rank {r} runs {op} before {Op(*local[0])}")
                        raise ValueError(f"rank {r} runs {op} before it has received "
                                         f"{Op(*missing[0])}")
                    partner: list[tuple[str, int, int]] = []
                    if overlap and schedule.pairs and computed[r] in schedule.pairs[r]:
                        nxt = schedule.ranks[r][computed[r] + 1]
                        partner = [n for n in needs(schedule, nxt)
                                   if n != (op.kind, op.mb, op.stage)]
                        if any(n not in done for n in partner):
                            break
                    start = max([free[r], *(done[n] for n in needs(schedule, op) + partner)])
                    computed[r] += 1
                    cost = unit_cost(schedule, r, op)
                    done[(op.kind, op.mb, op.stage)] = free[r] = start + cost
                    busy[r] += cost
                    timeline.append((r, start, cost, op))
                    ends = op.kind == "W" or (op.kind == "B" and not schedule.split(r, op.mb,
                                                                                     op.stage))
                    live[r] += 1 if op.kind == "F" else -1 if ends else 0
                    peaks[r] = max(peaks[r], live[r])
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = "; ".join(f"rank {r} at {ops[r][pos[r]]}" for r in range(p)
                              if pos[r] < len(ops[r]))
            raise ValueError(f"the schedule deadlocks: {stuck}")
    if any(channels.values()) or any(stash.values()):
        raise ValueError("a message is sent and never received")
    length = max(free)
    return Replay(peaks, length, [length - b for b in busy], timeline)


def run_on_threads(schedule: Schedule, timeout: float = 30.0) -> list[int]:
    """Run `schedule` on the in-process world, one thread per rank, each message carrying the
    (kind, microbatch, stage) it claims to be: raise unless every receive gets the message it
    expects and every op finds what it needs already done; each rank's peak of held chunk
    activations."""
    code = {"act": 0, "grad": 1}
    done: set[tuple[str, int, int]] = set()
    lock = threading.Lock()

    def rank(comm: Any) -> int:
        r, live, peak = comm.rank, 0, 0
        early: dict[int, set[tuple[int, int, int]]] = {}
        for op in schedule.rank_ops(r):
            if op.kind == "send":
                comm.send(np.array([code[op.what], op.mb, op.stage], np.int64), op.peer)
            elif op.kind == "recv":
                want = (code[op.what], op.mb, op.stage)
                while want not in early.setdefault(op.peer, set()):
                    got = np.empty(3, np.int64)
                    comm.recv(got, op.peer)
                    early[op.peer].add(tuple(int(x) for x in got))
                early[op.peer].remove(want)
            else:
                with lock:
                    missing = [n for n in needs(schedule, op) if n not in done]
                    if missing:
                        raise AssertionError(f"rank {r} runs {op} before {Op(*missing[0])}")
                    done.add((op.kind, op.mb, op.stage))
                split = schedule.split(r, op.mb, op.stage)
                live += 1 if op.kind == "F" else -1 if op.kind == "W" or not split else 0
                peak = max(peak, live)
        return peak

    return ThreadWorld(schedule.p).run(rank, timeout=timeout)


# -- one chunk per rank ----------------------------------------------------------------------
def schedule_ops(kind: str, m: int, pp: int, stage: int) -> list[tuple[str, int]]:
    """The order of stage `stage`'s ops ("F", j) / ("B", j) over m microbatches: AFAB runs every
    forward then every backward; 1F1B runs pp−stage−1 forwards (warm-up), then alternates one
    forward and one backward, then runs the remaining backwards (cool-down)."""
    if kind not in ("afab", "1f1b"):
        raise ValueError(f"schedule: expected one of afab, 1f1b, got {kind!r}")
    return [(op.kind, op.mb) for op in generate(kind, pp, m).ranks[stage]]


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
    F j on the last stage; W j after B j): (the step's length in slots, each stage's idle
    slots)."""
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
            need = (("F", j, i - 1) if i > 0 else None) if kind == "F" else ("B", j, i) \
                if kind == "W" else (("B", j, i + 1) if i < pp - 1 else ("F", j, i))
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


def bubble_formula(pp: int, m: int) -> float:
    """The idle share of a pipeline step: (p−1)/(m+p−1)."""
    return (pp - 1) / (m + pp - 1)

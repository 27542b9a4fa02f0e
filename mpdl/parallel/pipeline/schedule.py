"""The schedules of a pipeline step as plain data: for each stage, the order of its ops
("F", j) / ("B", j) over m microbatches (`schedule_ops`: a plain function of the schedule's
name, m, pp and the stage), and the bubble they leave.

Bubble: with unit-time forwards and backwards, a stage of a p-stage pipeline with m microbatches
is idle (p−1)/(m+p−1) of the step under either schedule (`slot_bubble` replays an executed order
on that clock; `timed_bubble` on a clock of measured op times: each forward and backward span
carries its thread CPU time as `cpu_s`); AFAB holds up to m microbatches' activations, 1F1B at
most p−i on stage i.
"""

from __future__ import annotations

from mpdl.parallel.schedules import KINDS

SCHEDULES = KINDS


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


def bubble_formula(pp: int, m: int) -> float:
    """The idle share of a pipeline step: (p−1)/(m+p−1)."""
    return (pp - 1) / (m + pp - 1)

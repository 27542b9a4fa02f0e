"""The counts of an all-to-all with varying blocks (`alltoallv`): their checks and their exchange.

A rank whose counts are wrong still takes part in the exchange, sending -1 in place of every
count, so that every rank learns of it and raises before any data moves; the rank at fault
raises its own, more precise error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

#: what a rank whose arguments are wrong sends in place of its counts
POISON = -1


def check_counts(counts: Any, p: int, argument: str) -> list[int]:
    """The counts as a list of p ints >= 0; ValueError naming the argument otherwise."""
    if isinstance(counts, str | bytes) or not hasattr(counts, "__len__"):
        raise ValueError(f"{argument}: expected a sequence of {p} row counts (one per rank), "
                         f"got {type(counts).__name__}")
    values = list(np.asarray(counts).reshape(-1)) if hasattr(counts, "dtype") else list(counts)
    if len(values) != p:
        raise ValueError(f"{argument}: expected {p} row counts (one per rank), got {len(values)}")
    if not all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{argument}: expected integer row counts, got {values!r}")
    if any(v < 0 for v in values):
        raise ValueError(f"{argument}: expected row counts >= 0, got {[int(v) for v in values]}")
    return [int(v) for v in values]


def check_send(x: Any, send_counts: Any, p: int) -> list[int]:
    """send_counts checked against x's rows."""
    if x.ndim == 0:
        raise ValueError("x: expected an array whose first axis holds the rows to send, got a "
                         "0-d array")
    counts = check_counts(send_counts, p, "send_counts")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"send_counts: expected counts adding up to x's {x.shape[0]} rows, got "
                         f"{counts} (sum {sum(counts)})")
    return counts


def _raise_for_poison(received: np.ndarray, ranks: list[int]) -> None:
    bad = [r for r in ranks if (received[r] < 0).any()]
    if bad:
        raise ValueError(f"send_counts: rank{'s' if len(bad) > 1 else ''} "
                         f"{', '.join(map(str, bad))} passed counts that do not fit its array "
                         f"(its own error says how); no rank sent any rows")


def exchange(mine: list[int] | None, problem: Exception | None, p: int,
             alltoall: Callable[[np.ndarray], np.ndarray]) -> list[int]:
    """The counts every rank sends to this one, by an all-to-all of the counts (`alltoall` of an
    int64 array of p). Raises `problem` (this rank's error) or one naming the ranks at fault."""
    row = np.full(p, POISON, np.int64) if mine is None else np.array(mine, np.int64)
    received = alltoall(row)
    if problem is not None:
        raise problem
    _raise_for_poison(received.reshape(p, 1), list(range(p)))
    return [int(v) for v in received]


def exchange_matrix(mine: list[int] | None, problem: Exception | None, p: int,
                    allgather: Callable[[np.ndarray], np.ndarray]) -> list[list[int]]:
    """Every rank's send counts (row i: what rank i sends to each rank), by an all-gather of the
    rows. Raises `problem` (this rank's error) or one naming the ranks at fault."""
    row = np.full(p, POISON, np.int64) if mine is None else np.array(mine, np.int64)
    matrix = allgather(row).reshape(p, p)
    if problem is not None:
        raise problem
    _raise_for_poison(matrix, list(range(p)))
    return matrix.tolist()

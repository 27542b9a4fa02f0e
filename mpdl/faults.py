"""Faults injected on purpose, for the tests of what happens when a rank dies or misbehaves.

`MPDL_FAULT` (read in mpdl.settings) names one: ``kill:RANK:STEP`` SIGKILLs rank RANK of
`mpdl train` right after its global training step STEP, unless the run resumed from a checkpoint
(so that a restarted run goes on); ``nan:RANK:STEP`` writes a NaN into rank RANK's first
parameter after that step, as a diverging update would; ``stall:RANK:STEP`` makes rank RANK
sleep for an hour after that step, as a hung rank would; ``skip:RANK:SEQ`` makes rank RANK skip
the collective with sequence number SEQ (counted per group of ranks, as in the flight records), as
a buggy program would.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

from mpdl import settings


def after_step(rank: int, step: int, resumed_at: int | None, params: Iterator[Any]) -> None:
    """The training loop's hook after each step (nothing unless MPDL_FAULT says kill, stall or
    nan)."""
    fault = settings.current().fault
    if fault is None or fault[1:] != (rank, step) or resumed_at is not None:
        return
    if fault[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault[0] == "stall":
        time.sleep(3600)
    elif fault[0] == "nan":
        p = next(p for p in params if p.data.size)
        p.data.reshape(-1)[0] = float("nan")


_skipped: list[bool] = []


def skips(world_rank: int, seq: int) -> bool:
    """Whether this rank is to skip its collective number seq (MPDL_FAULT skip:RANK:SEQ; once:
    the next call takes that number again and runs)."""
    fault = settings.current().fault
    if fault is None or fault != ("skip", world_rank, seq) or _skipped:
        return False
    _skipped.append(True)
    return True

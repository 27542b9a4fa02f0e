"""Faults injected on purpose, for the tests of what happens when a rank dies or misbehaves.

`MPDL_FAULT` (read in mpdl.settings) names one: ``kill:RANK:STEP`` SIGKILLs rank RANK of
`mpdl train` right after its global training step STEP, unless the run resumed from a checkpoint
(so that a restarted run goes on); ``skip:RANK:SEQ`` makes rank RANK skip the collective with
sequence number SEQ (counted per group of ranks, as in the flight records), as a buggy program
would.
"""

from __future__ import annotations

import os
import signal

from mpdl import settings


def after_step(rank: int, step: int, resumed_at: int | None) -> None:
    """The training loop's hook after each step (nothing unless MPDL_FAULT says kill)."""
    fault = settings.current().fault
    if fault is not None and fault == ("kill", rank, step) and resumed_at is None:
        os.kill(os.getpid(), signal.SIGKILL)


_skipped: list[bool] = []


def skips(world_rank: int, seq: int) -> bool:
    """Whether this rank is to skip its collective number seq (MPDL_FAULT skip:RANK:SEQ; once:
    the next call takes that number again and runs)."""
    fault = settings.current().fault
    if fault is None or fault != ("skip", world_rank, seq) or _skipped:
        return False
    _skipped.append(True)
    return True

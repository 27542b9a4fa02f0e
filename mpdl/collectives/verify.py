"""Online verification of `auto`'s long-lived choices: a persistent all-reduce plan (DDP's bucket
plans, ZeRO's replica plans, the plan cache of `allreduce(out=)`) times its algorithm against the
cost model's runner-up on its first runs, and keeps the faster.

With the settings' `verify_runs` = K > 0, a plan made with algorithm "auto" runs the choice and
the runner-up in turn for its first 2K runs (choice, runner-up, choice, ...), each run one
algorithm on every rank, so every rank's result of a run has the same bits as the one-shot call of
the algorithm that ran (two algorithms may round differently, so results may differ in the last
bits from run to run during these 2K runs; a run that must be bit-reproducible from run to run
fixes the algorithm). Each rank times its runs; after the 2K-th, one all-gather gives every rank
every rank's times, and every rank takes the same verdict from them: per run the slowest rank's
time, per algorithm the fastest of its K runs (other work only ever adds time: a run that another
process's time slice fell on says nothing of the algorithm); the runner-up wins when it is at
least SWITCH times faster (10%). The plan then runs the winner, and the verdict is remembered for this size in
`auto`'s model and its first-use cache file, so the next run starts with it (and does not verify
that size again). The exploration costs at most K runs of the runner-up instead of the choice,
plus one small all-gather.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import settings
from mpdl.collectives import auto

#: the runner-up replaces the choice when its fastest run is at most this fraction of the choice's
SWITCH = 0.9


class Trial:
    """The first 2K runs of a plan: which algorithm runs next, the times, and the verdict.

    `runners` maps each of (choice, runner-up) to its run function; `settle(name)` is called on
    every rank with the same winner after the last run."""

    def __init__(self, comm: Any, collective: str, nbytes: int, names: tuple[str, str],
                 runners: dict[str, Callable[[], None]], settle: Callable[[str], None],
                 runs: int) -> None:
        self.comm, self.collective, self.nbytes = comm, collective, nbytes
        self.names, self.runners, self.settle = names, runners, settle
        self.order = [names[i % 2] for i in range(2 * runs)]
        self.times: list[float] = []
        #: the algorithm of the run in progress (or the last one)
        self.current = names[0]

    def run(self) -> None:
        """One run of the trial: the next algorithm in turn, timed; the verdict after the last."""
        name = self.current = self.order[len(self.times)]
        t0 = time.perf_counter()
        self.runners[name]()
        self.times.append(time.perf_counter() - t0)
        if len(self.times) == len(self.order):
            self.settle(self.verdict(self.comm.allgather_object(self.times)))

    def verdict(self, everyone: list[list[float]]) -> str:
        """The winner from every rank's times (the same on every rank)."""
        slowest = np.max(np.array(everyone, dtype=np.float64), axis=0)
        fastest = {n: min(t for t, m in zip(slowest, self.order, strict=True) if m == n)
                   for n in self.names}
        choice, runner_up = self.names
        winner = runner_up if fastest[runner_up] <= SWITCH * fastest[choice] else choice
        auto.learn(self.comm, self.collective, self.nbytes, winner)
        return winner


def candidates(collective: str, nbytes: int, comm: Any) -> tuple[str, str] | None:
    """(auto's choice, the runner-up) for a plan of nbytes on comm when it should verify them;
    None when verification is off, the model is not calibrated, or the size was verified."""
    runs = settings.current().verify_runs
    if runs < 1 or comm.size < 2 or nbytes == 0:
        return None
    model = auto.model_for(comm)
    if not model.calibrated or model.params is None or f"{collective}:{nbytes}" in model.verified:
        return None
    return auto.ranked(collective, nbytes, comm, model)[:2] or None

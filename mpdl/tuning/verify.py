"""Online verification of `auto`'s long-lived choices: a persistent plan of an all-reduce (DDP's
bucket plans, ZeRO's replica plans, the plan cache of `allreduce(out=)`), a reduce-scatter or an
all-gather (ZeRO's units, their plan caches) times its algorithm against the contenders on its
first runs, and keeps the fastest.

With the settings' `verify_runs` = K > 0 (3 by default), a plan made with algorithm "auto" runs the
choice and each contender (for an all-reduce every candidate predicted within FIELD times the
choice's time, for the others every candidate) in K rounds that go forth and back (`serpentine`),
each algorithm's turn in a round TURN runs in a row, in its first TURN·K·n runs (n algorithms in
all); each run is one algorithm on every rank, so every rank's result of a run has the same bits as
the one-shot call of the algorithm that ran (two algorithms may round differently, so results may
differ in the last bits from run to run during these runs; a run that must be bit-reproducible from
run to run fixes the algorithm). Each rank times its runs; after the last, one all-gather gives
every rank every rank's times, and every rank takes the same verdict from them: per run the slowest
rank's time, per algorithm the fastest of its runs but its first (which sets up its workspaces and
schedules). Other work only ever adds time, and so does what the algorithm before left (the skew
between ranks, late messages) and a place in the caller's rhythm that costs more (the first call
after a barrier): the fastest run is the one nothing fell on. The fastest contender wins when it is
at least SWITCH times faster than the choice (10%). The plan then runs the winner, and the verdict
is remembered for this size in `auto`'s model and its first-use cache file, so the next run starts
with it (and does not verify that size again). A verdict taken on a busy machine (other work's load
per core, as `measuring.Busy` judges a calibration, the largest over ranks) is provisional: used,
and verified again by the next run. The exploration costs at most TURN·K runs of each contender
instead of the choice, plus one small all-gather, once per size and machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import settings
from mpdl.tuning import auto, measuring

#: the collectives whose plans verify auto's choice
VERIFIED = ("allreduce", "reduce_scatter", "allgather")
#: a contender replaces the choice when its fastest run is at most this fraction of the choice's
SWITCH = 0.9
#: the contenders: every candidate the cost model predicts within this factor of the choice's time
#: (the model times calls one at a time; calls back to back can rank otherwise:
#: docs/results/auto.md#the-field-of-contenders)
FIELD = 2.5
#: the same for the other collectives: every candidate (two, ring and tree), whose predictions
#: come from the links' parameters alone, with no measured table of the algorithms
FIELD_OTHERS = math.inf
#: runs of one algorithm in a row in a trial (a turn): a run is charged with what the run before it
#: left (the skew between ranks with which the previous algorithm ended, its late messages, its
#: buffers in the caches), so each algorithm also runs after itself, as the plan's runs will.
#: Every run but an algorithm's first counts, so the timed runs do not fall on fixed places of the
#: caller's rhythm (docs/results/auto.md#turns-of-two-runs)
TURN = 2


def serpentine(names: tuple[str, ...], rounds: int) -> list[str]:
    """The order of a trial's runs: every algorithm once a round, the rounds forth and back (a b,
    b a, a b ...). A plan runs in its caller's rhythm (a first call after a barrier or a step's
    compute, then calls back to back), and a trial's runs fall on its places. With each
    algorithm's runs in a row, the choice took the first calls after the caller's barriers and
    the next algorithm the calls back to back (`mpdl bench --loop 4`: two single warm-up calls,
    then groups of four), and the trials switched to algorithms the sweep then timed slower
    (docs/results/auto.md#turns-of-two-runs). Back and forth, each
    algorithm's runs spread over the places of any short rhythm, and each also runs after
    itself, as the plan's runs will."""
    return [name for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


class Trial:
    """The first TURN·K·n runs of a plan: which algorithm runs next, the times, and the verdict.

    `names` are the choice and the contenders (n in all), `runners` maps each to its run
    function; `settle(name)` is called on every rank with the same winner after the last run."""

    def __init__(self, comm: Any, collective: str, nbytes: int, names: tuple[str, ...],
                 runners: dict[str, Callable[[], None]], settle: Callable[[str], None],
                 runs: int, shared: bool = False) -> None:
        self.comm, self.collective, self.nbytes = comm, collective, nbytes
        #: the plan's array lies in shared memory (its verdict is kept apart)
        self.shared = shared
        self.names, self.runners, self.settle = names, runners, settle
        #: the algorithm of each run: turns of TURN runs, in rounds forth and back
        self.order = [name for name in serpentine(names, runs) for _ in range(TURN)]
        self.times: list[float] = []
        #: the algorithm of the run in progress (or the last one)
        self.current = names[0]
        self.ranks_here = next((len(g) for g in comm.node_groups() if comm.rank in g), 1)
        self.load_before = measuring.load_per_core(self.ranks_here)

    def run(self) -> None:
        """One run of the trial: the next algorithm in turn, timed; the verdict after the last."""
        name = self.current = self.order[len(self.times)]
        t0 = time.perf_counter()
        self.runners[name]()
        self.times.append(time.perf_counter() - t0)
        if len(self.times) == len(self.order):
            everyone = self.comm.allgather_object(
                (self.times, self.load_before, measuring.load_per_core(self.ranks_here)))
            busy = measuring.Busy(max(r[1] for r in everyone), max(r[2] for r in everyone), 1.0)
            self.settle(self.verdict([r[0] for r in everyone], busy.why))

    def verdict(self, everyone: list[list[float]], provisional: str = "") -> str:
        """The winner from every rank's times of every run (the same on every rank): the
        contender with the fastest run (the slowest rank's time; an algorithm's first run not
        counted) when that is at most SWITCH of the choice's, else the choice; learned as
        provisional, with the reason, when `provisional` says the machine was busy."""
        runs = zip(np.max(np.array(everyone, dtype=np.float64), axis=0), self.order, strict=True)
        fastest: dict[str, float] = {}
        for seconds, name in runs:
            # an algorithm's first run sets it up (workspaces, schedules): not counted
            fastest[name] = min(fastest[name], float(seconds)) if name in fastest else np.inf
        choice = self.names[0]
        best = min(self.names[1:], key=lambda n: (fastest[n], self.names.index(n)))
        winner = best if fastest[best] <= SWITCH * fastest[choice] else choice
        auto.learn(self.comm, self.collective, self.nbytes, winner, self.shared, provisional)
        return winner


def candidates(collective: str, nbytes: int, comm: Any,
               shared: bool = False) -> tuple[str, ...] | None:
    """(the plan's algorithm, the contenders) for a plan of nbytes on comm when it should verify
    them: auto's choice and the candidates the model predicts within FIELD of it (FIELD_OTHERS for
    a collective other than all-reduce), and when a
    provisional verdict is verified again, that verdict first and the prediction among them;
    None when verification is off, the model is not calibrated, the size was verified (on a quiet
    machine, or in this run), or there is no contender. With `shared` (the plan's array lies in
    shared memory, which shm sums where it lies), the verdict is kept apart from that of other
    arrays of the size."""
    runs = settings.current().verify_runs
    if runs < 1 or comm.size < 2 or nbytes == 0:
        return None
    model = auto.model_for(comm)
    entry = auto.verified_key(collective, nbytes, shared)
    if (not model.calibrated or model.params is None
            or (entry in model.verified and entry not in model.recheck)):
        return None
    # the prediction and its field; the plan runs a provisional verdict, if any, in its place
    within = FIELD if collective == "allreduce" else FIELD_OTHERS
    field = auto.ranked(collective, nbytes, comm, model, within) \
        or (auto.algorithm_for(collective, nbytes, comm).name,)
    runs_now = auto.plan_choice(collective, nbytes, comm, shared).name
    names = (runs_now, *(name for name in field if name != runs_now))
    return names if len(names) > 1 else None

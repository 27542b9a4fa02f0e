"""A plan whose runs the flight recorder notes: the wrapper `watched` puts around a plan
(`mpdl.tuning.plan.Plan`) whose communicator keeps a flight recorder.

Each run takes one entry, as a one-shot collective's (`collectives.api._run`): the group's next
sequence number, (collective, algorithm, bytes, dtype, op, group), its start and end, and its
state (started, done, or failed when the run raises). Under MPDL_FAULT skip:RANK:SEQ, world rank
RANK skips the run that would take sequence number SEQ (`mpdl.faults`), as a buggy program would.
A bare plan does neither, and the plans of a communicator without a recorder stay bare.
"""

from __future__ import annotations

from time import time
from typing import Any

from mpdl import faults
from mpdl.comm.flight import FlightEntry


class FlightPlan:
    """`plan`, its runs noted by its communicator's flight recorder (`flight`); its arrays, trial,
    algorithm and schedule are the plan's."""

    __slots__ = ("plan", "comm", "flight", "shape", "dtype", "_signature", "_cell", "_slots",
                 "_info", "_fault", "_entry")

    def __init__(self, plan: Any) -> None:
        self.plan, self.comm = plan, plan.comm
        #: the plan's array's shape and dtype (a cache hit compares them)
        self.shape, self.dtype = plan.shape, plan.dtype
        #: MPDL_FAULT is set: a run may be the one to skip
        self._fault = plan.comm.settings.fault is not None
        self._entry: FlightEntry | None = None
        self._bind(plan.comm.flight)

    # the plan's, read through (a class with __getattr__ would make every lookup on it slower)
    x = property(lambda self: self.plan.x)
    result = property(lambda self: self.plan.result)
    trial = property(lambda self: self.plan.trial)
    signature = property(lambda self: self.plan.signature)
    collective = property(lambda self: self.plan.collective)
    algorithm = property(lambda self: self.plan.algorithm)
    nbytes = property(lambda self: self.plan.nbytes)
    _held = property(lambda self: self.plan._held)

    def schedule(self) -> tuple[Any, Any, list | None]:
        return self.plan.schedule()

    def free(self) -> None:
        self.plan.free()

    def __repr__(self) -> str:
        return f"<FlightPlan of {self.plan!r}>"

    def _bind(self, rec: Any) -> None:
        """Keep the recorder, its counter of the communicator's group and the entry's fixed
        fields at hand (again after a verdict of verification switched the algorithm)."""
        plan = self.plan
        group = self.comm.flight_group()
        self.flight, self._signature = rec, plan.signature
        self._cell, self._slots = rec.counter(group), rec.slots
        self._info = (plan.collective, plan.algorithm, plan.nbytes, plan.dtype,
                      plan.signature[4], group)

    def __call__(self, x: Any = None) -> Any:
        """Run the collective once and return its result (`start` and `wait` in one)."""
        plan = self.plan
        if not plan._runs_inline(x):
            return self.start().wait()
        comm = self.comm
        rec = comm.flight
        if rec is None:  # switched off meanwhile (as around a first-use calibration)
            plan._run()
            return plan._result()
        if rec is not self.flight or plan.signature is not self._signature:
            self._bind(rec)
        cell = self._cell
        seq = cell[0]
        if self._fault and faults.skips(comm.world_rank(comm.rank), seq):
            return plan._result()
        cell[0] = seq + 1
        # the entry written here rather than through rec.begin_counted: a few stores, no call
        entry = FlightEntry(seq, self._info, time())
        self._slots.append(entry)
        try:
            plan._run()
        except BaseException:
            entry.end, entry.state = time(), "failed"
            raise
        entry.end, entry.state = time(), "done"
        return plan.result if plan._finish is None else plan._finish()

    def start(self, x: Any = None) -> FlightPlan:
        """Start the collective (hand-written algorithms run to the end here); returns the plan."""
        self.plan._start(x, self._begin, self._whole)
        return self

    def wait(self) -> Any:
        """Finish the collective started by `start()` and return its result."""
        entry, self._entry = self._entry, None
        if entry is not None:
            entry.end, entry.state = time(), "done"
        return self.plan.wait()

    def _whole(self) -> None:
        """`_begin`, its entry ended at once (run behind asynchronous collectives)."""
        self._begin()
        entry, self._entry = self._entry, None
        if entry is not None:
            entry.end, entry.state = time(), "done"

    def _begin(self) -> None:
        plan, comm = self.plan, self.comm
        plan._agree()
        rec = comm.flight
        if rec is None:
            plan._run()
            return
        if rec is not self.flight or plan.signature is not self._signature:
            self._bind(rec)
        if self._fault and faults.skips(comm.world_rank(comm.rank), self._cell[0]):
            return
        entry = rec.begin_counted(self._cell, self._info)
        try:
            plan._run()
        except BaseException:
            entry.end, entry.state = time(), "failed"
            raise
        self._entry = entry


def watched(plan: Any) -> Any:
    """The plan as it is to run now: in a FlightPlan while its communicator keeps a flight
    recorder, bare otherwise (a plan made before the recorder was switched is wrapped or
    unwrapped)."""
    bare = plan.plan if type(plan) is FlightPlan else plan
    return bare if bare.comm.flight is None else FlightPlan(bare)

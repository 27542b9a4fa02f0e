"""ZeRO's step meter (`mpdl.parallel.zero`): what a step reports, kept apart from the algorithm.

`ZeroMeter` counts the model-state bytes the strategy holds (parameters, gradients, optimizer
state) and their peak within a step; it times the step's phases, the main thread's waits for the
communication thread (the exposed communication) and the communication thread's collectives per
unit; and it counts the bytes this rank sent, from the communicator's message log. At the end
of a step, `finish` turns what it measured into the `StepResult`'s times and timeline spans.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from mpdl.comm import Communicator
from mpdl.parallel.shards import Unit
from mpdl.parallel.strategy import Span, StepResult


class Timed:
    """A with-block timed by time.perf_counter, from `start` (None: when it begins) to its end;
    `done(start, end)` is called when it ends (not when it raises)."""

    __slots__ = ("_done", "_start")

    def __init__(self, done: Callable[[float, float], None], start: float | None = None) -> None:
        self._done, self._start = done, start

    def __enter__(self) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self._done(self._start, time.perf_counter())


class ZeroMeter:
    """The timings and counters of the steps of a strategy over `comm`."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._lock = threading.Lock()
        self.held = 0             # model-state bytes held now
        self.peak_bytes = 0       # the most held since the last step began
        self.step_peak_bytes = 0  # the largest peak within a step so far
        self._optimizer_bytes = 0
        self.exposed_s = 0.0      # this step's waits of the main thread for communication
        #: seconds of the last step's all-gathers (communication thread) and of the main thread's
        #: waits for stage 3's gathers: 1 - wait / gather is the share prefetch hid
        self.gather_s = 0.0
        self.gather_wait_s = 0.0
        self._sent = 0
        self._steps = 0
        self._messages: list = []
        self._first_message = 0
        self._own_messages = False
        self._start = 0.0
        self._phases: list[Span] = []
        self._collectives: defaultdict[int, list[tuple[str, float, float]]] = defaultdict(list)
        self._gather_waits: list[tuple[int, float, float]] = []

    # -- the model state held ----------------------------------------------------------------------
    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.held += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    def optimizer_state(self, nbytes: int) -> None:
        """The optimizer state now takes `nbytes`."""
        self.hold(nbytes - self._optimizer_bytes)
        self._optimizer_bytes = nbytes

    def sent_bytes_per_step(self) -> float:
        """The bytes this rank sent per step, on average over the steps so far."""
        return self._sent / max(self._steps, 1)

    # -- a step ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """A step starts now."""
        self._messages, self._first_message = self._message_log()
        self.peak_bytes = self.held
        self.exposed_s = 0.0
        self._gather_waits = []
        self._collectives = defaultdict(list)
        self._phases = []
        self._start = time.perf_counter()

    def phase(self, name: str, cat: str = "compute", start: float | None = None) -> Timed:
        """The block is a phase of the step's timeline, from `start` (default: where the last
        phase ended, or when the block begins)."""
        if start is None and self._phases:
            start = self._phases[-1].end
        return Timed(lambda s, e: self._phases.append(Span(name, s, e, cat=cat)), start)

    def waiting(self, gather: Unit | None = None) -> Timed:
        """The block is the main thread waiting for communication (exposed); with `gather`, for
        that unit's all-gather."""
        return Timed(lambda s, e: self._waited(s, e, gather))

    def communicating(self, unit: Unit, name: str) -> Timed:
        """The block is the communication thread's collective `name` of `unit`."""
        return Timed(lambda s, e: self._collectives[unit.index].append((name, s, e)))

    def _waited(self, start: float, end: float, gather: Unit | None) -> None:
        self.exposed_s += end - start
        if gather is not None:
            self._gather_waits.append((gather.index, start, end))

    def finish(self, result: StepResult, units: list[Unit]) -> StepResult:
        """The step ends now: `result` gets its compute, communication and exposed seconds and
        its spans (phases, collectives, waits for all-gathers)."""
        end = time.perf_counter()
        self._count_sent()
        self.step_peak_bytes = max(self.step_peak_bytes, self.peak_bytes)
        spans = [(name, s, e, u) for u in units for name, s, e in self._collectives[u.index]]
        result.comm_s = sum(e - s for _, s, e, _ in spans)
        self.gather_s = sum(e - s for name, s, e, _ in spans if name == "all-gather")
        self.gather_wait_s = sum(e - s for _, s, e in self._gather_waits)
        result.exposed_s = self.exposed_s
        result.compute_s = (end - self._start) - result.exposed_s
        result.spans += self._phases
        result.spans += [Span(f"{name} unit {u.index}", s, e, cat="communication", thread="comm",
                              args={"bytes": u.nbytes}) for name, s, e, u in spans]
        result.spans += [Span(f"wait for all-gather unit {i}", s, e, cat="wait")
                         for i, s, e in self._gather_waits]
        return result

    # -- bytes sent --------------------------------------------------------------------------------
    def _message_log(self) -> tuple[list[Any], int]:
        """The communicator's message log (installed if there is none) and its length."""
        if self.comm.message_log is None:
            try:
                self.comm.message_log = []
                self._own_messages = True
            except AttributeError:  # a sub-communicator: its parent's log
                return [], 0
        return self.comm.message_log, len(self.comm.message_log)

    def _count_sent(self) -> None:
        me = self.comm.world_rank(self.comm.rank)
        sent = sum(entry[4] for entry in self._messages[self._first_message:] if entry[2] == me)
        if self._own_messages:  # the log this step installed goes with it (the next step's
            del self._messages[:]  # begin() installs it again): nothing else logs after us
            self.comm.message_log, self._own_messages = None, False
        self._sent += sent
        self._steps += 1

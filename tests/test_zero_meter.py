"""ZeRO's step meter (`ZeroMeter`) on a scripted clock: the model-state bytes held and their
peaks, which seconds count as exposed communication and as compute, the timeline's spans in
order, and the bytes sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mpdl.parallel import zero_meter
from mpdl.parallel.strategy import StepResult
from mpdl.parallel.zero_meter import ZeroMeter


class Clock:
    """A wall clock that moves only when the test says so."""

    def __init__(self) -> None:
        self.wall = 0.0

    def perf_counter(self) -> float:
        return self.wall

    def run(self, seconds: float) -> None:
        self.wall += seconds


class Comm:
    """A communicator's face as the meter sees it: rank 1 of the world, a message log whose
    entries are (kind, step, source, dest, bytes) when installed."""

    rank = 1
    message_log: list | None = None

    def world_rank(self, rank: int) -> int:
        return rank


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(zero_meter, "time", c)
    return c


def unit(index: int, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(index=index, nbytes=nbytes)


def test_bytes_held_peak_within_a_step_and_the_largest_step_peak_is_kept():
    r = ZeroMeter(Comm())
    r.hold(100)
    r.optimizer_state(40)       # the optimizer state appears: 140
    r.begin()
    r.hold(60)                  # a gathered unit: 200
    r.release(60)
    r.optimizer_state(50)       # it grows by 10: 150
    r.finish(StepResult(), [])
    assert (r.held, r.peak_bytes, r.step_peak_bytes) == (150, 200, 200)
    r.begin()                   # the next step's peak starts from what is held
    assert r.peak_bytes == 150
    r.hold(20)
    r.finish(StepResult(), [])
    assert (r.peak_bytes, r.step_peak_bytes) == (170, 200)


def test_a_step_splits_into_compute_and_exposed_seconds_with_its_spans_in_order(clock):
    r = ZeroMeter(Comm())
    units = [unit(0, 64), unit(1, 32)]
    result = StepResult()
    r.begin()                                               # t = 0
    clock.run(1.0)                                          # forward and backward
    with r.phase("finish (wait for reduce-scatter)", cat="wait", start=clock.wall):
        with r.waiting(), r.communicating(units[0], "reduce-scatter"):
            clock.run(0.5)                                  # all of it exposed
    with r.communicating(units[1], "all-gather"):           # 0.375 s on the comm thread,
        with r.phase("optimizer step"):                     # starts where the last phase ended
            clock.run(0.25)
        with r.waiting(gather=units[1]):
            clock.run(0.125)                                # its last 0.125 s exposed
    r.finish(result, units)                                 # t = 1.875
    assert result.exposed_s == 0.625
    assert result.compute_s == 1.875 - 0.625
    assert result.comm_s == 0.875
    assert (r.gather_s, r.gather_wait_s) == (0.375, 0.125)
    assert [(s.name, s.start, s.end, s.cat, s.thread) for s in result.spans] == [
        ("finish (wait for reduce-scatter)", 1.0, 1.5, "wait", "main"),
        ("optimizer step", 1.5, 1.75, "compute", "main"),
        ("reduce-scatter unit 0", 1.0, 1.5, "communication", "comm"),
        ("all-gather unit 1", 1.5, 1.875, "communication", "comm"),
        ("wait for all-gather unit 1", 1.75, 1.875, "wait", "main")]
    assert [s.args for s in result.spans[2:4]] == [{"bytes": 64}, {"bytes": 32}]


def test_the_bytes_this_rank_sent_are_counted_per_step_from_its_own_message_log():
    comm = Comm()
    r = ZeroMeter(comm)
    r.begin()                                   # installs a log on the communicator
    comm.message_log += [("send", 0, 1, 0, 100), ("send", 0, 0, 1, 7), ("send", 0, 1, 2, 20)]
    r.finish(StepResult(), [])
    assert comm.message_log is None                # its own log goes with each step
    r.begin()
    comm.message_log.append(("send", 1, 1, 0, 30))
    r.finish(StepResult(), [])
    assert r.sent_bytes_per_step() == (120 + 30) / 2


def test_a_log_installed_by_someone_else_is_read_from_where_the_step_began_and_kept():
    comm = Comm()
    comm.message_log = [("send", 0, 1, 0, 1000)]   # before the step: not counted
    r = ZeroMeter(comm)
    r.begin()
    comm.message_log.append(("send", 1, 1, 0, 8))
    r.finish(StepResult(), [])
    assert r.sent_bytes_per_step() == 8
    assert len(comm.message_log) == 2

"""Plans and the flight recorder on the in-process world: a plan runs bare unless its communicator
keeps a recorder; wrapped, it writes the entries a one-shot call writes, skips the call MPDL_FAULT
names, and sends the same messages as the bare plan (the message log)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import faults, settings
from mpdl import tuning as T
from mpdl.comm import CollectiveTimeout, flight
from mpdl.threadworld import run_world
from mpdl.tuning import plan as plans
from mpdl.tuning.flightplan import FlightPlan

GROUP = (0, 1, 2)


def entries(comm) -> list[tuple]:
    return [(r["seq"], r["collective"], r["algorithm"], r["bytes"], r["dtype"], r["op"],
             r["peers"], r["state"]) for r in comm.flight.records()]


@pytest.fixture
def fresh_cache():
    plans.clear_cache()
    yield
    plans.clear_cache()


def test_without_a_recorder_the_planned_path_returns_bare_plans(fresh_cache):
    def body(c):
        x, out = np.ones(6, np.float32), np.empty(6, np.float32)
        made = [T.allreduce_init(x, algorithm="ring", comm=c),
                T.reduce_scatter_init(x, algorithm="ring", comm=c),
                T.allgather_init(x, algorithm="ring", comm=c),
                T.alltoall_init(np.ones((3, 2)), comm=c, algorithm="pairwise")]
        for _ in range(3):
            C.allreduce(x, algorithm="ring", comm=c, out=out)
        cached = plans.cache[plans.allreduce_key(x, "sum", "ring", c, out)]
        return [type(h) for h in made], type(cached)

    for kinds, cached in run_world(3, body):
        assert kinds == [plans.Plan] * 4 and cached is plans.Plan


def test_planned_and_one_shot_calls_write_the_same_entries(fresh_cache):
    def body(c):
        c.flight = flight.FlightRecorder(50, c.rank, c.size)
        x = np.ones(5, np.float32)
        C.allreduce(x, algorithm="ring", comm=c)
        h = T.allreduce_init(x, op="max", algorithm="recursive_doubling", comm=c)
        h()
        h.start()
        started = entries(c)[-1][-1]
        h.wait()
        y, o = np.arange(7.0), np.empty(7)
        for _ in range(3):  # one-shot, then a plan made, then the cached plan
            C.allreduce(y, algorithm="ring", comm=c, out=o)
        cached = type(plans.cache[plans.allreduce_key(y, "sum", "ring", c, o)])
        T.reduce_scatter_init(np.ones(4, np.float32), algorithm="ring", comm=c)()
        w = np.ones(2, np.int32)
        T.allgather_init(w, algorithm="ring", comm=c)()
        C.allgather(w, algorithm="ring", comm=c)
        a = np.ones((3, 2))
        T.alltoall_init(a, comm=c, algorithm="pairwise")()
        C.alltoall(a, comm=c, algorithm="pairwise")
        return entries(c), started, cached, type(h)

    for records, started, cached, kind in run_world(3, body):
        assert records == [
            (0, "allreduce", "ring", 20, "float32", "sum", GROUP, "done"),
            (1, "allreduce", "recursive_doubling", 20, "float32", "max", GROUP, "done"),
            (2, "allreduce", "recursive_doubling", 20, "float32", "max", GROUP, "done"),
            (3, "allreduce", "ring", 56, "float64", "sum", GROUP, "done"),
            (4, "allreduce", "ring", 56, "float64", "sum", GROUP, "done"),
            (5, "allreduce", "ring", 56, "float64", "sum", GROUP, "done"),
            (6, "reduce_scatter", "ring", 16, "float32", "sum", GROUP, "done"),
            (7, "allgather", "ring", 24, "int32", None, GROUP, "done"),
            (8, "allgather", "ring", 24, "int32", None, GROUP, "done"),
            (9, "alltoall", "pairwise", 48, "float64", None, GROUP, "done"),
            (10, "alltoall", "pairwise", 48, "float64", None, GROUP, "done"),
        ]
        assert started == "started" and cached is FlightPlan and kind is FlightPlan


@pytest.mark.parametrize("how", ["call", "start and wait"])
def test_the_faulted_call_is_skipped_and_fails_on_the_others(monkeypatch, how):
    monkeypatch.setenv("MPDL_FAULT", "skip:1:2")
    monkeypatch.setenv("MPDL_TIMEOUT", "0.5")
    monkeypatch.setattr(faults, "_skipped", [])
    previous = settings.use(None)

    def body(c):
        c.flight = flight.FlightRecorder(50, c.rank, c.size)
        x = np.full(4, float(c.rank + 1))
        h = T.allreduce_init(x, algorithm="ring", comm=c)
        h()
        h.start().wait()
        run = h if how == "call" else (lambda: h.start().wait())
        if c.rank == 1:
            skipped = run().copy()
        else:
            with pytest.raises(CollectiveTimeout):
                run()
            skipped = None
        return entries(c), skipped

    try:
        results = run_world(3, body)
    finally:
        settings.use(previous)
    done = [(s, "allreduce", "ring", 32, "float64", "sum", GROUP, "done") for s in (0, 1)]
    assert results[1][0] == done
    np.testing.assert_array_equal(results[1][1], np.full(4, 6.0))  # the previous run's sums
    for r in (0, 2):
        assert results[r][0] == [*done, (2, "allreduce", "ring", 32, "float64", "sum", GROUP,
                                         "failed")]


def test_wrapped_and_bare_plans_send_the_same_messages():
    def body(c):
        x = np.arange(11.0) + c.rank
        sent = {}
        for kind in ("bare", "wrapped"):
            if kind == "wrapped":
                c.flight = flight.FlightRecorder(50, c.rank, c.size)
            plans_made = [T.allreduce_init(x, algorithm=a, comm=c, out=np.empty_like(x))
                          for a in ("ring", "recursive_doubling", "tree")]
            plans_made.append(T.alltoall_init(np.ones((3, 4)), comm=c, algorithm="bruck"))
            c.message_log = []
            results = [h().copy() for h in plans_made]
            sent[kind] = (c.message_log, [type(h) for h in plans_made], results)
            c.message_log = None
        return sent

    for sent in run_world(3, body):
        (bare, bare_kinds, bare_results), (wrapped, kinds, results) = sent["bare"], sent["wrapped"]
        assert bare_kinds == [plans.Plan] * 4 and kinds == [FlightPlan] * 4
        assert len(bare) >= 8 and bare == wrapped
        for a, b in zip(bare_results, results, strict=True):
            assert a.tobytes() == b.tobytes()


def test_a_recorder_switched_on_after_caching_notes_the_cached_plan(fresh_cache):
    def body(c):
        y, o = np.arange(3.0), np.empty(3)
        key = plans.allreduce_key(y, "sum", "ring", c, o)
        for _ in range(2):
            C.allreduce(y, algorithm="ring", comm=c, out=o)
        bare = plans.cache[key]
        c.flight = flight.FlightRecorder(50, c.rank, c.size)
        C.allreduce(y, algorithm="ring", comm=c, out=o)
        wrapped = plans.cache[key]
        recorder, c.flight = c.flight, None
        C.allreduce(y, algorithm="ring", comm=c, out=o)
        return type(bare), type(wrapped), wrapped.plan is bare, plans.cache[key] is bare, \
            [(r["seq"], r["algorithm"], r["state"]) for r in recorder.records()]

    for result in run_world(2, body):
        assert result == (plans.Plan, FlightPlan, True, True, [(0, "ring", "done")])


def test_a_plan_started_behind_asynchronous_calls_is_noted_after_them():
    """Started while an asynchronous all-reduce is in flight, the plan runs behind it on the
    communication thread and takes the next number; its entry ends there, before wait()."""
    def body(c):
        c.flight = flight.FlightRecorder(50, c.rank, c.size)
        x = np.ones(3)
        h = T.allreduce_init(x, algorithm="ring", comm=c)
        if c.rank != 0:
            time.sleep(0.3)  # rank 0's asynchronous call is still waiting for this rank
        handle = C.allreduce_async(np.ones(2), algorithm="ring", comm=c)
        h.start()
        states = [r["state"] for r in c.flight.records()]
        handle.wait()
        return states, entries(c), h.wait().copy()

    results = run_world(2, body)
    assert results[0][0] == ["done", "done"]  # rank 1's call may find the line empty again
    for _, records, result in results:
        assert records == [(0, "allreduce", "ring", 16, "float64", "sum", (0, 1), "done"),
                           (1, "allreduce", "ring", 24, "float64", "sum", (0, 1), "done")]
        np.testing.assert_array_equal(result, np.full(3, 2.0))


def test_entries_name_the_algorithm_a_verdict_switched_to():
    """A verdict of verification switches the bare plan's algorithm (`Plan.switch`): the wrapper's
    next entries name the new one, in start-and-wait as in a call."""
    def body(c):
        c.flight = flight.FlightRecorder(50, c.rank, c.size)
        x = np.arange(6.0) + c.rank
        h = T.allreduce_init(x, algorithm="ring", comm=c)
        h()
        go, fast, _ = T.allreduce_init(x, algorithm="recursive_doubling", comm=c,
                                       out=h.result).schedule()
        h.plan.switch("recursive_doubling", go, fast)
        result = h().copy()
        h.start().wait()
        return [(r["seq"], r["algorithm"], r["state"]) for r in c.flight.records()], result

    for records, result in run_world(3, body):
        assert records == [(0, "ring", "done"), (1, "recursive_doubling", "done"),
                           (2, "recursive_doubling", "done")]
        np.testing.assert_array_equal(result, 3 * np.arange(6.0) + 3)

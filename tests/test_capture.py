"""Captured schedules (mpdl.tuning.capture) against the live algorithms on the in-process
world: the same messages (peer, buffer, offset, length, step) and reductions, in the same order,
and a replay of the capture gives the live result bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl import settings
from mpdl.collectives.recursive import recursive_doubling_allreduce
from mpdl.collectives.ring import ring_allreduce
from mpdl.threadworld import run_world
from mpdl.tuning import capture
from mpdl.tuning.capture import BUF, SRC, CapturedSchedule, Message, Region, Round

ALGORITHMS = {"ring": ring_allreduce, "recursive_doubling": recursive_doubling_allreduce}


def counts(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 7, 13, 97})


def data(p: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(10 * p + n)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(p)]


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def live(algorithm, c, buf: np.ndarray) -> list[tuple]:
    """What algorithm(c, buf, add) does on this rank, in order: ("send" or "recv", peer, step,
    (buffer, offset, length)) per message posted, ("reduce", (a), (b), (out)) per reduction; a
    buffer is BUF or the name of the communicator's work buffer the array lies in, the offset
    None for an empty array (NumPy does not keep where an empty slice starts)."""
    events: list[tuple] = []

    def where(view: np.ndarray) -> tuple[str, int | None, int]:
        places = {BUF: buf, **{key[0]: w for key, w in c._workspace.items()}}
        for name, whole in places.items():
            if _owner(view) is _owner(whole):
                offset = view.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
                return name, offset // view.itemsize if view.size else None, view.size
        raise AssertionError("a message of an array that is neither buf nor a work buffer")

    isend, irecv = c.isend, c.irecv
    c.isend = lambda b, dest, step=None: (events.append(("send", dest, step, where(b))),
                                          isend(b, dest, step))[1]
    c.irecv = lambda b, source, step=None: (events.append(("recv", source, step, where(b))),
                                            irecv(b, source, step))[1]

    def reduce(a, b, out):
        events.append(("reduce", where(a), where(b), where(out)))
        np.add(a, b, out=out)

    algorithm(c, buf, reduce)
    return events


def captured(schedule: CapturedSchedule) -> list[tuple]:
    """The captured schedule's events in the form of `live`'s."""
    def where(region: Region) -> tuple[str, int | None, int]:
        return region.buffer, region.offset if region.size else None, region.size

    events: list[tuple] = []
    for r in schedule.rounds:
        events += [(m.kind, m.peer, m.step, where(m.region)) for m in r.messages]
        events += [("reduce", where(a), where(b), where(o)) for a, b, o in r.reductions]
    return events


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("segment_bytes", [1 << 20, 12])
def test_the_capture_is_what_the_live_algorithm_sends_and_reduces(name, segment_bytes):
    """Message for message (kind, peer, step, buffer, offset, length) and reduction for reduction,
    at p = 1..6 and awkward counts; 12-byte segments make the ring send blocks in pieces."""
    algorithm = ALGORITHMS[name]
    settings.update(segment_bytes=segment_bytes)
    for p in range(1, 7):
        for n in counts(p):
            xs = data(p, n)
            events = run_world(p, lambda c, xs=xs: live(algorithm, c, xs[c.rank].copy()))
            for rank, seen in enumerate(events):
                schedule = capture.capture(algorithm, rank, p, n, np.float32)
                assert captured(schedule) == seen, f"{name} p={p} n={n} rank {rank}"
                assert any(e[0] == "send" for e in seen) == (p > 1)


def replay(c, schedule: CapturedSchedule, arrays: dict[str, np.ndarray]) -> None:
    """Run a captured schedule on the in-process world: each round's messages posted together and
    waited for, then its reductions."""
    for r in schedule.rounds:
        c.waitall([(c.isend if m.kind == "send" else c.irecv)(m.region.view(arrays), m.peer,
                                                               m.step) for m in r.messages])
        for a, b, o in r.reductions:
            np.add(a.view(arrays), b.view(arrays), out=o.view(arrays))


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_replayed_capture_gives_the_live_result_bit_for_bit(name):
    """The capture as it is (the input copied into the buffer first) and `reading_input`'s (the
    buffer starts as garbage and the input is read where it was not yet written)."""
    algorithm = ALGORITHMS[name]
    for p in range(1, 7):
        for n in counts(p):
            xs = data(p, n)

            def body(c, xs=xs, n=n):
                x = xs[c.rank]
                expected = x.copy()
                algorithm(c, expected, np.add)
                schedule = capture.capture(algorithm, c.rank, c.size, n, x.dtype)
                scratch = {k: np.full(size, np.nan, x.dtype) for k, size in schedule.scratch.items()}
                copied = x.copy()
                replay(c, schedule, {BUF: copied, **scratch})
                reading = capture.reading_input(schedule)
                if reading is None:
                    return expected, copied, None
                fresh = np.full(n, np.nan, x.dtype)
                replay(c, reading, {BUF: fresh, SRC: x, **scratch})
                return expected, copied, fresh

            for rank, (expected, copied, fresh) in enumerate(run_world(p, body)):
                what = f"{name} p={p} n={n} rank {rank}"
                assert copied.tobytes() == expected.tobytes(), what
                # every rank of p > 1 writes all of its buffer, so it needs no copy of the input
                assert (fresh is not None) == (p > 1 or n == 0), what
                if fresh is not None:
                    assert fresh.tobytes() == expected.tobytes(), what


def test_reading_input_refuses_what_it_cannot_serve_from_the_input():
    f32 = np.dtype(np.float32)
    buf = Region(BUF, 0, 4, f32)
    tmp = Region("tmp", 0, 4, f32)
    unwritten = CapturedSchedule(4, [Round([Message("send", 1, buf, 0)])], {})
    assert capture.reading_input(unwritten) is None  # buf never written: it must hold x
    partly = CapturedSchedule(4, [Round([Message("recv", 1, buf[:2], 0)]),
                                  Round([Message("send", 1, buf, 1)], [(tmp, buf, buf)])],
                              {"tmp": 4})
    assert capture.reading_input(partly) is None  # a send of a part half written
    whole = CapturedSchedule(4, [Round([Message("send", 1, buf, 0), Message("recv", 1, tmp, 0)],
                                       [(tmp, buf[1:], buf[1:])]),
                                 Round([Message("recv", 1, buf[:1], 1)])], {"tmp": 4})
    served = capture.reading_input(whole)
    assert served is not None
    first = served.rounds[0]
    assert first.messages[0].region == Region(SRC, 0, 4, f32)
    assert first.reductions == [(tmp, Region(SRC, 1, 3, f32), Region(BUF, 1, 3, f32))]
    assert served.rounds[1].messages[0].region == Region(BUF, 0, 1, f32)

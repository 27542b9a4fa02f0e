"""Persistent point-to-point requests (`send_init` / `recv_init`) on the in-process world."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl import settings
from mpdl.comm import CollectiveTimeout, PersistentRequest, flight
from mpdl.threadworld import run_world

SHAPES = [(0,), (1,), (7,), (3, 5), (2, 3, 4)]


def ring_exchange(c, dtype, starts: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each rank sends to the right and receives from the left, `starts` times per shape, with
    the send buffer's values changed before every start; returns (sent, received) per start."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    seen = []
    for k, shape in enumerate(SHAPES):
        out, into = np.empty(shape, dtype), np.empty(shape, dtype)
        send = c.send_init(out, right, step=("shape", k))
        recv = c.recv_init(into, left, step=("shape", k))
        assert isinstance(send, PersistentRequest) and send.buf is out and recv.buf is into
        for n in range(starts):
            out[...] = (np.arange(out.size).reshape(shape) + 100 * c.rank + 10 * n).astype(dtype)
            c.waitall([recv.start(), send.start()])
            assert not send.active and not recv.active
            seen.append((out.copy(), into.copy()))
    return seen


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_each_start_delivers_the_current_values(p, dtype):
    results = run_world(p, lambda c: ring_exchange(c, dtype, starts=4))
    for rank in range(p):
        left = (rank - 1) % p
        for (_, got), (sent, _) in zip(results[rank], results[left], strict=True):
            assert got.tobytes() == sent.tobytes()


def test_starting_again_before_a_wait_raises():
    def body(c):
        buf = np.arange(4.0)
        if c.rank == 0:
            send = c.send_init(buf, 1, step="once")
            send.start()
            with pytest.raises(RuntimeError, match=r"persistent send to rank 1 \(step once\) "
                                                   r"started again before a wait"):
                send.start()
            c.waitall([send])
            send.start()  # allowed again after the wait
            c.waitall([send])
        else:
            recv = c.recv_init(buf, 0, step="once")
            for _ in range(2):
                recv.start()
                with pytest.raises(RuntimeError, match="persistent recv from rank 0"):
                    recv.start()
                c.waitall([recv])
        return True

    assert run_world(2, body) == [True, True]


def test_test_and_waitany_complete_a_started_request():
    def body(c):
        buf = np.full(3, float(c.rank))
        if c.rank == 0:
            send = c.send_init(buf, 1)
            for _ in range(3):
                c.waitall([send.start()])
            return None
        recv = c.recv_init(buf, 0)
        recv.start()
        assert c.waitany([recv]) == 0 and not recv.active
        recv.start()
        while not c.test(recv):
            pass
        recv.start()
        c.waitall([recv])
        return buf

    assert run_world(2, body)[1].tolist() == [0.0, 0.0, 0.0]


def test_a_sub_communicator_maps_its_ranks_and_the_recorder_sees_each_start():
    def body(c):
        if c.rank == 1:
            return None
        sub = c.sub([2, 0])  # sub rank 0 is world rank 2
        buf = np.full(5, float(c.rank))
        r = sub.send_init(buf, 1, "x") if sub.rank == 0 else sub.recv_init(buf, 0, "x")
        for _ in range(3):
            sub.waitall([r.start()])
        return buf

    results, log = run_world(3, body, message_log=True)
    assert results[0].tolist() == [2.0] * 5
    assert [(src, dst, n) for _, _, src, dst, n in log] == [(2, 0, 40)] * 3


def test_a_receive_whose_sender_never_comes_times_out(monkeypatch):
    monkeypatch.setenv("MPDL_TIMEOUT", "0.3")
    settings.use(None)

    def body(c):
        if c.rank == 1:
            return None
        recv = c.recv_init(np.empty(2), 1, step=("act", 3))
        c.waitall([recv.start()])

    with pytest.raises(CollectiveTimeout, match=r"rank 0 waited .* receiving from rank 1 at "
                                                r"step \('act', 3\)"):
        run_world(2, body)


def test_the_flight_recorder_keeps_one_entry_per_start():
    def body(c):
        c.flight = flight.FlightRecorder(10, c.rank, c.size)
        buf = np.ones(2)
        r = c.send_init(buf, 1) if c.rank == 0 else c.recv_init(buf, 0)
        r.start()
        started = [rec["state"] for rec in c.flight.records()]
        c.waitall([r])
        c.waitall([r.start()])
        return started, [(rec["seq"], rec["collective"], rec["algorithm"], rec["state"])
                         for rec in c.flight.records()]

    (started0, sends), (_, recvs) = run_world(2, body)
    assert started0 == ["started"]
    assert sends == [(0, "send", "p2p", "done"), (1, "send", "p2p", "done")]
    assert recvs == [(0, "recv", "p2p", "done"), (1, "recv", "p2p", "done")]

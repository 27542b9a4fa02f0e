"""The flight recorder: a ring of the last N operations, written where the settings say."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpdl import settings
from mpdl.comm import flight
from mpdl.threadworld import run_world


def test_the_ring_keeps_the_last_n_operations_in_order():
    rec = flight.FlightRecorder(3, rank=1, size=2)
    group = (0, 1)
    for i in range(5):
        entry = rec.begin(group, "allreduce", "ring", 8 * i, "float64", "sum", group)
        if i < 4:
            rec.end(entry)
    records = rec.records()
    assert [r["seq"] for r in records] == [2, 3, 4]
    assert [r["state"] for r in records] == ["done", "done", "started"]
    assert records[0]["bytes"] == 16 and records[0]["peers"] == (0, 1)
    assert rec.waiting([1, 0, 1]) is not None and rec.records()[-1]["waiting_for"] == [0, 1]
    other = rec.begin((1,), "send", "p2p", 4, "int32", None, (0,))
    assert other.seq == 0  # sequence numbers count per group
    assert rec.next_seq(group) == 5


@pytest.fixture
def fresh(monkeypatch):
    """A recorder of its own for the test, and the settings put back afterwards."""
    previous = settings.use(None)
    monkeypatch.setattr(flight, "_recorder", [])
    monkeypatch.setattr(flight, "_default_directory", [])
    monkeypatch.setattr(flight, "_dumped", set())
    monkeypatch.setattr(flight, "notify_peers", [])
    monkeypatch.setattr(flight, "_install_hooks", lambda: None)
    yield monkeypatch
    settings.use(previous)


def test_dump_goes_to_the_variable_then_the_default_then_the_current_folder(fresh, tmp_path):
    fresh.chdir(tmp_path)
    fresh.delenv("MPDL_FLIGHT_DIR", raising=False)
    settings.use(None)
    rec = flight.recorder(rank=2, size=3)
    rec.end(rec.begin((0, 1, 2), "broadcast", "tree", 4, "float32", None, (0, 1, 2)))
    assert flight.dump() == tmp_path / "mpdl-flight" / "rank-2.json"
    flight.set_default_directory(tmp_path / "ckpt" / "flight")
    assert flight.dump("again") == tmp_path / "ckpt" / "flight" / "rank-2.json"
    fresh.setenv("MPDL_FLIGHT_DIR", str(tmp_path / "env"))
    settings.use(None)
    path = flight.dump("SIGUSR1")
    assert path == tmp_path / "env" / "rank-2.json"
    data = json.loads(path.read_text())
    assert data["rank"] == 2 and data["reason"] == "SIGUSR1" and data["recorded"] == 1
    assert data["records"][0]["collective"] == "broadcast"
    assert flight.dump("fatal: x", once=True) is not None
    assert flight.dump("fatal: y", once=True) is None  # one fatal dump per process


def test_switched_off_with_zero_records(fresh):
    fresh.setenv("MPDL_FLIGHT_RECORDS", "0")
    settings.use(None)
    assert flight.recorder() is None and flight.dump() is None


@pytest.mark.parametrize("variable, value, message", [
    ("MPDL_FLIGHT_RECORDS", "-1", "MPDL_FLIGHT_RECORDS: expected an integer >= 0"),
    ("MPDL_STALL_WARN", "0", "MPDL_STALL_WARN: expected a positive number"),
    ("MPDL_FAULT", "kill:x:1", "MPDL_FAULT: expected kill:RANK:STEP, stall:RANK:STEP, "
                               "nan:RANK:STEP or skip:RANK:SEQ"),
])
def test_bad_values_name_the_variable(variable, value, message):
    with pytest.raises(ValueError, match=message):
        settings.Settings.from_environment({variable: value})


def test_collectives_and_p2p_are_recorded_on_a_recorder_of_the_communicator():
    from mpdl import collectives as C

    def body(comm):
        comm.flight = flight.FlightRecorder(10, comm.rank, comm.size)
        C.allreduce(np.ones(5), algorithm="ring", comm=comm)
        if comm.rank == 0:
            comm.send(np.ones(2), 1)
        elif comm.rank == 1:
            comm.recv(np.empty(2), 0)
        comm.barrier()
        return [(r["seq"], r["collective"], r["algorithm"], r["state"], r["op"])
                for r in comm.flight.records()]

    results = run_world(3, body)
    assert results[0] == [(0, "allreduce", "ring", "done", "sum"), (0, "send", "p2p", "done", None),
                          (1, "barrier", "dissemination", "done", None)]
    assert results[1][1] == (0, "recv", "p2p", "done", None)
    assert results[2] == [results[0][0], results[0][2]]

"""`mpdl bench` under mpiexec (any world size): tiny sweeps, their JSON rows, --check, bad flags, auto."""

from __future__ import annotations

import json
import os

import pytest
from mpi4py import MPI

from mpdl import settings
from mpdl.cli import main
from mpdl.collectives import registry
from mpdl.comm import as_communicator
from mpdl.perf.bench import bus_factor
from mpdl.tuning import auto, costmodel

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
TINY = ["-b", "8", "-e", "4K", "-f", "16", "-n", "2", "-w", "1"]


@pytest.fixture
def shared_dir(tmp_path_factory):
    """One directory every rank agrees on (rank 0's)."""
    path = str(tmp_path_factory.mktemp("bench")) if RANK == 0 else None
    return COMM.bcast(path, root=0)


def bench(args: list[str], shared_dir: str) -> list[dict]:
    out = os.path.join(shared_dir, "rows.json")
    assert main(["bench", *args, "--json", out]) == 0
    COMM.Barrier()
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    COMM.Barrier()
    return rows


def test_allreduce_sweep_rows_bandwidths_and_check(shared_dir):
    rows = bench(["allreduce", *TINY, "--check"], shared_dir)
    names = [*registry.algorithms("allreduce"), "auto"]
    assert [r["algorithm"] for r in rows[:len(names)]] == names
    assert sorted({r["bytes"] for r in rows}) == [8, 128, 2048]
    for r in rows:
        assert set(r) >= {"collective", "algorithm", "chosen", "ranks", "nodes", "bytes", "count",
                          "dtype", "op", "time_us", "time_us_min", "time_us_max", "algbw_gbs",
                          "busbw_gbs", "wrong", "predicted_us"}
        assert r["wrong"] == 0, r
        assert r["ranks"] == P and r["count"] * 4 == r["bytes"]
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (P - 1) / P)
        assert r["predicted_us"] > 0 and r["emulated"] == ""
        if r["algorithm"] == "auto":
            assert r["chosen"] in costmodel.candidates("allreduce", True)
        else:
            assert r["chosen"] == r["algorithm"]


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce",
                                        "alltoall"])
def test_other_collectives_check_and_bus_factor(collective, shared_dir):
    extra = [] if collective in ("allgather", "broadcast", "alltoall") else [
        "--dtype", "int64", "--op", "max"]
    rows = bench([collective, "-b", "64", "-e", "1K", "-f", "16", "-n", "2", "-w", "0", "--check",
                  *extra], shared_dir)
    assert {r["algorithm"] for r in rows} == {*registry.algorithms(collective), "auto"}
    for r in rows:
        assert r["wrong"] == 0, r
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * bus_factor(collective, P))
        if collective in ("allgather", "alltoall"):
            assert r["count"] % P == 0


def test_inplace_float64_avg_and_a_chosen_list(shared_dir):
    rows = bench(["-b", "100", "-e", "100", "--dtype", "float64", "--op", "avg", "--inplace",
                  "--algorithms", "ring,auto", "-n", "2", "-w", "1", "--check"], shared_dir)
    assert [r["algorithm"] for r in rows] == ["ring", "auto", "mpi"]  # the baseline is added
    assert all(r["wrong"] == 0 and r["dtype"] == "float64" and r["op"] == "avg" for r in rows)


def test_alltoall_in_place_in_a_loop_matches_mpi(shared_dir):
    rows = bench(["alltoall", "-b", str(40 * P), "-e", str(40 * P), "--inplace", "--loop", "3",
                  "--dtype", "int32", "-n", "2", "-w", "1", "--check"], shared_dir)
    assert {r["algorithm"] for r in rows} == {*registry.algorithms("alltoall"), "auto"}
    assert all(r["wrong"] == 0 and r["count"] == 10 * P for r in rows)


def test_emulated_rows_say_so(shared_dir):
    rows = bench(["-b", "1K", "-e", "1K", "-n", "1", "-w", "0", "--algorithms", "ring",
                  "--emulate", "inter=10Gbit/s,20us"], shared_dir)
    assert rows and all(r["emulated"] == "inter=10Gbit/s,20us" for r in rows)
    assert as_communicator(None).link_delay is None  # the run's emulation ends with it
    assert "MPDL_EMULATE" not in os.environ
    os.environ["MPDL_EMULATE"] = "inter=1Gbit/s"
    settings.use(None)
    try:
        rows = bench(["-b", "8", "-e", "8", "-n", "1", "-w", "0", "--algorithms", "ring",
                      "--emulate", "off"], shared_dir)
    finally:
        del os.environ["MPDL_EMULATE"]
        settings.use(None)
    assert all(r["emulated"] == "" for r in rows)


def test_emulation_is_a_setting_of_the_run_alone(shared_dir):
    """--emulate reaches auto's model through the settings object, for the run only; it writes
    no environment variable."""
    before = settings.current()
    rows = bench(["-b", "8", "-e", "8", "-n", "1", "-w", "0", "--algorithms", "auto",
                  "--emulate", "intra=1Gbit/s,5us"], shared_dir)
    assert all(r["emulated"] == "intra=1Gbit/s,5us" for r in rows)
    assert settings.current() is before and "MPDL_EMULATE" not in os.environ


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "alltoall"])
def test_loop_times_back_to_back_calls_per_call(collective, shared_dir):
    """--loop 3: every timed or untimed iteration makes 3 calls (counted by the flight recorder),
    the results stay right (--check) and the rows say how many calls an iteration made."""
    recorder = as_communicator(None).flight
    if recorder is None:
        pytest.skip("the flight recorder is off (MPDL_FLIGHT_RECORDS=0): nothing counts the calls")
    size = 24 * P  # bytes: an allgather of P blocks, found among the records by its size
    ours = "pairwise" if collective == "alltoall" else "ring"
    before = recorder.count
    rows = bench([collective, "-b", str(size), "-e", str(size), "--algorithms", ours, "-n", "2",
                  "-w", "1", "--loop", "3", "--check"], shared_dir)
    assert [r["algorithm"] for r in rows] == [ours, "mpi"]
    assert all(r["wrong"] == 0 and r["loop"] == 3 and r["time_us"] > 0 for r in rows)
    mine = [r for r in recorder.records()[-(recorder.count - before):]
            if r["collective"] == collective and r["bytes"] == size
            and r["algorithm"] in (ours, "mpi")]
    # per algorithm: 1 warm-up call, then 2 rounds of (1 untimed + 1 timed) iterations, 3 calls each
    assert len(mine) == 2 * (1 + 2 * 2 * 3)


@pytest.mark.parametrize("argv, message", [
    (["-b", "1M", "-e", "1K"], "--max-bytes"),
    (["--algorithms", "ring,bogus"], "unknown 'bogus'"),
    (["--dtype", "complex64"], "--dtype"),
    (["--op", "xor"], "--op"),
    (["--dtype", "int32", "--op", "avg"], "avg needs a floating-point"),
    (["-b", "lots"], "byte count"),
    (["gather"], "collective"),
    (["--emulate", "inter=fast"], "--emulate"),
    (["broadcast", "--inplace"], "--inplace"),
    (["--loop", "0"], "--loop"),
    (["--loop", "3", "--inplace"], "--loop with --inplace"),
])
def test_bad_flags_exit_2_with_one_line_from_rank_0(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    if RANK == 0:
        assert err.count("\n") == 1 and message in err and err.startswith("mpdl bench: error:")
        assert "Traceback" not in err
    else:
        assert err == ""


def test_auto_is_identical_on_all_ranks(shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "model.json")
    if RANK == 0:
        costmodel.save(path, costmodel.Params(alpha=3e-6, beta=2e-10, ranks=P))
    COMM.Barrier()
    monkeypatch.setenv("MPDL_COST_MODEL", path)
    settings.use(None)
    try:
        auto.forget()
        picks = [auto.choose(c, n, P, nodes, shm) for c in registry.COLLECTIVES
                 for n in (0, 8, 1 << 12, 1 << 16, 1 << 20, 1 << 26) for nodes in (1, 2)
                 for shm in (True, False)]
    finally:
        monkeypatch.undo()
        settings.use(None)
        auto.forget()
    everyone = COMM.allgather(picks)
    assert all(e == everyone[0] for e in everyone)

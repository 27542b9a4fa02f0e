"""`auto` without a calibration file: the defaults' choices, where the model comes from, and the
first-use calibration's cache (its key, atomic writes, a corrupt file, agreement through rank 0).
The measurement itself runs under mpiexec (tests/mpi/test_auto.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import settings
from mpdl.threadworld import run_world
from mpdl.tuning import auto, firstuse, measuring
from mpdl.tuning import costmodel as cm


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """No calibration file, a first-use cache in tmp_path/cache, nothing remembered."""
    monkeypatch.setenv("MPDL_COST_MODEL", str(tmp_path / "costmodel.json"))
    monkeypatch.setenv("MPDL_AUTO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MPDL_EMULATE", raising=False)
    settings.use(None)
    auto.forget()
    yield
    auto.forget()


class FakeComm:
    """Rank 0 of a two-rank MPI-backed communicator on one node, as far as `auto` looks: no
    messages (allgather_object returns rank 0's object for both ranks)."""

    mpi = object()  # "real MPI"
    MPI = None
    parent = None
    collective = "p2p"
    has_shared_memory = True

    def __init__(self, size: int = 2) -> None:
        self.size, self.rank = size, 0

    def node_groups(self):
        return [list(range(self.size))]

    def allgather_object(self, obj):
        return [obj] * self.size


MEASURED = cm.Params(alpha=7e-6, beta=3e-10, copy_cached=2e-11, barrier=11e-6, ranks=2,
                     source="fake first-use calibration")


def test_without_a_calibration_file_the_defaults_take_shm_on_one_node_where_it_wins():
    """The issue's miss: 256 KiB on one node went to ring at 1.6x shm's time."""
    assert auto.static_model(2).origin == "defaults"
    for p in (2, 3, 4):
        for nbytes in (1 << 16, 1 << 18, 1 << 20, 1 << 24, 1 << 26):
            assert auto.choose("allreduce", nbytes, p, 1, True) == "shm", (p, nbytes)
        assert auto.choose("allreduce", 8, p, 1, True) != "shm"  # latency-bound: few messages
    # without shared memory (or across nodes) shm is not eligible
    assert all(auto.choose("allreduce", 1 << n, 4, 1, False) != "shm" for n in range(3, 27))


@pytest.mark.parametrize("p", [2, 4])
def test_every_default_choice_is_the_models_fastest(p):
    params = cm.Params()
    for n in range(3, 27):
        names = cm.candidates("allreduce", True)
        times = {a: cm.predict("allreduce", a, 1 << n, p, 1, params) for a in names}
        assert times[auto.choose("allreduce", 1 << n, p, 1, True)] == min(times.values())


def test_the_cache_key_names_host_mpi_library_world_size_and_ranks_per_node(tmp_path):
    comm = FakeComm(4)
    key = firstuse.cache_key(comm, host="node-a", mpi_library="MPICH Version: 5.0.2")
    assert key == {"host": "node-a", "mpi_library": "MPICH Version: 5.0.2", "world_size": 4,
                   "ranks_per_node": [4]}
    path = firstuse.cache_path(str(tmp_path), key)
    assert os.path.basename(path).startswith("auto-node-a-p4-1x4-") and path.endswith(".json")
    other = firstuse.cache_path(str(tmp_path), {**key, "mpi_library": "Open MPI v5.0.5"})
    assert other != path  # another MPI library, another file


def test_cache_round_trip_and_a_file_of_another_key_is_refused(tmp_path):
    key = {"host": "h", "mpi_library": "m", "world_size": 2, "ranks_per_node": [2]}
    path = str(tmp_path / "sub" / "auto.json")
    assert firstuse.read(path, key) is None
    firstuse.write(path, key, MEASURED)
    assert firstuse.read(path, key) == MEASURED
    assert os.listdir(tmp_path / "sub") == ["auto.json"]  # no temporary file left behind
    with pytest.raises(cm.ModelUnavailable, match="made for"):
        firstuse.read(path, {**key, "world_size": 4})


def test_the_provisional_flag_round_trips_and_never_replaces_a_quiet_calibration(tmp_path):
    key = {"host": "h", "mpi_library": "m", "world_size": 2, "ranks_per_node": [2]}
    path = str(tmp_path / "auto.json")
    busy = replace(MEASURED, provisional="busy machine: load 3.00 per core")
    assert firstuse.write(path, key, busy)
    assert firstuse.read(path, key).provisional == "busy machine: load 3.00 per core"
    assert firstuse.write(path, key, MEASURED)  # a quiet one replaces a provisional one
    assert firstuse.read(path, key) == MEASURED and MEASURED.provisional == ""
    assert not firstuse.write(path, key, busy)  # ... and a provisional one never replaces it
    assert firstuse.read(path, key) == MEASURED
    # the same rule in `mpdl calibrate`'s file, per world size
    model = str(tmp_path / "costmodel.json")
    assert cm.save(model, replace(busy, ranks=2)) and cm.read_file(model)[2].provisional
    assert cm.save(model, replace(MEASURED, ranks=2))
    assert not cm.save(model, replace(busy, ranks=2)) and cm.read_file(model)[2].provisional == ""


def test_a_provisional_cache_is_kept_and_never_measured_again_at_start_up(tmp_path, monkeypatch):
    """A calibration taken on a busy machine is the model of every later run, marked with its
    reason (the load it saw) in `mpdl info`'s line: no run measures it again."""
    settings.update(auto_cache=str(tmp_path), cost_model=str(tmp_path / "none.json"))
    comm = FakeComm(2)
    key = firstuse.cache_key(comm)
    path = firstuse.cache_path(str(tmp_path), key)
    busy = replace(MEASURED, provisional="busy machine: load 2.40 per core")
    firstuse.write(path, key, busy)
    model, measure_into = auto.look(comm)
    assert measure_into == "" and model.origin == "cache" and model.params == busy
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: pytest.fail("measured again"))
    for _ in range(3):  # three later runs
        auto.forget()
        model = auto.model_for(FakeComm(2))
        assert model.origin == "cache" and model.provisional == busy.provisional
        assert model.describe().startswith("provisional (busy machine: load 2.40 per core)")
    assert firstuse.read(path, key) == busy


class FakeSub(FakeComm):
    """Rank 0 of a part of two ranks of a FakeComm world of four (a process grid's group)."""

    def __init__(self, world: FakeComm) -> None:
        super().__init__(2)
        self.parent = world


def test_a_sub_communicator_derives_its_model_from_the_worlds_calibration(tmp_path,
                                                                           monkeypatch):
    """With the world's first-use calibration cached, a part of the world measures nothing: it
    takes the world's links (the table of the world's own shape stays unused for its shape),
    saves them in its own file, and later runs read that file; its plans' verdicts go there."""
    world = FakeComm(4)
    world_params = replace(MEASURED, ranks=4, nodes=1, provisional="busy machine: load 2.00",
                           allreduce_times=(("ring", ((8.0, 1.0),)),))
    world_key = firstuse.cache_key(world)
    firstuse.write(firstuse.cache_path(settings.current().auto_cache, world_key), world_key,
                   world_params)
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: pytest.fail("a part measured"))
    sub = FakeSub(world)
    model = auto.model_for(sub)
    assert model.origin == "derived" and model.calibrated and "-sub2-" in model.path
    assert model.params.alpha == MEASURED.alpha and model.params.provisional == "busy machine: load 2.00"
    assert model.params.source.startswith("derived from the world's fake first-use")
    assert "derived from the world's first-use calibration" in model.describe()
    # the world's table is for 4 ranks: the part's 2 ranks get the formula
    assert cm.predict("allreduce", "ring", 8, 2, 1, model.params) == cm.predict(
        "allreduce", "ring", 8, 2, 1, replace(model.params, allreduce_times=()))
    auto.learn(sub, "allreduce", 4096, "ring")
    assert firstuse.read_verified(model.path, firstuse.cache_key(sub)) == {"allreduce:4096": "ring"}
    auto.forget()
    again = auto.model_for(FakeSub(world))  # the next run: its own file
    assert again.origin == "cache" and again.params == model.params
    assert again.verified == {"allreduce:4096": "ring"}


def test_a_sub_communicator_without_a_world_calibration_measures_once(monkeypatch):
    calls = []
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: calls.append(comm) or MEASURED)
    world = FakeComm(4)
    assert auto.model_for(FakeSub(world)).origin == "measured" and len(calls) == 1
    auto.forget()
    assert auto.model_for(FakeSub(world)).origin == "cache" and len(calls) == 1


def test_the_table_leaves_out_the_sizes_its_time_would_not_cover(monkeypatch):
    """With `seconds`, the sizes are timed coarse to fine, and those expected to end past the time
    given are left out (the same on every rank): the table is partial, and beyond its last size
    (below 1 MiB) the formula predicts."""
    monkeypatch.setattr(measuring, "TUNE_SIZES", (8, 1 << 10, 1 << 13, 1 << 15))
    asked = []

    def expected(last, last_bytes, nbytes):
        asked.append(nbytes)
        return 1e3 if nbytes == 1 << 13 else 0.0

    monkeypatch.setattr(measuring, "next_size_seconds", expected)
    tables = run_world(2, lambda c: measuring.allreduce_table(c, seconds=100.0))
    assert tables[0] == tables[1] and tables[0].partial
    for _, rows in tables[0].rows:
        assert [b for b, _ in rows] == [8.0, 1024.0, 32768.0]
    # coarse to fine: after 8 B, 32 KiB (TUNE_ORDER begins 0, 3), then 8 KiB (left out), 1 KiB
    assert list(dict.fromkeys(asked)) == [32768, 8192, 1024], asked
    whole = run_world(2, lambda c: measuring.allreduce_table(c))[0]  # no limit: every size
    assert not whole.partial and [b for b, _ in whole.rows[0][1]] == [8.0, 1024.0, 8192.0, 32768.0]
    params = replace(MEASURED, allreduce_times=tables[0].rows, allreduce_times_partial=True,
                     nodes=1)
    formula = replace(params, allreduce_times=())
    assert cm.predict("allreduce", "ring", 1 << 20, 2, 1, params) == cm.predict(
        "allreduce", "ring", 1 << 20, 2, 1, formula)
    assert cm.predict("allreduce", "ring", 4096, 2, 1, params) != cm.predict(
        "allreduce", "ring", 4096, 2, 1, formula)
    assert cm.Params.from_json(json.loads(json.dumps(params.to_json()))) == params
    # a partial table that reached 1 MiB keeps its last rate beyond, as a whole table does
    mib = float(cm.PARTIAL_RATE_BYTES)
    reached = replace(params, allreduce_times=tuple(
        (name, ((8.0, 1e-5), (mib, 1e-3))) for name, _ in tables[0].rows))
    assert cm.predict("allreduce", "ring", 4 << 20, 2, 1, reached) == pytest.approx(
        MEASURED.call + 4e-3)


def test_the_next_sizes_time_follows_the_bytes_from_one_mib():
    """Below 1 MiB the last size's time (latency and time slices); from it in proportion to the
    bytes; 3/4 of that in half the rounds (16 MiB took 5.9 s, 64 MiB 16.1 s at 3 ranks on 2 busy
    cores); the same rule from a larger size down to a smaller one."""
    assert measuring.next_size_seconds(2.0, 8, 1 << 10) == 2.0
    assert measuring.next_size_seconds(3.0, 8 << 20, 16 << 20) == 6.0
    assert measuring.next_size_seconds(5.9, 16 << 20, 64 << 20) == pytest.approx(17.7)
    assert measuring.next_size_seconds(17.7, 64 << 20, 16 << 20) == pytest.approx(5.9)
    assert measuring.next_size_seconds(4.0, 2 << 20, 1 << 15) == 2.0
    assert sorted(measuring.TUNE_ORDER) == list(range(len(measuring.TUNE_SIZES)))


def test_busy_check_names_the_load_and_the_spread(monkeypatch):
    from mpdl.tuning import measuring

    assert measuring.Busy(0.1, 0.2, 1.1).why == ""
    assert "load 0.90 per core" in measuring.Busy(0.1, 0.9, 1.1).why
    assert "differed 2.00x" in measuring.Busy(0.0, 0.0, 2.0).why
    monkeypatch.setattr(measuring.os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    monkeypatch.setattr(measuring.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(measuring, "runnable_now", lambda: 9.0)
    assert measuring.load_per_core(3) == 1.0  # (5 - 3 measuring ranks) over 2 cores
    # the ranks of a run that just ended still weigh in the 1-minute average, not in the present
    monkeypatch.setattr(measuring, "runnable_now", lambda: 4.0)
    assert measuring.load_per_core(3) == 0.5


def test_busy_check_judges_each_nodes_share_of_core_time(monkeypatch):
    """A machine whose ranks have a core each is as quiet as its slowest rank; a machine of more
    ranks than cores by their sum over the cores (also where they are MPI nodes of their own, as
    network namespaces on one kernel); the busy check takes the worst machine, names it, and a
    calibration too short to judge is not judged."""
    import time

    from mpdl.tuning import measuring

    assert measuring.machine_share([0.99, 0.7], cores=2) == 0.7
    assert measuring.machine_share([0.56, 0.65, 0.57], cores=2) == pytest.approx(0.89)
    assert measuring.machine_share([0.37, 0.35, 0.36, 0.35], cores=2) == pytest.approx(0.715)

    class Comm:  # two machines: ranks 0-1 and 2-4, as every rank's all-gather hands them back
        def __init__(self, shares):
            self.shares = shares

        def allgather_object(self, mine):
            return [(0.0, 0.0, s, 2, "a" if r < 2 else "b") for r, s in enumerate(self.shares)]

    quiet = measuring.busy_check(Comm([0.99, 0.97, 0.6, 0.6, 0.6]), 0.0, 0.0, 1.0)
    assert quiet.share == pytest.approx(0.9) and quiet.why == ""
    busy = measuring.busy_check(Comm([0.99, 0.97, 0.5, 0.5, 0.5]), 0.0, 0.0, 1.0)
    assert busy.share == pytest.approx(0.75)
    assert busy.why == "busy machine: the measuring ranks had 0.75 of the core time they have alone"
    assert measuring.busy_check(Comm([0.7, 0.97, 0.6, 0.6, 0.6]), 0.0, 0.0, 1.0).share == 0.7
    assert measuring.machine_id() == measuring.machine_id() != ""
    # a rank that sleeps has no core time; a stretch shorter than SHARE_MIN_SECONDS is not judged
    since = measuring.clocks()
    assert measuring.core_share(since) == 1.0
    time.sleep(measuring.SHARE_MIN_SECONDS + 0.1)
    assert measuring.core_share(since) < 0.2


def test_runnable_now_counts_the_caller_and_a_busy_process():
    if not os.path.exists("/proc/loadavg"):
        pytest.skip("the count of runnable processes is read from Linux's /proc/loadavg")
    assert measuring.runnable_now() >= 1  # this process, reading it
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        counts = [measuring.runnable_now() for _ in range(20)]
    finally:
        spinner.kill()
        spinner.wait()
    assert all(math.isfinite(c) for c in counts) and max(counts) >= 2  # the caller and the spinner


def test_cache_is_written_atomically(tmp_path, monkeypatch):
    """A write that fails half-way leaves the old file as it was (a reader sees old or new)."""
    key = {"host": "h", "mpi_library": "m", "world_size": 2, "ranks_per_node": [2]}
    path = str(tmp_path / "auto.json")
    firstuse.write(path, key, MEASURED)
    before = open(path).read()

    def half_then_fail(obj, f, **kw):
        f.write('{"version": 1, "ke')
        raise OSError("disk full")

    monkeypatch.setattr(firstuse.json, "dump", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        firstuse.write(path, key, replace(MEASURED, alpha=1.0))
    assert open(path).read() == before and os.listdir(tmp_path) == ["auto.json"]


def test_first_use_measures_once_writes_one_file_and_is_reused(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: calls.append(comm) or MEASURED)
    monkeypatch.setattr(firstuse.socket, "gethostname", lambda: "testhost")
    comm = FakeComm()
    model = auto.model_for(comm)
    assert model.origin == "measured" and model.params == MEASURED and model.calibrated
    assert len(calls) == 1
    files = os.listdir(tmp_path / "cache")
    assert len(files) == 1 and files[0].startswith("auto-testhost-p2-1x2-")
    assert auto.model_for(comm) is model  # kept on the communicator: no second look
    again = auto.model_for(FakeComm())  # a new communicator of the same shape reads the file
    assert again.origin == "cache" and again.params == MEASURED and len(calls) == 1
    assert "calibrated on first use" in again.describe()
    # auto's choices come from the measured parameters
    nodes, shm = 1, True
    assert auto.choose("allreduce", 1 << 20, 2, nodes, shm, again) == cm.fastest(
        "allreduce", 1 << 20, 2, nodes, shm, MEASURED)


def test_a_corrupt_cache_file_is_ignored_with_a_warning_and_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: MEASURED)
    comm = FakeComm()
    model, path = auto.look(comm)
    assert model is None  # nothing yet: measure into path
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(RuntimeWarning, match="not a usable first-use calibration.*measuring again"):
        model = auto.model_for(comm)
    assert model.origin == "measured"
    assert json.load(open(path))["params"]["alpha"] == MEASURED.alpha  # replaced by a good one


def test_a_calibration_file_comes_before_the_first_use_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: pytest.fail("must not measure"))
    cm.save(str(tmp_path / "costmodel.json"), replace(cm.Params(), alpha=2e-6, ranks=2))
    model = auto.model_for(FakeComm())
    assert model.origin == "file" and model.params.alpha == 2e-6
    assert "mpdl calibrate" in model.describe() and not os.path.exists(tmp_path / "cache")


def test_first_use_calibration_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: pytest.fail("must not measure"))
    monkeypatch.setenv("MPDL_AUTO_CACHE", "off")
    settings.use(None)
    assert settings.current().auto_cache == "off"
    model = auto.model_for(FakeComm())
    assert model.origin == "defaults" and not model.calibrated
    assert "MPDL_AUTO_CACHE=off" in model.describe()
    monkeypatch.setenv("MPDL_COST_MODEL", "off")
    settings.use(None)
    assert auto.model_for(FakeComm()).params is None  # the size rule


def test_a_settings_change_makes_a_communicator_look_again(tmp_path, monkeypatch):
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: MEASURED)
    comm = FakeComm()
    assert auto.model_for(comm).origin == "measured"
    settings.update(auto_cache="off")
    assert auto.model_for(comm).origin == "defaults"


def test_the_in_process_world_uses_the_defaults_and_writes_nothing(tmp_path):
    x = np.arange(6, dtype=np.float32)
    for r in run_world(3, lambda c: C.allreduce(x, comm=c)):
        np.testing.assert_array_equal(r, 3 * x)
    origins = run_world(2, lambda c: auto.model_for(c).origin)
    assert origins == ["defaults", "defaults"] and not os.path.exists(tmp_path / "cache")


def test_auto_cache_setting_defaults_to_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("MPDL_AUTO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert settings.Settings.from_environment().auto_cache == str(tmp_path / "xdg" / "mpdl")
    assert settings.Settings.from_environment({"MPDL_AUTO_CACHE": "OFF"}).auto_cache == "off"
    assert settings.Settings.from_environment({"MPDL_AUTO_CACHE": "~/c"}).auto_cache == (
        os.path.expanduser("~/c"))


def test_no_warning_when_all_is_well(tmp_path, monkeypatch):
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: MEASURED)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto.model_for(FakeComm())
        auto.model_for(FakeComm())


def test_beyond_the_last_measured_size_the_ranking_there_holds():
    """A first-use calibration at 8 and 16 MiB (2 ranks): hierarchical 2.35 and 4.26 ms, tree
    3.66 and 5.29 ms. At 64 MiB hierarchical stays ahead (each keeps its rate at 16 MiB); the
    slope of the last two sizes would have had tree ahead (15.1 against 15.8 ms), where it took
    1.56x the best in the sweep."""
    mib = float(1 << 20)
    table = (("hierarchical", ((8 * mib, 2.35e-3), (16 * mib, 4.26e-3))),
             ("tree", ((8 * mib, 3.66e-3), (16 * mib, 5.29e-3))))
    table += tuple((name, ((8 * mib, 1.0), (16 * mib, 2.0)))
                   for name in cm.candidates("allreduce", True) if name not in dict(table))
    params = replace(cm.Params(call=1e-6), allreduce_times=table, ranks=2, nodes=1)
    assert cm.fastest("allreduce", 64 << 20, 2, 1, True, params) == "hierarchical"
    assert cm.predict("allreduce", "tree", 64 << 20, 2, 1, params) == pytest.approx(
        1e-6 + 4 * 5.29e-3)


def test_measured_allreduce_times_replace_the_formula_for_their_world_shape_only():
    table = (("ring", ((8.0, 100e-6), (1024.0, 120e-6), (1 << 20, 1e-3))),
             ("shm", ((8.0, 50e-6), (1024.0, 60e-6), (1 << 20, 3e-3))))
    params = replace(cm.Params(call=1e-6), allreduce_times=table, ranks=4, nodes=1)
    assert cm.predict("allreduce", "ring", 8, 4, 1, params) == pytest.approx(101e-6)
    assert cm.predict("allreduce", "ring", 516, 4, 1, params) == pytest.approx(111e-6)
    # beyond the last size: the last size's time per byte
    assert cm.predict("allreduce", "ring", 2 << 20, 4, 1, params) == pytest.approx(1e-6 + 2e-3)
    slow = ((8.0, 1.0), (1 << 20, 2.0))  # every other candidate far slower
    params = replace(params, allreduce_times=table + tuple(
        (name, slow) for name in cm.candidates("allreduce", True) if name not in ("ring", "shm")))
    assert cm.fastest("allreduce", 1024, 4, 1, True, params) == "shm"
    assert cm.fastest("allreduce", 1 << 20, 4, 1, True, params) == "ring"
    # another world shape, an algorithm not timed, another collective: the formula
    formula = cm.Params(call=1e-6)
    for args in (("allreduce", "ring", 1024, 2, 1), ("allreduce", "ring", 1024, 4, 2),
                 ("allreduce", "mpi", 1024, 4, 1), ("reduce", "ring", 1024, 4, 1)):
        assert cm.predict(*args, params) == cm.predict(*args, formula)
    # the table survives JSON, and emulated links drop it (it timed the real ones)
    assert cm.Params.from_json(json.loads(json.dumps(params.to_json()))) == params
    from mpdl import emulation

    assert params.emulated(emulation.parse("inter=1Gbit/s")).allreduce_times == ()


def test_allreduce_table_times_every_candidate_and_never_decreases(monkeypatch):
    """On the in-process world: one row per candidate auto may pick, every tuned size, and a
    small size never slower than a larger one (noise capped); every rank gets the same table."""
    tables = run_world(2, lambda c: measuring.allreduce_table(c).rows)
    assert tables[0] == tables[1]
    assert [name for name, _ in tables[0]] == cm.candidates("allreduce", True)
    for _, rows in tables[0]:
        assert [b for b, _ in rows] == [float(b) for b in measuring.TUNE_SIZES]
        assert [t for _, t in rows] == sorted(t for _, t in rows)


def test_sizes_beyond_the_caches_are_timed_in_half_the_rounds(monkeypatch):
    """From TUNE_HUGE (a call takes milliseconds) a candidate gets TUNE_ROUNDS // 2 rounds of one
    timed call; below it TUNE_ROUNDS rounds of TUNE_REPS[0]; 64 MiB is the last tuned size."""
    assert measuring.TUNE_SIZES[-1] == 1 << 26 >= measuring.TUNE_HUGE > measuring.TUNE_SIZES[-2]
    monkeypatch.setattr(measuring, "TUNE_SIZES", (8, measuring.TUNE_HUGE))
    monkeypatch.setattr(measuring, "candidates", lambda collective, shared: ["ring"])
    times = run_world(2, measuring._allreduce_times)[0]["ring"]
    assert [len(rounds) for rounds in times] == [measuring.TUNE_ROUNDS, measuring.TUNE_ROUNDS // 2]
    assert [len(calls) for calls in times[0]] == [measuring.TUNE_REPS[0]] * measuring.TUNE_ROUNDS
    assert [len(calls) for calls in times[1]] == [1] * (measuring.TUNE_ROUNDS // 2)


def test_the_allreduce_table_keeps_the_fastest_round_so_a_slow_spell_cannot_poison_it(
        monkeypatch):
    """A slow spell (another process's time slice) over two of recursive doubling's four rounds
    at every size: the table still has it at its quiet time, below tree's, so `auto` keeps it
    (the median over all calls, 155 us, would have chosen tree at 20 us); the spread is the
    median round over the fastest."""
    assert measuring.TUNE_ROUNDS == 4
    quiet, spell, tree = 10e-6, 300e-6, 20e-6

    def times(comm, crowded_node, seconds=None):
        def rounds(name):
            if name == "recursive_doubling":
                return [[spell] * 4, [quiet] * 4, [spell] * 4, [quiet] * 4]
            return [[tree if name == "tree" else 1e-3] * 4 for _ in range(4)]
        return {name: [rounds(name) for _ in measuring.TUNE_SIZES]
                for name in cm.candidates("allreduce", True)}

    monkeypatch.setattr(measuring, "_allreduce_times", times)
    monkeypatch.setattr(measuring, "crowded", lambda comm: False)  # a core per rank
    table = run_world(2, measuring.allreduce_table)[0]
    rows = dict(table.rows)
    assert not table.crowded
    assert {t for _, t in rows["recursive_doubling"]} == {quiet}
    assert {t for _, t in rows["tree"]} == {tree}
    # the median of rounds (10, 10, 300, 300) is 155 us: 15.5x the fastest, for rd; 1 elsewhere
    assert table.spread == 1.0
    params = replace(MEASURED, allreduce_times=table.rows, nodes=1)
    assert cm.fastest("allreduce", 8, 2, 1, True, params) == "recursive_doubling"


#: an algorithm's first run in the stand-in times (its setup): faster than any other run, so a
#: verdict that counted it would tie every algorithm (and keep the choice)
SETUP = 0.01


def in_order(trial, runs: dict[str, list[float]]) -> list[float]:
    """One rank's times of every run in the trial's order, from each algorithm's times of its runs
    after its first (which takes SETUP)."""
    left = {name: iter([SETUP, *times]) for name, times in runs.items()}
    return [next(left[name]) for name in trial.order]


def test_a_trial_runs_in_turns_in_rounds_forth_and_back():
    """Every algorithm's turn once a round, the rounds reversed in turn: each algorithm's runs
    fall on every place of a short rhythm of its caller (calls after a barrier, calls back to
    back); a turn is TURN runs in a row."""
    from mpdl.tuning import verify

    assert verify.TURN == 2
    assert verify.serpentine(("a", "b"), 3) == ["a", "b", "b", "a", "a", "b"]
    assert verify.serpentine(("a", "b", "c"), 2) == ["a", "b", "c", "c", "b", "a"]
    trial = verify.Trial(FakeComm(2), "allreduce", 4096, ("a", "b"), {}, lambda name: None, 3)
    assert trial.order == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]


@pytest.mark.parametrize("runner_up_time, winner", [(0.89, "b"), (0.91, "a")])
def test_a_trial_switches_only_when_the_runner_up_is_ten_percent_faster(runner_up_time, winner,
                                                                        monkeypatch):
    """Per run the slowest rank's time, per algorithm the fastest of its runs: the runner-up (b)
    wins at <= 0.9 of the choice's (a) time; rank 0's fast run of a (0.1) does not count, rank 1's
    1.0 in the same run does, and neither do the algorithms' first runs (SETUP)."""
    from mpdl.tuning import verify

    learned = []
    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: learned.append(verdict))
    trial = verify.Trial(FakeComm(2), "allreduce", 4096, ("a", "b"), {}, lambda name: None, 3)
    rank0 = in_order(trial, {"a": [1.0, 1.0, 0.1, 1.0, 1.0], "b": [0.5] * 5})
    rank1 = in_order(trial, {"a": [1.0, 1.0, 1.0, 0.5, 1.0],
                             "b": [runner_up_time] * 4 + [5.0]})
    assert trial.verdict([rank0, rank1]) == winner
    # (not an array in shared memory; not provisional)
    assert learned == [("allreduce", 4096, winner, False, "")]


def test_a_turns_first_run_after_another_algorithm_does_not_decide_the_trial(monkeypatch):
    """The runner-up b takes 5.0 on the first run of each turn (charged with what the algorithm
    before it left) and 0.5 on the second; the choice a 1.0 on both: b wins, as its runs after
    itself say (the runs after another algorithm alone would have kept a)."""
    from mpdl.tuning import verify

    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: None)
    trial = verify.Trial(FakeComm(2), "allreduce", 4096, ("a", "b"), {}, lambda name: None, 3)
    times = [5.0 if (i % 2 == 0 and name == "b") else 0.5 if name == "b" else 1.0
             for i, name in enumerate(trial.order)]
    assert trial.verdict([times, times]) == "b"
    after_others = [1.0 if name == "a" else 5.0 for name in trial.order]
    assert trial.verdict([after_others, after_others]) == "a"


def test_every_run_but_the_first_counts_wherever_it_falls_in_the_callers_rhythm(monkeypatch):
    """A trial of recursive doubling (a) and ring (b) at 8 B on 2 ranks, in `mpdl bench --loop 4`
    (the slowest rank's time of each run, us): the turns' second runs fell on the slow places of
    the rhythm for a (41, 19, 41) and not for b (39, 17, 22), so counting only them switched to
    b, which the sweep then timed at 1.4x a. a's first runs of its later turns (29, 11) count:
    a stays."""
    from mpdl.tuning import verify

    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: None)
    trial = verify.Trial(FakeComm(2), "allreduce", 8, ("a", "b"), {}, lambda name: None, 3)
    runs = {"a": [350, 41, 29, 19, 11, 41], "b": [212, 39, 51, 17, 34, 22]}
    left = {name: iter(t) for name, t in runs.items()}
    times = [next(left[name]) * 1e-6 for name in trial.order]
    assert trial.verdict([times, times]) == "a"


def test_a_slow_spell_over_two_of_the_runner_ups_turns_does_not_decide_the_trial(monkeypatch):
    """The runner-up (b) runs at 0.5 when the machine lets it and at 3.0 in its first two turns,
    when another process's time slice falls on it; the choice (a) runs at 1.0: b wins (its
    median, 3.0, would have kept a). The fastest run counts on every node, one with more ranks
    than cores too."""
    from mpdl.tuning import verify

    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: None)
    monkeypatch.setattr(measuring, "crowded", lambda comm: True)
    trial = verify.Trial(FakeComm(4), "allreduce", 4096, ("a", "b"), {}, lambda name: None, 3)
    times = in_order(trial, {"a": [1.0] * 5, "b": [3.0, 3.0, 3.0, 0.5, 0.5]})
    assert trial.verdict([times] * 4) == "b"


def test_the_fastest_of_several_contenders_wins_and_each_runs_in_turn(monkeypatch):
    """Choice a, contenders b and c, each in every round (a, b, c, c, b, a): c's fastest run
    (0.5) beats b's (0.85), both within 0.9 of a's (1.0): c wins."""
    from mpdl.tuning import verify

    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: None)
    trial = verify.Trial(FakeComm(2), "allreduce", 4096, ("a", "b", "c"), {}, lambda n: None, 2)
    assert trial.order[::verify.TURN] == ["a", "b", "c", "c", "b", "a"]
    times = in_order(trial, {"a": [1.0, 1.2, 1.1], "b": [0.85, 0.9, 0.95],
                             "c": [2.0, 2.0, 0.5]})
    assert trial.verdict([times, times]) == "c"


def test_the_contenders_are_the_candidates_predicted_within_the_field():
    """ranked: the choice, then every other candidate predicted within `within` of its time,
    fastest predicted first (here from a measured table on 2 ranks of one node)."""
    seconds = {"shm": 10e-6, "rabenseifner": 12e-6, "recursive_doubling": 24e-6, "tree": 26e-6}
    table = tuple((name, tuple((float(b), seconds.get(name, 1.0)) for b in measuring.TUNE_SIZES))
                  for name in cm.candidates("allreduce", True))
    model = auto.Model(replace(MEASURED, allreduce_times=table, nodes=1, call=0.0), "cache")
    comm = FakeComm(2)
    comm._auto_model = ((settings.current().cost_model, settings.current().auto_cache,
                         cm.generation()), model)
    assert auto.ranked("allreduce", 4096, comm, model, 2.5) == (
        "shm", "rabenseifner", "recursive_doubling")
    assert auto.ranked("allreduce", 4096, comm, model, 1.1) == ()


def test_a_verified_choice_is_what_plans_of_its_size_run_one_shot_calls_keep_the_prediction():
    comm = FakeComm(2)
    model = auto.Model(cm.Params(), "cache", verified={"allreduce:4096": "ring"})
    comm._auto_model = ((settings.current().cost_model, settings.current().auto_cache,
                         cm.generation()), model)
    predicted = auto.choose("allreduce", 4096, 2, 1, True, model)
    assert predicted != "ring"  # the defaults' choice differs
    assert auto.plan_choice("allreduce", 4096, comm).name == "ring"
    assert auto.algorithm_for("allreduce", 4096, comm).name == predicted
    assert auto.plan_choice("allreduce", 8192, comm).name == auto.choose(
        "allreduce", 8192, 2, 1, True, model)


def test_with_more_ranks_than_cores_the_allreduce_table_keeps_the_median_round(monkeypatch):
    """Where a node runs more ranks than cores, double_tree's one lucky round (100 us, its others
    600-700 us) does not rank it under tree (steady 300 us): the median round counts, on every
    rank, when any one rank's node is crowded; with a core per rank the fastest round counts.
    Every rank then times its calls after the same kind of barrier (MPI_Barrier where crowded)."""
    assert measuring.TUNE_ROUNDS == 4
    lucky = {"double_tree": [100e-6, 600e-6, 700e-6, 650e-6], "tree": [300e-6] * 4}

    barriers = []

    def times(comm, crowded_node, seconds=None):
        barriers.append(crowded_node)  # every rank times after the same barriers
        return {name: [[[t] * 4 for t in lucky.get(name, [1e-3] * 4)] for _ in measuring.TUNE_SIZES]
                for name in cm.candidates("allreduce", True)}

    monkeypatch.setattr(measuring, "_allreduce_times", times)
    for crowded_rank, statistic, chosen in ((1, 625e-6, "tree"), (None, 100e-6, "double_tree")):
        monkeypatch.setattr(measuring, "crowded", lambda comm, r=crowded_rank: comm.rank == r)
        barriers.clear()
        tables = run_world(2, measuring.allreduce_table)
        assert tables[0] == tables[1] and tables[0].crowded == (crowded_rank is not None)
        assert barriers == [crowded_rank is not None] * 2
        rows = dict(tables[0].rows)
        assert [t for _, t in rows["double_tree"]] == pytest.approx([statistic] * len(rows["tree"]))
        params = replace(MEASURED, allreduce_times=tables[0].rows, nodes=1)
        assert cm.fastest("allreduce", 1 << 16, 2, 1, True, params) == chosen


def test_a_node_with_more_ranks_than_cores_is_crowded(monkeypatch):
    from mpdl import mpi_runtime

    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setattr(mpi_runtime, "usable_cores", lambda: 2)
    assert not measuring.crowded(FakeComm(2))
    assert measuring.crowded(FakeComm(4))
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")  # the launcher counts other ranks of the node
    assert measuring.crowded(FakeComm(2))


@pytest.mark.parametrize("loads, provisional", [((0.0, 0.2), ""), ((0.0, 3.0), "load 3.00")])
def test_a_trial_on_a_busy_machine_learns_a_provisional_verdict(loads, provisional, monkeypatch):
    """The whole trial on stand-in runners: other work's load per core (3.0 on the last rank at
    the end) makes the verdict provisional, with the busy check's reason; every rank's largest
    load counts (FakeComm's all-gather hands every rank rank 0's view)."""
    from mpdl.tuning import verify

    learned, settled = [], []
    monkeypatch.setattr(auto, "learn", lambda comm, *verdict: learned.append(verdict))
    readings = iter(loads)
    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: next(readings))
    runs = {"a": 0, "b": 0}
    runners = {n: (lambda n=n: runs.__setitem__(n, runs[n] + 1)) for n in runs}
    trial = verify.Trial(FakeComm(2), "allreduce", 4096, ("a", "b"), runners, settled.append, 2)
    for _ in range(len(trial.order)):
        trial.run()
    assert runs == {"a": 2 * verify.TURN, "b": 2 * verify.TURN}
    assert len(settled) == 1 and len(learned) == 1
    *_, why = learned[0]
    assert (why == "") if not provisional else (why.startswith("busy machine: " + provisional))


def test_a_provisional_verdict_round_trips_and_never_replaces_a_quiet_one(tmp_path):
    key = {"host": "h", "mpi_library": "m", "world_size": 2, "ranks_per_node": [2]}
    path = str(tmp_path / "auto.json")
    assert not firstuse.remember(path, key, "allreduce:8", "ring")  # no calibration there yet
    firstuse.write(path, key, MEASURED)
    assert firstuse.remember(path, key, "allreduce:8", "ring", "busy machine: load 3.00")
    assert firstuse.read_verified(path, key) == {"allreduce:8": "ring"}
    assert firstuse.read_unsettled(path, key) == {"allreduce:8": "busy machine: load 3.00"}
    # a quiet verdict replaces it, and a provisional one then never replaces the quiet one
    assert firstuse.remember(path, key, "allreduce:8", "recursive_doubling")
    assert firstuse.read_unsettled(path, key) == {}
    assert not firstuse.remember(path, key, "allreduce:8", "ring", "busy machine: load 3.00")
    assert firstuse.read_verified(path, key) == {"allreduce:8": "recursive_doubling"}
    # a calibration measured again keeps both
    assert firstuse.remember(path, key, "allreduce:64", "tree", "busy machine: load 2.00")
    assert firstuse.write(path, key, replace(MEASURED, source="again"))
    assert firstuse.read_unsettled(path, key) == {"allreduce:64": "busy machine: load 2.00"}
    assert firstuse.read_verified(path, key) == {"allreduce:8": "recursive_doubling",
                                                 "allreduce:64": "tree"}


def test_every_candidate_contends_in_a_reduce_scatter_or_allgather_plan(tmp_path, monkeypatch):
    """For an all-reduce the contenders are the candidates predicted within FIELD; for the other
    verified collectives every candidate, however far behind the model puts it (here with a FIELD
    of 1.1, at 16 MiB on 4 ranks: tree beyond it, which `ranked` leaves out)."""
    from mpdl.tuning import verify

    monkeypatch.setattr(verify, "FIELD", 1.1)
    settings.update(auto_cache=str(tmp_path), cost_model=str(tmp_path / "none.json"))
    comm = FakeComm(4)
    key = firstuse.cache_key(comm)
    firstuse.write(firstuse.cache_path(str(tmp_path), key), key, replace(MEASURED, ranks=4,
                                                                          nodes=1))
    model = auto.model_for(comm)
    for collective in ("reduce_scatter", "allgather"):
        assert collective in verify.VERIFIED
        predicted = {name: cm.predict(collective, name, 1 << 24, 4, 1, model.params)
                     for name in cm.candidates(collective, True)}
        assert max(predicted.values()) > verify.FIELD * min(predicted.values()), predicted
        assert "tree" not in auto.ranked(collective, 1 << 24, comm, model, verify.FIELD)
        names = verify.candidates(collective, 1 << 24, comm)
        assert names is not None and names[0] == auto.algorithm_for(collective, 1 << 24, comm).name
        assert sorted(names) == sorted(predicted)


def test_a_provisional_verdict_is_used_verified_again_by_the_next_run_and_shown(tmp_path):
    """The cache holds a quiet verdict for 4096 B and a provisional one for 8192 B: plans of both
    sizes run their verdicts, a plan of 8192 B verifies again (once in the run: a verdict learned
    now settles it), 4096 B does not; `mpdl info`'s line counts the provisional verdicts."""
    from mpdl.tuning import verify

    settings.update(auto_cache=str(tmp_path), cost_model=str(tmp_path / "none.json"))
    comm = FakeComm(2)
    key = firstuse.cache_key(comm)
    path = firstuse.cache_path(str(tmp_path), key)
    firstuse.write(path, key, replace(MEASURED, nodes=1))
    firstuse.remember(path, key, "allreduce:4096", "ring")
    firstuse.remember(path, key, "allreduce:8192", "tree", "busy machine: load 3.00")
    model = auto.model_for(comm)
    assert model.origin == "cache" and model.recheck == {"allreduce:8192"}
    assert "1 of 2 verified choices provisional (busy machine: load 3.00)" in model.describe()
    assert auto.plan_choice("allreduce", 4096, comm).name == "ring"
    assert auto.plan_choice("allreduce", 8192, comm).name == "tree"
    assert verify.candidates("allreduce", 4096, comm) is None
    # the plan runs the provisional verdict, so it leads the trial, the prediction among the rest
    contenders = verify.candidates("allreduce", 8192, comm)
    predicted = auto.algorithm_for("allreduce", 8192, comm).name
    assert predicted != "tree" and contenders[0] == "tree" and predicted in contenders[1:]
    auto.learn(comm, "allreduce", 8192, "recursive_doubling")  # verified again, on a quiet machine
    assert verify.candidates("allreduce", 8192, comm) is None
    assert auto.plan_choice("allreduce", 8192, comm).name == "recursive_doubling"
    assert firstuse.read_unsettled(path, key) == {} and "choices provisional" not in model.describe()


def test_a_second_run_does_not_calibrate(tmp_path):
    """Two runs under real mpiexec from an empty cache: the first says it calibrates and writes
    one file, the second says nothing and leaves the file as it was (busy or not)."""
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "MPDL_AUTO_CACHE": str(tmp_path / "cache"),
           "MPDL_COST_MODEL": str(tmp_path / "none.json")}
    said, contents = [], []
    for _ in range(2):
        run = subprocess.run(["timeout", "-k", "5", "120", os.path.join(bin_dir, "mpiexec"), "-n",
                              "2", os.path.join(bin_dir, "mpdl"), "bench", "allreduce", "-b", "8",
                              "-e", "8", "-n", "1", "-w", "0", "--algorithms", "auto"],
                             capture_output=True, text=True, env=env, timeout=130)
        assert run.returncode == 0, run.stderr
        said.append([line for line in run.stderr.splitlines() if "calibrating" in line])
        files = os.listdir(tmp_path / "cache")
        assert len(files) == 1, files
        contents.append((tmp_path / "cache" / files[0]).read_text())
    assert len(said[0]) == 1 and said[0][0].startswith("mpdl: first use, calibrating"), said
    assert said[1] == [] and contents[1] == contents[0]

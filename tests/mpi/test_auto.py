"""`auto`'s first-use calibration under real mpiexec (any world size): it measures once, writes one
cache file, does not hang, and every rank of the communicator ends with the same model and the same
choices, on the world, a sub-communicator, and behind asynchronous work."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import settings
from mpdl.collectives import registry
from mpdl.comm import MPIComm
from mpdl.tuning import auto, firstuse, measuring

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
SIZES = [0, 8, 1 << 10, 1 << 15, 1 << 18, 1 << 20, 1 << 24, 1 << 26]
#: a first-use calibration takes about a second for 4 ranks on 2 cores; this is the "no hang" bound
LIMIT_S = 60


@pytest.fixture
def cache(tmp_path_factory, monkeypatch, quiet_machine):
    """A first-use cache folder every rank agrees on (rank 0's), no calibration file, and a
    machine taken as quiet however loaded it is (stand-in readings: the busy check's tests below
    stand in readings of their own)."""
    # these tests check how calibrations are shared, kept and replaced, not the sizes they time:
    # the 16 and 64 MiB turns would add several seconds to each of them on 4 ranks
    monkeypatch.setattr(measuring, "TUNE_SIZES", measuring.TUNE_SIZES[:-2])
    path = str(tmp_path_factory.mktemp("auto")) if RANK == 0 else None
    path = COMM.bcast(path, root=0)
    previous = settings.update(auto_cache=os.path.join(path, "cache"),
                               cost_model=os.path.join(path, "costmodel.json"))
    auto.forget()
    yield os.path.join(path, "cache")
    settings.use(previous)
    auto.forget()
    COMM.Barrier()


@pytest.fixture
def stand_in_probes(monkeypatch):
    """The slow probes of a calibration stand aside (the rest of it runs as it is): for the tests
    of what is done with a calibration, not of what it measures."""
    sizes = measuring.QUICK.sizes
    monkeypatch.setattr(measuring, "link_curves", lambda comm, effort: {
        "intra": [1e-6 * (1 + n / 1e6) for n in sizes], "ring": None, "ring_reduce": None,
        "inter": None})
    monkeypatch.setattr(measuring, "allreduce_table", lambda comm, seconds=None: measuring.Table((), 1.0))


def fresh() -> MPIComm:
    """A communicator auto has not seen (its model is looked up again)."""
    return MPIComm(COMM.Dup())


def files(folder: str) -> list[str]:
    COMM.Barrier()
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def agree(comm, model) -> None:
    """Every rank has the same parameters and makes the same choices."""
    mine = (model.origin, None if model.params is None else model.params.to_json(),
            [auto.algorithm_for(c, n, comm).name for c in registry.COLLECTIVES for n in SIZES])
    everyone = comm.allgather_object(mine)
    assert all(e == everyone[0] for e in everyone), everyone


def test_first_use_calibration_writes_one_cache_and_every_rank_agrees(cache, capsys):
    comm = fresh()
    x = np.arange(1000, dtype=np.float32) + RANK
    t0 = time.perf_counter()
    y = C.allreduce(x, comm=comm)  # the first auto call: measures (with 2 or more ranks)
    took = max(COMM.allgather(time.perf_counter() - t0))
    said = capsys.readouterr().err.splitlines()
    if P > 1 and RANK == 0:  # one line on rank 0: what, where it is cached, how to skip it
        assert len(said) == 1 and said[0].startswith("mpdl: first use, calibrating: the collectives"), said
        assert cache in said[0] and "MPDL_AUTO_CACHE=off" in said[0], said
    else:
        assert said == []
    np.testing.assert_allclose(y, P * np.arange(1000) + P * (P - 1) / 2)
    assert took < LIMIT_S
    model = auto.model_for(comm)
    if P == 1:
        assert model.origin == "defaults" and files(cache) == []
        return
    assert model.origin == "measured" and model.calibrated
    assert model.params.ranks == P and model.params.alpha > 0
    agree(comm, model)
    written = files(cache)
    assert len(written) == 1 and written[0].startswith("auto-") and f"-p{P}-" in written[0]

    # another communicator of the same shape reads it back: no second measurement, same model
    again = fresh()
    t0 = time.perf_counter()
    C.allreduce(x, comm=again)
    assert auto.model_for(again).origin == "cache"
    assert capsys.readouterr().err == ""  # read back: nothing to say
    assert auto.model_for(again).params == model.params
    assert time.perf_counter() - t0 < LIMIT_S / 4
    assert files(cache) == written
    agree(again, auto.model_for(again))


def test_a_corrupt_cache_is_ignored_with_a_warning_on_rank_0_and_measured_again(cache,
                                                                                 stand_in_probes):
    if P == 1:
        pytest.skip("one rank measures nothing")
    C.allreduce(np.ones(4), comm=fresh())
    (name,) = files(cache)
    if RANK == 0:
        with open(os.path.join(cache, name), "w") as f:
            f.write("garbage")
    COMM.Barrier()
    comm = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = auto.model_for(comm)
    said = [str(w.message) for w in caught if "first-use calibration" in str(w.message)]
    assert (len(said) == 1 and "measuring again" in said[0]) if RANK == 0 else said == []
    assert model.origin == "measured"
    agree(comm, model)
    assert files(cache) == [name]


def test_a_sub_communicator_calibrates_for_its_own_shape_only_without_a_world_calibration(cache):
    if P < 3:
        pytest.skip("needs a part of the world of at least two ranks")
    world = fresh()
    world.node_groups()  # a part's layout is read from the whole's (collective over the whole)
    members = list(range(P - 1))
    if RANK in members:
        sub = world.sub(members)
        x = np.full(10, RANK, np.float64)
        np.testing.assert_array_equal(C.allreduce(x, comm=sub), sum(members))
        model = auto.model_for(sub)
        assert model.origin == "measured" and model.params.ranks == P - 1
        agree(sub, model)
    written = files(cache)
    assert len(written) == 1 and f"-sub{P - 1}-" in written[0]


def test_a_sub_communicator_derives_from_the_worlds_calibration_without_measuring(
        cache, stand_in_probes, monkeypatch, capsys):
    """Once the world has calibrated, its parts (a pipeline's or a grid's groups, of any size)
    measure nothing and say nothing: each takes the world's parameters, the same on its every
    rank, and its rank 0 saves them in the part's own file."""
    if P < 3:
        pytest.skip("needs a part of the world of at least two ranks")
    world = fresh()
    world_model = auto.model_for(world)
    assert world_model.origin == "measured"
    capsys.readouterr()
    monkeypatch.setattr(firstuse, "measure_quick", lambda comm: pytest.fail("a part measured"))
    halves = [list(range(0, P // 2 + 1)), list(range(P // 2 + 1, P))]
    mine = next(h for h in halves if RANK in h)
    sub = world.sub(mine)
    x = np.full(10, RANK, np.float64)
    np.testing.assert_array_equal(C.allreduce(x, comm=sub), sum(mine))
    model = auto.model_for(sub)
    if len(mine) > 1:
        assert model.origin == "derived" and model.params.alpha == world_model.params.alpha
        assert model.params.ranks == P and model.params.source.startswith("derived from")
        agree(sub, model)
    assert capsys.readouterr().err == ""
    written = files(cache)
    parts = {f"-sub{len(h)}-" for h in halves if len(h) > 1}
    assert len(written) == 1 + len(parts), written
    assert all(any(part in name for name in written) for part in parts), written


def test_first_use_behind_asynchronous_work_runs_in_order(cache):
    """The first auto call, made while an asynchronous all-reduce is in flight on the same
    communicator, measures after it (not in between its messages)."""
    comm = fresh()
    big = np.ones(1 << 18, np.float32) * (RANK + 1)
    handle = C.allreduce_async(big, algorithm="ring", comm=comm)
    small = C.allreduce(np.ones(3), comm=comm)
    np.testing.assert_array_equal(small, P)
    np.testing.assert_array_equal(handle.wait(), P * (P + 1) / 2)
    agree(comm, auto.model_for(comm))


def first_use_verdicts(cache: str) -> tuple[MPIComm, Any, list[str], str] | None:
    """A first-use calibration on a fresh communicator: (the communicator, its model, every
    rank's provisional reason, the one its cache file holds); None on one rank, which measures
    nothing."""
    comm = fresh()
    model = auto.model_for(comm)
    if P == 1:
        assert model.origin == "defaults" and not model.provisional
        return None
    verdicts = comm.allgather_object(model.provisional)
    assert all(v == verdicts[0] for v in verdicts)
    key = firstuse.cache_key(comm)
    [name] = files(cache)
    return comm, model, verdicts, firstuse.read(os.path.join(cache, name), key).provisional


def test_a_calibration_whose_ranks_lost_core_time_is_provisional_on_every_rank(
        cache, stand_in_probes, monkeypatch):
    """Work that starts with the calibration is not in the load average yet: the ranks' share of
    core time (a test hook on `measuring.core_share`: 0.3 of a core each, their sum over 2 cores
    where they share them) makes the calibration provisional on every rank, with the reason, in
    the cache."""
    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: 0.0)
    monkeypatch.setattr(measuring, "core_share", lambda since: 0.3)
    monkeypatch.setattr(measuring.os, "cpu_count", lambda: 2)
    calibrated = first_use_verdicts(cache)
    if calibrated is None:
        return
    _, _, verdicts, cached = calibrated
    share = 0.3 if P <= 2 else 0.3 * P / 2
    assert verdicts[0] == (f"busy machine: the measuring ranks had {share:.2f} of the core time "
                           "they have alone") == cached


def test_a_calibration_under_load_is_provisional_on_every_rank_and_kept(
        cache, stand_in_probes, monkeypatch, capsys):
    """The last rank alone sees a loaded machine: every rank takes the calibration as provisional
    (the largest load over ranks decides), with the load in the cache; the next run, on a quiet
    machine, measures nothing, says nothing and keeps it (`mpdl calibrate` measures anew)."""
    loaded = RANK == P - 1
    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: 3.0 if loaded else 0.0)
    calibrated = first_use_verdicts(cache)
    if calibrated is None:
        return
    comm, model, verdicts, cached = calibrated
    assert "load 3.00 per core" in verdicts[0] and cached == verdicts[0]
    assert "provisional (busy machine" in model.describe()
    key = firstuse.cache_key(comm)
    [name] = files(cache)
    capsys.readouterr()

    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: 0.0)
    measured = []
    monkeypatch.setattr(firstuse, "measure_quick", lambda c: measured.append(c))
    auto.forget()
    again = auto.model_for(fresh())
    assert again.origin == "cache" and again.provisional == verdicts[0] and measured == []
    assert capsys.readouterr().err == ""
    assert files(cache) == [name]
    assert firstuse.read(os.path.join(cache, name), key).provisional == verdicts[0]

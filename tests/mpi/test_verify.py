"""Online verification of `auto`'s choice in a persistent all-reduce, reduce-scatter or all-gather
plan, under real mpiexec: with the choice made slower on purpose, every rank switches to a
contender at the same run, every run gives the bits of the one-shot call of the algorithm that
ran, and the next run starts with the verdict (read from the first-use cache); DDP's buckets leave
a poisoned calibration's choice with the default settings."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import settings
from mpdl import tuning as T
from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.tensor import Tensor
from mpdl.comm import MPIComm
from mpdl.parallel import DistributedDataParallel
from mpdl.tuning import auto, firstuse, measuring, verify
from mpdl.tuning import costmodel as cm
from mpdl.tuning import plan as plans

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
RUNS = 2
#: elements of the planned array: an awkward count (prime, not divisible by p)
COUNT = 1009


@pytest.fixture
def world(tmp_path_factory, monkeypatch, quiet_machine):
    """A first-use calibration (quick probes stood aside: a fixed, quiet one) in a fresh cache
    folder, verification on with RUNS runs of each algorithm, and a communicator auto has not
    seen."""
    yield from _first_use_world(tmp_path_factory, monkeypatch, "verify", (), verify_runs=RUNS)


def slow_down(choice: str, monkeypatch, collective: str = "allreduce") -> None:
    """The test hook: plans of collective running `choice` take 20 ms longer a run, on every
    rank."""
    real = getattr(plans, f"_{collective}_runner")

    def slowed(c, algo, *args):
        go, fast, requests = real(c, algo, *args)
        if algo.name != choice:
            return go, fast, requests
        return (lambda: (time.sleep(0.02), go())), None, requests

    monkeypatch.setattr(plans, f"_{collective}_runner", slowed)


def run_trial(plan, names: tuple[str, ...], one_shot) -> list[str]:
    """Run plan through its trial of names and twice after it, each run's bits checked against
    `one_shot(name)` of the algorithm that ran; the algorithm of each run."""
    assert plan.algorithm == names[0] and plan.trial is not None
    trial_runs = len(plan.trial.order)
    assert trial_runs == verify.TURN * RUNS * len(names)
    ran = []
    for _ in range(trial_runs + 2):
        got = plan().copy()
        name = plan.trial.current if len(ran) < trial_runs else plan.algorithm
        ran.append(name)
        want = one_shot(name)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), name
    return ran


def test_a_trial_times_each_algorithm_waiting_as_its_later_runs_will(world, monkeypatch):
    """A plan that verifies is run many times, so its trial's runs wait in compiled code from the
    first, as the runs after the trial do: with compiled waits otherwise put off for good, the
    trial makes them for the algorithms with a captured schedule, and every run gives the
    one-shot call's bits."""
    if P == 1:
        pytest.skip("one rank: there is no algorithm to verify (auto runs nothing)")
    from mpdl.comm import polling  # noqa: PLC0415

    real, made = polling.compiled_wait, []
    monkeypatch.setattr(polling, "compiled_wait",
                        lambda requests: made.append(real(requests)) or made[-1])
    x = np.random.default_rng(RANK).standard_normal(COUNT).astype(np.float32)
    names = verify.candidates("allreduce", x.nbytes, world)
    scheduled = [n for n in names if plans._REPLAYED.get(n) is not None
                 and plans._REPLAYED[n](COUNT, plans.segment_elements(4), P)]
    assert scheduled, f"no contender with a captured schedule among {names}"
    monkeypatch.setattr(plans, "COMPILED_AFTER", 10**6)  # plans outside a trial: never compiled
    plan = T.allreduce_init(x, algorithm="auto", comm=world)
    for _ in range(len(plan.trial.order)):
        got = plan().copy()
        want = C.allreduce(x, algorithm=plan.trial.current, comm=world)  # the one that ran
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), plan.trial.current
    assert made and all(wait is not None for wait in made), made


def test_a_slowed_choice_is_replaced_by_a_contender_the_same_way_on_every_rank(world,
                                                                               monkeypatch):
    if P == 1:
        pytest.skip("one rank: there is no algorithm to verify (auto runs nothing)")
    model = auto.model_for(world)
    assert model.calibrated
    x = np.random.default_rng(RANK).standard_normal(COUNT).astype(np.float32)
    names = verify.candidates("allreduce", x.nbytes, world)
    choice = names[0]
    slow_down(choice, monkeypatch)
    plan = T.allreduce_init(x, algorithm="auto", comm=world)
    ran = run_trial(plan, names, lambda name: C.allreduce(x, algorithm=name, comm=world))
    winner = plan.algorithm
    assert winner in names[1:]
    turns = [name for name in verify.serpentine(names, RUNS) for _ in range(verify.TURN)]
    assert ran == turns + [winner, winner]
    assert world.allgather_object(plan.algorithm) == [winner] * P
    # the next run starts right: the verdict is in the cache file, and a new plan takes it
    world.barrier()
    key = firstuse.cache_key(world)
    assert firstuse.read_verified(firstuse.cache_path(settings.current().auto_cache, key),
                                  key) == {f"allreduce:{x.nbytes}": winner}
    auto.forget()
    again = T.allreduce_init(x, algorithm="auto", comm=MPIComm(COMM.Dup()))
    assert again.algorithm == winner and again.trial is None


def _gathering(collective: str, x: np.ndarray, comm):
    """(the bytes auto chooses by, a plan with auto, the one-shot call of a named algorithm) of a
    reduce-scatter or all-gather of x."""
    if collective == "reduce_scatter":
        return (x.nbytes, lambda: T.reduce_scatter_init(x, algorithm="auto", comm=comm),
                lambda name: C.reduce_scatter(x, algorithm=name, comm=comm))
    return (x.nbytes * P, lambda: T.allgather_init(x, algorithm="auto", comm=comm),
            lambda name: C.allgather(x, algorithm=name, comm=comm))


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather"])
def test_a_slowed_reduce_scatter_or_allgather_choice_is_replaced_on_every_rank(world, monkeypatch,
                                                                               collective):
    """ZeRO's units: a reduce-scatter or all-gather plan with auto times its choice (made 20 ms
    slower on purpose) against every other candidate, each run the bits of the one-shot call of
    the algorithm that ran; every rank switches at the same run, and the next run's plan starts
    with the verdict from the cache."""
    if P == 1:
        pytest.skip("one rank: there is no algorithm to verify (auto runs nothing)")
    x = np.random.default_rng(RANK).standard_normal(COUNT).astype(np.float32)
    nbytes, make, one_shot = _gathering(collective, x, world)
    names = verify.candidates(collective, nbytes, world)
    assert sorted(names) == sorted(cm.candidates(collective, True))
    choice = names[0]
    slow_down(choice, monkeypatch, collective)
    plan = make()
    ran = run_trial(plan, names, one_shot)
    winner = plan.algorithm
    assert winner != choice
    assert ran == [n for n in verify.serpentine(names, RUNS) for _ in range(verify.TURN)] + [
        winner, winner]
    assert world.allgather_object(winner) == [winner] * P
    world.barrier()
    key = firstuse.cache_key(world)
    assert firstuse.read_verified(firstuse.cache_path(settings.current().auto_cache, key),
                                  key) == {f"{collective}:{nbytes}": winner}
    auto.forget()
    again = _gathering(collective, x, MPIComm(COMM.Dup()))[1]()
    assert again.algorithm == winner and again.trial is None


def test_a_verdict_taken_on_a_busy_machine_is_verified_again_by_the_next_run(world, monkeypatch):
    """The trial sees a busy machine (a stand-in load of 3 per core): its verdict (a contender:
    the choice is slowed 20 ms per run) is provisional in the cache; the next run's plan runs it
    and verifies it again, with the verdict first, every run's bits those of the one-shot
    all-reduce of the algorithm that ran, the same on every rank."""
    if P == 1:
        pytest.skip("one rank: there is no algorithm to verify (auto runs nothing)")
    assert not auto.model_for(world).provisional  # a quiet calibration; the trial is on a busy
    monkeypatch.setattr(measuring, "load_per_core", lambda ranks_here: 3.0)  # machine
    x = np.random.default_rng(RANK).standard_normal(COUNT).astype(np.float32)
    choice = verify.candidates("allreduce", x.nbytes, world)[0]
    slow_down(choice, monkeypatch)
    plan = T.allreduce_init(x, algorithm="auto", comm=world)
    for _ in range(len(plan.trial.order)):
        plan()
    winner = plan.algorithm
    assert winner != choice
    world.barrier()
    key = firstuse.cache_key(world)
    path = firstuse.cache_path(settings.current().auto_cache, key)
    entry = f"allreduce:{x.nbytes}"
    assert firstuse.read_verified(path, key) == {entry: winner}
    assert firstuse.read_unsettled(path, key)[entry].startswith("busy machine: load 3.00")
    world.barrier()
    auto.forget()
    again = T.allreduce_init(x, algorithm="auto", comm=MPIComm(COMM.Dup()))
    assert again.algorithm == winner and again.trial is not None
    assert again.trial.names[0] == winner and choice in again.trial.names
    for _ in range(len(again.trial.order)):
        got = again().copy()
        want = C.allreduce(x, algorithm=again.trial.current, comm=world)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert world.allgather_object(again.algorithm) == [again.algorithm] * P
    assert again.algorithm != choice


@pytest.fixture
def poisoned(tmp_path_factory, monkeypatch, quiet_machine):
    """A first-use calibration whose all-reduce table is poisoned (as a busy machine can leave it):
    it has double_tree fastest at every size, ring next and every other candidate far behind; the
    busy check does not flag it. The settings' verify_runs is left at its default."""
    seconds = {"double_tree": 1e-6, "ring": 2e-6}
    rows = tuple((name, tuple((float(b), seconds.get(name, 1.0)) for b in measuring.TUNE_SIZES))
                 for name in cm.candidates("allreduce", True))
    yield from _first_use_world(tmp_path_factory, monkeypatch, "poisoned", rows)


def _first_use_world(tmp_path_factory, monkeypatch, name: str, rows: tuple, **options):
    """The fixtures' world (on a `quiet_machine`): settings pointing at a fresh cache folder (and
    `options`), quick probes stood aside (a fixed link curve, an all-reduce table of
    `rows`), auto forgotten; yields a communicator auto has not seen, then restores them."""
    path = COMM.bcast(str(tmp_path_factory.mktemp(name)) if RANK == 0 else None, root=0)
    previous = settings.update(auto_cache=os.path.join(path, "cache"),
                               cost_model=os.path.join(path, "costmodel.json"), **options)
    sizes = measuring.QUICK.sizes
    monkeypatch.setattr(measuring, "link_curves", lambda comm, effort: {
        "intra": [1e-6 * (1 + n / 1e6) for n in sizes], "ring": None, "ring_reduce": None,
        "inter": None})
    monkeypatch.setattr(measuring, "allreduce_table", lambda comm, seconds=None: measuring.Table(rows, 1.0))
    auto.forget()
    yield MPIComm(COMM.Dup())
    settings.use(previous)
    auto.forget()
    COMM.Barrier()


def test_ddp_buckets_leave_a_poisoned_choice_by_default_on_every_rank(poisoned, monkeypatch):
    """DDP with auto on the poisoned calibration: its bucket plans start with double_tree (made
    20 ms slower on purpose), time it against ring over the first 2·TURN·K steps (K the default
    verify_runs, TURN the runs of a turn), and every rank runs ring from then on; the cache holds
    both verdicts."""
    if P == 1:
        pytest.skip("one rank: DDP reduces nothing (auto runs nothing)")
    runs = settings.current().verify_runs
    assert runs == 3
    real = plans._allreduce_runner

    def slowed(c, algo, *args):
        go, fast, requests = real(c, algo, *args)
        if algo.name != "double_tree":
            return go, fast, requests
        return (lambda: (time.sleep(0.02), go())), None, requests

    monkeypatch.setattr(plans, "_allreduce_runner", slowed)
    model = nn.Sequential(nn.Linear(5, 7, seed=0), nn.ReLU(), nn.Linear(7, 3, seed=1))
    ddp = DistributedDataParallel(model, comm=poisoned, bucket_mb=1e-5, first_bucket_mb=1e-5)
    assert len(ddp.buckets) >= 2
    assert ddp.bucket_algorithms() == ["double_tree"] * len(ddp.buckets)
    x = np.random.default_rng(RANK).standard_normal((4, 5)).astype(np.float32)
    for _ in range(2 * verify.TURN * runs + 1):
        F.cross_entropy(ddp(Tensor(x)), np.arange(4) % 3).backward()
        ddp.finish()
    assert poisoned.allgather_object(ddp.bucket_algorithms()) == [["ring"] * len(ddp.buckets)] * P
    poisoned.barrier()
    key = firstuse.cache_key(poisoned)
    verified = firstuse.read_verified(firstuse.cache_path(settings.current().auto_cache, key), key)
    # (on one node the buckets lie in shared memory: their verdicts are kept apart from other
    # arrays'; across nodes they are ordinary arrays)
    one_node = poisoned.has_shared_memory and len(poisoned.node_groups()) == 1
    assert verified == {auto.verified_key("allreduce", b.nbytes, shared=one_node): "ring"
                        for b in ddp.buckets}

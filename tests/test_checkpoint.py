"""A checkpoint survives a crash at any moment of a save: the previous or the new one loads."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpdl.collectives.ops import block_bounds
from mpdl.threadworld import run_world
from mpdl.training import checkpoint as ck


class Crash(Exception):
    pass


def _save(directory, value: float, epoch: int) -> None:
    model = {"w": np.full((3, 4), value), "b": np.full(4, value)}
    optimizer = {"state": {0: {"momentum": np.full((3, 4), -value), "step": epoch}},
                 "param_groups": [{"lr": 0.1, "params": [0]}]}
    ck.save_checkpoint(directory, model, optimizer, {"epoch": epoch})


def _loaded(directory) -> tuple[int, float, float]:
    model, optimizer, state = ck.load_checkpoint(directory)
    return state["epoch"], float(model["w"][0, 0]), float(optimizer["state"]["0"]["momentum"][0, 0])


def _crash_after(monkeypatch, target, name: str, calls: int) -> None:
    """Make target.name raise Crash on its call number `calls` (counting from 0)."""
    real, count = getattr(target, name), [0]

    def fake(*args, **kwargs):
        if count[0] == calls:
            raise Crash
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, fake)


@pytest.mark.parametrize("where", [("write_atomic", k) for k in range(3)]
                         + [("replace", k) for k in range(6)])
def test_a_crash_anywhere_in_a_save_leaves_a_whole_checkpoint(tmp_path, monkeypatch, where):
    """Saves write three files (write_atomic) and rename them (os.replace: three in staging,
    three into place); a crash before any of them must leave epoch 1 or epoch 2, never a mix, and
    the next save must work."""
    _save(tmp_path, 1.0, 1)
    name, calls = where
    with monkeypatch.context() as patch:
        _crash_after(patch, ck if name == "write_atomic" else ck.os, name, calls)
        with pytest.raises(Crash):
            _save(tmp_path, 2.0, 2)
    assert _loaded(tmp_path) in ((1, 1.0, -1.0), (2, 2.0, -2.0))
    assert ck.has_checkpoint(tmp_path)
    _save(tmp_path, 3.0, 3)
    assert _loaded(tmp_path) == (3, 3.0, -3.0)
    assert sorted(os.listdir(tmp_path)) == sorted(ck.FILES)  # staging is gone


def test_a_crash_while_moving_resumes_from_the_new_checkpoint(tmp_path, monkeypatch):
    _save(tmp_path, 1.0, 1)
    with monkeypatch.context() as patch:
        _crash_after(patch, ck.os, "replace", 4)  # model.npz is in place, the others are not
        with pytest.raises(Crash):
            _save(tmp_path, 2.0, 2)
    assert _loaded(tmp_path) == (2, 2.0, -2.0)


def test_mismatched_files_without_staging_are_refused(tmp_path):
    _save(tmp_path, 1.0, 1)
    other = tmp_path / "other"
    _save(other, 2.0, 2)
    os.replace(other / "model.npz", tmp_path / "model.npz")
    with pytest.raises(ck.CheckpointError, match="model.npz does not match state.json"):
        ck.load_checkpoint(tmp_path)
    with pytest.raises(ck.CheckpointError, match="not a checkpoint"):
        ck.load_checkpoint(tmp_path / "nothing")


def test_keep_leaves_the_newest_copies_in_history(tmp_path):
    for step in (3, 6, 9):
        model = {"w": np.full(2, float(step))}
        optimizer = {"state": {}, "param_groups": []}
        ck.save_checkpoint(tmp_path, model, optimizer, {"epoch": 0, "step": step}, keep=2)
    history = tmp_path / ck.HISTORY
    assert sorted(p.name for p in history.iterdir()) == ["step-00000006", "step-00000009"]
    model, _, state = ck.load_checkpoint(history / "step-00000006")
    assert state["step"] == 6 and model["w"][0] == 6.0
    assert ck.load_checkpoint(tmp_path)[2]["step"] == 9


def test_the_sampler_goes_on_from_its_position_in_the_epoch():
    from mpdl.parallel import DistributedSampler

    whole = DistributedSampler(50, 8, seed=3)
    whole.set_epoch(1)
    batches = [idx.tolist() for idx, _ in whole]
    first = DistributedSampler(50, 8, seed=3)
    first.set_epoch(1)
    steps = iter(first)
    for _ in range(3):
        next(steps)
    saved = first.state_dict()
    assert saved["position"] == 3
    resumed = DistributedSampler(50, 8, seed=3, num_replicas=1)
    resumed.load_state_dict(saved)
    resumed.set_epoch(1)
    assert [idx.tolist() for idx, _ in resumed] == batches[3:]
    resumed.set_epoch(2)
    assert len(list(resumed)) == len(batches)  # the next epoch starts at its first batch


def _save_sharded(directory, value: float, epoch: int, ranks: int = 1) -> None:
    """A sharded checkpoint of `ranks` shards of one unit holding w (3x4) and b (4)."""
    flat = np.full(16, value)
    bounds = block_bounds(16, ranks)
    manifest = {"ranks": ranks, "units": [{"dtype": "float64", "count": 16,
                                           "params": [["w", 0, [3, 4], 0], ["b", 1, [4], 12]]}],
                "state_keys": ["momentum"], "scalars": {"step": epoch},
                "param_groups": [{"lr": 0.1, "params": [0, 1]}]}

    def body(comm):
        mine = flat[bounds[comm.rank]:bounds[comm.rank + 1]]
        shard = {"unit0/param": mine, "unit0/state/momentum": -mine}
        ck.save_sharded_checkpoint(directory, comm, shard, {"epoch": epoch,
                                                            "manifest": manifest})

    run_world(ranks, body)


@pytest.mark.parametrize("where", [("write_atomic", k) for k in range(2)]
                         + [("replace", k) for k in range(4)])
def test_a_crash_anywhere_in_a_sharded_save_leaves_a_whole_checkpoint(tmp_path, monkeypatch,
                                                                       where):
    """A sharded save (one shard here: a crash must not leave other ranks waiting) writes the
    shard and state.json and renames them twice; after a crash epoch 1 or 2 loads, never a mix;
    a consolidated checkpoint before and after works with it."""
    _save(tmp_path, 1.0, 1)
    _save_sharded(tmp_path, 1.0, 1)
    name, calls = where
    with monkeypatch.context() as patch:
        _crash_after(patch, ck if name == "write_atomic" else ck.os, name, calls)
        with pytest.raises(Crash):
            _save_sharded(tmp_path, 2.0, 2)
    assert _loaded(tmp_path) in ((1, 1.0, -1.0), (2, 2.0, -2.0))
    _save_sharded(tmp_path, 3.0, 3)
    assert _loaded(tmp_path) == (3, 3.0, -3.0)
    assert sorted(os.listdir(tmp_path)) == ["shard-00000.npz", "state.json"]
    _save(tmp_path, 4.0, 4)
    assert sorted(os.listdir(tmp_path)) == sorted(ck.FILES)


def test_a_sharded_checkpoint_loads_as_whole_tensors(tmp_path):
    _save_sharded(tmp_path, 5.0, 7, ranks=3)
    assert sorted(os.listdir(tmp_path)) == [f"shard-0000{r}.npz" for r in range(3)] + [
        "state.json"]
    model, optimizer, state = ck.load_checkpoint(tmp_path)
    assert model["w"].shape == (3, 4) and model["b"].shape == (4,)
    assert np.all(model["w"] == 5.0) and np.all(optimizer["state"]["1"]["momentum"] == -5.0)
    assert optimizer["state"]["0"]["step"] == 7 and state["epoch"] == 7
    _save_sharded(tmp_path, 6.0, 8, ranks=2)  # fewer shards: the third is dropped
    assert sorted(os.listdir(tmp_path)) == ["shard-00000.npz", "shard-00001.npz", "state.json"]
    os.replace(tmp_path / "shard-00001.npz", tmp_path / "shard-00000.npz")
    with pytest.raises(ck.CheckpointError, match="missing shard-00001.npz"):
        ck.load_checkpoint(tmp_path)

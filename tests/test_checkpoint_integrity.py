"""state.json carries the checksum of its canonical form: an edited or corrupt one (the ZeRO
manifest with it), one without its checksum (unless accepted once), or one without a key a resume
needs, is refused in one line naming it; train does not overwrite another run's checkpoint
without --resume, nor the arrays of one whose state.json is gone, unless --force."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint import _save, _save_sharded

from mpdl.training import checkpoint as ck

BIN = Path(sys.executable).parent


def _edit(directory: Path, change) -> None:
    path = directory / "state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state, indent=1) + "\n")


def test_an_edited_step_is_refused_naming_the_file(tmp_path):
    _save(tmp_path, 1.0, 49)
    assert ck.load_checkpoint(tmp_path)[2]["epoch"] == 49
    _edit(tmp_path, lambda s: s.update(epoch=3))
    with pytest.raises(ck.CheckpointError, match=rf"^refusing {tmp_path}/state.json: changed "
                                                 r"since it was written \(its checksum"):
        ck.load_checkpoint(tmp_path)


def test_a_shifted_zero_unit_offset_is_refused(tmp_path):
    _save_sharded(tmp_path, 2.0, 4, ranks=2)
    ck.load_checkpoint(tmp_path)

    def shift(state):
        state["manifest"]["units"][0]["params"][1][3] += 1
    _edit(tmp_path, shift)
    with pytest.raises(ck.CheckpointError, match="state.json: changed since it was written"):
        ck.load_checkpoint(tmp_path)


def test_the_checksum_ignores_layout_and_key_order_and_a_file_without_one_is_refused(tmp_path):
    _save(tmp_path, 1.0, 2)
    path = tmp_path / "state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(state.items())))))  # no indent, keys reversed
    assert ck.load_checkpoint(tmp_path)[2]["epoch"] == 2
    del state[ck.CHECKSUM]
    path.write_text(json.dumps(state))  # as written before state.json had a checksum
    with pytest.raises(ck.CheckpointError, match=rf"^refusing {tmp_path}/state.json: it has no "
                                                 r"checksum .* --accept-unchecked-checkpoint"):
        ck.load_checkpoint(tmp_path)
    assert ck.load_checkpoint(tmp_path, accept_unchecked=True)[2]["epoch"] == 2
    assert ck.add_checksum(tmp_path) and not ck.add_checksum(tmp_path)
    assert json.loads(path.read_text())[ck.CHECKSUM] == ck.canonical_sha256(state)
    assert ck.load_checkpoint(tmp_path)[2]["epoch"] == 2
    assert ck.canonical_sha256({"a": (1, 2), 3: "x"}) == ck.canonical_sha256({"3": "x",
                                                                               "a": [1, 2]})
    assert ck.canonical_sha256({"a": 1}) != ck.canonical_sha256({"a": 2})


def test_a_missing_key_is_named(tmp_path):
    with pytest.raises(ck.CheckpointError, match=r"^D/state.json: no 'sampler' key; cannot resume"):
        ck.check_keys("D", {"epoch": 1, "step": 3})
    ck.check_keys("D", {"epoch": 1, "step": 3, "sampler": {}})


def test_orphan_arrays_are_the_archives_left_without_state_json(tmp_path):
    assert ck.orphan_arrays(tmp_path / "none") == []
    _save(tmp_path, 1.0, 1)
    assert ck.orphan_arrays(tmp_path) == []
    os.remove(tmp_path / "state.json")
    assert ck.orphan_arrays(tmp_path) == ["model.npz", "optimizer.npz"]


def _train(*flags: str) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", "100", str(BIN / "mpiexec"), "-n", "2", str(BIN / "mpdl"),
           "train", "--no-progress", "--epochs", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_train_refuses_an_edited_state_json_and_orphan_arrays_with_one_line(tmp_path):
    d = tmp_path / "D"
    assert _train("--checkpoint", str(d)).returncode == 0
    _edit(d, lambda s: s.update(step=3))
    out = _train("--checkpoint", str(d), "--resume", "--epochs", "2")
    assert out.returncode == 2 and out.stderr == (
        f"mpdl train: error: refusing {d}/state.json: changed since it was written (its checksum "
        f"does not match its contents: edited by hand or a bad disk)\n")
    os.remove(d / "state.json")
    before = (d / "model.npz").read_bytes()
    out = _train("--checkpoint", str(d), "--resume")
    assert out.returncode == 2 and out.stderr == (
        f"mpdl train: error: --resume: {d} holds model.npz, optimizer.npz but no state.json; "
        f"refusing to start over and overwrite them (restore state.json, or give --force to "
        f"start over)\n")
    assert (d / "model.npz").read_bytes() == before
    out = _train("--checkpoint", str(d), "--resume", "--force")
    assert out.returncode == 0, out.stderr
    assert "# no checkpoint in" in out.stdout and (d / "state.json").is_file()
    assert ck.load_checkpoint(d)[2]["step"] > 0


def _zero_weights_unchecked(d: Path) -> None:
    """What an edit by hand can do once the checksum is gone: zero weights (the archive's SHA-256
    updated to match) and a step moved back."""
    import hashlib
    import io

    import numpy as np

    with np.load(d / "model.npz") as archive:
        zeroed = {k: np.zeros_like(archive[k]) for k in archive.files}
    buffer = io.BytesIO()
    np.savez(buffer, **zeroed)
    (d / "model.npz").write_bytes(buffer.getvalue())

    def edit(state):
        del state[ck.CHECKSUM]
        state["sha256"]["model.npz"] = hashlib.sha256(buffer.getvalue()).hexdigest()
        state["step"] = 5
    _edit(d, edit)


def test_train_refuses_a_checksumless_state_json_with_one_line_and_reports_loaded_weights(tmp_path):
    """Deleting the checksum does not turn the check off; accepted once with the flag, the
    checksum is written, and the closing line of a run resumed at its end gives the accuracy of
    the loaded (zeroed: one class for every digit) weights, not the saved history's."""
    d = tmp_path / "D"
    assert _train("--checkpoint", str(d)).returncode == 0
    _zero_weights_unchecked(d)
    out = _train("--checkpoint", str(d), "--resume")
    assert out.returncode == 2 and out.stderr == (
        f"mpdl train: error: refusing {d}/state.json: it has no checksum (written before "
        f"checksums, or its 'checksum' key deleted); if it is an older checkpoint you trust, "
        f"resume from it once with mpdl train --resume --accept-unchecked-checkpoint (that "
        f"writes its checksum)\n")
    out = _train("--checkpoint", str(d), "--resume", "--accept-unchecked-checkpoint")
    assert out.returncode == 0, out.stderr
    assert f"# {d}/state.json had no checksum: accepted once, its checksum written" in out.stdout
    saved = json.loads((d / "state.json").read_text())
    assert saved[ck.CHECKSUM] == ck.canonical_sha256(saved)
    history = saved["history"][-1]["test_acc"]
    closing = float(out.stdout.split("# done: test accuracy ")[1].split(",")[0])
    assert history > 0.5 and closing < 0.2, (history, closing)
    assert _train("--checkpoint", str(d), "--resume").returncode == 0


def test_train_refuses_with_one_line_to_overwrite_another_runs_checkpoint_unless_forced(tmp_path):
    d = tmp_path / "D"
    assert _train("--checkpoint", str(d), "--model", "mlp").returncode == 0
    before = (d / "model.npz").read_bytes()
    out = _train("--checkpoint", str(d), "--model", "lenet")
    assert out.returncode == 2 and out.stderr == (
        f"mpdl train: error: --checkpoint {d} holds the checkpoint of another run; refusing to "
        f"overwrite it (give --resume to continue it, --force to start over in its place, or "
        f"another DIR)\n")
    assert (d / "model.npz").read_bytes() == before
    os.remove(d / "state.json")  # its arrays alone are guarded too
    assert _train("--checkpoint", str(d), "--model", "lenet").returncode == 2
    out = _train("--checkpoint", str(d), "--model", "lenet", "--force")
    assert out.returncode == 0, out.stderr
    assert ck.load_checkpoint(d)[2]["config"]["model"]["name"] == "lenet"

"""Failures in one line: a full disk or a read-only path names the error, the path and the bytes
needed; `mpdl launch` does not retry what a restart cannot fix; sizes beyond the simulator's range
and non-UTF-8 configuration files are refused in one line."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mpdl.threadworld import run_world
from mpdl.training import checkpoint as ck

BIN = Path(sys.executable).parent


def _full_disk_at(monkeypatch, victim: str) -> None:
    """Make write_atomic fail with ENOSPC (no filename, as a short write reports it) on files
    named `victim`."""
    real = ck.write_atomic

    def write(path, data, durable=False):
        if Path(path).name == victim:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data, durable)

    monkeypatch.setattr(ck, "write_atomic", write)


def _save(directory: Path, value: float, step: int) -> None:
    ck.save_checkpoint(directory, {"w": np.full(1000, value)}, {"state": {}, "param_groups": []},
                       {"epoch": 0, "step": step, "sampler": {}})


def test_a_full_disk_names_enospc_the_path_and_the_bytes_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    _save(tmp_path, 1.0, 5)
    with monkeypatch.context() as patch:
        _full_disk_at(patch, "optimizer.npz")
        with pytest.raises(ck.CheckpointWriteError) as info:
            _save(tmp_path, 2.0, 10)
    message = str(info.value)
    assert message.startswith(f"cannot write the checkpoint {tmp_path}: ENOSPC (No space left on "
                              f"device) at {tmp_path}/.staging/optimizer.npz; it needs ")
    assert int(message.rsplit("needs ", 1)[1].split()[0].replace(",", "")) > 8000
    model, _, state = ck.load_checkpoint(tmp_path)
    assert state["step"] == 5 and model["w"][0] == 1.0
    _save(tmp_path, 3.0, 15)
    assert ck.load_checkpoint(tmp_path)[2]["step"] == 15


def test_a_sharded_save_fails_on_every_rank_when_one_rank_cannot_write(tmp_path, monkeypatch):
    _full_disk_at(monkeypatch, "shard-00001.npz")

    def body(comm):
        try:
            ck.save_sharded_checkpoint(tmp_path, comm, {"unit0/param": np.ones(4)},
                                       {"epoch": 1, "manifest": {}})
        except ck.CheckpointWriteError as exc:
            return str(exc)
        return None

    messages = run_world(3, body)
    assert len(set(messages)) == 1 and "ENOSPC" in messages[0]
    assert f"at {tmp_path}/.staging/shard-00001.npz" in messages[0]
    assert not ck.has_checkpoint(tmp_path)


def _mpdl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "mpdl"), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_train_into_a_full_tmpfs_ends_with_one_line_and_launch_does_not_retry(tmp_path):
    """A real 2 MiB tmpfs, filled (root only: elsewhere the fault hook above holds the logic)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                            str(disk)], capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        (disk / "fill").write_bytes(b"\0" * (1900 << 10))
        out = _mpdl("launch", "-n", "2", "--max-restarts", "2", "--", "train", "--no-progress",
                    "--epochs", "2", "--checkpoint", str(disk / "D"))
        errors = [line for line in out.stderr.splitlines() if "error" in line]
        assert out.returncode == 4 and len(errors) == 1, out.stderr
        assert errors[0].startswith(f"mpdl train: error: cannot write the checkpoint {disk}/D: "
                                    f"ENOSPC (No space left on device) at {disk}/D")
        assert "Traceback" not in out.stderr and out.stderr.count("attempt 1 of 3") == 1
        assert "giving up: a checkpoint could not be written" in out.stderr
        assert "attempt 2" not in out.stderr
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_launch_does_not_retry_a_non_finite_stop(tmp_path):
    out = _mpdl("launch", "-n", "2", "--max-restarts", "3", "--", "train", "--no-progress",
                "--lr", "1e30", "--checkpoint", str(tmp_path / "D"))
    assert out.returncode == 3, out.stderr
    assert "giving up: the run stopped on a NaN or inf" in out.stderr
    assert "attempt 2" not in out.stderr


def test_simulate_refuses_sizes_beyond_its_range_at_once():
    start = time.monotonic()
    out = _mpdl("simulate", "--profile", "resnet50-v100", "--nodes", "100000000", "--per-node",
                "4", timeout=15)
    assert time.monotonic() - start < 15
    assert out.returncode == 2 and out.stderr == (
        "mpdl simulate: error: --nodes x --per-node: 400,000,000 workers is beyond the "
        "simulator's range of 1..1,048,576 (its cost model walks the ranks)\n")


def test_a_non_utf8_config_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes(b"[optim]\nlr = 0.1 # \xff\n")
    out = _mpdl("train", "--config", str(path))
    assert out.returncode == 2 and out.stderr == (
        f"mpdl train: error: {path}: not UTF-8 text (byte 0xff at offset 19); TOML files are "
        f"UTF-8\n")


def test_launch_names_the_rank_that_stalled_not_the_one_that_timed_out(tmp_path):
    out = subprocess.run(
        [str(BIN / "mpdl"), "launch", "-n", "2", "--", "train", "--no-progress", "--epochs", "1",
         "--checkpoint", str(tmp_path / "D")], capture_output=True, text=True, timeout=120,
        env={**os.environ, "MPDL_FAULT": "stall:1:3", "MPDL_TIMEOUT": "3"})
    assert out.returncode != 0
    assert "attempt 1 failed (exit status 1): rank 1 stalled or missed a collective: rank 0 " \
           "timed out waiting for it" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("line, stalled", [
    ("CollectiveTimeout: allreduce/ring: rank 2 waited more than 5 s receiving from rank 1 at "
     "step 0 (MPDL_TIMEOUT sets the limit)", 1),
    ("CollectiveTimeout: p2p: rank 0 waited more than 5 s in object size for rank 1", 1),
    ("CollectiveTimeout: allreduce/mpi: rank 0 waited more than 5 s in MPI_Iallreduce for the "
     "ranks 0-2 (one of them never came)", None),
])
def test_the_supervisor_reads_whom_the_timed_out_rank_waited_for(line, stalled):
    from mpdl.tools.supervisor import parse_failure  # noqa: PLC0415

    failure = parse_failure(f"Traceback ...\nmpdl.comm.base.{line}\n", 1, {})
    assert failure.stalled == stalled
    if stalled is not None:
        assert failure.describe().startswith(f"rank {stalled} stalled or missed a collective")

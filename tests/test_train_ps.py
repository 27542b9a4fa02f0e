"""`mpdl train --mode ps` under mpiexec -n 3 (2 workers, 1 server): each synchronisation mode
learns the digits, prints the staleness histogram, writes the standard JSON rows and shuts down
cleanly; flags that do not fit a parameter server exit 2 with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
MPDL = str(BIN / "mpdl")


def train(n: int, *flags: str, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), MPDL, "train",
           "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15,
                          env={**os.environ, "MPDL_TIMEOUT": "30"})


@pytest.mark.parametrize("flags, mode, accuracy", [
    ([], "sync", 0.9), (["--staleness", "1"], "ssp", 0.85), (["--async"], "async", 0.85)])
def test_each_mode_learns_and_shuts_down(tmp_path, flags, mode, accuracy):
    out = train(3, "--mode", "ps", "--servers", "1", "--epochs", "4", *flags,
                "--json", str(tmp_path / "r.jsonl"))
    assert out.returncode == 0, out.stderr
    header = out.stdout.splitlines()[0]
    assert "3 ranks (2 workers, 1 server)" in header and f"parameter server {mode}" in header
    assert f"# parameter server {mode}: " in out.stdout and "staleness 0: " in out.stdout
    first, *rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert first["config"]["parallel"]["mode"] == "ps"
    epochs, summary = rows[:-1], rows[-1]
    assert [r["epoch"] for r in epochs] == [1, 2, 3, 4]
    for row in epochs:
        assert set(row) >= {"loss", "train_acc", "test_acc", "samples_per_s", "compute_s",
                            "comm_s", "exposed_comm_s", "ranks", "algorithm", "lr", "emulated"}
        assert row["mode"] == "ps" and row["ps_mode"] == mode and row["workers"] == 2
        assert row["comm_s"] > 0
    assert summary["summary"] and summary["test_acc"] >= accuracy, summary
    pushes = sum(summary["worker_steps"])
    assert sum(summary["staleness"].values()) == pushes
    if mode == "sync":
        assert set(summary["staleness"]) == {"0"} and summary["updates"] == [pushes // 2]
    else:
        assert summary["updates"] == [pushes]


@pytest.mark.parametrize("n, flags, message", [
    (3, ["--async", "--staleness", "1"], "--async and --staleness exclude each other"),
    (3, ["--servers", "3"], "--servers: expected 1 to 2"),
    (1, [], "needs at least 2 ranks"),
    (3, ["--optimizer", "adam"], "the servers run sgd"),
    (3, ["--checkpoint", "ckpt"], "cannot be combined with --checkpoint"),
    (3, ["--global-batch-size", "1"], "number of workers (2)"),
])
def test_bad_ps_flags_exit_2_with_one_line(n, flags, message):
    out = train(n, "--mode", "ps", *flags)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


def test_async_needs_mode_ps():
    out = train(2, "--async")
    assert out.returncode == 2 and "--async needs --mode ps" in out.stderr

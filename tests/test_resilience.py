"""Resilience under real mpiexec: flight records and `mpdl doctor` after a rank skips an
all-reduce, stall warnings, and `mpdl launch` restarting a killed training run from its
checkpoint with the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
MPDL = str(BIN / "mpdl")

SKIP_SCRIPT = """
from mpdl import collectives as C
from mpdl.comm import as_communicator
comm = as_communicator(None)
for i in range(10):
    C.allreduce(np.full(256, float(i)), algorithm="ring")
comm.barrier()
"""


def run(cmd: list[str], timeout: float, env: dict | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_a_skipped_allreduce_ends_the_job_and_doctor_names_the_rank(tmp_path):
    script = tmp_path / "skip.py"
    script.write_text(SKIP_SCRIPT)
    flight = tmp_path / "flight"
    timeout = 5
    start = time.monotonic()
    out = run([MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", str(script)], timeout=120,
              env={"MPDL_TIMEOUT": str(timeout), "MPDL_STALL_WARN": "1",
                   "MPDL_FAULT": "skip:1:5", "MPDL_FLIGHT_DIR": str(flight)})
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert elapsed < timeout + 10, f"the job took {elapsed:.1f} s to end"
    # the stall warning: once per waiting rank, naming whom it waits for, before the timeout
    warnings = re.findall(r"mpdl: rank (\d) has waited \d+ s in (\S+) \(#9\) for (.*?) \(",
                          out.stderr)
    assert sorted(w[0] for w in warnings) == ["0", "1", "2"], out.stderr
    assert ("2", "allreduce/ring", "rank 1") in warnings
    assert sorted(p.name for p in flight.iterdir()) == [f"rank-{r}.json" for r in range(3)]
    records = json.loads((flight / "rank-2.json").read_text())
    last = records["records"][-1]
    assert (last["seq"], last["collective"], last["waiting_for"]) == (9, "allreduce", [1])
    doctor = run([MPDL, "doctor", str(flight)], timeout=60)
    assert doctor.returncode == 1
    assert "first difference among ranks 0-2: #9" in doctor.stdout
    assert "rank 1: barrier/mpi" in doctor.stdout
    assert doctor.stdout.strip().endswith("look first at: rank 1"), doctor.stdout


def test_doctor_without_records_says_so(tmp_path):
    out = run([MPDL, "doctor", str(tmp_path)], timeout=60)
    assert out.returncode == 2 and "no flight records" in out.stderr

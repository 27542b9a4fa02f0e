"""Mismatched calls never return, with no setting but MPDL_TIMEOUT: ranks that call different
collectives, ops, dtypes of the same bytes, counts or roots, or a plan against a one-shot call,
end the job within a minute with a line on every rank naming each rank's call; a program that
uses the library directly (no `mpdl` command, no `python -m mpi4py`) gets the same. A rank that
stalls gets a line of its own too, and a timeout prints one line per rank, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

#: each job: its code (rank is this rank), and what every rank's line must name
JOBS = {
    "op": ("""
        allreduce(np.ones(1000, np.float32), op="sum" if rank == 0 else "max")
    """, ["op sum", "op max"]),
    "count under mpi": ("""
        allreduce(np.ones(1000 if rank == 0 else 2000, np.float32), algorithm="mpi")
    """, ["float32 (1000,)", "float32 (2000,)"]),
    "dtype of the same bytes": ("""
        allreduce(np.ones(2000, np.float32) if rank == 0 else np.ones(1000, np.float64))
    """, ["float32 (2000,)", "float64 (1000,)"]),
    "dtype of the same bytes under mpi": ("""
        x = np.ones(2000, np.float32) if rank == 0 else np.ones(1000, np.float64)
        allreduce(x, algorithm="mpi")
    """, ["float32 (2000,)", "float64 (1000,)"]),
    "root": ("""
        broadcast(np.full(1000, rank, np.float32), root=rank)
    """, ["root 0", "root 1"]),
    "collective": ("""
        x = np.ones(1000, np.float32)
        allreduce(x) if rank == 0 else allgather(x)
    """, ["allreduce/", "allgather/"]),
    "collective under mpi": ("""
        x = np.ones(1000, np.float32)
        allreduce(x, algorithm="mpi") if rank == 0 else allgather(x, algorithm="mpi")
    """, ["allreduce/mpi", "allgather/mpi"]),
    "plan against one-shot": ("""
        x = np.ones(1000, np.float32)
        allreduce_init(x)() if rank == 0 else allreduce(x)
    """, ["allreduce plan"]),
}


def _run(code: str) -> tuple[subprocess.CompletedProcess, float]:
    """code run by 2 ranks as a plain script (no -m mpi4py) under MPDL_TIMEOUT=15 alone (auto
    takes its size rule, so that no calibration runs first)."""
    program = "\n".join([
        "import time", "import numpy as np", "from mpi4py import MPI",
        "from mpdl.collectives import allgather, allreduce, broadcast",
        "from mpdl.tuning import allreduce_init", "rank = MPI.COMM_WORLD.Get_rank()",
        textwrap.dedent(code), "print(f'rank {rank} returned', flush=True)"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPDL_")}
    env.update(MPDL_TIMEOUT="15", MPDL_AUTO_CACHE="off")
    start = time.monotonic()
    out = subprocess.run(["timeout", "-k", "5", "90", str(BIN / "mpiexec"), "-n", "2",
                          sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=100, env=env)
    return out, time.monotonic() - start


def _lines(stderr: str, rank: int) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"mpdl: rank {rank}")]


@pytest.mark.parametrize("job", list(JOBS))
def test_a_mismatch_ends_every_rank_with_a_line_naming_it(job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the flight records go to ./mpdl-flight
    code, names = JOBS[job]
    out, seconds = _run(code)
    assert out.returncode not in (0, 124, 137), out.stderr[-3000:]
    assert seconds < 60
    assert "returned" not in out.stdout, out.stdout
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    for rank in (0, 1):
        lines = _lines(out.stderr, rank)
        assert len(lines) == 1, out.stderr[-3000:]
        assert all(name in lines[0] for name in names), lines[0]


def test_a_stalled_rank_says_one_line_when_the_other_times_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, seconds = _run("""
        x = np.ones(8, np.float32)
        allreduce(x, algorithm="ring")
        allreduce(x, algorithm="ring") if rank == 0 else time.sleep(80)
    """)
    assert out.returncode not in (0, 124, 137) and seconds < 60, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    waiting, stalled = _lines(out.stderr, 0), _lines(out.stderr, 1)
    assert len(waiting) == 1 and "waited more than 15 s receiving from rank 1" in waiting[0]
    assert len(stalled) == 1 and "ending because rank 0 failed" in stalled[0], stalled


def test_a_library_users_failure_ends_the_job_with_a_line_on_every_rank(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, seconds = _run("""
        allreduce(np.ones(8, np.float32))
        if rank == 1:
            raise ValueError("the data ran out")
        allreduce(np.ones(8, np.float32))
    """)
    assert out.returncode not in (0, 124, 137) and seconds < 30, out.stderr[-3000:]
    failed, other = _lines(out.stderr, 1), _lines(out.stderr, 0)
    assert failed == ["mpdl: rank 1 failed; aborting the job"], out.stderr[-3000:]
    assert "ValueError: the data ran out" in out.stderr  # its traceback: not one of mpdl's errors
    assert len(other) == 1 and "rank 1 failed: ValueError: the data ran out" in other[0], other


SIGNATURES = {
    "call": ("allreduce", "ring", (1000,), "float32", "sum", None),
    "op": ("allreduce", "ring", (1000,), "float32", "max", None),
    "count": ("allreduce", "ring", (2000,), "float32", "sum", None),
    "dtype of the same bytes": ("allreduce", "ring", (500,), "float64", "sum", None),
    "algorithm": ("allreduce", "recursive_doubling", (1000,), "float32", "sum", None),
    "collective": ("allgather", "ring", (1000,), "float32", None, None),
    "root": ("broadcast", "ring", (1000,), "float32", None, 1),
    "the call's count in another shape": ("allreduce", "ring", (10, 100), "float32", "sum", None),
}


def _tags_in_a_new_process(seed: str) -> list[int]:
    """The tags of SIGNATURES (dtypes as NumPy's) in a fresh interpreter with PYTHONHASHSEED=seed:
    what another rank computes."""
    code = ("import numpy as np; from mpdl.comm.calls import call_name\n"
            f"signatures = {list(SIGNATURES.values())!r}\n"
            "print([call_name((*s[:3], np.dtype(s[3]), *s[4:])).tag for s in signatures])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONHASHSEED": seed}, check=True)
    return [int(t) for t in out.stdout.strip().strip("[]").split(",")]


def test_a_signature_gives_the_same_tag_in_every_process_and_each_mismatch_another():
    first, second = _tags_in_a_new_process("1"), _tags_in_a_new_process("2")
    assert first == second
    assert first[-1] == first[0]  # arrays of one size in two shapes make the same call
    assert len(set(first[:-1])) == len(SIGNATURES) - 1
    assert all(8192 <= tag <= 32767 for tag in first)  # above mpdl's own tags, under MPI's least TAG_UB

"""Every wait ends: ranks that disagree (mismatched shapes under `auto`, MPI's own all-reduce
against its all-gather, a node lookup or shared-memory setup one rank never joins) end the job
after MPDL_TIMEOUT with a line naming the collective and what it waited for, and a test run whose
oracle skips for want of PyTorch fails under MPDL_REQUIRE_ORACLE=1."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

JOBS = {
    "auto with mismatched shapes": """
        x = np.ones(1000 if rank == 0 else 2000, np.float32)
        allreduce(x, algorithm="auto")
    """,
    "mpi all-reduce against all-gather": """
        x = np.ones(1000, np.float32)
        allreduce(x, algorithm="mpi") if rank == 0 else allgather(x, algorithm="mpi")
    """,
    # the rank that never joins sleeps rather than waits in mpdl, so that its own deadline cannot
    # end the job first on a loaded machine
    "a node lookup one rank never joins": """
        comm = as_communicator(None)
        comm.node_of_rank() if rank == 0 else time.sleep(80)
    """,
    "a shared-memory setup one rank never joins": """
        comm = as_communicator(None)
        comm.node_of_rank()
        comm.shared_segments(64) if rank == 0 else time.sleep(80)
    """,
}


def _run(code: str, timeout_s: int, check: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    program = "\n".join([
        "import time", "import numpy as np", "from mpi4py import MPI",
        "from mpdl.collectives import allgather, allreduce",
        "from mpdl.comm import as_communicator", "rank = MPI.COMM_WORLD.Get_rank()",
        textwrap.dedent(code)])
    start = time.monotonic()
    out = subprocess.run(["timeout", "-k", "5", "90", str(BIN / "mpiexec"), "-n", "2",
                          sys.executable, "-m", "mpi4py", "-c", program], capture_output=True,
                         text=True, timeout=100, env={
                             **{k: v for k, v in os.environ.items() if k != "MPDL_RANKS_PER_NODE"},
                             "MPDL_TIMEOUT": str(timeout_s), "MPDL_CHECK": "1" if check else "0"})
    return out, time.monotonic() - start


@pytest.mark.parametrize("job", list(JOBS))
def test_ranks_that_disagree_end_the_job_after_the_timeout(job):
    out, seconds = _run(JOBS[job], 4)
    assert out.returncode not in (0, 124, 137), out.stderr[-2000:]
    assert seconds < 60
    if job.startswith("a node lookup"):
        assert "the node lookup: rank 0 waited more than 4 s receiving from rank 1" in out.stderr
    elif job.startswith("a shared-memory"):
        assert "the shared-memory setup (before MPI_Comm_split_type): rank 0 waited more than " \
            "4 s receiving from rank 1" in out.stderr
    elif job.startswith("mpi"):  # the signature check before MPI's own collectives
        assert "allreduce/mpi #0: the ranks called different collectives: rank 0: allreduce/mpi(" \
            "op sum, float32 (1000,)); rank 1: allgather/mpi(float32 (1000,))" in out.stderr


@pytest.mark.parametrize("where", ["test", "module"])
def test_a_skip_for_want_of_pytorch_fails_under_mpdl_require_oracle(tmp_path, where):
    body = "pytest.importorskip('torch')"
    test = ("import sys\nsys.modules['torch'] = None\nimport pytest\n"
            + (f"{body}\n\ndef test_a():\n    pass\n" if where == "module" else
               f"\ndef test_a():\n    {body}\n"))
    (tmp_path / "test_oracle_probe.py").write_text(test)
    (tmp_path / "test_other.py").write_text("def test_b():\n    pass\n")

    def run(required: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
             "--rootdir", str(tmp_path), str(tmp_path)],
            capture_output=True, text=True, timeout=60, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parent),
                 "MPDL_REQUIRE_ORACLE": required}).returncode

    assert run("1") != 0
    assert run("0") == 0


def test_doctor_names_the_rank_that_skipped_an_allreduce_at_2_ranks(tmp_path):
    """Rank 1 skips its fourth collective (#3, the second step's gradient bucket; `auto`'s
    first-use calibration before it is not counted); train checks its first steps' calls across
    ranks, so rank 1 stops at its next call and doctor names it."""
    ck = tmp_path / "D"
    out = subprocess.run(
        ["timeout", "-k", "5", "90", str(BIN / "mpiexec"), "-n", "2", str(BIN / "mpdl"), "train",
         "--no-progress", "--epochs", "1", "--checkpoint", str(ck)], capture_output=True,
        text=True, timeout=100,
        env={**os.environ, "MPDL_FAULT": "skip:1:3", "MPDL_TIMEOUT": "5",
             "MPDL_AUTO_CACHE": str(tmp_path / "cache")})
    assert out.returncode not in (0, 124, 137), out.stderr[-2000:]
    doctor = subprocess.run([str(BIN / "mpdl"), "doctor", str(ck / "flight")],
                            capture_output=True, text=True, timeout=60)
    assert doctor.returncode == 1
    assert "never arrived: rank 1 at #3 allreduce" in doctor.stdout
    assert doctor.stdout.strip().endswith("look first at: rank 1"), doctor.stdout


def test_check_every_call_switches_every_communicator():
    from mpdl.comm import as_communicator, check_every_call  # noqa: PLC0415
    from mpdl.threadworld import ThreadWorld  # noqa: PLC0415

    comms = [as_communicator(None), ThreadWorld(1).comm(0)]
    comms.append(comms[1].sub([0]))
    assert not any(c.check for c in comms)
    check_every_call(True)
    try:
        assert all(c.check for c in comms)
    finally:
        check_every_call(False)
    assert not any(c.check for c in comms)


def test_plans_compare_their_signature_at_creation_without_mpdl_check():
    out, _ = _run("""
        from mpdl.tuning import allreduce_init
        from mpdl.comm import CollectiveMismatch
        x = np.ones(1000 if rank == 0 else 2000, np.float32)
        try:
            allreduce_init(x, algorithm="auto")
        except CollectiveMismatch as exc:
            print("refused:", exc, flush=True)
    """, 60)
    assert out.returncode == 0, out.stderr[-2000:]
    # both ranks refuse (their lines may interleave on the shared stdout)
    assert out.stdout.count("allreduce plan #0: ranks disagree on the call") == 2, out.stdout
    assert out.stdout.count("rank 0: ('allreduce plan', 'auto', (1000,)") == 2
    assert out.stdout.count("rank 1: ('allreduce plan', 'auto', (2000,)") == 2

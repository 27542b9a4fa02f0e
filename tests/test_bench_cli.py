"""`mpdl bench` and `mpdl calibrate` as a user runs them: under mpiexec, in a subprocess."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
MPDL = str(BIN / "mpdl")


def run(n: int, args: list[str], env: dict | None = None, timeout: float = 90):
    return subprocess.run(["timeout", "-k", "5", str(int(timeout)), MPIEXEC, "-n", str(n), MPDL,
                           *args], capture_output=True, text=True, timeout=timeout + 10,
                          env={**os.environ, **(env or {})})


def test_calibrate_then_bench_under_emulated_nodes(tmp_path):
    model = tmp_path / "model.json"
    env = {"MPDL_COST_MODEL": str(model)}
    out = run(2, ["calibrate", "-n", "3"], env)
    assert out.returncode == 0, out.stderr
    assert f"saved {model}" in out.stdout
    entry = json.loads(model.read_text())["entries"]["2"]
    assert entry["alpha"] > 0 and entry["beta"] > 0 and entry["gammas"]["float32"] > 0
    assert entry["barrier"] > 0 and entry["call"] > 0 and entry["handoff"] >= 0
    # a ring of two is a pair, timed in a chain of steps as the ring takes them, plain and
    # reducing; the input copy on reused buffers at the same sizes
    assert (len(entry["ring_exchange"]) == len(entry["ring_reduce_exchange"])
            == len(entry["copy_curve"]) == len(entry["exchange"]) == 6)

    rows_path, csv_path, png = tmp_path / "rows.json", tmp_path / "rows.csv", tmp_path / "bw.png"
    out = run(2, ["bench", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1",
                  "--algorithms", "ring,hierarchical,auto", "--emulate", "inter=10Gbit/s,20us",
                  "--json", str(rows_path), "--csv", str(csv_path), "--plot", str(png)],
              {**env, "MPDL_RANKS_PER_NODE": "1"})
    assert out.returncode == 0, out.stderr
    assert "EMULATED" in out.stdout and "auto→" in out.stdout and "x mpi" in out.stdout
    assert "# predictions: mpdl calibrate on" in out.stdout
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    assert len(rows) == 3 * 4
    assert all(r["nodes"] == 2 and r["emulated"] == "inter=10Gbit/s,20us" for r in rows)
    with open(csv_path) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_flag_is_one_line_from_rank_0_and_exit_2():
    out = run(3, ["bench", "--algorithms", "ring,fastest"])
    assert out.returncode == 2
    assert out.stderr.count("mpdl bench: error:") == 1 and "'fastest'" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_list_gives_each_algorithm_and_its_cost():
    out = run(1, ["bench", "allreduce", "--list"])
    assert out.returncode == 0, out.stderr
    for name in ("ring", "recursive_doubling", "hierarchical", "mpi", "auto"):
        assert any(line.startswith(name) for line in out.stdout.splitlines()), name
    assert "2(p-1)α" in out.stdout


def test_calibrate_needs_two_ranks(tmp_path):
    out = run(1, ["calibrate"], {"MPDL_COST_MODEL": str(tmp_path / "m.json")})
    assert out.returncode == 2 and "at least 2 ranks" in out.stderr and "Traceback" not in out.stderr


def test_calibrate_at_an_odd_world_size(tmp_path):
    """At p=3 one rank has no partner for the exchanges; every rank still contributes the same
    figures to the merge (it once made MPI_Allreduce fail with a truncated message)."""
    model = tmp_path / "model.json"
    out = run(3, ["calibrate", "-n", "3"], {"MPDL_COST_MODEL": str(model)}, timeout=120)
    assert out.returncode == 0, out.stderr
    entry = json.loads(model.read_text())["entries"]["3"]
    assert entry["alpha"] > 0 and entry["alpha_native"] > 0 and entry["beta"] > 0
    assert entry["gemm_flops"] > 1e8  # the per-core float32 GEMM peak behind training's MFU
    # three ranks on a node: the ring curve is measured beside the pair curve
    assert len(entry["ring_exchange"]) == len(entry["exchange"]) == 6
    assert all(t > 0 for _, t in entry["ring_exchange"] + entry["ring_reduce_exchange"])
    # rank 1 waits for rank 0's compute: its polls cost CPU, whatever core it shares
    assert entry["wait_cpu"] >= 0 and 0 <= entry["wait_share"] <= 1
    assert entry["wait_cpu"] + entry["wait_share"] > 0


@pytest.mark.parametrize("iters", [1, 2, 3, 4, 5, 20, 41])
def test_turns_time_every_iteration_once(iters):
    from mpdl.perf.bench import ROUNDS, turns

    rounds = turns(iters)
    assert sorted(i for turn in rounds for i in turn) == list(range(iters))
    assert len(rounds) == min(ROUNDS, iters)
    assert max(map(len, rounds)) - min(map(len, rounds)) <= 1


@pytest.mark.parametrize("collective,expected", [
    ("allreduce", {"mpi:ring", "mpi:recursive_doubling", "mpi:rabenseifner"}),
    ("allgather", {"mpi:ring", "mpi:recursive_doubling", "mpi:bruck"})])
def test_mpi_variants_time_the_library_s_own_algorithms_beside_mpdl_s(tmp_path, collective,
                                                                      expected):
    """Each library algorithm forced by name (the library raises for one that does not apply,
    so a row is that algorithm) gives MPI's result and sits right after mpdl's of its name."""
    rows_path = tmp_path / "rows.json"
    out = run(2, ["bench", collective, "-b", "4K", "-e", "4K", "-n", "2", "-w", "0", "--check",
                  "--mpi-variants", "--algorithms", "ring,recursive_doubling",
                  "--json", str(rows_path)])
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    names = [r["algorithm"] for r in rows]
    assert expected <= set(names), names
    # the library's algorithms with no mpdl counterpart are only timed (Open MPI 5.0.11's
    # sparbit all-gather, in place, returned wrong elements)
    checked = [r for r in rows if not r["algorithm"].startswith("mpi:")
               or r["algorithm"][4:] in names]
    assert all(r["wrong"] == 0 for r in checked), checked
    for name in ("ring", "recursive_doubling"):
        if f"mpi:{name}" in names and name in names:
            assert names.index(f"mpi:{name}") == names.index(name) + 1, names
    assert "mpdl / the library's same algorithm" in out.stdout


BAD_LR = ("mpdl train: error: argument --lr: invalid float value: 'abc' "
          "(mpdl train --help lists the options)\n")


def test_a_bad_flag_is_reported_with_one_line_from_rank_0_alone():
    """argparse's error, without its usage block, once for the whole job (not once per rank)."""
    out = run(3, ["train", "--lr", "abc"])
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == BAD_LR


def test_a_mistyped_flag_points_to_the_verbs_own_help_with_one_line():
    for verb, flag in (("train", "--epochz"), ("simulate", "--nodez")):
        out = run(2, [verb, flag, "2"])
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr == (f"mpdl {verb}: error: unrecognized arguments: {flag} 2 "
                              f"(mpdl {verb} --help lists the options)\n")


def test_a_bad_flag_reaches_stderr_once_under_every_mpi():
    """Under any launcher (Open MPI's adds a paragraph of its own), rank 0's line is there, once."""
    out = run(3, ["train", "--lr", "abc"])
    assert out.returncode != 0 and out.stderr.count(BAD_LR) == 1, out.stderr


def test_rows_reach_a_pipe_as_each_size_is_measured(tmp_path):
    """Through a pipe (not a terminal), the header and the first size's rows arrive while the
    later sizes are still being timed: the job is ended on reading the first row, and what was
    printed by then holds no summary (which follows the last size)."""
    job = subprocess.Popen(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", MPDL, "bench",
                            "-b", "8", "-e", "64M", "-f", "8", "-n", "20", "-w", "1",
                            "--algorithms", "ring,tree,recursive_doubling"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           start_new_session=True,
                           env={**os.environ, "MPDL_AUTO_CACHE": "off",
                                "MPDL_COST_MODEL": str(tmp_path / "none.json")})
    try:
        seen = []
        for line in job.stdout:
            seen.append(line)
            if line.split()[:1] == ["8"]:  # the first row of the first size
                break
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        rest = job.stdout.read()
        job.wait()
    assert seen and seen[0].startswith("# mpdl bench allreduce: 2 ranks"), seen
    assert seen[-1].split()[:5] == ["8", "2", "float32", "sum", "ring"], seen
    assert "# summary" not in rest and "16777216" not in rest, rest

"""Does `mpdl simulate` predict this machine? Calibrate, then compare its predictions with measured
`mpdl bench` (ring all-reduce, 512 KiB-2 MiB) and `mpdl train` (LeNet) step times at p=2.

    python benchmarks/simulate_agreement.py

Exits 1 when a median ratio predicted/measured lies outside ±25%. It is a benchmark, not a unit
test: timings on a shared machine are noisy, so it is run by hand and its figures reported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mpdl import simulate as S
from mpdl.collectives import costmodel as cm

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")


TOLERANCE = 0.25


def _mpirun(n: int, args: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run(["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), MPDL, *args],
                         capture_output=True, text=True, timeout=timeout + 10, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out


def _environment(tmp_path: Path) -> dict:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load > 3:
        print(f"warning: load average {load:.1f} per core: timings are unreliable now")
    env = {**os.environ, "MPDL_COST_MODEL": str(tmp_path / "model.json"), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    for var in ("MPDL_EMULATE", "MPDL_RANKS_PER_NODE", "MPDL_SEGMENT_BYTES"):
        env.pop(var, None)
    return env


def train_step_ratio(tmp_path: Path) -> float:
    """After calibrate, in two rounds that interleave `simulate --measure lenet` (per-sample
    time on this machine) and `mpdl train` of LeNet under mpiexec -n 2: the median of
    predicted/measured step time (median over epochs after the first) lies within ±25%."""
    env = _environment(tmp_path)
    _mpirun(2, ["calibrate", "-n", "30"], env, 60)
    ratios = []
    for round_ in range(2):
        sim_path, train_path = tmp_path / f"sim{round_}.jsonl", tmp_path / f"train{round_}.jsonl"
        subprocess.run([MPDL, "simulate", "--measure", "lenet", "--measure-input", "mnist",
                        "--network", "calibrated", "--nodes", "1", "--per-node", "2",
                        "--max-workers", "2", "--algorithms", "ring", "--json", str(sim_path)],
                       capture_output=True, text=True, timeout=60, env=env, check=True)
        predicted = next(row["step_s"] for row in map(json.loads, sim_path.read_text().splitlines())
                         if row.get("workers") == 2)
        _mpirun(2, ["train", "--model", "lenet", "--dataset", "synthetic", "--synthetic-samples",
                    "2048", "--epochs", "3", "--algorithm", "ring", "--no-progress", "--json",
                    str(train_path)], env, 120)
        # the first epoch pays for compiling kernels and first-touch allocations: leave it out
        epochs = [json.loads(x) for x in train_path.read_text().splitlines()][1:-1]
        step = statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in epochs)
        ratios.append(predicted / step)
    ratio = statistics.median(ratios)
    print(f"train step at p=2, predicted/measured: {ratio:.2f} ({', '.join(f'{r:.2f}' for r in ratios)})")
    return ratio


def allreduce_ratio(tmp_path: Path) -> float:
    """Calibrate, then bench the ring all-reduce of 512 KiB-2 MiB, back to back in two rounds:
    the median predicted/measured over the six sizes lies within ±25%."""
    env = _environment(tmp_path)
    ratios = []
    for round_ in range(2):
        _mpirun(2, ["calibrate", "-n", "30"], env, 60)
        params = cm.read_file(env["MPDL_COST_MODEL"])[2]
        path = tmp_path / f"bench{round_}.jsonl"
        _mpirun(2, ["bench", "-b", "512K", "-e", "2M", "-n", "9", "-w", "2", "--algorithms", "ring",
                    "--json", str(path)], env, 60)
        for r in (json.loads(x) for x in path.read_text().splitlines()):
            if r["algorithm"] == "ring":
                predicted = S.allreduce_seconds("ring", r["bytes"], 2, 1, params)
                ratios.append(predicted / (r["time_us"] * 1e-6))
    ratio = statistics.median(ratios)
    print(f"ring all-reduce at p=2, predicted/measured: {ratio:.2f} "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return ratio


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        bench = allreduce_ratio(Path(tmp))
        train = train_step_ratio(Path(tmp))
    ok = True
    for what, ratio in (("ring all-reduce, mpdl bench", bench), ("LeNet step, mpdl train", train)):
        verdict = "ok" if abs(ratio - 1) <= TOLERANCE else "outside ±25%"
        ok &= verdict == "ok"
        print(f"{what:<28} predicted/measured {ratio:.2f}  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

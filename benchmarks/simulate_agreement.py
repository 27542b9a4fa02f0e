"""Does `mpdl simulate` predict this machine? For each world size p (default 2, 3 and 4): calibrate at
p, then compare the model's predictions with measured `mpdl bench` (ring all-reduce, 512 KiB-2 MiB)
and `mpdl train` (LeNet, 32 samples per rank) step times.

    python benchmarks/simulate_agreement.py [--ranks 2 3 4] [--rounds 5]

Each round calibrates again, then benches and trains right after, because this machine's speed
drifts within minutes; the verdict is on the median over rounds.

Exits 1 when a median ratio predicted/measured lies outside ±25%. It is a benchmark, not a unit
test: timings on a shared machine are noisy, so it is run by hand and its figures reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mpdl.collectives import costmodel as cm
from mpdl.perf import simulate as S

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")


TOLERANCE = 0.25


def verdict(ratios: list[float]) -> tuple[float, bool]:
    """(median ratio, whether it lies within ±TOLERANCE of 1)."""
    ratio = statistics.median(ratios)
    return ratio, abs(ratio - 1) <= TOLERANCE


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


def _calibrate(p: int, env: dict) -> None:
    _mpirun(p, ["calibrate", "-n", "30"], env, 120)


def train_step_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """predicted/measured LeNet step time at p ranks, 32 samples per rank:
    `mpiexec -n p mpdl simulate --measure lenet` (every rank measures at once), then
    `mpiexec -n p mpdl train`, whose step is the median over the epochs after the first (which
    pays for compiling kernels)."""
    sim_path, train_path = tmp_path / f"sim{p}.{round_}.jsonl", tmp_path / f"train{p}.{round_}.jsonl"
    _mpirun(p, ["simulate", "--measure", "lenet", "--measure-input", "mnist", "--network",
                "calibrated", "--nodes", "1", "--per-node", str(p), "--max-workers", str(p),
                "--batch-per-worker", "32", "--algorithms", "ring", "--json", str(sim_path)],
            env, 120)
    predicted = next(row["step_s"] for row in map(json.loads, sim_path.read_text().splitlines())
                     if row.get("workers") == p)
    _mpirun(p, ["train", "--model", "lenet", "--dataset", "synthetic", "--synthetic-samples",
                str(2048 * p), "--global-batch-size", str(32 * p), "--epochs", "3",
                "--algorithm", "ring", "--no-progress", "--json", str(train_path)], env, 240)
    epochs = [json.loads(x) for x in train_path.read_text().splitlines()][1:-1]
    return predicted / statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in epochs)


def allreduce_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """The median over 512 KiB, 1 MiB and 2 MiB of predicted/measured time of the ring all-reduce
    at p ranks, benched just after calibrating."""
    params = cm.read_file(env["MPDL_COST_MODEL"])[p]
    path = tmp_path / f"bench{p}.{round_}.jsonl"
    _mpirun(p, ["bench", "-b", "512K", "-e", "2M", "-n", "40", "-w", "2", "--algorithms", "ring",
                "--json", str(path)], env, 120)
    return statistics.median(
        S.allreduce_seconds("ring", r["bytes"], p, 1, params) / (r["time_us"] * 1e-6)
        for r in map(json.loads, path.read_text().splitlines()) if r["algorithm"] == "ring")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of calibrate, bench, simulate and train per size (default 5)")
    args = parser.parse_args()
    ok = True
    print(f"{'p':>2}  {'what':<26} {'predicted/measured':>18}  {'each round':<30} verdict")
    with tempfile.TemporaryDirectory() as tmp:
        env = _environment(Path(tmp))
        for p in args.ranks:
            bench, train = [], []
            for round_ in range(args.rounds):
                _calibrate(p, env)  # again each round: the machine's speed drifts within minutes
                bench.append(allreduce_ratio(p, env, Path(tmp), round_))
                train.append(train_step_ratio(p, env, Path(tmp), round_))
            for what, ratios in (("ring all-reduce, bench", bench), ("LeNet step, train", train)):
                ratio, agrees = verdict(ratios)
                ok &= agrees
                each = ", ".join(f"{r:.2f}" for r in ratios)
                print(f"{p:>2}  {what:<26} {ratio:>18.2f}  {each:<30} "
                      f"{'ok' if agrees else 'outside ±25%'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

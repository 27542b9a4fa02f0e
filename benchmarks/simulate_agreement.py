"""Does `mpdl simulate` predict this machine? For each world size p (default 2, 3 and 4): calibrate at
p, then compare the model's predictions with measured `mpdl bench` (ring all-reduce, 512 KiB-2 MiB)
and `mpdl train` (LeNet, 32 samples per rank) step times. With --zero, also `mpdl train --zero S`
of LeNet with float32 Adam at each stage: its step time against the data-parallel prediction
(per unit the calibrated cost of its reduce-scatter and all-gather, stage 3 two all-gathers, not
hidden behind compute), and its measured `model_state_bytes` against `mpdl.perf.layouts`' memory per GPU
(float32 Adam, sharded over p, plus the largest unit held whole: its gradient at stage 2, its
gradient and gathered weights at stage 3; the unit sizes are the ones the run reports).

    python benchmarks/simulate_agreement.py [--ranks 2 3 4] [--rounds 5] [--zero 1 2 3] [--only-zero]

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
from mpdl.perf import layouts as L
from mpdl.perf import simulate as S

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")


TOLERANCE = 0.25
MEMORY_TOLERANCE = 0.10


def verdict(ratios: list[float], tolerance: float = TOLERANCE) -> tuple[float, bool]:
    """(median ratio, whether it lies within ±tolerance of 1)."""
    ratio = statistics.median(ratios)
    return ratio, abs(ratio - 1) <= tolerance


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


def predicted_lenet_step(p: int, env: dict, tmp_path: Path, round_: int) -> dict:
    """`mpiexec -n p mpdl simulate --measure lenet`'s row at p workers (every rank measures)."""
    sim_path = tmp_path / f"zsim{p}.{round_}.jsonl"
    _mpirun(p, ["simulate", "--measure", "lenet", "--measure-input", "mnist", "--network",
                "calibrated", "--nodes", "1", "--per-node", str(p), "--max-workers", str(p),
                "--batch-per-worker", "32", "--algorithms", "ring", "--json", str(sim_path)],
            env, 120)
    return next(row for row in map(json.loads, sim_path.read_text().splitlines())
                if row.get("workers") == p)


def zero_ratios(p: int, stage: int, predicted: dict, env: dict, tmp_path: Path,
                round_: int) -> tuple[float, float]:
    """(predicted/measured step time, predicted/measured model_state_bytes) of `mpdl train
    --zero stage` (LeNet, 32 samples per rank, float32 Adam)."""
    path = tmp_path / f"zero{stage}.{p}.{round_}.jsonl"
    _mpirun(p, ["train", "--model", "lenet", "--dataset", "synthetic", "--synthetic-samples",
                str(2048 * p), "--global-batch-size", str(32 * p), "--epochs", "3",
                "--algorithm", "ring", "--optimizer", "adam", "--zero", str(stage),
                "--no-progress", "--json", str(path)], env, 240)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    epochs, summary = rows[1:-1], rows[-1]
    measured_step = statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in epochs)
    units = [b // 4 for b in summary["unit_bytes"]]
    # each unit is reduce-scattered and all-gathered (stage 3: gathered before forward and again
    # before backward), one collective call per unit, charged by the calibrated cost model. They
    # are taken as exposed: LeNet's stage 1 and 2 have a single unit, whose reduce-scatter starts
    # when backward ends and whose all-gather follows the optimizer
    params = cm.read_file(env["MPDL_COST_MODEL"])[p]
    comm = sum(cm.predict("reduce_scatter", "ring", b, p, 1, params)
               + (2 if stage == 3 else 1) * cm.predict("allgather", "ring", b, p, 1, params)
               for b in summary["unit_bytes"])
    step = predicted["compute_s"] + comm
    fp32 = L.PRECISIONS["fp32"]
    memory = (L.model_states(sum(units), fp32, stage, p)["model_state_bytes"]
              + L.zero_working_bytes(max(units), fp32, stage))
    return step / measured_step, memory / summary["model_state_bytes"]


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
    parser.add_argument("--zero", type=int, nargs="*", default=[], metavar="STAGE",
                        help="also check mpdl train --zero at these stages (1 2 3)")
    parser.add_argument("--only-zero", action="store_true",
                        help="skip the all-reduce and the data-parallel LeNet step")
    args = parser.parse_args()
    if any(stage not in (1, 2, 3) for stage in args.zero):
        parser.error(f"--zero: expected stages 1, 2 or 3, got {args.zero}")
    ok = True
    print(f"{'p':>2}  {'what':<26} {'predicted/measured':>18}  {'each round':<30} verdict")
    with tempfile.TemporaryDirectory() as tmp:
        env = _environment(Path(tmp))
        for p in args.ranks:
            results: dict[str, tuple[list[float], float]] = {}
            for round_ in range(args.rounds):
                _calibrate(p, env)  # again each round: the machine's speed drifts within minutes
                if not args.only_zero:
                    results.setdefault("ring all-reduce, bench", ([], TOLERANCE))[0].append(
                        allreduce_ratio(p, env, Path(tmp), round_))
                    results.setdefault("LeNet step, train", ([], TOLERANCE))[0].append(
                        train_step_ratio(p, env, Path(tmp), round_))
                if args.zero:
                    predicted = predicted_lenet_step(p, env, Path(tmp), round_)
                    for stage in args.zero:
                        step, memory = zero_ratios(p, stage, predicted, env, Path(tmp), round_)
                        results.setdefault(f"ZeRO {stage} step, train", ([], TOLERANCE))[0].append(
                            step)
                        results.setdefault(f"ZeRO {stage} model state", ([], MEMORY_TOLERANCE)
                                           )[0].append(memory)
            for what, (ratios, tolerance) in results.items():
                ratio, agrees = verdict(ratios, tolerance)
                ok &= agrees
                each = ", ".join(f"{r:.2f}" for r in ratios)
                print(f"{p:>2}  {what:<26} {ratio:>18.2f}  {each:<30} "
                      f"{'ok' if agrees else f'outside ±{tolerance:.0%}'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

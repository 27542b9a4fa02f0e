"""Does `mpdl simulate` predict this machine? Each round calibrates at p (`mpdl calibrate`), then
compares the model's predictions with measurements taken right after:

* ring   - `mpdl bench` of the ring all-reduce at 512 KiB, 1 MiB and 2 MiB against the calibrated
           cost model (the median over the three sizes);
* lenet  - `mpdl train` of LeNet (32 samples per rank, data parallel) against `mpiexec -n p mpdl
           simulate --measure lenet` (every rank measures at once);
* zero   - `mpdl train --zero S --optimizer adam` of LeNet at each stage: its step against the
           compute measured with Adam plus, per ZeRO unit, the calibrated ring reduce-scatter and
           all-gather (two all-gathers at stage 3), all exposed, each with the calibrated
           handoff to the communication thread, and ZeRO's own work (a step of ZeRO less one
           of plain training, both on one rank, in turns), or, with more ranks than
           cores, every rank's compute (timed with no more ranks than cores at once), own work,
           collectives and handoffs and what their waits take from the cores, spread over the
           cores, if that is longer;
           and its measured
           `model_state_bytes` against `mpdl.perf.layouts`' memory per GPU (float32 Adam sharded
           over p, plus the largest unit held whole: its gradient at stage 2, its gradient and
           gathered weights at stage 3; the unit sizes are the ones the run reports);
* pp     - `mpdl train --pp 2 --microbatches 4` of LeNet (32 samples per pipeline; dp = p/2)
           against the pipeline model: each stage's forward + backward of one microbatch (timed
           on p/pp ranks at once, the pieces cut as the pipeline cuts them), one microbatch
           through all stages and the other m-1 paced by the slowest stage (equal stages give
           the bubble (pp-1)/(m+pp-1)) or, with more ranks than cores, all ranks' compute
           and what their waits take from the cores (the calibrated `wait_cpu` and
           `wait_share`) spread over the cores if that is longer, an activation and a gradient
           message per stage boundary on that path, the slowest stage's optimizer step and,
           with dp > 1, the calibrated ring all-reduce of the largest stage's gradient.

    flock /tmp/mpdl-bench.lock python benchmarks/simulate_agreement.py            # everything
    python benchmarks/simulate_agreement.py --checks ring lenet --ranks 2 3 4 --rounds 5
    python benchmarks/simulate_agreement.py --checks zero pp --ranks 2 4 --zero 1 2 3

Each round calibrates again, because this machine's speed drifts within minutes; the verdict is
on the median over rounds (±25% for times, ±10% for memory), and every round is printed. Ends
with one summary line per check. Exits 1 when a median lies outside its band. It is a benchmark,
not a unit test: timings on a shared machine are noisy, so it is run by hand and its figures
reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpdl.collectives import costmodel as cm
from mpdl.mpi_runtime import usable_cores
from mpdl.perf import layouts as L
from mpdl.perf import simulate as S
from mpdl.perf.agreement import MEMORY_TOLERANCE, TOLERANCE, pipeline_step, verdict, zero_step

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")

CHECKS = ("ring", "lenet", "zero", "pp")
#: the pipeline check: stages, microbatches, samples per pipeline
PP, MICROBATCHES, PP_BATCH = 2, 4, 32


def _run(n: int, argv: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    out = subprocess.run(["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), *argv],
                         capture_output=True, text=True, timeout=timeout + 10, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out


def _mpirun(n: int, args: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    return _run(n, [MPDL, *args], env, timeout)


def _environment(tmp_path: Path) -> dict:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    if load > 1:
        print(f"warning: load average {load:.1f} per core: timings are unreliable now")
    env = {**os.environ, "MPDL_COST_MODEL": str(tmp_path / "model.json"), "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1"}
    for var in ("MPDL_EMULATE", "MPDL_RANKS_PER_NODE", "MPDL_SEGMENT_BYTES"):
        env.pop(var, None)
    return env


def _calibrate(p: int, env: dict) -> None:
    _mpirun(p, ["calibrate", "-n", "30"], env, 180)


def _params(env: dict, p: int) -> cm.Params:
    return cm.read_file(env["MPDL_COST_MODEL"])[p]


def _train(p: int, args: list[str], env: dict, path: Path, batch_per_rank: int = 32
           ) -> tuple[float, dict]:
    """(median step of epochs 2-3, the summary row) of `mpdl train --model lenet` on synthetic
    MNIST-shaped data."""
    _mpirun(p, ["train", "--model", "lenet", "--dataset", "synthetic", "--synthetic-samples",
                str(2048 * p), "--global-batch-size", str(batch_per_rank * p), "--epochs", "3",
                "--algorithm", "ring", "--no-progress", "--json", str(path), *args], env, 300)
    rows = [json.loads(x) for x in path.read_text().splitlines()][1:]  # after the configuration
    epochs = rows[1:-1]  # the first epoch pays for compiling kernels
    return statistics.median(r["compute_s"] + r["exposed_comm_s"] for r in epochs), rows[-1]


def predicted_lenet_step(p: int, env: dict, tmp_path: Path, tag: str,
                         optimizer: str = "sgd") -> dict:
    """`mpiexec -n p mpdl simulate --measure lenet`'s row at p workers (every rank measures)."""
    sim_path = tmp_path / f"sim.{tag}.jsonl"
    _mpirun(p, ["simulate", "--measure", "lenet", "--measure-input", "mnist",
                "--measure-optimizer", optimizer, "--network", "calibrated", "--nodes", "1",
                "--per-node", str(p), "--max-workers", str(p), "--batch-per-worker", "32",
                "--algorithms", "ring", "--json", str(sim_path)], env, 120)
    return next(row for row in map(json.loads, sim_path.read_text().splitlines())
                if row.get("workers") == p)


def lenet_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """predicted/measured data-parallel LeNet step at p ranks, 32 samples per rank."""
    predicted = predicted_lenet_step(p, env, tmp_path, f"dp{p}.{round_}")["step_s"]
    measured, _ = _train(p, [], env, tmp_path / f"train{p}.{round_}.jsonl")
    return predicted / measured


def own_work_times(repeats: int = 50, warmup: int = 10) -> dict[int, float]:
    """ZeRO's own work at each stage: the seconds a step of `ZeroStrategy` takes beyond one of
    plain data parallel training (`AllReduceStrategy`), LeNet, 32 samples, Adam, on a world of
    one rank, where nothing moves (gathering into and freeing flat buffers, the hooks, the
    optimizer on pieces); the four take turns step by step, medians, at least 0."""
    from mpdl.autograd import optim
    from mpdl.comm import as_communicator
    from mpdl.parallel.data_parallel import AllReduceStrategy
    from mpdl.parallel.strategy import Batch
    from mpdl.parallel.zero import ZeroStrategy
    from mpdl.training.models import build_model

    comm = as_communicator(None)
    shape = S.INPUT_SHAPES["mnist"]
    rng = np.random.default_rng(0)
    batch = Batch(rng.standard_normal((32, *shape)).astype(np.float32),
                  rng.integers(0, 10, 32), 32, 1e-3)
    strategies = {0: AllReduceStrategy(comm, algorithm="ring"),
                  **{stage: ZeroStrategy(comm, stage=stage, algorithm="ring")
                     for stage in (1, 2, 3)}}
    for strategy in strategies.values():
        strategy.setup(build_model("lenet", shape, 10, seed=0),
                       lambda ps: optim.Adam(ps, lr=1e-3))
    times: dict[int, list[float]] = {k: [] for k in strategies}
    for i in range(warmup + repeats):
        for k, strategy in strategies.items():
            t0 = time.perf_counter()
            strategy.step(batch)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    plain = statistics.median(times[0])
    return {stage: max(0.0, statistics.median(times[stage]) - plain) for stage in (1, 2, 3)}


def _own_worker(argv: list[str]) -> int:
    """Under mpiexec -n 1: writes `own_work_times()` (stage -> seconds) to argv[0]."""
    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does
    Path(argv[0]).write_text(json.dumps(own_work_times()))
    return 0


def zero_own_work(env: dict, tmp_path: Path, tag: str) -> dict[int, float]:
    """`own_work_times()` measured in a process of its own (one rank)."""
    path = tmp_path / f"own.{tag}.json"
    _run(1, [sys.executable, __file__, "--own-worker", str(path)], env, 120)
    return {int(stage): t for stage, t in json.loads(path.read_text()).items()}


def zero_ratios(p: int, stage: int, predicted: dict, pure_s: float, own_s: float, env: dict,
                tmp_path: Path, round_: int) -> tuple[float, float]:
    """(predicted/measured step time, predicted/measured model_state_bytes) of `mpdl train
    --zero stage` (LeNet, 32 samples per rank, float32 Adam)."""
    measured_step, summary = _train(p, ["--optimizer", "adam", "--zero", str(stage)], env,
                                    tmp_path / f"zero{stage}.{p}.{round_}.jsonl")
    units = [b // 4 for b in summary["unit_bytes"]]
    step = zero_step(predicted["compute_s"], pure_s, own_s, summary["unit_bytes"], stage, p,
                     _params(env, p), usable_cores())
    fp32 = L.PRECISIONS["fp32"]
    memory = (L.model_states(sum(units), fp32, stage, p)["model_state_bytes"]
              + L.zero_working_bytes(max(units), fp32, stage))
    return step / measured_step, memory / summary["model_state_bytes"]


def _compute_worker(argv: list[str]) -> int:
    """Under mpiexec -n n: every rank times LeNet's step (forward and backward of 32 samples and
    an Adam step, `simulate.measure_workload`) at once; rank 0 writes the slowest rank's seconds."""
    (out,) = argv
    from mpi4py import MPI

    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does
    work = S.measure_workload("lenet", "mnist", batch=32, optimizer="adam")
    slowest = MPI.COMM_WORLD.reduce(work.sample_s * 32 + work.step_s, op=MPI.MAX, root=0)
    if MPI.COMM_WORLD.rank == 0:
        Path(out).write_text(json.dumps(slowest))
    return 0


def pure_compute(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """LeNet's Adam step (32 samples) timed by min(p, cores) ranks at once: the compute of one rank
    when no more ranks than cores run."""
    path = tmp_path / f"compute{p}.{round_}.json"
    _run(min(p, usable_cores()), [sys.executable, __file__, "--compute-worker", str(path)], env,
         120)
    return float(json.loads(path.read_text()))


# -- the pipeline ----------------------------------------------------------------------------------
def stage_times(model: str, shape: str, microbatch: int, pp: int, repeats: int = 60,
                seed: int = 0) -> dict:
    """Per stage of `model` cut as `mpdl train --pp` cuts it (`pipeline.model_pieces`, balanced by
    `pipeline.partition`): the median seconds of forward (the last stage with its loss), backward
    and the SGD step (momentum 0.9, as mpdl train) of one microbatch, and the bytes of each
    stage's output and gradient."""
    from mpdl.autograd import functional as F
    from mpdl.autograd import optim
    from mpdl.autograd.tensor import Tensor
    from mpdl.parallel.pipeline import model_pieces, partition
    from mpdl.training.models import build_model

    net = build_model(model, S.INPUT_SHAPES[shape], 10, seed=seed)
    pieces = model_pieces(net)
    bounds = partition([w for _, w in pieces], pp)
    stages = [[piece for piece, _ in pieces[bounds[s]:bounds[s + 1]]] for s in range(pp)]
    params = [[q for piece in st for q in piece.parameters()] for st in stages]
    opts = [optim.SGD(ps, lr=0.01, momentum=0.9) for ps in params]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((microbatch, *S.INPUT_SHAPES[shape])).astype(np.float32)
    y = rng.integers(0, 10, microbatch)
    times = np.zeros((repeats, pp, 3))
    out_bytes = [0] * pp
    warmup = 20
    for it in range(repeats + warmup):
        h, inputs, outputs = x, [], []
        for s, stage in enumerate(stages):
            t0 = time.perf_counter()
            inp = Tensor(h, requires_grad=s > 0)
            out = inp
            for piece in stage:
                out = piece(out)
            if s == pp - 1:
                out = F.cross_entropy(out, y) * (1.0 / microbatch)
                float(out.item())
            else:
                h = np.ascontiguousarray(out.data)
                out_bytes[s] = h.nbytes
            inputs.append(inp)
            outputs.append(out)
            if it >= warmup:
                times[it - warmup, s, 0] = time.perf_counter() - t0
        grad = None
        for s in reversed(range(pp)):
            t0 = time.perf_counter()
            if s == pp - 1:
                outputs[s].backward()
            else:
                outputs[s].backward(grad)
            if s > 0:
                grad = np.ascontiguousarray(inputs[s].grad)
            if it >= warmup:
                times[it - warmup, s, 1] = time.perf_counter() - t0
        for s, opt in enumerate(opts):
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if it >= warmup:
                times[it - warmup, s, 2] = time.perf_counter() - t0
    med = np.median(times, axis=0)
    return {"forward": med[:, 0].tolist(), "backward": med[:, 1].tolist(),
            "optimizer": med[:, 2].tolist(), "output_bytes": out_bytes,
            "grad_bytes": [4 * sum(q.size for q in ps) for ps in params]}


def _stage_worker(argv: list[str]) -> int:
    """Under mpiexec -n p: the stages are timed by p/pp ranks at once (one per pipeline, as many
    as compute at once when the slowest stage paces the pipeline and the others wait for it), the
    other ranks sleeping; rank 0 writes the slowest measuring rank's figures."""
    model, shape, microbatch, pp, out = argv
    from mpi4py import MPI

    from mpdl.allocator import keep_heap

    keep_heap()  # as `mpdl train` does (its command line keeps glibc's heap between steps)

    from mpdl.perf.calibrate import quiet_barrier

    world = MPI.COMM_WORLD
    measuring = world.rank < world.size // int(pp)
    quiet_barrier(world)
    mine = stage_times(model, shape, int(microbatch), int(pp)) if measuring else None
    everyone = [r for r in world.gather(mine, root=0) or [] if r is not None]
    quiet_barrier(world)
    if world.rank == 0:
        worst = {k: [max(r[k][s] for r in everyone) for s in range(int(pp))] for k in everyone[0]}
        Path(out).write_text(json.dumps(worst))
    return 0


def pipeline_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """predicted/measured step of `mpdl train --pp 2 --microbatches 4` (LeNet, dp = p/2)."""
    dp = p // PP
    path = tmp_path / f"stages{p}.{round_}.json"
    _run(p, [sys.executable, __file__, "--stage-worker", "lenet", "mnist",
             str(PP_BATCH // MICROBATCHES), str(PP), str(path)], env, 120)
    predicted = pipeline_step(json.loads(path.read_text()), MICROBATCHES, dp, _params(env, p),
                              usable_cores())
    measured, _ = _train(p, ["--pp", str(PP), "--microbatches", str(MICROBATCHES),
                             "--schedule", "1f1b"], env, tmp_path / f"pp{p}.{round_}.jsonl",
                         batch_per_rank=PP_BATCH // PP)
    return predicted["step_s"] / measured


def allreduce_ratio(p: int, env: dict, tmp_path: Path, round_: int) -> float:
    """The median over 512 KiB, 1 MiB and 2 MiB of predicted/measured time of the ring all-reduce
    at p ranks, benched just after calibrating."""
    params = _params(env, p)
    path = tmp_path / f"bench{p}.{round_}.jsonl"
    _mpirun(p, ["bench", "-b", "512K", "-e", "2M", "-n", "40", "-w", "2", "--algorithms", "ring",
                "--json", str(path)], env, 120)
    return statistics.median(
        S.allreduce_seconds("ring", r["bytes"], p, 1, params) / (r["time_us"] * 1e-6)
        for r in map(json.loads, path.read_text().splitlines()) if r["algorithm"] == "ring")


def main() -> int:
    if sys.argv[1:2] == ["--stage-worker"]:
        return _stage_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--compute-worker"]:
        return _compute_worker(sys.argv[2:])
    if sys.argv[1:2] == ["--own-worker"]:
        return _own_worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", nargs="+", default=list(CHECKS), choices=CHECKS,
                        help="what to compare (default: all)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4],
                        help="world sizes of the ring and lenet checks (default 2 3 4)")
    parser.add_argument("--zero-ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes of the zero check (default 2 4)")
    parser.add_argument("--pp-ranks", type=int, nargs="+", default=[2, 4],
                        help="world sizes of the pipeline check, even (default 2 4)")
    parser.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3], metavar="STAGE",
                        help="ZeRO stages of the zero check (default 1 2 3)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of calibrate and measure per world size (default 5)")
    args = parser.parse_args()
    if any(stage not in (1, 2, 3) for stage in args.zero):
        parser.error(f"--zero: expected stages 1, 2 or 3, got {args.zero}")
    if any(p < 2 or p % PP for p in args.pp_ranks):
        parser.error(f"--pp-ranks: expected even world sizes, got {args.pp_ranks}")
    if any(p < 2 for p in args.ranks + args.zero_ranks) or args.rounds < 1:
        parser.error("--ranks, --zero-ranks: expected at least 2; --rounds at least 1")
    checks = set(args.checks)
    sizes = sorted({*(args.ranks if checks & {"ring", "lenet"} else []),
                    *(args.zero_ranks if "zero" in checks else []),
                    *(args.pp_ranks if "pp" in checks else [])})
    ok, summary = True, []
    print(f"{'p':>2}  {'what':<28} {'predicted/measured':>18}  {'each round':<36} verdict")
    with tempfile.TemporaryDirectory() as tmp:
        env = _environment(Path(tmp))
        for p in sizes:
            results: dict[str, tuple[list[float], float]] = {}

            def add(what: str, ratio: float, tolerance: float = TOLERANCE,
                    results: dict = results) -> None:
                results.setdefault(what, ([], tolerance))[0].append(ratio)

            for round_ in range(args.rounds):
                _calibrate(p, env)  # again each round: the machine's speed drifts within minutes
                if "ring" in checks and p in args.ranks:
                    add("ring all-reduce, bench", allreduce_ratio(p, env, Path(tmp), round_))
                if "lenet" in checks and p in args.ranks:
                    add("LeNet step, train", lenet_ratio(p, env, Path(tmp), round_))
                if "zero" in checks and p in args.zero_ranks:
                    predicted = predicted_lenet_step(p, env, Path(tmp), f"z{p}.{round_}", "adam")
                    pure = (pure_compute(p, env, Path(tmp), round_) if p > usable_cores()
                            else predicted["compute_s"])
                    own = zero_own_work(env, Path(tmp), f"{p}.{round_}")
                    for stage in args.zero:
                        step, memory = zero_ratios(p, stage, predicted, pure, own[stage], env,
                                                   Path(tmp), round_)
                        add(f"ZeRO {stage} step, train", step)
                        add(f"ZeRO {stage} model state", memory, MEMORY_TOLERANCE)
                if "pp" in checks and p in args.pp_ranks:
                    add(f"pp={PP} m={MICROBATCHES} step, train",
                        pipeline_ratio(p, env, Path(tmp), round_))
            for what, (ratios, tolerance) in results.items():
                ratio, agrees = verdict(ratios, tolerance)
                ok &= agrees
                each = ", ".join(f"{r:.2f}" for r in ratios)
                line = (f"{p:>2}  {what:<28} {ratio:>18.2f}  {each:<36} "
                        f"{'ok' if agrees else f'outside ±{tolerance:.0%}'}")
                summary.append(line)
                print(line, flush=True)
    passed = sum(1 for line in summary if line.endswith(" ok"))
    print(f"\nsummary: {passed} of {len(summary)} checks within their bands")
    for line in summary:
        print("  " + line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""DDP, DiLoCo and Streaming DiLoCo on the Shakespeare recipe, side by side: the validation loss,
the bytes each rank sent, the training time, the time to reach DDP's final loss and the share of
the step spent computing; optionally over an emulated slow link between islands of ranks.

    python benchmarks/bench_diloco.py --ranks 4 --steps 1500
    python benchmarks/bench_diloco.py --ranks 4 --steps 300 --emulate inter=1Gbit/s,10ms \\
        --ranks-per-node 2 --algorithm hierarchical --extra-steps 0.3 --plot diloco.png

Every run trains `examples/shakespeare.toml` at a global batch of --batch for --steps steps (the
cosine over those steps); DiLoCo's runs may go on --extra-steps × steps further at the last
learning rate, to show when they reach DDP's final loss. Training time is the sum of the logged
step times (evaluations left out). Under --emulate every message mpdl sends between islands waits
latency + bytes/bandwidth (mpdl.emulation); pick an mpdl --algorithm (the MPI library's own are
not slowed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def train(name: str, args: argparse.Namespace, extra: list[str], steps: int, out: Path) -> dict:
    """Run one configuration; its evaluations, step logs and summary."""
    path = out / f"{name}.jsonl"
    command = [str(BIN / "mpiexec"), "-n", str(args.ranks), str(BIN / "mpdl"), "train",
               "--config", str(ROOT / "examples" / "shakespeare.toml"),
               "--global-batch-size", str(args.batch), "--max-steps", str(steps),
               "--lr-decay-steps", str(args.steps), "--eval-interval", str(args.eval_interval),
               "--eval-steps", str(args.eval_steps), "--log-interval", str(args.log_interval),
               "--algorithm", args.algorithm, "--no-progress", "--json", str(path), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    if args.emulate:
        command += ["--emulate", args.emulate]
        env["MPDL_RANKS_PER_NODE"] = str(args.ranks_per_node)
    print(f"# {name}: {' '.join(command[3:])}", flush=True)
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    evals = [(d["step"], d["val_loss"]) for d in lines if "val_loss" in d and "step" in d]
    logs = [(d["step"], d["step_ms"]) for d in lines if "step_ms" in d and "step" in d]
    epochs = [d for d in lines if "epoch" in d and "compute_s" in d]
    summary = next(d for d in lines if d.get("summary"))
    return {"evals": evals, "logs": logs, "epochs": epochs, "summary": summary}


def elapsed(logs: list[tuple[int, float]], step: int) -> float:
    """Seconds of training up to `step`, from the logs' mean step times per interval."""
    total, last = 0.0, 0
    for s, ms in logs:
        if s > step:
            return total + (step - last) * ms / 1e3
        total += (s - last) * ms / 1e3
        last = s
    return total


def time_to_reach(run: dict, target: float) -> float | None:
    """Training seconds until the validation loss first reaches target (linear between two
    evaluations), or None."""
    evals = run["evals"]
    for (s0, l0), (s1, l1) in zip(evals, evals[1:], strict=False):
        if l1 <= target:
            step = s0 + (s1 - s0) * (l0 - target) / (l0 - l1) if l0 > target else s0
            return elapsed(run["logs"], step)
    return None


def compute_share(run: dict) -> float:
    """The share of a step spent computing: compute / (compute + exposed communication)."""
    compute = sum(e["compute_s"] for e in run["epochs"])
    exposed = sum(e["exposed_comm_s"] for e in run["epochs"])
    return compute / (compute + exposed) if compute + exposed else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=48, help="global batch (sequences)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--sync-every", type=int, default=50)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--extra-steps", type=float, default=0.0,
                        help="DiLoCo's runs go on this fraction of --steps further")
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--emulate", default=None, help="e.g. inter=1Gbit/s,10ms")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", default=None, help="folder for the runs' JSON lines")
    parser.add_argument("--plot", default=None, help="a PNG of val loss against training time")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_diloco-"))
    out.mkdir(parents=True, exist_ok=True)
    outer = ["--diloco", "--sync-every", str(args.sync_every), "--outer-lr", "0.7",
             "--outer-momentum", "0.9"]
    more = args.steps + int(args.extra_steps * args.steps)
    runs = {"DDP": train("ddp", args, [], args.steps, out),
            "DiLoCo": train("diloco", args, outer, more, out),
            f"Streaming F={args.fragments}": train(
                "streaming", args, outer + ["--diloco-fragments", str(args.fragments)], more, out)}
    ddp = runs["DDP"]
    target = ddp["evals"][-1][1]
    ddp_time = time_to_reach(ddp, target)
    print(f"\n# {args.ranks} ranks, global batch {args.batch}, {args.steps} steps, H = "
          f"{args.sync_every}" + (f", emulated {args.emulate} between islands of "
                                  f"{args.ranks_per_node}" if args.emulate else "")
          + f"; target: DDP's final val loss {target:.4f}")
    print(f"{'run':<16} {'val@' + str(args.steps):>9} {'vs DDP':>7} {'allreduce_bytes':>16} "
          f"{'DDP/this':>9} {'train_s':>8} {'to_target_s':>12} {'speedup':>8} {'compute':>8}")
    for name, run in runs.items():
        at_steps = next((loss for step, loss in run["evals"] if step == args.steps), float("nan"))
        sent = run["summary"]["allreduce_bytes"]
        reach = time_to_reach(run, target)
        print(f"{name:<16} {at_steps:>9.4f} {at_steps / target - 1:>+7.2%} {sent:>16,} "
              f"{ddp['summary']['allreduce_bytes'] / sent:>9.1f} "
              f"{elapsed(run['logs'], args.steps):>8.1f} "
              + (f"{reach:>12.1f} {ddp_time / reach:>7.2f}x" if reach else f"{'not reached':>12} "
                 f"{'':>8}") + f" {compute_share(run):>8.1%}")
    if args.plot:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415

        fig, ax = plt.subplots(figsize=(6.5, 3.6))
        for name, run in runs.items():
            ax.plot([elapsed(run["logs"], s) for s, _ in run["evals"]],
                    [loss for _, loss in run["evals"]], marker="o", ms=3, label=name)
        ax.axhline(target, color="k", ls=":", lw=1, label="DDP's final loss")
        ax.set(xlabel="training time (s)", ylabel="validation loss",
               title=f"{args.ranks} ranks" + (f", {args.emulate} between islands"
                                              if args.emulate else ""))
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"# figure: {args.plot}")


if __name__ == "__main__":
    main()

"""Data-parallel training benchmarks: weak scaling, overlap, and mpdl DDP against PyTorch DDP.

    python benchmarks/bench_ddp.py [--reps 5] [--steps 30] [--json PATH] [--only weak,overlap,torch]

Each comparison launches short mpiexec jobs of this script's `worker` mode, interleaved
(A, B, A, B, ...) so that load on a shared machine hits both sides alike, and reports medians
and ratios measured in one run. Every rank runs with one BLAS thread (OMP/OPENBLAS_NUM_THREADS=1).

- weak scaling: samples/s at p=1 and p=2 with the same per-rank batch; efficiency =
  samples/s(p=2) / (2 · samples/s(p=1)).
- overlap: a wide MLP at p=2 where communication dominates; step time with overlap vs without,
  and the share of all-reduce time hidden behind backward, 1 - exposed/comm.
- torch: the same MLP and global batch at p=2 under PyTorch DDP (gloo, CPU) and mpdl DDP;
  ratio = mpdl samples/s / PyTorch samples/s. Needs torch (`pip install torch`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.comm import as_communicator
from mpdl.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------------- worker (under mpiexec)
def worker(args: argparse.Namespace) -> None:
    widths = [int(w) for w in args.widths.split(",")]
    rank = int(os.environ.get("PMI_RANK", "0"))
    size = int(os.environ.get("PMI_SIZE", "1"))
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch, widths[0])).astype(np.float32)
    y = rng.integers(0, widths[-1], args.batch)
    if args.torch:
        steps = _torch_steps(args, widths, x, y, rank, size)
    else:
        steps = _mpdl_steps(args, widths, x, y)
    if rank == 0:
        timed = steps[args.warmup:]
        step_s = statistics.median(s[0] for s in timed)
        print(json.dumps({"p": size, "step_s": step_s, "samples_per_s": args.batch * size / step_s,
                          "comm_s": statistics.median(s[1] for s in timed),
                          "exposed_s": statistics.median(s[2] for s in timed)}), flush=True)


def _mpdl_steps(args, widths, x, y) -> list[tuple[float, float, float]]:
    layers: list = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b, seed=i))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    ddp = DistributedDataParallel(model, algorithm=args.algorithm, overlap=not args.no_overlap,
                                  bucket_mb=args.bucket_mb)
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    as_communicator().barrier()
    steps = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        F.cross_entropy(ddp(Tensor(x)), y).backward()
        ddp.finish()
        opt.step()
        opt.zero_grad()
        steps.append((time.perf_counter() - t0, ddp.last_comm_s, ddp.last_exposed_s))
    return steps


def _torch_steps(args, widths, x, y, rank, size) -> list[tuple[float, float, float]]:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as TorchDDP  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=size)
    layers: list = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = TorchDDP(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    dist.barrier()
    steps = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(tx), ty).backward()
        opt.step()
        opt.zero_grad()
        steps.append((time.perf_counter() - t0, float("nan"), float("nan")))
    dist.destroy_process_group()
    return steps


# ---------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(p: int, widths: str, batch: int, steps: int, extra: list[str],
           env: dict[str, str] | None = None) -> dict:
    cmd = ["timeout", "-k", "5", "300", MPIEXEC, "-n", str(p), sys.executable, __file__, "worker",
           "--widths", widths, "--batch", str(batch), "--steps", str(steps), *extra]
    if "--torch" in extra:
        cmd += ["--port", str(_free_port())]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT), **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def interleave(reps: int, runs: dict[str, callable]) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            results[name].append(fn())
    return results


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", default="weak,overlap,torch")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--bucket-mb", default="25", help="overlap run: DDP bucket size (MiB)")
    parser.add_argument("--emulate", metavar="SPEC",
                        help="overlap run only: each rank is its own emulated node and messages "
                             "between them pay this link, e.g. inter=1Gbit/s,50us")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    report: dict[str, dict] = {}

    if "weak" in only:
        widths, batch = "784,512,512,10", 64
        r = interleave(args.reps, {
            "p1": lambda: launch(1, widths, batch, args.steps, []),
            "p2": lambda: launch(2, widths, batch, args.steps, [])})
        s1, s2 = med(r["p1"], "samples_per_s"), med(r["p2"], "samples_per_s")
        report["weak_scaling"] = {"model": f"mlp {widths}", "batch_per_rank": batch,
                                  "samples_per_s_p1": s1, "samples_per_s_p2": s2,
                                  "efficiency": s2 / (2 * s1)}
        print(f"weak scaling (mlp {widths}, {batch}/rank): p=1 {s1:.0f} samples/s, p=2 "
              f"{s2:.0f} samples/s, efficiency {s2 / (2 * s1):.2f}", flush=True)

    if "overlap" in only:
        widths, batch = "1024,2048,2048,2048,10", 32
        link = ({"MPDL_EMULATE": args.emulate, "MPDL_RANKS_PER_NODE": "1"} if args.emulate
                else None)
        r = interleave(args.reps, {
            "on": lambda: launch(2, widths, batch, args.steps, ["--bucket-mb", args.bucket_mb], link),
            "off": lambda: launch(2, widths, batch, args.steps, ["--no-overlap"], link)})
        on, off = med(r["on"], "step_s"), med(r["off"], "step_s")
        comm_on, exposed_on = med(r["on"], "comm_s"), med(r["on"], "exposed_s")
        comm_off = med(r["off"], "comm_s")
        hidden = 1 - exposed_on / comm_on
        saved = (off - on) / comm_off
        report["overlap"] = {"model": f"mlp {widths}", "batch_per_rank": batch, "p": 2,
                             "emulated_link": args.emulate,
                             "step_s_overlap": on, "step_s_no_overlap": off,
                             "comm_s_overlap": comm_on, "exposed_s_overlap": exposed_on,
                             "comm_s_no_overlap": comm_off, "hidden_fraction": hidden,
                             "step_time_saved_over_comm": saved}
        where = args.emulate or "shared memory"
        print(f"overlap (mlp {widths}, {batch}/rank, p=2, link {where}): "
              f"step {on * 1e3:.1f} ms with overlap vs "
              f"{off * 1e3:.1f} ms without; all-reduce {comm_on * 1e3:.1f} ms of which "
              f"{exposed_on * 1e3:.1f} ms exposed: hidden {hidden:.0%}; step time saved = "
              f"{saved:.0%} of the no-overlap all-reduce time", flush=True)

    if "torch" in only:
        widths, batch = "784,512,512,10", 64
        r = interleave(args.reps, {
            "mpdl": lambda: launch(2, widths, batch, args.steps, []),
            "torch": lambda: launch(2, widths, batch, args.steps, ["--torch"])})
        ours, theirs = med(r["mpdl"], "samples_per_s"), med(r["torch"], "samples_per_s")
        import torch  # noqa: PLC0415

        report["vs_torch"] = {"model": f"mlp {widths}", "global_batch": 2 * batch, "p": 2,
                              "torch": torch.__version__, "samples_per_s_mpdl": ours,
                              "samples_per_s_torch": theirs, "ratio": ours / theirs}
        print(f"vs PyTorch {torch.__version__} DDP/gloo (mlp {widths}, global batch {2 * batch}, "
              f"p=2): mpdl {ours:.0f} samples/s, torch {theirs:.0f} samples/s, ratio "
              f"{ours / theirs:.2f}x", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        p = argparse.ArgumentParser()
        p.add_argument("mode")
        p.add_argument("--widths", required=True)
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--algorithm", default="auto")
        p.add_argument("--first-bucket-mb", type=float, default=1.0)
        p.add_argument("--bucket-mb", type=float, default=25.0)
        p.add_argument("--no-overlap", action="store_true")
        p.add_argument("--torch", action="store_true")
        p.add_argument("--port", type=int, default=29500)
        worker(p.parse_args())
    else:
        main()

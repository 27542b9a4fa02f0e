"""Data-parallel training benchmarks: weak scaling, overlap, and mpdl DDP against PyTorch DDP.

    python benchmarks/bench_ddp.py [--reps 5] [--steps 30] [--json PATH] [--only weak,overlap,torch]

Each comparison launches short mpiexec jobs of this script's `worker` mode, interleaved
(A, B, A, B, ...) so that load on a shared machine hits both sides alike, and reports medians
and ratios measured in one run. Every rank runs with one BLAS thread (OMP/OPENBLAS_NUM_THREADS=1).

- weak scaling: samples/s at p=1 and p=2 with the same per-rank batch; efficiency =
  samples/s(p=2) / (2 · samples/s(p=1)). Beside it, the limit this machine allows:
  step(p=1) / (step of 2 ranks side by side + all-reduce alone), where "side by side" is two
  single-rank DDP jobs (each on its own MPI.COMM_SELF) stepping together, one per core, so that
  they share the memory bandwidth and caches as the p=2 ranks do, and "all-reduce alone" is the
  same buckets all-reduced at p=2 with nothing else running (on 2 ranks and 2 cores nothing can
  hide it: both cores compute). A table gives each run's step by phase: forward, backward,
  grad-ready hooks (bucket copies), waiting for / running all-reduces in finish(), optimizer,
  other.
- overlap: a wide MLP at p=2 over an emulated slow link (default inter=5Gbit/s,50us, each rank
  its own node, buckets of 4 MiB); step time with overlap vs without, and the share of all-reduce
  time hidden behind backward, 1 - exposed/comm. Beside it, the most that can be hidden: each
  bucket's all-reduce (timed alone) started as soon as it is full and its predecessors are done,
  against the end of backward.
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
from mpi4py import MPI

from mpdl.autograd import functional as F
from mpdl.autograd import nn
from mpdl.autograd.optim import SGD
from mpdl.autograd.tensor import Tensor
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MPIEXEC = str(BIN / "mpiexec")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ---------------------------------------------------------------------- worker (under mpiexec)
#: the phases of a step, as the worker reports them (milliseconds, medians over steps)
PHASES = ("forward", "backward", "hooks", "finish", "optimizer", "other")


def worker(args: argparse.Namespace) -> None:
    widths = [int(w) for w in args.widths.split(",")]
    rank = int(os.environ.get("PMI_RANK", "0"))
    size = int(os.environ.get("PMI_SIZE", "1"))
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch, widths[0])).astype(np.float32)
    y = rng.integers(0, widths[-1], args.batch)
    extra: dict = {}
    if args.torch:
        steps = _torch_steps(args, widths, x, y, rank, size)
    else:
        steps, extra = _mpdl_steps(args, widths, x, y)
    if rank == 0:
        timed = steps[args.warmup:]
        step_s = statistics.median(s["step"] for s in timed)
        ranks = 1 if args.side_by_side else size
        print(json.dumps({"p": size, "step_s": step_s, "samples_per_s": args.batch * ranks / step_s,
                          "comm_s": statistics.median(s["comm"] for s in timed),
                          "exposed_s": statistics.median(s["exposed"] for s in timed),
                          "phases_ms": {k: 1e3 * statistics.median(s[k] for s in timed)
                                        for k in PHASES if k in timed[0]}, **extra}), flush=True)


def _mpdl_steps(args, widths, x, y) -> tuple[list[dict], dict]:
    layers: list = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=True)):
        layers.append(nn.Linear(a, b, seed=i))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    world = as_communicator()
    comm = as_communicator(MPI.COMM_SELF) if args.side_by_side else world
    ddp = DistributedDataParallel(model, comm=comm, algorithm=args.algorithm,
                                  overlap=not args.no_overlap, bucket_mb=args.bucket_mb,
                                  first_bucket_mb=args.first_bucket_mb)
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    world.barrier()
    steps, ready, backward_end = [], [], []
    t0 = time.perf_counter()
    for _ in range(args.warmup + args.steps):
        if args.side_by_side:
            world.barrier()  # the two single-rank jobs step together
        start = time.perf_counter()
        loss = F.cross_entropy(ddp(Tensor(x)), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        ddp.finish()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t4 = time.perf_counter()
        hooks = ddp.last_hook_s
        phases = {"forward": t1 - start, "backward": t2 - t1 - hooks, "hooks": hooks,
                  "finish": t3 - t2, "optimizer": t4 - t3}
        ready.append(ddp.bucket_ready_times())
        backward_end.append(t2)
        end = time.perf_counter()  # a step runs from one step's start to the next one's
        steps.append({"step": end - t0, "comm": ddp.last_comm_s, "exposed": ddp.last_exposed_s,
                      "other": end - t0 - sum(phases.values()), **phases})
        t0 = end
    extra: dict = {"buckets": [b.nbytes for b in ddp.buckets],
                   "algorithms": ddp.bucket_algorithms()}
    if comm.size > 1:
        alone = _allreduce_alone(ddp, comm)
        extra["allreduce_alone_s"] = sum(alone)
        exposed = [_least_exposure(r, alone, end) for r, end in
                   zip(ready[args.warmup:], backward_end[args.warmup:], strict=True)]
        extra["exposed_min_s"] = statistics.median(exposed)
    return steps, extra


def _allreduce_alone(ddp, comm, reps: int = 15) -> list[float]:
    """Median seconds of each bucket's all-reduce with nothing else running: its plan, as the
    steps run it (the one-shot call with compression)."""
    times = [[] for _ in ddp.buckets]
    for _ in range(reps):
        for i, b in enumerate(ddp.buckets):
            comm.barrier()
            start = time.perf_counter()
            if b.plan is not None:
                b.plan()
            else:
                allreduce(b.buffer, op="sum", algorithm=ddp.algorithm, comm=comm, out=b.buffer)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _least_exposure(ready: list[float], alone: list[float], backward_end: float) -> float:
    """Seconds of all-reduce left after backward if each bucket's all-reduce (taking its time
    alone) starts as soon as it is full and the one before it is done."""
    end = -np.inf
    for r, c in zip(ready, alone, strict=True):
        end = max(r, end) + c
    return max(0.0, end - backward_end)


def _torch_steps(args, widths, x, y, rank, size) -> list[dict]:
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
        steps.append({"step": time.perf_counter() - t0, "comm": float("nan"),
                      "exposed": float("nan")})
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


def phases(rows: list[dict]) -> dict[str, float]:
    """A run's step by phase in ms: medians over repetitions of each repetition's median."""
    return {k: statistics.median(r["phases_ms"][k] for r in rows) for k in PHASES}


def phase_table(runs: dict[str, list[dict]]) -> str:
    """Each run's step and its phases, in ms."""
    lines = [f"  {'run':<28}{'step':>8}" + "".join(f"{k:>10}" for k in PHASES)]
    for name, rows in runs.items():
        phases_ms = phases(rows)
        lines.append(f"  {name:<28}{med(rows, 'step_s') * 1e3:>8.2f}"
                     + "".join(f"{phases_ms[k]:>10.2f}" for k in PHASES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", default="weak,overlap,torch")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--bucket-mb", default="4", help="overlap run: DDP bucket size (MiB)")
    parser.add_argument("--overlap-batch", type=int, default=32,
                        help="overlap run: samples per rank")
    parser.add_argument("--emulate", metavar="SPEC", default="inter=5Gbit/s,50us",
                        help="overlap run only: each rank is its own emulated node and messages "
                             "between them pay this link ('off': shared memory)")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    report: dict[str, dict] = {}

    if "weak" in only:
        widths, batch = "784,512,512,10", 64
        r = interleave(args.reps, {
            "p1": lambda: launch(1, widths, batch, args.steps, []),
            "p2": lambda: launch(2, widths, batch, args.steps, []),
            "side": lambda: launch(2, widths, batch, args.steps, ["--side-by-side"])})
        s1, s2 = med(r["p1"], "samples_per_s"), med(r["p2"], "samples_per_s")
        t1, t_side = med(r["p1"], "step_s"), med(r["side"], "step_s")
        t_allreduce = med(r["p2"], "allreduce_alone_s")
        limit = t1 / (t_side + t_allreduce)
        report["weak_scaling"] = {"model": f"mlp {widths}", "batch_per_rank": batch,
                                  "samples_per_s_p1": s1, "samples_per_s_p2": s2,
                                  "efficiency": s2 / (2 * s1), "limit": limit,
                                  "step_s_p1": t1, "step_s_p2": med(r["p2"], "step_s"),
                                  "step_s_side_by_side": t_side, "allreduce_alone_s": t_allreduce,
                                  "phases_ms": {k: phases(v) for k, v in r.items()}}
        print(f"weak scaling (mlp {widths}, {batch}/rank): p=1 {s1:.0f} samples/s, p=2 "
              f"{s2:.0f} samples/s, efficiency {s2 / (2 * s1):.2f}; limit on this machine "
              f"{limit:.2f} = step p=1 {t1 * 1e3:.2f} ms / (2 ranks side by side "
              f"{t_side * 1e3:.2f} ms + all-reduce alone {t_allreduce * 1e3:.2f} ms)", flush=True)
        print(phase_table({"p=1": r["p1"], "p=2": r["p2"],
                           "p=1 x2 side by side": r["side"]}), flush=True)

    if "overlap" in only:
        widths, batch = "1024,2048,2048,2048,10", args.overlap_batch
        emulate = None if args.emulate.strip().lower() in ("off", "none", "0") else args.emulate
        link = {"MPDL_EMULATE": emulate, "MPDL_RANKS_PER_NODE": "1"} if emulate else None
        buckets = ["--bucket-mb", args.bucket_mb]
        r = interleave(args.reps, {
            "on": lambda: launch(2, widths, batch, args.steps, buckets, link),
            "off": lambda: launch(2, widths, batch, args.steps, [*buckets, "--no-overlap"], link)})
        on, off = med(r["on"], "step_s"), med(r["off"], "step_s")
        comm_on, exposed_on = med(r["on"], "comm_s"), med(r["on"], "exposed_s")
        comm_off = med(r["off"], "comm_s")
        hidden = 1 - exposed_on / comm_on
        alone, least = med(r["on"], "allreduce_alone_s"), med(r["on"], "exposed_min_s")
        limit = 1 - least / alone
        saved = (off - on) / comm_off
        report["overlap"] = {"model": f"mlp {widths}", "batch_per_rank": batch, "p": 2,
                             "emulated_link": emulate, "bucket_mb": args.bucket_mb,
                             "step_s_overlap": on, "step_s_no_overlap": off,
                             "comm_s_overlap": comm_on, "exposed_s_overlap": exposed_on,
                             "comm_s_no_overlap": comm_off, "hidden_fraction": hidden,
                             "hidden_limit": limit, "allreduce_alone_s": alone,
                             "exposed_min_s": least, "step_time_saved_over_comm": saved,
                             "phases_ms": {k: phases(v) for k, v in r.items()}}
        where = emulate or "shared memory"
        print(f"overlap (mlp {widths}, {batch}/rank, p=2, link {where}, buckets "
              f"{args.bucket_mb} MiB): step {on * 1e3:.1f} ms with overlap vs "
              f"{off * 1e3:.1f} ms without; all-reduce {comm_on * 1e3:.1f} ms of which "
              f"{exposed_on * 1e3:.1f} ms exposed: hidden {hidden:.0%} (at most {limit:.0%}: the "
              f"buckets' all-reduces alone take {alone * 1e3:.1f} ms, {least * 1e3:.1f} ms of it "
              f"after backward even if each starts once full); step time saved = "
              f"{saved:.0%} of the no-overlap all-reduce time", flush=True)
        print(phase_table({"overlap": r["on"], "no overlap": r["off"]}), flush=True)

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
        p.add_argument("--side-by-side", action="store_true",
                       help="each rank trains alone (DDP over MPI.COMM_SELF), in step with the "
                            "others")
        p.add_argument("--torch", action="store_true")
        p.add_argument("--port", type=int, default=29500)
        worker(p.parse_args())
    else:
        main()

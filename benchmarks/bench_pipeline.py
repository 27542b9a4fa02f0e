"""Pipeline schedules side by side (bubble, step time, activations held), and a tensor-parallel
step against one rank, in one run.

    mpiexec -n 4 python benchmarks/bench_pipeline.py [--steps 8] [--json PATH]
    mpiexec -n 2 python benchmarks/bench_pipeline.py --draw   # each schedule's timeline, m = 4

Schedules: for pp = 2 and 4 (those that divide the world size; dp = world / pp) and m = 4, 8, 16
microbatches of 32 samples each, an MLP of equal Linear layers (so that the stages balance) trains
under every schedule the combination allows: afab, 1f1b, interleaved (2 chunks per rank), zb-h1,
zb-v and dualpipev (m ≥ 2·pp). For each: the idle share of a stage's step, mean over stages,
median over steps, three ways, beside the formula:

- slots: the schedule replayed on a clock where a forward, an input gradient and a weight
  gradient take one slot each and a whole backward two (`check`); what the schedule itself gives.
- CPU replay (one chunk per rank): the executed orders replayed with each op's measured thread
  CPU time (`timed_bubble`), as if every stage had a core of its own and messages took no time:
  the bubble of the measured stage times (uneven stages, a backward longer than a forward, the
  last stage's loss) without the machine's time-sharing.
- wall clock: 1 − the stage's wall time in its ops over the pipeline's span of them (the first
  start to the last end over its stages: the ranks of one machine share the monotonic clock),
  from the step's timeline spans. With more ranks than cores, a stage that waits gives its core
  to the others and a stage that computes may wait for a core: then 'idle' is not idle, and this
  column measures the machine's scheduling as much as the schedule (the header says how many
  cores this process may use).

Beside them: the step's time (the slowest rank's, median over steps) and the most chunk
activations and stage-output bytes a stage held at once (largest over the stages).

Memory: per-rank bytes of parameters and of model state (parameters, gradients, Adam's state)
after one step of a GPT of 8 blocks at pp = 1, 2, 4, tp = 2 and dp 2 × pp 2 with and without
ZeRO-1, on the in-process world (a stage keeps only its own parameters).

Tensor parallelism: a GPT step (forward, backward, update) with tp = the world size against the
same step of the whole model on rank 0 alone, in turns; the step's time is the slowest rank's,
median over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

from mpdl.autograd import nn, optim
from mpdl.comm import as_communicator
from mpdl.models.gpt import GPT
from mpdl.parallel.pipeline import PipelineStrategy, timed_bubble
from mpdl.parallel.pipeline.schedule import allowed, check, generate, schedule_bubble
from mpdl.parallel.strategy import Batch
from mpdl.threadworld import run_world

MICRO = 32  # samples per microbatch
MIB = 1 << 20


def deep_mlp(width: int = 512, layers: int = 8) -> nn.Module:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods += [nn.Linear(width, width, seed=i), nn.ReLU()]
    return nn.Sequential(*mods[:-1])


#: the schedules compared, with their chunks per rank
SCHEDULES = (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2),
             ("dualpipev", 2))
#: an op's kind from its timeline span's first word
KIND = {"forward": "F", "backward": "B", "input": "B", "weight": "W"}


def bubble(comm, pp: int, m: int, schedule: str, v: int, steps: int) -> dict[str, float]:
    """The median over steps of the mean over stages of the bubble measurements, the step's
    time and the peaks of activations held."""
    dp = comm.size // pp
    strategy = PipelineStrategy(comm, dp, pp, microbatches=m, schedule=schedule,
                                virtual_stages=v)
    model = deep_mlp()
    strategy.setup(model, lambda p: optim.SGD(p, lr=1e-3))
    rng = np.random.default_rng(0)
    n = MICRO * m
    x = rng.standard_normal((n, 512)).astype(np.float32)
    y = rng.integers(0, 512, n)
    wall, cpu, seconds = [], [], []
    for step in range(steps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        r = strategy.step(Batch(x, y, n * dp, 1e-3))
        took = time.perf_counter() - t0
        spans = [s for s in r.spans if s.name.split()[0] in ("recv", *KIND)]
        busy = sum(s.end - s.start for s in spans if not s.name.startswith("recv"))
        ends = strategy.grid.pp_comm.allgather_object((min(s.start for s in spans),
                                                       max(s.end for s in spans)))
        ops = {(KIND[s.name.split()[0]], s.args["microbatch"]): s.args["cpu_s"]
               for s in spans if "cpu_s" in s.args}
        if step:  # the first step finds the shapes
            # idle: the pipeline's span of its ops (first start to last end over its stages;
            # one monotonic clock on one machine) less this stage's compute
            wall.append(1 - busy / (max(e for _, e in ends) - min(b for b, _ in ends)))
            cpu.append(ops)
            seconds.append(max(comm.allgather_object(took)))
    # every stage's orders and op times, along the pipeline of dp rank 0
    pipeline = strategy.grid.pp_comm.allgather_object((strategy.last_order, cpu,
                                                       strategy.last_peak,
                                                       strategy.last_peak_bytes))
    replayed = []
    if v == 1:
        orders = [order for order, *_ in pipeline]
        for k in range(steps):
            span, idle_s = timed_bubble(orders, [times[k] for _, times, *_ in pipeline])
            replayed.append(float(np.mean(idle_s)) / span)
    slots = check(generate(schedule, pp, m, v))
    everyone = np.array(comm.allgather_object(wall))  # (ranks, steps)
    return {"slots": float(np.mean(slots.idle)) / slots.length,
            "cpu": float(np.median(replayed)) if replayed else float("nan"),
            "wall": float(np.median(everyone.mean(axis=0))),
            "step_s": float(np.median(seconds)),
            "peak_chunks": max(peak for *_, peak, _ in pipeline),
            "peak_bytes": max(b for *_, b in pipeline)}


def draw(comm, m: int, columns: int = 96) -> None:
    """Each schedule's second step on pp = the world size, drawn from its timeline spans: a
    letter per column of time, F forward, B backward (its input gradient where a W follows), W
    weight gradients, lower case on a rank's second chunk, . waiting."""
    pp = comm.size
    for schedule, v in SCHEDULES:
        if allowed(schedule, pp, m, v):
            continue
        strategy = PipelineStrategy(comm, 1, pp, microbatches=m, schedule=schedule,
                                    virtual_stages=v)
        strategy.setup(deep_mlp(), lambda p: optim.SGD(p, lr=1e-3))
        x = np.random.default_rng(0).standard_normal((MICRO * m, 512)).astype(np.float32)
        y = np.zeros(MICRO * m, dtype=np.int64)
        for _ in range(2):
            comm.barrier()
            r = strategy.step(Batch(x, y, MICRO * m, 1e-3))
        mine = [(KIND[s.name.split()[0]], s.args.get("stage", strategy.stage), s.start, s.end)
                for s in r.spans if s.name.split()[0] in KIND]
        spans = comm.allgather_object(mine)
        if comm.rank:
            continue
        t0 = min(a for rank in spans for *_, a, _ in rank)
        t1 = max(b for rank in spans for *_, b in rank)
        print(f"{schedule} (pp {pp}, m {m}{f', {v} chunks per rank' if v > 1 else ''}), "
              f"{(t1 - t0) * 1e3:.0f} ms")
        for rank, ops in enumerate(spans):
            line = ["."] * columns
            for kind, stage, a, b in ops:
                lo = int((a - t0) / (t1 - t0) * columns)
                hi = max(lo + 1, int((b - t0) / (t1 - t0) * columns))
                letter = kind if stage < pp else kind.lower()
                line[lo:hi] = letter * (min(hi, columns) - lo)
            print(f"  rank {rank} |{''.join(line)}|")


def memory() -> list[dict]:
    """Per-rank parameter and model-state bytes (parameters, gradients, Adam's state) after one
    step of a GPT of 8 blocks, on the in-process world (deterministic: no timing)."""
    x = np.random.default_rng(0).integers(0, 96, (8, 64))
    rows = []
    for dp, pp, tp, zero in [(1, 1, 1, 0), (1, 2, 1, 0), (1, 4, 1, 0), (1, 1, 2, 0), (1, 2, 2, 0),
                             (2, 2, 1, 0), (2, 2, 1, 1)]:
        def body(c, dp=dp, pp=pp, tp=tp, zero=zero):
            s = PipelineStrategy(c, dp, pp, tp, microbatches=2, zero=zero)
            s.setup(GPT(96, 64, 8, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
            lo, hi = np.linspace(0, 8, dp + 1).astype(int)[s.grid.d:s.grid.d + 2]
            s.step(Batch(x[lo:hi], np.roll(x, -1, axis=1)[lo:hi], 8, 1e-3))
            return s.rank_parameter_bytes, s.rank_state_bytes
        out = run_world(dp * pp * tp, body)
        rows.append({"dp": dp, "pp": pp, "tp": tp, "zero": zero,
                     "parameter_bytes": [o[0] for o in out],
                     "model_state_bytes": [o[1] for o in out]})
    return rows


def tensor_step(comm, steps: int) -> tuple[float, float]:
    x = np.random.default_rng(0).integers(0, 96, (16, 64))
    batch = Batch(x, np.roll(x, -1, axis=1), 16, 1e-3)
    tp = PipelineStrategy(comm, 1, 1, comm.size)
    tp.setup(GPT(96, 64, 4, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
    one = PipelineStrategy(comm.sub([0]), 1, 1, 1) if comm.rank == 0 else None
    if one is not None:
        one.setup(GPT(96, 64, 4, 4, 128, seed=0), lambda p: optim.Adam(p, lr=1e-3))
    times: dict[str, list[float]] = {"tp": [], "one": []}
    for step in range(steps + 1):
        comm.barrier()
        t0 = time.perf_counter()
        tp.step(batch)
        t = comm.allgather_object(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        if one is not None:
            one.step(batch)
        s = time.perf_counter() - t0
        if step:
            times["tp"].append(max(t))
            times["one"].append(s)
    return float(np.median(times["one"])), float(np.median(times["tp"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--draw", action="store_true",
                        help="draw each schedule's timeline at pp = the world size, m = 4")
    args = parser.parse_args()
    comm = as_communicator(MPI.COMM_WORLD)
    if args.draw:
        draw(comm, 4)
        return
    rows = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if comm.rank == 0:
        print(f"# pipeline schedules, {comm.size} ranks on {cores} cores, MLP 8 x Linear(512, "
              f"512), {MICRO} samples per microbatch; idle share of a stage's step, mean over "
              f"stages, median of {args.steps} steps")
        print("# slots: the schedule on a unit clock (F, B, W one slot each, a whole backward "
              "two); cpu: the executed orders replayed with each op's measured CPU time (a core "
              "per stage, free messages; one chunk per rank); wall: 1 - the stage's compute "
              "time over the pipeline's step"
              + (" (more ranks than cores: stages time-share the cores, so this counts "
                 "scheduling too)" if comm.size > cores else "")
              + "; step: the slowest rank's seconds; held: the most chunk activations and MiB "
                "of stage outputs a stage held")
        print(f"{'pp':>3} {'dp':>3} {'m':>3} {'schedule':>11} {'formula':>8} {'slots':>6} "
              f"{'cpu':>6} {'wall':>6} {'step ms':>8} {'held':>5} {'MiB':>6}")
    for pp in (2, 4):
        if comm.size % pp:
            continue
        for m in (4, 8, 16):
            for schedule, v in SCHEDULES:
                if allowed(schedule, pp, m, v):
                    continue
                f = bubble(comm, pp, m, schedule, v, args.steps)
                row = {"pp": pp, "dp": comm.size // pp, "m": m, "schedule": schedule, "v": v,
                       "formula": schedule_bubble(schedule, pp, m, v), "ranks": comm.size,
                       "cores": cores, **f}
                rows.append(row)
                if comm.rank == 0:
                    print(f"{pp:>3} {row['dp']:>3} {m:>3} {schedule:>11} "
                          f"{row['formula']:>8.1%} {f['slots']:>6.1%} {f['cpu']:>6.1%} "
                          f"{f['wall']:>6.1%} {f['step_s'] * 1e3:>8.1f} {f['peak_chunks']:>5} "
                          f"{f['peak_bytes'] / MIB:>6.2f}")
    if comm.rank == 0:
        mem = memory()
        base = max(mem[0]["model_state_bytes"])
        print("# memory per rank after one step, GPT 8 blocks, width 128, Adam (in-process "
              "world): parameters / model state (parameters, gradients, optimizer) in MiB, "
              "the most of any rank against one rank")
        for r in mem:
            print(f"dp {r['dp']} pp {r['pp']} tp {r['tp']} zero {r['zero']}: parameters "
                  f"{max(r['parameter_bytes']) / MIB:.3f} MiB, model state "
                  f"{max(r['model_state_bytes']) / MIB:.3f} MiB (per rank: "
                  f"{', '.join(f'{b / MIB:.2f}' for b in r['model_state_bytes'])}; "
                  f"{max(r['model_state_bytes']) / base:.2f} of one rank)")
        rows += mem
    if comm.size > 1 and 4 % comm.size == 0:
        one, tp = tensor_step(comm, args.steps)
        rows.append({"tp": comm.size, "one_rank_s": one, "tp_s": tp})
        if comm.rank == 0:
            print(f"# tensor parallel GPT (4 layers, 4 heads, width 128, 16 x 64 tokens): one "
                  f"rank {one * 1e3:.1f} ms, tp = {comm.size} {tp * 1e3:.1f} ms per step "
                  f"(speedup {one / tp:.2f})")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

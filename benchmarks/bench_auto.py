"""How good is `auto`, how good is the cost model, and does hierarchical win on a slow network?

Runs, for each world size P:
  1. `mpdl calibrate` (into OUT/costmodel.json, via MPDL_COST_MODEL); with --no-calibration, none:
     no calibration file and an empty first-use cache (OUT/auto-cache, via MPDL_AUTO_CACHE), so
     `auto` starts as it does on a fresh machine (bench's first step is its first-use calibration),
  2. `mpdl bench allreduce` from MIN to MAX bytes with every algorithm, auto and the mpi baseline,
and then, with MPDL_RANKS_PER_NODE=P/2 and an emulated inter-node link,
  3. `mpdl bench allreduce` of ring, hierarchical and auto at large sizes.
It prints: auto's time over the best algorithm's per size (and, where OUT holds an earlier run's
sweep of the same kind, that run's fastest algorithms judged in this one: the ceiling of any
choice made before the run); the model's prediction over the measurement for ring, tree and
recursive doubling at >= 64 KiB; hierarchical against ring under emulation, measured and
predicted.

    python benchmarks/bench_auto.py --ranks 2 4 --max-bytes 64M --out bench-out
    python benchmarks/bench_auto.py --ranks 2 4 --no-calibration --no-emulated --iters 20
    python benchmarks/bench_auto.py --ranks 2 --no-calibration --no-emulated --poison --loop 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def mpdl(n: int, args: list[str], env: dict[str, str], timeout: int) -> None:
    cmd = ["timeout", "-k", "10", str(timeout), str(BIN / "mpiexec"), "-n", str(n),
           str(BIN / "mpdl"), *args]
    print("$", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(cmd[4:]), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, **env}, stdout=subprocess.DEVNULL)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


#: algorithms that send the same messages on one node: hierarchical is the ring there, and on 2
#: ranks so are Rabenseifner's and the torus's (one exchange of half the array each way, then one
#: of the reduced halves); their spread within a run is the run's noise
TWINS = ("ring", "hierarchical")
TWINS_AT_2 = (*TWINS, "rabenseifner", "torus2d")


def fastest(data: list[dict]) -> dict[int, dict]:
    """Per size, the row of the fastest algorithm (auto and the mpi baseline aside)."""
    best: dict[int, dict] = {}
    for r in data:
        if r["algorithm"] not in ("auto", "mpi") and \
                r["time_us"] < best.get(r["bytes"], {"time_us": float("inf")})["time_us"]:
            best[r["bytes"]] = r
    return best


def auto_vs_best(data: list[dict]) -> list[str]:
    """Per size: the best algorithm, auto's choice, and choice/best (the chosen algorithm's own
    column over the best: the judged ratio); beside it auto's own run over the best, and on one
    node the noise of the run: the slowest of the algorithms that send the same messages (TWINS,
    TWINS_AT_2) over the fastest."""
    twins = ()
    # with --loop the calls run through plans, where ring runs a captured schedule and its twins
    # a Python call each: their spread is that difference, not the run's noise
    if data and data[0]["nodes"] == 1 and data[0].get("loop", 1) == 1:
        twins = TWINS_AT_2 if data[0]["ranks"] == 2 else TWINS
    lines = [f"{'bytes':>10} {'best':>20} {'best us':>10} {'auto→':>20} {'auto us':>10} "
             f"{'auto/best':>9} {'own/best':>9} {'mpi us':>10}"
             + (f" {'noise':>6}" if twins else "")]
    worst = 0.0
    within = 0
    ratios = []
    for size, best in sorted(fastest(data).items()):
        mine = {r["algorithm"]: r for r in data if r["bytes"] == size}
        auto = mine["auto"]
        # auto ran its chosen algorithm: judge the choice by that algorithm's own column, timed as
        # often as the best's (auto's own run is one more noisy sample of the same algorithm)
        ratio = mine[auto["chosen"]]["time_us"] / best["time_us"]
        worst = max(worst, ratio)
        within += ratio <= 1.10
        ratios.append(ratio)
        line = (f"{size:>10} {best['algorithm']:>20} {best['time_us']:>10.1f} "
                f"{auto['chosen']:>20} {auto['time_us']:>10.1f} {ratio:>9.2f} "
                f"{auto['time_us'] / best['time_us']:>9.2f} {mine['mpi']['time_us']:>10.1f}")
        if twins:
            same = [mine[n]["time_us"] for n in twins if n in mine]
            line += f" {max(same) / min(same):>6.2f}"
        lines.append(line)
    lines.append(f"auto within 10% of the best at {within}/{len(lines) - 1} sizes; worst ratio "
                 f"{worst:.2f}; mean ratio {sum(ratios) / max(len(ratios), 1):.3f}")
    return lines


def previous_best(previous: list[dict], data: list[dict]) -> list[str]:
    """The ceiling of any choice made before this run: per size, the algorithm an earlier run of
    the same sweep timed fastest, judged by this run's own columns as auto's choice is. Where the
    machine ranks the algorithms otherwise from one run to the next, no choice carried into the
    run (a calibration, a cached verdict) can do better than this."""
    before = {size: r["algorithm"] for size, r in fastest(previous).items()}
    now = fastest(data)
    times = {(r["bytes"], r["algorithm"]): r["time_us"] for r in data}
    sizes = sorted(s for s in now if s in before and (s, before[s]) in times)
    ratios = [times[s, before[s]] / now[s]["time_us"] for s in sizes]
    moved = [f"{s} B {before[s]} {r:.2f}" for s, r in zip(sizes, ratios, strict=True)
             if r > 1.10]
    return [f"the previous run's fastest algorithm within 10% of this run's best at "
            f"{sum(r <= 1.10 for r in ratios)}/{len(sizes)} sizes; worst ratio "
            f"{max(ratios, default=1.0):.2f}" + (f" ({', '.join(moved)})" if moved else "")]


def prediction_vs_measured(data: list[dict], names=("ring", "tree", "recursive_doubling"),
                           min_bytes: int = 64 << 10) -> list[str]:
    lines = [f"{'bytes':>10} " + " ".join(f"{n + ' pred/meas':>30}" for n in names)]
    inside = total = 0
    for size in sorted({r["bytes"] for r in data if r["bytes"] >= min_bytes}):
        mine = {r["algorithm"]: r for r in data if r["bytes"] == size}
        cells = []
        for n in names:
            r = mine[n]
            ratio = r["predicted_us"] / r["time_us"]
            total += 1
            inside += 0.5 <= ratio <= 2.0
            cells.append(f"{r['predicted_us']:>10.0f}/{r['time_us']:>10.0f} = {ratio:5.2f}")
        lines.append(f"{size:>10} " + " ".join(f"{c:>30}" for c in cells))
    lines.append(f"within 2x: {inside}/{total}")
    return lines


def emulated_table(data: list[dict]) -> list[str]:
    lines = [f"{'bytes':>10} {'ring us':>10} {'(pred)':>10} {'hier us':>10} {'(pred)':>10} "
             f"{'ring/hier':>9} {'auto→':>14}"]
    for size in sorted({r["bytes"] for r in data}):
        mine = {r["algorithm"]: r for r in data if r["bytes"] == size}
        ring, hier = mine["ring"], mine["hierarchical"]
        lines.append(f"{size:>10} {ring['time_us']:>10.0f} {ring['predicted_us']:>10.0f} "
                     f"{hier['time_us']:>10.0f} {hier['predicted_us']:>10.0f} "
                     f"{ring['time_us'] / hier['time_us']:>9.2f} {mine['auto']['chosen']:>14}")
    return lines


def poisoned_calibration(p: int, env: dict[str, str], cache: Path) -> str:
    """Make auto's first-use calibration of p ranks while a spinning process (at this process's
    priority) keeps a core busy; what the cache then says of it."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        mpdl(p, ["bench", "allreduce", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "--algorithms",
                 "auto"], env, 300)
    finally:
        spinner.kill()
        spinner.wait()
    for f in cache.glob("auto-*.json"):
        data = json.loads(f.read_text())
        if data["key"]["world_size"] == p:
            return data["params"]["provisional"] or "not flagged: kept as a quiet calibration"
    return "no first-use calibration"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--emulate", default="inter=10Gbit/s,20us")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    parser.add_argument("--skip-calibrate", action="store_true",
                        help="reuse OUT/costmodel.json from an earlier run")
    parser.add_argument("--no-calibration", action="store_true",
                        help="no calibration file: auto calibrates on first use, into an empty "
                             "OUT/auto-cache")
    parser.add_argument("--no-emulated", action="store_true",
                        help="skip the emulated-network sweep")
    parser.add_argument("--loop", type=int, default=1, metavar="CALLS",
                        help="time CALLS calls back to back per iteration (`mpdl bench --loop`; "
                             "default 1: a barrier before every call)")
    parser.add_argument("--poison", action="store_true",
                        help="with --no-calibration: take each first-use calibration while another "
                             "process keeps a core busy, then time the sweep on the cache it left")
    parser.add_argument("--keep-cache", action="store_true",
                        help="with --no-calibration: start from OUT/auto-cache as an earlier run "
                             "left it (as a user's next run does) instead of emptying it")
    args = parser.parse_args()
    if not (BIN / "mpdl").exists() or not (BIN / "mpiexec").exists():
        print(f"bench_auto.py: no mpdl and mpiexec beside {sys.executable}: run it with the venv's "
              f"python (source .venv/bin/activate after make install)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"MPDL_COST_MODEL": str(args.out / "costmodel.json")}
    cache = args.out / "auto-cache"
    if args.no_calibration:
        env = {"MPDL_COST_MODEL": str(args.out / "no-costmodel.json"),
               "MPDL_AUTO_CACHE": str(cache)}
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    report: list[str] = []
    for p in args.ranks:
        if not args.skip_calibrate and not args.no_calibration:
            mpdl(p, ["calibrate"], env, 300)
        if args.poison and args.no_calibration:
            report += [f"\n## p={p}: first-use calibration with a core kept busy: "
                       f"{poisoned_calibration(p, env, cache)}"]
        sweep = args.out / f"allreduce_p{p}.json"
        previous = rows(sweep) if sweep.exists() else []
        if previous and (previous[0].get("loop", 1), previous[0]["ranks"]) != (args.loop, p):
            previous = []  # another kind of sweep: nothing to compare
        mpdl(p, ["bench", "allreduce", "-b", args.min_bytes, "-e", args.max_bytes, "-n",
                 str(args.iters), "-w", "2", "--loop", str(args.loop), "--json", str(sweep),
                 "--plot", str(args.out / f"allreduce_p{p}.png")], env, 3000)
        data = rows(sweep)
        model = "calibrated by mpdl calibrate"
        if args.no_calibration:
            made = [json.loads(f.read_text())["params"]["source"] for f in cache.glob("auto-*.json")
                    if json.loads(f.read_text())["key"]["world_size"] == p]
            model = f"no calibration file; {'; '.join(made) or 'no first-use calibration'}"
        report += [f"\n## p={p}: auto against the best algorithm ({model})", *auto_vs_best(data),
                   *(previous_best(previous, data) if previous else []),
                   f"\n## p={p}: cost model against measurement (>= 64 KiB)",
                   *prediction_vs_measured(data)]
        if p >= 4 and p % 2 == 0 and not args.no_emulated:
            emulated = args.out / f"allreduce_p{p}_emulated.json"
            mpdl(p, ["bench", "allreduce", "-b", "64K", "-e", args.max_bytes, "-f", "4", "-n",
                     str(max(3, args.iters // 2)), "-w", "1", "--algorithms",
                     "ring,hierarchical,auto", "--emulate", args.emulate, "--json", str(emulated)],
                 {**env, "MPDL_RANKS_PER_NODE": str(p // 2)}, 3000)
            report += [f"\n## p={p}, 2 emulated nodes ({args.emulate}): hierarchical against ring",
                       *emulated_table(rows(emulated))]
    text = "\n".join(report)
    print(text)
    (args.out / "report.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

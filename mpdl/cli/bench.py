"""`mpdl bench`: time collective algorithms side by side, in the style of nccl-tests.

The timing loop is `mpdl.perf.bench` (how the algorithms take turns, what a row holds, busbw);
this verb checks the flags and prints the table, the CSV, the JSON lines and the plot.
Beside each measurement is the cost model's prediction (`mpdl calibrate` sets its parameters).
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import Any

from tqdm import tqdm

from mpdl import backend, emulation, settings
from mpdl.cli import UsageError, check_choice
from mpdl.cli.output import is_rank0, write_json_lines
from mpdl.collectives import COLLECTIVES, REGISTRY
from mpdl.collectives.ops import OPS
from mpdl.comm import as_communicator
from mpdl.fileio import atomic_open
from mpdl.mpi_runtime import load_mpi
from mpdl.perf import bench, mpi_variants
from mpdl.perf.units import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("collective", nargs="?", default="allreduce",
                        help=f"the collective to measure: {', '.join(COLLECTIVES)} "
                             f"(default allreduce)")
    parser.add_argument("-b", "--min-bytes", default="8", metavar="SIZE",
                        help="smallest message (default 8; accepts 8, 1K, 64M)")
    parser.add_argument("-e", "--max-bytes", default="1M", metavar="SIZE",
                        help="largest message (default 1M)")
    parser.add_argument("-f", "--factor", type=float, default=2.0,
                        help="multiply the size by this between steps (default 2)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=3,
                        help="untimed iterations first (default 3)")
    parser.add_argument("--loop", type=int, default=1, metavar="CALLS",
                        help="time CALLS calls back to back per iteration, with no barrier "
                             "between them (OSU-style latency; out= preallocated); time is per "
                             "call (default 1: a barrier before every call)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default), or another dtype the collectives carry: "
                             "float16, float64, bfloat16, float8_e4m3fn, float8_e5m2, int8 … "
                             "uint64, bool")
    parser.add_argument("--op", default="sum", help="sum (default), prod, max, min or avg")
    parser.add_argument("--inplace", action="store_true",
                        help="allreduce or alltoall into the input array (out=x)")
    parser.add_argument("--device", default="cpu",
                        help="where the arrays live (default cpu)")
    parser.add_argument("--algorithms", default="all", metavar="LIST",
                        help="comma list of algorithms, or all (default: all, auto and the mpi "
                             "baseline)")
    parser.add_argument("--root", type=int, default=0, help="root of broadcast and reduce")
    parser.add_argument("--check", action="store_true",
                        help="compare every result with the mpi baseline; mismatches go in #wrong")
    parser.add_argument("--mpi-variants", action="store_true",
                        help="also time the MPI library's own algorithms by name (MPICH's "
                             "MPIR_CVAR_<COLL>_INTRA_ALGORITHM, Open MPI's coll_tuned_<coll>_"
                             "algorithm), as rows mpi:NAME beside mpdl's algorithm of that name")
    parser.add_argument("--list", action="store_true",
                        help="list the algorithms with their cost formulas and exit")
    parser.add_argument("--emulate", metavar="SPEC",
                        help="emulate slower links, e.g. inter=10Gbit/s,20us, or off "
                             "(default: MPDL_EMULATE)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per (size, algorithm)")
    parser.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of busbw against size")


# -- validation: every rank reaches the same verdict from the same argv, before any message -------
def validate(args: argparse.Namespace) -> bench.Config:
    """The checked configuration; UsageError with a one-line message otherwise."""
    check_choice("collective", args.collective, COLLECTIVES)
    if args.device not in ("cpu", "gpu"):
        raise UsageError(f"--device: expected cpu or gpu, got {args.device!r}")
    try:
        min_bytes, max_bytes = parse_size(args.min_bytes), parse_size(args.max_bytes)
    except ValueError as exc:
        raise UsageError(f"--min-bytes/--max-bytes: {exc}") from None
    if max_bytes < min_bytes:
        raise UsageError(f"--max-bytes ({max_bytes}) must be at least --min-bytes ({min_bytes})")
    if not args.factor > 1:
        raise UsageError(f"--factor: expected a number above 1, got {args.factor:g}")
    if args.loop < 1:
        raise UsageError(f"--loop: expected at least 1 call, got {args.loop}")
    if args.loop > 1 and args.inplace and args.collective == "allreduce":
        raise UsageError("--loop with --inplace: each call would reduce the previous result; "
                         "drop one of them")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and "
                         f"{args.warmup}")
    dtypes = {d.name: d for d in backend.SUPPORTED_DTYPES}
    check_choice("--dtype", args.dtype, dtypes)
    dtype = dtypes[args.dtype]
    reducing = args.collective in ("allreduce", "reduce_scatter", "reduce")
    check_choice("--op", args.op, OPS)
    if reducing and args.op == "prod" and dtype.kind == "b":
        raise UsageError("--op prod is not defined for bool; use min (logical and)")
    if args.op == "avg" and not backend.is_floating(dtype):
        raise UsageError(f"--op avg needs a floating-point --dtype, got {args.dtype}")
    if args.inplace and args.collective not in ("allreduce", "alltoall"):
        raise UsageError("--inplace applies to allreduce and alltoall only")
    chosen = None
    if args.algorithms.strip() != "all":
        chosen = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    try:
        names = bench.algorithm_names(args.collective, chosen)
    except ValueError as exc:
        raise UsageError(f"--algorithms: {exc}") from None
    try:
        environment = settings.current()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        emulated = emulation.resolve(args.emulate) if args.emulate is not None \
            else environment.emulation
    except ValueError as exc:
        raise UsageError(f"--emulate: {exc}") from None
    return bench.Config(collective=args.collective, algorithms=tuple(names), dtype=dtype,
                        sizes=tuple(bench.sizes(min_bytes, max_bytes, args.factor)),
                        op=args.op if reducing else None, iters=args.iters, warmup=args.warmup,
                        root=args.root, inplace=args.inplace, check=args.check,
                        device=args.device, emulation=emulated, loop=args.loop,
                        mpi_variants=args.mpi_variants)


def list_algorithms(collective: str) -> None:
    table = REGISTRY[collective]
    width = max(len(n) for n in [*table, "auto"])
    print(f"# {collective}: algorithm, what it is, cost (α latency, β s/byte, γ reduction s/byte, "
          f"n bytes, p ranks, g ranks per node)")
    if collective == "alltoall":
        print("# n: the bytes each rank sends in all (n/p to each rank); α', β' between nodes, "
              "c a local copy per byte")
    for name, algo in table.items():
        print(f"{name:<{width}}  {algo.summary}; cost {algo.cost}")
    print(f"{'auto':<{width}}  the algorithm the cost model predicts fastest for the size, ranks "
          f"and nodes (mpdl calibrate)")


def run(args: argparse.Namespace) -> int:
    config = validate(args)
    if args.list:
        if is_rank0():
            list_algorithms(args.collective)
        return 0
    load_mpi()
    comm = as_communicator(None)
    bar = table = None
    if comm.rank == 0:
        bar = tqdm(total=len(config.sizes), file=sys.stderr, unit="size", desc="mpdl bench",
                   leave=False, disable=None)
        table = Table(args, config.emulation.describe() if config.emulation else "")

        def progress(measured: bench.Result) -> None:
            table.add(measured)
            bar.update(1)
    try:
        result = bench.run(config, comm, progress=None if table is None else progress)
    except bench.Unusable as exc:
        raise UsageError(f"--{exc}") from None
    except mpi_variants.Unavailable as exc:
        raise UsageError(f"--mpi-variants: {exc}") from None
    finally:
        if bar is not None:
            bar.close()
    if comm.rank != 0:
        return 0
    if not config.sizes:
        table.add(result)  # the header alone
    print_summary(result.rows, table.emulated, table.width)
    if args.json:
        write_json_lines(args.json, result.rows)
    if args.csv:
        write_csv(args.csv, result.rows)
    if args.plot:
        plot(args.plot, result.rows, args.collective, result.ranks, table.emulated)
    return 0


# -- output ------------------------------------------------------------------------------------
class Table:
    """The table on stdout, each size's rows printed (and flushed) as soon as they are measured,
    so that a pipe or a file shows them during a long run; the header before the first."""

    def __init__(self, args: argparse.Namespace, emulated: str) -> None:
        self.args, self.emulated = args, emulated
        self.width = 0  # set by the header

    def add(self, measured: bench.Result) -> None:
        """Print measured's rows, after the header the first time."""
        if not self.width:
            self.width = max(len("algorithm"), *map(len, measured.labels),
                             *(len(_label(r)) for r in measured.rows))
            self._header(measured)
        for r in measured.rows:
            wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
            tqdm.write(f"{r['bytes']:>12} {r['count']:>10} {r['dtype']:>8} {r['op']:>5} "
                       f"{_label(r):<{self.width}} {r['time_us']:>10.1f} "
                       f"{r['time_us_min']:>10.1f} {r['time_us_max']:>10.1f} "
                       f"{r['algbw_gbs']:>7.3f} {r['busbw_gbs']:>7.3f} {wrong:>6} "
                       f"{r['predicted_us']:>10.1f}", file=sys.stdout)
        sys.stdout.flush()

    def _header(self, measured: bench.Result) -> None:
        args = self.args
        if measured.note is not None:
            print(f"# cost model unavailable ({measured.note}); predictions use the defaults",
                  file=sys.stderr)
        rounds = len(bench.turns(args.iters))
        each = (f"each {args.loop} calls back to back (time per call)" if args.loop > 1
                else "each one call after a barrier")
        print(f"# mpdl bench {args.collective}: {measured.ranks} ranks, {measured.nodes} node(s), "
              f"{args.iters} iterations ({args.warmup} warm-up) {each}, algorithms taking turns "
              f"in {rounds} rounds; time = slowest rank, median (min-max)")
        print(f"# predictions: {measured.params.source}")
        if measured.model:
            print(f"# auto's cost model: {measured.model}")
        if self.emulated:
            print(f"# EMULATED links: {self.emulated} (nodes from MPDL_RANKS_PER_NODE); the mpi "
                  f"baseline bypasses mpdl's sends and is not slowed")
        print(f"{'size(B)':>12} {'count':>10} {'type':>8} {'op':>5} {'algorithm':<{self.width}} "
              f"{'time(us)':>10} {'min(us)':>10} {'max(us)':>10} {'algbw':>7} {'busbw':>7} "
              f"{'#wrong':>6} {'pred(us)':>10}")


def print_summary(rows, emulated: str, width: int) -> None:
    print()
    print("# summary per size: fastest of mpdl's algorithms, its time / mpi's, and auto's time / "
          "the fastest's" + (" [EMULATED]" if emulated else ""))
    for size in sorted({r["bytes"] for r in rows}):
        mine = [r for r in rows if r["bytes"] == size]
        ours = [r for r in mine if r["algorithm"] not in ("mpi", "auto")
                and not r["algorithm"].startswith("mpi:")]
        mpi = next((r for r in mine if r["algorithm"] == "mpi"), None)
        auto = next((r for r in mine if r["algorithm"] == "auto"), None)
        if not ours:
            continue
        best = min(ours, key=lambda r: r["time_us"])
        line = f"{size:>12}  best {best['algorithm']:<{width}} {best['time_us']:>10.1f} us"
        if mpi is not None and mpi["time_us"] > 0:
            line += f"  {best['time_us'] / mpi['time_us']:6.2f}x mpi"
        if auto is not None and best["time_us"] > 0:
            line += f"  auto→{auto['chosen']} {auto['time_us'] / best['time_us']:5.2f}x best"
        print(line)
        pairs = [(r, next((v for v in mine if v["algorithm"] == f"mpi:{r['algorithm']}"), None))
                 for r in ours]
        same = [f"{r['algorithm']} {r['time_us'] / v['time_us']:.2f}x" for r, v in pairs
                if v is not None and v["time_us"] > 0]
        if same:
            print(f"{'':>12}  mpdl / the library's same algorithm (mpi:NAME): {', '.join(same)}")


def _label(row) -> str:
    return f"auto→{row['chosen']}" if row["algorithm"] == "auto" else row["algorithm"]


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    with atomic_open(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=bench.FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot(path: str, rows: list[dict[str, Any]], collective: str, p: int, emulated: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == name]
        ax.plot([r["bytes"] for r in mine], [r["busbw_gbs"] for r in mine], marker="o",
                markersize=3, label=name, linestyle="--" if name == "mpi" else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    title = f"mpdl bench {collective}, {p} ranks"
    ax.set_title(title + (f" (EMULATED {emulated})" if emulated else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


"""`mpdl bench`: time collective algorithms side by side, in the style of nccl-tests.

Per message size, the algorithms take turns in rounds (A A A B B B C C C, A A A B B B ...), so a
noisy machine that drifts treats them alike, while each call follows a call of the same algorithm,
as in nccl-tests' loops: a call that follows another algorithm's (whose buffers and messages left
the caches and the scheduler in another state) ran 1.11-1.37x slower at p=3 and 4 on 2 cores. Each
turn starts with one untimed call. One iteration is: MPI barrier, start the clock, call, stop the
clock.
A collective's time is the slowest rank's (one MAX all-reduce of all the timings after the loop),
and the table reports the median over iterations with min and max. Bandwidths follow nccl-tests:
algbw = bytes / time, busbw = algbw × 2(p-1)/p (allreduce), × (p-1)/p (reduce_scatter, allgather),
× 1 (broadcast, reduce); bytes is the whole array (the result, for allgather).
Beside each measurement is the cost model's prediction (`mpdl calibrate` sets its parameters).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time
from typing import Any

import numpy as np

from mpdl.cli import UsageError

COLLECTIVE_NAMES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")
FIELDS = ["collective", "algorithm", "chosen", "ranks", "nodes", "bytes", "count", "dtype", "op",
          "time_us", "time_us_min", "time_us_max", "algbw_gbs", "busbw_gbs", "wrong",
          "predicted_us", "emulated"]
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_TOLERANCE = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}


def parse_size(text: str) -> int:
    """'8', '1K', '64M', '1G' (also 1KB, 1KiB; binary multiples) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise ValueError(f"expected a byte count such as 8, 1K, 64M or 1G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def bus_factor(collective: str, p: int) -> float:
    """nccl-tests' busbw / algbw ratio."""
    if collective == "allreduce":
        return 2 * (p - 1) / p
    if collective in ("reduce_scatter", "allgather"):
        return (p - 1) / p
    return 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("collective", nargs="?", default="allreduce",
                        help=f"the collective to measure: {', '.join(COLLECTIVE_NAMES)} "
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
    parser.add_argument("--dtype", default="float32",
                        help="float16, float32 (default), float64, int32 or int64")
    parser.add_argument("--op", default="sum", help="sum (default), prod, max, min or avg")
    parser.add_argument("--inplace", action="store_true",
                        help="allreduce into the input array (out=x)")
    parser.add_argument("--device", default="cpu",
                        help="where the arrays live (default cpu)")
    parser.add_argument("--algorithms", default="all", metavar="LIST",
                        help="comma list of algorithms, or all (default: all, auto and the mpi "
                             "baseline)")
    parser.add_argument("--root", type=int, default=0, help="root of broadcast and reduce")
    parser.add_argument("--check", action="store_true",
                        help="compare every result with the mpi baseline; mismatches go in #wrong")
    parser.add_argument("--list", action="store_true",
                        help="list the algorithms with their cost formulas and exit")
    parser.add_argument("--emulate", metavar="SPEC",
                        help="emulate slower links, e.g. inter=10Gbit/s,20us, or off "
                             "(default: MPDL_EMULATE)")
    parser.add_argument("--json", metavar="PATH", help="write one JSON line per (size, algorithm)")
    parser.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of busbw against size")


# -- validation: every rank reaches the same verdict from the same argv, before any message -------
def validate(args: argparse.Namespace) -> dict[str, Any]:
    """The checked configuration; UsageError with a one-line message otherwise."""
    from mpdl import emulation  # noqa: PLC0415
    from mpdl.backend import SUPPORTED_DTYPES  # noqa: PLC0415
    from mpdl.collectives import registry  # noqa: PLC0415
    from mpdl.collectives.ops import OPS  # noqa: PLC0415

    if args.collective not in COLLECTIVE_NAMES:
        raise UsageError(f"collective: expected one of {', '.join(COLLECTIVE_NAMES)}, "
                         f"got {args.collective!r}")
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
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and "
                         f"{args.warmup}")
    dtypes = {d.name: d for d in SUPPORTED_DTYPES}
    if args.dtype not in dtypes:
        raise UsageError(f"--dtype: expected one of {', '.join(dtypes)}, got {args.dtype!r}")
    dtype = dtypes[args.dtype]
    reducing = args.collective in ("allreduce", "reduce_scatter", "reduce")
    if args.op not in OPS:
        raise UsageError(f"--op: expected one of {', '.join(OPS)}, got {args.op!r}")
    if args.op == "avg" and dtype.kind != "f":
        raise UsageError(f"--op avg needs a floating-point --dtype, got {args.dtype}")
    if args.inplace and args.collective != "allreduce":
        raise UsageError("--inplace applies to allreduce only")
    known = list(registry.REGISTRY[args.collective])
    if args.algorithms.strip() == "all":
        names = [*known, "auto"]
    else:
        names = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        unknown = [a for a in names if a not in (*known, "auto")]
        if unknown or not names:
            raise UsageError(f"--algorithms: unknown {', '.join(map(repr, unknown)) or 'empty list'}"
                             f" for {args.collective}; expected all or a comma list of "
                             f"{', '.join([*known, 'auto'])}")
        names = list(dict.fromkeys(names))
        if "mpi" not in names:
            names.append("mpi")  # the baseline every ratio refers to
    emulated = None
    if args.emulate is not None and args.emulate.strip().lower() in ("off", "none", "0"):
        emulated = None
    elif args.emulate is not None:
        try:
            emulated = emulation.parse(args.emulate)
        except ValueError as exc:
            raise UsageError(f"--emulate: {exc}") from None
    else:
        try:
            emulated = emulation.from_environment()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size = max(size + 1, int(round(size * args.factor)))
    return {"names": names, "dtype": dtype, "sizes": sizes, "emulation": emulated,
            "op": args.op if reducing else None}


def list_algorithms(collective: str) -> None:
    from mpdl.collectives import registry  # noqa: PLC0415

    table = registry.REGISTRY[collective]
    width = max(len(n) for n in [*table, "auto"])
    print(f"# {collective}: algorithm, what it is, cost (α latency, β s/byte, γ reduction s/byte, "
          f"n bytes, p ranks, g ranks per node)")
    for name, algo in table.items():
        print(f"{name:<{width}}  {algo.summary}; cost {algo.cost}")
    print(f"{'auto':<{width}}  the algorithm the cost model predicts fastest for the size, ranks "
          f"and nodes (mpdl calibrate)")


# -- the measurement ---------------------------------------------------------------------------
class Case:
    """One (size, algorithm): how to call it, and what it produced on this rank."""

    def __init__(self, collective: str, algorithm: str, x: Any, op: str | None, root: int,
                 inplace: bool, comm: Any):
        from mpdl import collectives as C  # noqa: PLC0415

        self.algorithm = algorithm
        self.result = None
        #: restores the input before an iteration (in-place runs overwrite it); outside the clock
        self.reset = None
        if collective == "allreduce":
            if inplace:
                original = x.copy()
                self.reset = lambda: x.__setitem__(Ellipsis, original)
                self.call = lambda: C.allreduce(x, op=op, algorithm=algorithm, comm=comm, out=x)
            else:
                self.call = lambda: C.allreduce(x, op=op, algorithm=algorithm, comm=comm)
        elif collective == "reduce_scatter":
            self.call = lambda: C.reduce_scatter(x, op=op, algorithm=algorithm, comm=comm)
        elif collective == "allgather":
            self.call = lambda: C.allgather(x, algorithm=algorithm, comm=comm)
        elif collective == "broadcast":
            self.call = lambda: C.broadcast(x, root=root, algorithm=algorithm, comm=comm)
        else:
            self.call = lambda: C.reduce(x, root=root, op=op, algorithm=algorithm, comm=comm)


def _input(collective: str, nbytes: int, dtype: np.dtype, p: int, rank: int, xp: Any) -> tuple:
    """(this rank's input array, the size in bytes the row reports, its element count)."""
    count = nbytes // dtype.itemsize
    if collective == "allgather":
        count -= count % p  # every rank contributes count/p elements
        local = count // p
    else:
        local = count
    values = ((np.arange(local, dtype=np.int64) + rank) % 3 + 1).astype(dtype)
    return xp.asarray(values) if xp is not np else values, count * dtype.itemsize, count


def _wrong(result: Any, reference: Any, dtype: np.dtype) -> int:
    """How many elements differ from the baseline (with a tolerance for float sums)."""
    from mpdl.backend import to_host  # noqa: PLC0415

    if result is None and reference is None:
        return 0
    if result is None or reference is None:
        return max(getattr(result, "size", 0), getattr(reference, "size", 0), 1)
    a, b = to_host(result).reshape(-1), to_host(reference).reshape(-1)
    if a.shape != b.shape:
        return max(a.size, b.size)
    if dtype.kind == "f":
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        tol = _TOLERANCE[dtype.name]
        close = np.isclose(a64, b64, rtol=tol, atol=tol, equal_nan=True) | (a64 == b64)
        return int(np.count_nonzero(~close))
    return int(np.count_nonzero(a != b))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, file=sys.stderr, unit="size", desc="mpdl bench", leave=False,
                disable=None)


def run(args: argparse.Namespace) -> int:
    if args.list:
        validate(args)
        from mpdl.cli.output import is_rank0  # noqa: PLC0415

        if is_rank0():
            list_algorithms(args.collective)
        return 0
    config = validate(args)
    from mpdl import emulation  # noqa: PLC0415
    from mpdl.collectives import costmodel  # noqa: PLC0415
    from mpdl.comm import as_communicator  # noqa: PLC0415
    from mpdl.mpi_runtime import load_mpi  # noqa: PLC0415

    MPI = load_mpi()
    comm = as_communicator(None)
    previous_hook, previous_env = comm.link_delay, os.environ.get(emulation.ENV)
    # For this run, the links (and auto's model, which reads MPDL_EMULATE) are the ones asked for.
    if config["emulation"] is None:
        os.environ.pop(emulation.ENV, None)
    else:
        os.environ[emulation.ENV] = config["emulation"].describe()
    costmodel.forget()
    try:
        emulation.install(comm, config["emulation"])
        return _measure_all(args, config, comm, MPI)
    finally:
        comm.link_delay = previous_hook
        if previous_env is None:
            os.environ.pop(emulation.ENV, None)
        else:
            os.environ[emulation.ENV] = previous_env
        costmodel.forget()


def _measure_all(args: argparse.Namespace, config: dict[str, Any], comm: Any, MPI: Any) -> int:
    from mpdl import backend  # noqa: PLC0415
    from mpdl.collectives import costmodel  # noqa: PLC0415
    from mpdl.comm import Communicator  # noqa: PLC0415

    p, rank = comm.size, comm.rank
    if not 0 <= args.root < p:
        raise UsageError(f"--root: expected a rank in [0, {p}), got {args.root}")
    xp = np
    if args.device == "gpu":
        cupy = backend.cupy_module()
        if not all(comm.allgather_object(cupy is not None)):
            raise UsageError("--device gpu: CuPy with a visible GPU is needed on every rank")
        xp = cupy
    nodes = len(comm.node_groups())
    shared = type(comm).shared_segments is not Communicator.shared_segments
    try:
        params = costmodel.load_params(p).emulated(config["emulation"])
    except costmodel.ModelUnavailable as exc:
        if rank == 0:
            print(f"# cost model unavailable ({exc}); predictions use the defaults", file=sys.stderr)
        params = costmodel.Params().emulated(config["emulation"])

    names, dtype, op = config["names"], config["dtype"], config["op"]
    rows: list[dict[str, Any]] = []
    bar = _progress(len(config["sizes"]), rank == 0)
    chosen_everywhere: list[tuple[int, str]] = []
    for size in config["sizes"]:
        rows.extend(measure_size(args, comm, MPI, size, names, dtype, op, xp, params, nodes,
                                 shared, chosen_everywhere))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    # auto must pick the same algorithm on every rank: check it, loudly.
    everyone = comm.allgather_object(chosen_everywhere)
    if any(c != everyone[0] for c in everyone):
        raise RuntimeError(f"auto chose differently on different ranks: {everyone}")

    if rank == 0:
        emulated = config["emulation"].describe() if config["emulation"] else ""
        for row in rows:
            row["emulated"] = emulated
        print_table(rows, args, p, nodes, emulated, params)
        if args.json:
            from mpdl.cli.output import write_json_lines  # noqa: PLC0415

            write_json_lines(args.json, rows)
        if args.csv:
            write_csv(args.csv, rows)
        if args.plot:
            plot(args.plot, rows, args.collective, p, emulated)
    return 0


#: rounds the timed iterations of one size are split into (see the module docstring)
ROUNDS = 4


def turns(iters: int) -> list[range]:
    """The iterations each algorithm times back to back in each of ROUNDS rounds (fewer rounds
    when there are fewer iterations), as even as they come."""
    rounds = max(1, min(ROUNDS, iters))
    edges = [iters * k // rounds for k in range(rounds + 1)]
    return [range(edges[k], edges[k + 1]) for k in range(rounds)]


def measure_size(args, comm, MPI, size, names, dtype, op, xp, params, nodes, shared,
                 chosen_everywhere) -> list[dict[str, Any]]:
    """Time every algorithm at one size, in turns; the rows (complete on rank 0)."""
    from mpdl.collectives import costmodel, registry  # noqa: PLC0415

    p, rank, collective = comm.size, comm.rank, args.collective
    x, nbytes, count = _input(collective, size, dtype, p, rank, xp)
    model_bytes = nbytes
    cases = [Case(collective, a, x.copy() if args.inplace else x, op, args.root, args.inplace, comm)
             for a in names]
    chosen = {a: a for a in names}
    if "auto" in names:
        chosen["auto"] = registry.choose(collective, model_bytes, p, nodes, shared)
        chosen_everywhere.append((size, chosen["auto"]))
    world = comm.mpi
    for _ in range(args.warmup):
        for case in cases:
            if case.reset is not None:
                case.reset()
            world.Barrier()
            case.call()
    times = np.zeros((len(cases), args.iters), dtype=np.float64)
    for turn in turns(args.iters):
        for i, case in enumerate(cases):
            for it in (None, *turn):  # None: the turn's untimed first call
                if case.reset is not None:
                    case.reset()
                world.Barrier()
                t0 = time.perf_counter()
                result = case.call()
                if it is not None:
                    times[i, it] = time.perf_counter() - t0
            if args.check:  # keep results only when they are compared
                case.result = result
    slowest = np.empty_like(times)
    world.Allreduce(times, slowest, op=MPI.MAX)

    wrong = np.zeros(len(cases), dtype=np.int64)
    if args.check:
        reference = cases[names.index("mpi")].result
        for i, case in enumerate(cases):
            wrong[i] = _wrong(case.result, reference, dtype)
        world.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
    if rank != 0:
        return []
    rows = []
    for i, case in enumerate(cases):
        median = float(np.median(slowest[i]))
        algbw = nbytes / median / 1e9 if median > 0 else 0.0
        predicted = costmodel.predict(collective, chosen[case.algorithm], model_bytes, p, nodes,
                                      params, dtype.name)
        rows.append({"collective": collective, "algorithm": case.algorithm,
                     "chosen": chosen[case.algorithm], "ranks": p, "nodes": nodes,
                     "bytes": nbytes, "count": count, "dtype": dtype.name, "op": op or "none",
                     "time_us": median * 1e6, "time_us_min": float(slowest[i].min()) * 1e6,
                     "time_us_max": float(slowest[i].max()) * 1e6, "algbw_gbs": algbw,
                     "busbw_gbs": algbw * bus_factor(collective, p),
                     "wrong": int(wrong[i]) if args.check else None,
                     "predicted_us": predicted * 1e6, "emulated": ""})
    return rows


# -- output ------------------------------------------------------------------------------------
def print_table(rows, args, p, nodes, emulated, params) -> None:
    print(f"# mpdl bench {args.collective}: {p} ranks, {nodes} node(s), {args.iters} iterations "
          f"({args.warmup} warm-up), algorithms taking turns in {len(turns(args.iters))} rounds; "
          f"time = slowest rank, median (min-max)")
    print(f"# predictions: {params.source}")
    if emulated:
        print(f"# EMULATED links: {emulated} (nodes from MPDL_RANKS_PER_NODE); the mpi baseline "
              f"bypasses mpdl's sends and is not slowed")
    width = max(len("algorithm"), *(len(_label(r)) for r in rows)) if rows else 9
    header = (f"{'size(B)':>12} {'count':>10} {'type':>8} {'op':>5} {'algorithm':<{width}} "
              f"{'time(us)':>10} {'min(us)':>10} {'max(us)':>10} {'algbw':>7} {'busbw':>7} "
              f"{'#wrong':>6} {'pred(us)':>10}")
    print(header)
    for r in rows:
        wrong = "N/A" if r["wrong"] is None else str(r["wrong"])
        print(f"{r['bytes']:>12} {r['count']:>10} {r['dtype']:>8} {r['op']:>5} "
              f"{_label(r):<{width}} {r['time_us']:>10.1f} {r['time_us_min']:>10.1f} "
              f"{r['time_us_max']:>10.1f} {r['algbw_gbs']:>7.3f} {r['busbw_gbs']:>7.3f} "
              f"{wrong:>6} {r['predicted_us']:>10.1f}")
    print()
    print("# summary per size: fastest of mpdl's algorithms, its time / mpi's, and auto's time / "
          "the fastest's" + (" [EMULATED]" if emulated else ""))
    for size in sorted({r["bytes"] for r in rows}):
        mine = [r for r in rows if r["bytes"] == size]
        ours = [r for r in mine if r["algorithm"] not in ("mpi", "auto")]
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


def _label(row) -> str:
    return f"auto→{row['chosen']}" if row["algorithm"] == "auto" else row["algorithm"]


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


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


"""`mpdl simulate`: predict the time per training step and the time to train on N workers.

    mpdl simulate --profile resnet50-v100 --nodes 544 --per-node 4 --global-batch 69632
    mpdl simulate --params 25.6M --sample-ms 0.8 --inter 100Gbit/s,5us --algorithms ring,torus2d
    mpdl simulate --measure lenet --network calibrated --nodes 1 --per-node 2

The model (mpdl/perf/simulate.py): compute = batch × per-sample time + per-step time; the gradient
goes out in buckets, each all-reduced with the α-β-γ cost model of the chosen algorithm; with
overlap, buckets are reduced during backward and only what sticks out is exposed. No MPI needed:
run it on a laptop. Sweeps N = 1, 2, 4, ... up to --max-workers (default 65,536) in seconds.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
from dataclasses import replace
from typing import Any

from mpdl import emulation
from mpdl.cli import UsageError, check_choice
from mpdl.cli import simulate_layouts as layouts
from mpdl.cli.output import is_rank0, world_size, write_json_lines
from mpdl.cli.simulate_layouts import duration as _duration
from mpdl.fileio import atomic_open
from mpdl.models.zoo import IMAGE_MODELS
from mpdl.mpi_runtime import load_mpi, oversubscribed
from mpdl.perf import published as P
from mpdl.perf import simulate as S
from mpdl.perf.units import parse_count, parse_size
from mpdl.tuning import costmodel

#: the most workers a configuration or a sweep may have (the cost model walks the ranks)
MAX_WORKERS = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("algorithms take per-algorithm options after colons, e.g. "
                     "--algorithms 'ring,hierarchical:overlap=off:compression=2:bucket=8M'")
    g = parser.add_argument_group("the model (one of)")
    g.add_argument("--profile", metavar="NAME",
                   help=f"a published model and GPU: {', '.join(S.PROFILES)} (default resnet50-v100)")
    g.add_argument("--params", metavar="COUNT", help="parameter count (e.g. 25.6M), with --sample-ms")
    g.add_argument("--sample-ms", type=float, help="forward + backward milliseconds per sample")
    g.add_argument("--step-ms", type=float, default=0.0,
                   help="fixed milliseconds per step, e.g. the optimizer (default 0)")
    g.add_argument("--bytes-per-param", type=int, choices=(2, 4, 8),
                   help="gradient bytes per parameter (default 4; 2 for fp16 gradients)")
    g.add_argument("--backward-fraction", type=float,
                   help="share of compute spent in backward, which overlap can hide (default 2/3)")
    g.add_argument("--measure", metavar="MODEL",
                   help="time an mpdl zoo model (mlp, lenet, resnet8) on this machine")
    g.add_argument("--measure-input", default="digits", metavar="{digits,mnist,cifar}",
                   help="input shape for --measure (default digits: 1x8x8)")
    g.add_argument("--measure-optimizer", default="sgd", metavar="{sgd,adam}",
                   help="optimizer whose step --measure times (default sgd, as mpdl train)")
    g = parser.add_argument_group("the workers and the network")
    g.add_argument("--nodes", type=int, help="nodes of the configuration reported in detail (default 1)")
    g.add_argument("--per-node", type=int, help="workers per node (default: the network's)")
    g.add_argument("--max-workers", type=int, default=65536,
                   help="the sweep goes 1, 2, 4, ... up to this (default 65536)")
    g.add_argument("--network", metavar="NAME",
                   help=f"{', '.join(S.NETWORKS)}, or calibrated (this machine, after mpdl "
                        f"calibrate); default: the profile's, calibrated with --measure; with "
                        f"--model-shape also {', '.join(P.NETWORKS)} (default: the --gpu's, "
                        f"else selene)")
    g.add_argument("--intra", metavar="BW,LAT", help="intra-node link, e.g. 25GB/s,5us")
    g.add_argument("--inter", metavar="BW,LAT", help="inter-node link, e.g. 100Gbit/s,5us")
    g = parser.add_argument_group("the job")
    g.add_argument("--batch-per-worker", type=float,
                   help="samples per worker per step (default 32); the fixed per-worker regime")
    g.add_argument("--global-batch", type=int,
                   help="samples per step over all workers: report the fixed global batch regime")
    g.add_argument("--dataset-size", metavar="COUNT", default="1281167",
                   help="samples per epoch (default 1281167, ImageNet-1k)")
    g.add_argument("--epochs", type=float, default=90.0, help="epochs (default 90)")
    g.add_argument("--price-per-hour", type=float, help="price of one worker-hour")
    g = parser.add_argument_group("communication")
    g.add_argument("--algorithms", default=",".join(S.DEFAULT_ALGORITHMS), metavar="LIST",
                   help="comma list of all-reduce algorithms, each with optional "
                        ":overlap=on|off:compression=R:bucket=SIZE (default: %(default)s)")
    g.add_argument("--no-overlap", action="store_true", help="default overlap off")
    g.add_argument("--compression", type=float, default=1.0,
                   help="default compression ratio: gradient bytes are divided by it (default 1)")
    g.add_argument("--bucket-mb", type=float, default=25.0, help="default bucket MiB (default 25)")
    g = parser.add_argument_group("output")
    g.add_argument("--min-gain", type=float, default=0.05,
                   help="a doubling of N that adds less than this to the speedup does not help "
                        "(default 0.05)")
    g.add_argument("--list", action="store_true",
                   help="list profiles, networks, GPUs, model shapes and precisions and exit")
    g.add_argument("--json", metavar="PATH", help="one JSON line per (algorithm, N), then a summary")
    g.add_argument("--csv", metavar="PATH", help="the rows as CSV")
    g.add_argument("--plot", metavar="PATH", help="PNG of speedup against N per algorithm")
    layouts.add_arguments(parser)


# -- parsing ---------------------------------------------------------------------------------------
def parse_strategies(text: str, overlap: bool, compression: float, bucket_bytes: float) -> list:
    """'ring,tree:overlap=off:compression=2:bucket=8M' -> Strategies (defaults from the flags)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, *options = [o.strip() for o in item.split(":")]
        if name not in S.ALGORITHMS:
            raise UsageError(f"--algorithms: unknown algorithm {name!r}; expected one of "
                             f"{', '.join(S.ALGORITHMS)}")
        values: dict[str, Any] = {"overlap": overlap, "compression": compression,
                                  "bucket_bytes": bucket_bytes}
        for option in options:
            key, _, value = option.partition("=")
            key = key.strip().lower()
            try:
                if key == "overlap" and value.lower() in ("on", "off", "true", "false", "1", "0"):
                    values["overlap"] = value.lower() in ("on", "true", "1")
                elif key == "compression":
                    values["compression"] = float(value)
                elif key == "bucket":
                    values["bucket_bytes"] = float(parse_size(value))
                else:
                    raise ValueError
            except ValueError:
                raise UsageError(f"--algorithms: bad option {option!r} of {name}; expected "
                                 f"overlap=on|off, compression=R or bucket=SIZE") from None
        if not values["compression"] >= 1:
            raise UsageError(f"--algorithms: compression of {name} must be >= 1, got "
                             f"{values['compression']:g}")
        if not values["bucket_bytes"] > 0:
            raise UsageError(f"--algorithms: bucket of {name} must be positive")
        out.append(S.GradientSync(name, **values))
    if not out:
        raise UsageError("--algorithms: empty list")
    return out


def _link(flag: str, text: str) -> tuple[float, float]:
    try:
        link = emulation.parse(f"inter={text}").inter
    except ValueError as exc:
        raise UsageError(f"{flag}: {str(exc).split(': ', 1)[-1]}") from None
    return link.bandwidth, link.latency


def choose_network(args: argparse.Namespace, default: str, ranks: int):
    name = args.network or default
    if name == "calibrated":
        try:
            params = costmodel.load_params(ranks)
        except costmodel.ModelUnavailable as exc:
            raise UsageError(f"--network calibrated: {exc}") from None
        net = S.Network("calibrated", params, per_node=os.cpu_count() or 1,
                        source=params.source)
    elif name in S.NETWORKS:
        net = S.NETWORKS[name]
    else:
        raise UsageError(f"--network: expected one of {', '.join(S.NETWORKS)} or calibrated, "
                         f"got {name!r}")
    p = net.params
    if args.intra:
        bw, lat = _link("--intra", args.intra)
        p = replace(p, alpha=lat, beta=0.0 if math.isinf(bw) else 1 / bw)
    if args.inter:
        bw, lat = _link("--inter", args.inter)
        p = replace(p, alpha_inter=lat, beta_inter=0.0 if math.isinf(bw) else 1 / bw)
    if args.intra or args.inter:
        net = S.Network(f"{net.name} (links overridden)", p, net.per_node, net.source,
                        net.shared_inter)
    return net


def measure_on_every_rank(model: str, shape: str, batch: int, optimizer: str = "sgd"):
    """The workload measured on this machine. Under mpiexec every rank measures at the same time,
    so the figures include what the ranks of a node take from each other (cores, caches, memory
    bandwidth); the slowest rank's are kept, because a synchronous step waits for it. With more
    ranks than cores, each rank's steps are averaged (the mean, not the median: some run alone
    on a core, some time-sliced)."""
    if world_size() == 1:
        return S.measure_workload(model, shape, batch=batch, optimizer=optimizer)
    world = load_mpi().COMM_WORLD
    world.Barrier()
    statistic = "mean" if oversubscribed() else "median"
    workloads = world.allgather(S.measure_workload(model, shape, batch=batch, optimizer=optimizer,
                                                   statistic=statistic))
    slowest = max(workloads, key=lambda w: w.compute(batch))
    return replace(slowest, source=f"{slowest.source}; {len(workloads)} ranks measuring at once, "
                                   f"the slowest kept")


def choose_workload(args: argparse.Namespace):
    given = [flag for flag, on in (("--profile", args.profile), ("--params", args.params),
                                   ("--measure", args.measure)) if on]
    if len(given) > 1:
        raise UsageError(f"give one model: {' and '.join(given)} both given")
    if args.params is not None or args.sample_ms is not None:
        if args.params is None or args.sample_ms is None:
            raise UsageError("--params and --sample-ms go together")
        try:
            count = parse_count(args.params)
        except ValueError as exc:
            raise UsageError(f"--params: {exc}") from None
        if not count >= 1 or not args.sample_ms > 0:
            raise UsageError("--params must be >= 1 and --sample-ms positive")
        workload = S.Workload("custom", int(count), args.sample_ms / 1e3, source="given")
        default_net = "ethernet-10g"
    elif args.measure:
        check_choice("--measure", args.measure, IMAGE_MODELS)
        check_choice("--measure-input", args.measure_input, S.INPUT_SHAPES)
        check_choice("--measure-optimizer", args.measure_optimizer, S.MEASURE_OPTIMIZERS)
        batch = max(1, int(args.batch_per_worker or 32))
        workload = measure_on_every_rank(args.measure, args.measure_input, batch,
                                         args.measure_optimizer)
        default_net = "calibrated"
    else:
        name = args.profile or "resnet50-v100"
        check_choice("--profile", name, S.PROFILES)
        workload, default_net = S.PROFILES[name], S.PROFILE_NETWORK[name]
    changes: dict[str, Any] = {"step_s": workload.step_s + args.step_ms / 1e3}
    if args.bytes_per_param:
        changes["bytes_per_param"] = args.bytes_per_param
    if args.backward_fraction is not None:
        if not 0 <= args.backward_fraction <= 1:
            raise UsageError(f"--backward-fraction: expected 0..1, got {args.backward_fraction}")
        changes["backward_fraction"] = args.backward_fraction
    return replace(workload, **changes), default_net


# -- output --------------------------------------------------------------------------------------
def print_table(workload, net, job, headline: int, per_node: int, rows, lims, strategies,
                min_gain: float) -> None:
    regime = "fixed per-worker batch" if job.global_batch is None else "fixed global batch"
    print(f"# mpdl simulate: {workload.name}, {workload.params / 1e6:.2f}M parameters × "
          f"{workload.bytes_per_param} B, {workload.sample_s * 1e3:.3f} ms/sample + "
          f"{workload.step_s * 1e3:.3f} ms/step, backward {workload.backward_fraction:.0%}")
    if workload.source:
        print(f"#   model: {workload.source}")
    p = net.params
    a_out, b_out = p.link(True)
    print(f"#   network {net.name}: intra α {p.alpha * 1e6:.2f} us, "
          f"{_bw(p.beta)}; inter α {a_out * 1e6:.2f} us, {_bw(b_out)}"
          + (f" ({net.source})" if net.source else ""))
    head = [r for r in rows if r.workers == headline]
    first = head[0].main
    print(f"#   {headline} workers = {-(-headline // per_node)} node(s) × {per_node}; "
          f"{regime}: {first['batch_per_worker']:g} per worker, global {first['global_batch']:g}; "
          f"{job.epochs:g} epochs of {job.dataset_size} samples")
    cost = job.price_per_hour is not None
    print(f"{'algorithm':<28} {'bucket':>7} {'step_ms':>9} {'compute':>9} {'comm':>9} "
          f"{'exposed':>9} {'samples/s':>11} {'speedup':>9} {'eff':>5} {'train time':>10} "
          f"{'worker-h':>10}" + (f" {'cost':>10}" if cost else ""))
    for r in head:
        m = r.main
        line = (f"{r.strategy.label():<28} {r.strategy.bucket_bytes / S.MB:>5.0f}MB "
                f"{m['step_s'] * 1e3:>9.2f} {m['compute_s'] * 1e3:>9.2f} {m['comm_s'] * 1e3:>9.2f} "
                f"{m['exposed_comm_s'] * 1e3:>9.2f} {m['samples_per_s']:>11.0f} "
                f"{m['speedup']:>9.1f} {m['efficiency']:>5.2f} {_duration(m['time_to_train_s']):>10} "
                f"{m['worker_hours']:>10.1f}")
        if cost:
            line += f" {m['cost']:>10.2f}"
        print(line)
    labels = [s.label() for s in strategies]
    width = max(12, *(len(label) for label in labels))
    for key, title in (("per_worker", f"fixed per-worker batch "
                                      f"{rows[0].per_worker['batch_per_worker']:g}"),
                       ("global_", f"fixed global batch {head[0].global_.get('global_batch', 0):g}")):
        print(f"\n# speedup (efficiency) against N, {title}")
        print(f"{'N':>7} " + " ".join(f"{label:>{width}}" for label in labels))
        for n in sorted({r.workers for r in rows}):
            cells = []
            for label in labels:
                r = next(x for x in rows if x.workers == n and x.strategy.label() == label)
                d = getattr(r, key)
                cells.append(f"{d['speedup']:.1f} ({d['efficiency']:.2f})" if d else "-")
            print(f"{n:>7} " + " ".join(f"{c:>{width}}" for c in cells))
    print(f"\n# N beyond which adding workers no longer helps (a doubling adds < {min_gain:.0%} "
          f"to the speedup)")
    for label in labels:
        fg, pw = lims[label]["fixed_global_batch"], lims[label]["fixed_per_worker_batch"]
        top = max(r.workers for r in rows)
        print(f"{label:<{width}}  fixed global batch: {fg if fg else f'> {top}'}, "
              f"fixed per-worker batch: {pw if pw else f'> {top}'}")


def _bw(beta: float) -> str:
    return "infinite bandwidth" if beta == 0 else f"{1e-9 / beta:.2f} GB/s"


def plot(path: str, rows, strategies, title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, name in ((axes[0], "per_worker", "fixed per-worker batch"),
                          (axes[1], "global_", "fixed global batch")):
        ns = sorted({r.workers for r in rows})
        ax.plot(ns, ns, color="grey", linestyle=":", label="ideal")
        for s in strategies:
            mine = [r for r in rows if r.strategy.label() == s.label() and getattr(r, key)]
            ax.plot([r.workers for r in mine], [getattr(r, key)["speedup"] for r in mine],
                    marker="o", markersize=3, label=s.label())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("workers N")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup over one worker")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if layouts.wanted(args) and not args.list:
        return layouts.run(args)
    if args.list:
        for name, w in S.PROFILES.items():
            print(f"profile {name:<20} {w.params / 1e6:.2f}M params, {w.sample_s * 1e3:.3f} "
                  f"ms/sample, network {S.PROFILE_NETWORK[name]}; {w.source}")
        layouts.print_list()
        return 0
    if args.max_workers < 1 or args.max_workers > MAX_WORKERS:
        raise UsageError(f"--max-workers: expected 1..{MAX_WORKERS}, got {args.max_workers}")
    if args.batch_per_worker is not None and args.global_batch is not None:
        raise UsageError("give --batch-per-worker or --global-batch, not both")
    if args.batch_per_worker is not None and not args.batch_per_worker > 0:
        raise UsageError(f"--batch-per-worker: expected a positive number, got "
                         f"{args.batch_per_worker:g}")
    if args.global_batch is not None and args.global_batch < 1:
        raise UsageError(f"--global-batch: expected a positive count, got {args.global_batch}")
    try:
        dataset = int(parse_count(args.dataset_size))
    except ValueError as exc:
        raise UsageError(f"--dataset-size: {exc}") from None
    if dataset < 1 or not args.epochs > 0:
        raise UsageError("--dataset-size and --epochs must be positive")
    if args.bucket_mb <= 0 or args.compression < 1:
        raise UsageError("--bucket-mb must be positive and --compression >= 1")
    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise UsageError("--price-per-hour must be >= 0")
    for flag, value in (("--nodes", args.nodes), ("--per-node", args.per_node)):
        if value is not None and value < 1:
            raise UsageError(f"{flag}: expected a positive count, got {value}")
    workers = (args.nodes or 1) * (args.per_node or 1)
    if workers > MAX_WORKERS:
        raise UsageError(f"--nodes x --per-node: {workers:,} workers is beyond the simulator's "
                         f"range of 1..{MAX_WORKERS:,} (its cost model walks the ranks)")
    strategies = parse_strategies(args.algorithms, not args.no_overlap, args.compression,
                                  args.bucket_mb * S.MB)
    workload, default_net = choose_workload(args)
    net = choose_network(args, default_net, (args.nodes or 1) * (args.per_node or 1))
    per_node = args.per_node or net.per_node
    headline = (args.nodes or 1) * per_node
    if args.global_batch is not None and headline > args.global_batch:
        raise UsageError(f"{headline} workers need a global batch of at least {headline}, got "
                         f"--global-batch {args.global_batch}")
    job = S.Job(dataset, args.epochs, args.batch_per_worker or 32.0, args.global_batch,
                args.price_per_hour)
    counts = S.worker_counts(max(args.max_workers, 1), extra=[headline])
    rows = S.simulate(workload, net, strategies, job, counts, per_node, headline)
    lims = S.limits(rows, args.min_gain)
    if not is_rank0():
        return 0
    print_table(workload, net, job, headline, per_node, rows, lims, strategies, args.min_gain)
    if args.json:
        summary = {"summary": True, "model": workload.name, "params": workload.params,
                   "sample_s": workload.sample_s, "step_s": workload.step_s,
                   "bytes_per_param": workload.bytes_per_param,
                   "backward_fraction": workload.backward_fraction, "model_source": workload.source,
                   "network": net.name, "network_params": net.params.to_json(),
                   "per_node": per_node, "headline_workers": headline,
                   "dataset_size": dataset, "epochs": args.epochs,
                   "price_per_hour": args.price_per_hour, "min_gain": args.min_gain,
                   "limits": lims}
        write_json_lines(args.json, [r.to_json() for r in rows] + [summary])
    if args.csv:
        records = [r.to_json() for r in rows]
        fields = list(dict.fromkeys(k for rec in records for k in rec))
        with atomic_open(args.csv, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(records)
    if args.plot:
        plot(args.plot, rows, strategies, f"mpdl simulate: {workload.name} on {net.name}, "
                                          f"{per_node} workers per node")
    return 0

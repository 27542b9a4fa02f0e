"""`mpdl calibrate`: measure α, β and γ on this machine and save them for the cost model.

The measuring and fitting are `mpdl.perf.calibrate`'s; this verb parses the flags and prints.
The parameters are stored under this world size in $MPDL_COST_MODEL, or ~/.cache/mpdl/costmodel.json
(XDG_CACHE_HOME is honoured); `auto` and `mpdl bench` read them from there.
"""

from __future__ import annotations

import argparse
import json

from mpdl.cli import UsageError
from mpdl.comm import as_communicator
from mpdl.mpi_runtime import load_mpi
from mpdl.perf.calibrate import calibrate
from mpdl.tuning import costmodel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="repetitions per measurement (default 20; the median is kept)")
    parser.add_argument("-o", "--output", metavar="PATH",
                        help="where to save (default: $MPDL_COST_MODEL, else costmodel.json in "
                             "$XDG_CACHE_HOME/mpdl, i.e. ~/.cache/mpdl)")
    parser.add_argument("--json", action="store_true", help="print the parameters as JSON on rank 0")


def _size(nbytes: float) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}B"


def _rate(seconds_per_byte: float) -> str:
    return f"{seconds_per_byte * 1e9:.3f} ns/B ({1e-9 / seconds_per_byte:.2f} GB/s)"


def run(args: argparse.Namespace) -> int:
    if args.iters < 1:
        raise UsageError(f"--iters: expected a positive count, got {args.iters}")
    load_mpi()
    comm = as_communicator(None)
    if comm.size < 2:
        raise UsageError("needs at least 2 ranks to measure links: mpiexec -n 2 mpdl calibrate")
    path = args.output or costmodel.default_path()
    nodes = len(comm.node_groups())
    params = calibrate(comm, args.iters, path)
    if comm.rank != 0:
        return 0
    if args.json:
        print(json.dumps({"path": path, **params.to_json()}))
        return 0
    print(f"# mpdl calibrate: {comm.size} ranks, {nodes} node(s); all ranks measured at once")
    print(f"alpha           {params.alpha * 1e6:9.2f} us per message (intra-node, with Python)")
    print(f"beta            {_rate(params.beta)}")
    if params.alpha_inter is not None:
        print(f"alpha_inter     {params.alpha_inter * 1e6:9.2f} us per message (inter-node)")
        print(f"beta_inter      {_rate(params.beta_inter)}")
    for dtype, gamma in params.gammas:
        print(f"gamma {dtype:<9} {_rate(gamma)}")
    print(f"copy            {_rate(params.copy)} (not in cache)")
    print(f"copy_cached     {_rate(params.copy_cached)} (in cache)")
    for name, curve in (("ring step", params.ring_exchange),
                        ("ring reduce step", params.ring_reduce_exchange),
                        ("input copy", params.copy_curve)):
        if curve:
            points = ", ".join(f"{_size(b)} {t * 1e6:.1f}" for b, t in curve)
            print(f"{name:<15} us at {points}")
    print(f"barrier         {params.barrier * 1e6:9.2f} us")
    print(f"call            {params.call * 1e6:9.2f} us per collective call (API overhead, all "
          f"ranks calling)")
    print(f"handoff         {params.handoff * 1e6:9.2f} us per call handed to the communication "
          f"thread")
    print(f"alpha_native    {params.alpha_native * 1e6:9.2f} us per message (MPI library)")
    print(f"gemm_flops      {params.gemm_flops / 1e9:9.2f} GFLOP/s per core (float32 512x512 GEMM; "
          f"the peak of `mpdl train`'s MFU)")
    if params.allreduce_times:
        sizes = params.allreduce_times[0][1]
        print(f"allreduce_times {len(params.allreduce_times)} algorithms timed at {len(sizes)} "
              f"sizes, {int(sizes[0][0])} B to {int(sizes[-1][0]) >> 20} MiB (what auto "
              f"interpolates for {comm.size} ranks)")
    if params.provisional:
        print(f"provisional     {params.provisional}: rerun on a quiet machine")
        if costmodel.read_file(path).get(comm.size) != params:
            print(f"kept the quiet calibration already in {path} (a provisional one never "
                  f"replaces it)")
            return 0
    print(f"saved {path}")
    return 0

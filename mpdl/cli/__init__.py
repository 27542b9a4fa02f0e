"""The `mpdl` command: one module per verb (info, bench, calibrate, train, simulate)."""

from __future__ import annotations

import argparse
import importlib
import sys

VERBS = {
    "info": "versions, MPI library, world size, nodes, GPU and CUDA-awareness",
    "bench": "measure collective algorithms side by side (nccl-tests style), with predictions",
    "train": "data-parallel training of a zoo model (default: an MLP on the shipped digits)",
    "calibrate": "measure this machine's α, β, γ for the cost model that drives algorithm='auto'",
    "simulate": "predict step time, speedup against N (up to 65,536), time and cost to train",
}


class UsageError(Exception):
    """Bad flags or an inconsistent configuration: exit code 2 with a one-line message."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mpdl` console script."""
    from mpdl import __version__  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="mpdl", description="mpdl: transparent MPI data-parallel "
                                     "deep learning. Launch with mpiexec -n P mpdl VERB ...")
    parser.add_argument("--version", action="version", version=f"mpdl {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    modules = {}
    for verb, help_text in VERBS.items():
        module = importlib.import_module(f"mpdl.cli.{verb}")
        module.add_arguments(verbs.add_parser(verb, help=help_text, description=help_text))
        modules[verb] = module
    args = parser.parse_args(argv)

    from mpdl.allocator import keep_heap  # noqa: PLC0415
    from mpdl.mpi_runtime import MPIUnavailable, abort_on_uncaught_exception  # noqa: PLC0415

    keep_heap()
    try:
        abort_on_uncaught_exception()
        return modules[args.verb].run(args) or 0
    except MPIUnavailable as exc:
        print(f"mpdl {args.verb}: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        from mpdl.cli.output import is_rank0  # noqa: PLC0415

        if is_rank0():
            print(f"mpdl {args.verb}: error: {exc}", file=sys.stderr)
        return 2

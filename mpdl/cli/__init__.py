"""The `mpdl` command: one module per verb (info, bench, calibrate, train, simulate, generate,
serve, export, launch, doctor).

Only the verb asked for is imported (with what it needs), so that a verb's start-up, which every
mpiexec rank pays, does not include the other verbs' dependencies.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable
from typing import Any

from mpdl import __version__, blas, settings
from mpdl.allocator import keep_heap
from mpdl.cli.output import is_rank0
from mpdl.mpi_runtime import MPIUnavailable, abort_on_uncaught_exception, wait_for_peers

VERBS = {
    "info": "versions, MPI library, world size, nodes, GPU and CUDA-awareness",
    "bench": "measure collective algorithms side by side (nccl-tests style), with predictions",
    "train": "train a zoo model or the GPT: data, ZeRO, pipeline, tensor, context or expert "
             "parallelism (default: an MLP on the shipped digits, data-parallel)",
    "calibrate": "measure this machine's α, β, γ for the cost model that drives algorithm='auto'",
    "simulate": "predict step time, memory, speedup against N (up to 65,536), time and cost to "
                "train; search layouts of large models",
    "generate": "sample text from a GPT checkpoint of `mpdl train --model gpt`",
    "serve": "serve a GPT checkpoint over HTTP (OpenAI API) with continuous batching over a "
             "paged KV cache",
    "export": "write a GPT checkpoint as a safetensors file under nanoGPT's names, or for "
              "Hugging Face transformers",
    "launch": "run `mpdl train` under mpiexec or srun and restart it from its checkpoint when "
              "it fails",
    "doctor": "say what went wrong from the flight records of every rank",
}


class UsageError(Exception):
    """Bad flags or an inconsistent configuration: exit code 2 with a one-line message."""


def check_choice(flag: str, value: Any, choices: Iterable[str]) -> None:
    """UsageError naming flag unless value is one of choices."""
    if value not in choices:
        raise UsageError(f"{flag}: expected one of {', '.join(choices)}, got {value!r}")


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line, from rank 0 only (every rank parses the same argv), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if is_rank0():
            print(f"{self.prog}: error: {message} ({self.prog} --help lists the options)",
                  file=sys.stderr, flush=True)
        wait_for_peers()  # else Open MPI may end the job before rank 0's line is out
        sys.exit(2)


def _check_settings() -> None:
    """Read the MPDL_* variables and the BLAS they choose now, so that a bad one (the same on
    every rank) is a one-line error before any work, not a traceback at its first use."""
    try:
        settings.current()
        blas.selected()
    except ValueError as exc:
        raise UsageError(exc) from None


def _verb_in(argv: list[str]) -> str | None:
    """The verb argv names: its first word that is not an option (mpdl's own options take no
    value), when it is one of VERBS."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in VERBS else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mpdl` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(prog="mpdl", description="mpdl: a from-scratch distributed deep-"
                                     "learning runtime over MPI. Launch with mpiexec -n P mpdl "
                                     "VERB ...")
    parser.add_argument("--version", action="version", version=f"mpdl {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    wanted = _verb_in(argv)
    module, verb_parser = None, parser
    for verb, help_text in VERBS.items():
        sub = verbs.add_parser(verb, help=help_text, description=help_text)
        if verb == wanted:
            module, verb_parser = importlib.import_module(f"mpdl.cli.{verb}"), sub
            module.add_arguments(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the verb's parser, whose --help lists the options it takes
        verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")

    try:
        abort_on_uncaught_exception()
        _check_settings()
        keep_heap()
        return module.run(args) or 0
    except MPIUnavailable as exc:
        print(f"mpdl {args.verb}: {exc}", file=sys.stderr)
        return 1
    except UsageError as exc:
        if is_rank0():
            print(f"mpdl {args.verb}: error: {exc}", file=sys.stderr, flush=True)
        wait_for_peers()
        return 2

"""`mpdl train`: train a zoo model or the GPT on data, ZeRO, pipeline, tensor, context or expert
parallelism (default: an MLP on the shipped UCI digits, data-parallel).

    mpiexec -n P mpdl train [--model mlp|lenet|resnet8] [--dataset digits|mnist|synthetic] ...
    mpiexec -n P mpdl train --model gpt [--dataset addition|text --data FILE] [--n-layer L] ...

Rank 0 prints one line per epoch (loss, train and test accuracy, samples/s, and the step time
split into compute, communication and exposed communication); --json writes the configuration,
then the same as JSON lines plus a summary line, --timeline a Chrome trace with one track per
rank. --mode ps trains with a parameter server (synchronous, --staleness S or --async) and ends
with the staleness histogram; --emulate SPEC slows the links like `mpdl bench --emulate`. A GPT's
lines add tokens/s, MFU, validation loss and exact match (addition) or bits per character (text).

The flags are made from the options of TrainConfig (mpdl.training.config, where an option is
added); --config FILE reads them from TOML, with the flags given as well overriding the file, and
--print-config prints the resolved configuration in that form.
"""

from __future__ import annotations

import argparse
import os
import sys

from threadpoolctl import threadpool_limits

from mpdl.backend import cupy_module
from mpdl.cli import UsageError
from mpdl.cli.output import is_rank0
from mpdl.comm import flight
from mpdl.mpi_runtime import launcher_local_size, load_mpi, wait_for_peers
from mpdl.training.checkpoint import CheckpointWriteError
from mpdl.training.config import (
    OPTIONS,
    SECTIONS,
    ConfigError,
    TrainConfig,
    check_options,
    model_defaults,
    option_type,
    resolve,
    validate,
)
from mpdl.training.config_file import config_toml, read_config_file
from mpdl.training.guard import NonFiniteStop
from mpdl.training.loop import Trainer


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags: --config and --print-config, then a group per section of TrainConfig with a
    flag per option (its default is the option's; none is set here, so that a flag not given
    leaves the file's value or the model's default)."""
    p.epilog = ("example: mpiexec -n 4 mpdl train --epochs 10 --json train.jsonl "
                "--timeline trace.json; parameter server: mpiexec -n 3 mpdl train --mode ps "
                "--servers 1 --staleness 2; a transformer: mpiexec -n 2 mpdl train --model gpt; "
                "from a file: mpdl train --model gpt --print-config > run.toml, then mpiexec -n 2 "
                "mpdl train --config run.toml")
    p.add_argument("--config", metavar="FILE",
                   help="read the options from a TOML file (a table per section below, as "
                        "--print-config writes it); flags given as well override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved configuration as TOML (for --config) and exit")
    gpt = model_defaults("gpt")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{section}]", (cls.__doc__ or "").split("\n\n")[0])
        for key in OPTIONS:
            if key.startswith(section + "."):
                group.add_argument(flag(key), dest=key, default=argparse.SUPPRESS,
                                   help=_help(key, gpt.get(key)), **_kind(key))


def _kind(key: str) -> dict:
    """add_argument's action, type and metavar for an option."""
    field = OPTIONS[key]
    kind = option_type(key)
    if kind is bool:
        return {"action": "store_const", "const": not field.default}
    choices = field.metadata["choices"]
    metavar = field.metadata["metavar"] or (
        "{" + ",".join(map(str, choices)) + "}" if choices else key.split(".")[1].upper())
    return {"type": kind, "metavar": metavar}


def _help(key: str, model_default: object) -> str:
    field = OPTIONS[key]
    text = field.metadata["help"]
    if option_type(key) is not bool and field.default is not None:
        gpt = f"; gpt: {model_default}" if model_default not in (None, field.default) else ""
        text += f" (default: {field.default}{gpt})"
    return text.strip().replace("%", "%%")


def flag(key: str) -> str:
    """The flag of an option: --global-batch-size for optim.global_batch_size."""
    return OPTIONS[key].metadata["flag"] or "--" + key.split(".")[1].replace("_", "-")


def usage_error(exc: ValueError, path: str | None = None,
                from_file: frozenset[str] = frozenset()) -> UsageError:
    """The library's error in the flags' words, or the file's keys for the options whose value
    came from the configuration file at path (from_file), the message then naming the file."""
    if not isinstance(exc, ConfigError):
        return UsageError(str(exc))
    text = exc.message(lambda key: key if key in from_file else flag(key))
    if path and from_file.intersection(exc.keys()):
        text = f"{path}: {text}"
    return UsageError(text)


def check(config: TrainConfig, world_size: int, path: str | None = None,
          from_file: frozenset[str] = frozenset()) -> None:
    """UsageError, in the flags' (or the file's) words, for a configuration that cannot run on
    world_size ranks."""
    try:
        validate(config, world_size)
    except ValueError as exc:
        raise usage_error(exc, path, from_file) from None


def given(args: argparse.Namespace) -> dict[str, object]:
    """The options given as flags, by key."""
    return {key: value for key, value in vars(args).items() if key in OPTIONS}


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, frozenset[str]]:
    """The configuration of the file (--config) and the flags, which override it; an option
    given in neither takes the model's default. Also the keys whose value came from the file."""
    flags = given(args)
    try:
        in_file = read_config_file(args.config) if args.config else {}
    except ConfigError as exc:
        raise usage_error(exc) from None
    from_file = frozenset(in_file) - frozenset(flags)
    try:
        return resolve({**in_file, **flags}), from_file
    except ConfigError as exc:
        raise usage_error(exc, args.config, from_file) from None


def limit_blas_threads() -> None:
    """Like torchrun: with several ranks on a node, give each rank's BLAS cores/ranks threads
    unless OMP_NUM_THREADS or OPENBLAS_NUM_THREADS says otherwise (oversubscribed BLAS thread
    pools spin against each other and slow small matrix products down by orders of magnitude)."""
    if any(os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")):
        return
    local = launcher_local_size() or 1
    if local <= 1:
        return
    threadpool_limits(max(1, (os.cpu_count() or 1) // local))


def run(args: argparse.Namespace) -> int:
    config, from_file = config_from_args(args)
    if args.print_config:
        try:
            check_options(config)
        except ConfigError as exc:
            raise usage_error(exc, args.config, from_file) from None
        if is_rank0():
            print(config_toml(config), end="")
        return 0
    MPI = load_mpi()
    check(config, MPI.COMM_WORLD.Get_size(), args.config, from_file)
    if config.model.device == "gpu":
        if cupy_module() is None:
            raise UsageError("--device gpu: CuPy is not installed or sees no GPU (pip install "
                             "\"mpdl[gpu]\"), or use --device cpu")
    if config.optim.deterministic:
        threadpool_limits(1)  # one BLAS thread on any layout: a GEMM's bits may depend on its threads
    else:
        limit_blas_threads()
    if config.checkpoint.dir:
        flight.set_default_directory(os.path.join(config.checkpoint.dir, "flight"))
    trainer = Trainer(config)
    try:
        trainer.setup()
    except ConfigError as exc:
        raise usage_error(exc, args.config, from_file) from None
    try:
        trainer.run()
    except (NonFiniteStop, CheckpointWriteError) as exc:
        if is_rank0():
            print(f"mpdl train: error: {exc}", file=sys.stderr, flush=True)
        if is_rank0() and trainer.trainers is not None and trainer.trainers.size < trainer.size:
            MPI.COMM_WORLD.Abort(exc.exit_status)  # a parameter server's servers wait for pushes
        wait_for_peers()
        return exc.exit_status
    return 0

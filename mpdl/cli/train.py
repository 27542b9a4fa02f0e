"""`mpdl train`: data-parallel training of a zoo model (default: an MLP on the shipped UCI digits).

    mpiexec -n P mpdl train [--model mlp|lenet|resnet8] [--dataset digits|mnist|synthetic] ...
    mpiexec -n P mpdl train --model gpt [--dataset addition|text --data FILE] [--n-layer L] ...

Rank 0 prints one line per epoch (loss, train and test accuracy, samples/s, and the step time
split into compute, communication and exposed communication); --json writes the same as JSON
lines plus a summary line, --timeline a Chrome trace with one track per rank. --mode ps trains
with a parameter server (synchronous, --staleness S or --async) and ends with the staleness
histogram; --emulate SPEC slows the links like `mpdl bench --emulate`. A GPT's lines add tokens/s,
MFU, validation loss and exact match (addition) or bits per character (text).
"""

from __future__ import annotations

import argparse
import os

from threadpoolctl import threadpool_limits

from mpdl.backend import cupy_module
from mpdl.cli import UsageError
from mpdl.comm import flight
from mpdl.mpi_runtime import launcher_local_size, load_mpi
from mpdl.training.config import ConfigError, TrainConfig, model_defaults, validate
from mpdl.training.loop import Trainer

_D = {"model": "mlp", "dataset": "digits", "epochs": 15, "global_batch_size": 64,
      "optimizer": "sgd", "algorithm": "auto", "first_bucket_mb": 1.0}
#: the GPT's defaults where they differ (mpdl.training.config.MODEL_DEFAULTS)
_GPT = model_defaults("gpt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("example: mpiexec -n 4 mpdl train --epochs 10 --json train.jsonl "
                "--timeline trace.json; parameter server: mpiexec -n 3 mpdl train --mode ps "
                "--servers 1 --staleness 2; a transformer: mpiexec -n 2 mpdl train --model gpt")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=_D["model"], metavar="{mlp,lenet,resnet8,gpt}",
                   help="model from the zoo; gpt: a decoder-only transformer for --dataset "
                        "addition or text (default: %(default)s)")
    g.add_argument("--dataset", metavar="{digits,mnist,synthetic,addition,text}",
                   help="digits: the shipped UCI 8x8 digits; mnist: IDX files or .npz at --data; "
                        "synthetic: generated; addition: n-digit sums as characters, answers "
                        "reversed; text: a UTF-8 file at --data, characters (default: "
                        f"{_D['dataset']}; gpt: {_GPT['dataset']})")
    g.add_argument("--data", metavar="PATH",
                   help="MNIST folder with the standard IDX files (gzipped or not) or an .npz with "
                        "x_train, y_train, x_test, y_test; --dataset text: the text file")
    g.add_argument("--synthetic-shape", default="mnist", metavar="{mnist,cifar}",
                   help="image shape of --dataset synthetic: 1x28x28 or 3x32x32 (default: "
                        "%(default)s)")
    g.add_argument("--synthetic-samples", type=int, default=4096, metavar="N",
                   help="training samples of --dataset synthetic, plus N/4 test (default: "
                        "%(default)s)")
    g.add_argument("--dtype", default="float32", metavar="{float32,float64}")
    g.add_argument("--digits", type=int, default=3,
                   help="--dataset addition: digits of each operand, 1 to 9 (default: %(default)s)")
    g.add_argument("--n-layer", type=int, default=2, metavar="L",
                   help="gpt: transformer blocks (default: %(default)s)")
    g.add_argument("--n-head", type=int, default=4, metavar="H",
                   help="gpt: attention heads, dividing --n-embd (default: %(default)s)")
    g.add_argument("--n-embd", type=int, default=64, metavar="D",
                   help="gpt: width of the embeddings (default: %(default)s)")
    g.add_argument("--block-size", type=int, metavar="T",
                   help="gpt: the longest sequence (default: addition 3 x digits + 2, text 64)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int,
                   help="total epochs (a resumed run continues up to this) (default: "
                        f"{_D['epochs']}; gpt: {_GPT['epochs']})")
    g.add_argument("--global-batch-size", type=int, metavar="B",
                   help="samples (sequences) per step over all ranks, split into contiguous "
                        f"per-rank slices (default: {_D['global_batch_size']}; gpt: "
                        f"{_GPT['global_batch_size']})")
    g.add_argument("--lr", type=float,
                   help="learning rate (default: sgd 0.2, adam 0.001, lars 2, lamb 0.01; lenet: "
                        "sgd 0.03, adam 0.003; gpt: adam 0.003; x 0.25 under --compression "
                        "signsgd)")
    g.add_argument("--optimizer", metavar="{sgd,adam,lars,lamb}",
                   help=f"(default: {_D['optimizer']}; gpt: {_GPT['optimizer']}; sgd and lars "
                        f"use --momentum)")
    g.add_argument("--momentum", type=float, default=0.9, help="(default: %(default)s)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="(default: %(default)s)")
    g.add_argument("--warmup-epochs", type=float,
                   help="linear learning-rate warmup (Goyal et al.) (default: 0; gpt: "
                        f"{_GPT['warmup_epochs']})")
    g.add_argument("--scale-lr", action="store_true",
                   help="linear scaling rule: --lr is the rate for a batch of 256, scaled by B/256")
    g.add_argument("--lr-schedule", default="cosine", metavar="{constant,cosine}",
                   help="after warmup (default: %(default)s)")
    g.add_argument("--drop-last", action="store_true",
                   help="drop each epoch's last, short global batch")
    g.add_argument("--seed", type=int, default=0,
                   help="model initialisation and data order (default: %(default)s)")
    g = p.add_argument_group("communication")
    g.add_argument("--algorithm", default=_D["algorithm"], metavar="NAME",
                   help="gradient all-reduce: auto or any name of `mpdl bench --list` "
                        "(default: %(default)s)")
    g.add_argument("--bucket-mb", type=float,
                   help="gradient bucket size in MiB (default: 25; --zero 1 and 2: at most 1/16 "
                        "of the model and 25)")
    g.add_argument("--first-bucket-mb", type=float, default=_D["first_bucket_mb"],
                   help="size of the first (last layers') bucket (default: %(default)s)")
    g.add_argument("--no-overlap", action="store_true",
                   help="reduce all buckets after backward instead of during it")
    g.add_argument("--compression", default="none",
                   metavar="{none,fp16,topk,qsgd,signsgd,powersgd}",
                   help="gradient compression per bucket (default: %(default)s)")
    g.add_argument("--ratio", type=float, default=0.01,
                   help="topk: fraction of values sent (default: %(default)s)")
    g.add_argument("--levels", type=int, default=127,
                   help="qsgd: quantisation levels s, at most 127 (default: %(default)s)")
    g.add_argument("--rank", type=int, default=2, help="powersgd: rank r (default: %(default)s)")
    g.add_argument("--sync-every", type=int, default=1, metavar="H",
                   help="local SGD: average parameters every H steps instead of gradients every "
                        "step (default: %(default)s)")
    g.add_argument("--post-local-warmup", type=int, default=0, metavar="STEPS",
                   help="local SGD: all-reduce gradients for the first STEPS steps (default: "
                        "%(default)s)")
    g.add_argument("--mode", default="allreduce", metavar="{allreduce,ps}",
                   help="ps: parameter server; the last --servers ranks hold the parameters and "
                        "run sgd, the others train; synchronous unless --staleness or --async "
                        "(default: %(default)s)")
    g.add_argument("--servers", type=int, default=1,
                   help="--mode ps: server ranks (default: %(default)s)")
    g.add_argument("--staleness", type=int, metavar="S",
                   help="--mode ps: stale synchronous parallel, no worker more than S steps "
                        "ahead of the slowest")
    g.add_argument("--async", dest="ps_async", action="store_true",
                   help="--mode ps: fully asynchronous (each push applied on arrival); with "
                        "--staleness or --async each push is its own step at 2 x lr x the "
                        "worker's share of the batch, server momentum at most 0.5")
    g.add_argument("--zero", type=int, default=0, metavar="{1,2,3}",
                   help="ZeRO sharded data parallelism: 1 shards the optimizer state, 2 also the "
                        "gradients, 3 also the parameters (FSDP); gradients reduce-scattered and "
                        "parameters all-gathered with --algorithm auto, ring, tree or mpi")
    g.add_argument("--zero-hybrid", action="store_true",
                   help="--zero: shard within each node, replicate across nodes (nodes from MPI "
                        "shared memory or MPDL_RANKS_PER_NODE; equal sizes)")
    g.add_argument("--recompute", default="none", metavar="{none,selective,full}",
                   help="--model gpt: recompute in backward each attention core (selective) or "
                        "each whole block (full) instead of keeping their activations "
                        "(default: %(default)s)")
    g.add_argument("--no-prefetch", action="store_true",
                   help="--zero 3: gather each unit's parameters only when it runs, not while "
                        "the previous one computes")
    g.add_argument("--dp", type=int, metavar="D",
                   help="data-parallel degree of the process grid dp x pp x tp (default: the "
                        "number of ranks / (pp x tp)); ranks row-major, tp fastest")
    g.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline stages, balanced by parameter count (mlp, lenet, gpt; default: "
                        "%(default)s)")
    g.add_argument("--tp", type=int, default=1, metavar="T",
                   help="tensor-parallel degree: Megatron attention heads and MLP split over T "
                        "ranks (gpt; embeddings and LayerNorms replicated; default: %(default)s)")
    g.add_argument("--microbatches", type=int, default=1, metavar="M",
                   help="--pp/--tp: microbatches per step (default: %(default)s)")
    g.add_argument("--schedule", default="1f1b", metavar="{afab,1f1b}",
                   help="--pp: all forward then all backward (GPipe), or one forward one "
                        "backward (PipeDream-flush) (default: %(default)s)")
    g.add_argument("--verbose-comm", action="store_true",
                   help="--pp: print every message between stages (stderr)")
    g.add_argument("--emulate", metavar="SPEC",
                   help="emulate slower links, e.g. inter=10Gbit/s,20us (nodes from "
                        "MPDL_RANKS_PER_NODE), or off (default: MPDL_EMULATE)")
    g.add_argument("--device", default="cpu", metavar="{cpu,gpu}",
                   help="gpu needs CuPy and a GPU (default: %(default)s)")
    g = p.add_argument_group("output and checkpoints")
    g.add_argument("--checkpoint", metavar="DIR",
                   help="rank 0 writes DIR/model.npz, optimizer.npz and state.json every epoch")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="also checkpoint every STEPS steps (with the position in the epoch), so a "
                        "restart repeats at most STEPS steps (default: at the end of each epoch "
                        "only)")
    g.add_argument("--keep", type=int, default=0, metavar="N",
                   help="keep copies of the last N checkpoints in DIR/history/step-NNNNNNNN "
                        "(default: %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --checkpoint DIR (any number of ranks; "
                        "starts fresh when DIR holds none yet)")
    g.add_argument("--json", metavar="PATH", help="one JSON line per epoch, then a summary line")
    g.add_argument("--timeline", metavar="PATH",
                   help="Chrome-trace JSON (Perfetto, chrome://tracing), one track per rank")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")


#: the flags whose names are not the TrainConfig field's
FLAGS = {"ps_async": "--async", "powersgd_rank": "--rank", "overlap": "--no-overlap",
         "progress": "--no-progress", "prefetch": "--no-prefetch"}


def flag(field: str) -> str:
    """The flag of a TrainConfig field: --global-batch-size for global_batch_size."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def usage_error(exc: ValueError) -> UsageError:
    """The library's error in the flags' words."""
    return UsageError(exc.message(flag) if isinstance(exc, ConfigError) else str(exc))


def check(config: TrainConfig, world_size: int) -> None:
    """UsageError, in the flags' words, for a configuration that cannot run on world_size ranks."""
    try:
        validate(config, world_size)
    except ValueError as exc:
        raise usage_error(exc) from None


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The configuration of the flags; a flag not given takes the model's default."""
    d = {k: v if getattr(args, k) is None else getattr(args, k)
         for k, v in model_defaults(args.model).items()}
    return TrainConfig(
        model=args.model, dataset=d["dataset"], data=args.data, epochs=d["epochs"],
        global_batch_size=d["global_batch_size"], lr=args.lr, optimizer=d["optimizer"],
        momentum=args.momentum, weight_decay=args.weight_decay, warmup_epochs=d["warmup_epochs"],
        scale_lr=args.scale_lr, lr_schedule=args.lr_schedule, algorithm=args.algorithm,
        bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb,
        overlap=not args.no_overlap, seed=args.seed, checkpoint=args.checkpoint,
        resume=args.resume, checkpoint_every=args.checkpoint_every, keep=args.keep,
        json=args.json, timeline=args.timeline, device=args.device,
        dtype=args.dtype, synthetic_shape=args.synthetic_shape,
        synthetic_samples=args.synthetic_samples, drop_last=args.drop_last,
        progress=not args.no_progress, compression=args.compression, ratio=args.ratio,
        levels=args.levels, powersgd_rank=args.rank, sync_every=args.sync_every,
        post_local_warmup=args.post_local_warmup, mode=args.mode, servers=args.servers,
        staleness=args.staleness, ps_async=args.ps_async, emulate=args.emulate,
        n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
        digits=args.digits, zero=args.zero, prefetch=not args.no_prefetch,
        zero_hybrid=args.zero_hybrid, recompute=args.recompute, dp=args.dp, pp=args.pp, tp=args.tp,
        microbatches=args.microbatches, schedule=args.schedule, verbose_comm=args.verbose_comm)


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
    config = config_from_args(args)
    MPI = load_mpi()
    check(config, MPI.COMM_WORLD.Get_size())
    if config.device == "gpu":
        if cupy_module() is None:
            raise UsageError("--device gpu: CuPy is not installed or sees no GPU (pip install "
                             "\"mpdl[gpu]\"), or use --device cpu")
    limit_blas_threads()
    if config.checkpoint:
        flight.set_default_directory(os.path.join(config.checkpoint, "flight"))
    trainer = Trainer(config)
    try:
        trainer.setup()
    except ConfigError as exc:
        raise usage_error(exc) from None
    trainer.run()
    return 0

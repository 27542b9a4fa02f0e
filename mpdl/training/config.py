"""What defines a training run (`TrainConfig`), its checks, its default learning rates and its data.

Checks raise `ConfigError` in the library's words: a message names the fields of `TrainConfig`
("global_batch_size: expected a positive number, got 0"); `ConfigError.message(name)` names them
as a front end does (the CLI passes its flags: "--global-batch-size: ...").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import datasets, emulation
from mpdl.autograd.optim import scale_lr
from mpdl.collectives.registry import algorithms
from mpdl.parallel.compression import COMPRESSORS, make_compression
from mpdl.parallel.ps import check_config
from mpdl.parallel.zero import ALGORITHMS as ZERO_ALGORITHMS
from mpdl.parallel.zero import STAGES as ZERO_STAGES
from mpdl.training.gpt import RECOMPUTE
from mpdl.training.models import MODELS

OPTIMIZERS = ("sgd", "adam", "lars", "lamb")
DATASETS = ("digits", "mnist", "synthetic", "addition", "text")
#: the datasets of the GPT (token sequences); the image models take the others
SEQUENCE_DATASETS = ("addition", "text")
SCHEDULES = ("constant", "cosine")
MODES = ("allreduce", "ps")
#: the learning rate of each optimizer when --lr is not given ...
DEFAULT_LR = {"sgd": 0.2, "adam": 1e-3, "lars": 2.0, "lamb": 1e-2}
#: ... unless the model has its own: LeNet (no batch norm) diverges at sgd 0.2 and learns
#: faster with adam at 3e-3
MODEL_LR = {("lenet", "sgd"): 0.03, ("lenet", "adam"): 3e-3, ("gpt", "adam"): 3e-3}
#: what a model's run gets by default where the flag is not given: the GPT trains with Adam on
#: batches of 128 sequences for 8 epochs (3,128 steps on the addition task; with 5 the cosine
#: decays before the model has learnt the carries), after a warmup of about 100 steps
MODEL_DEFAULTS = {"gpt": {"dataset": "addition", "optimizer": "adam", "epochs": 8,
                          "global_batch_size": 128, "warmup_epochs": 0.25}}
#: the length of a text run's sequences when block_size is not given
TEXT_BLOCK_SIZE = 64
#: and the factor a compressor applies to it: a scaled sign step moves every coordinate by the
#: mean magnitude, a larger step than the gradient's for most coordinates
COMPRESSION_LR_SCALE = {"signsgd": 0.25}
#: the batch size --lr refers to under --scale-lr (Goyal et al. 2017)
BASE_BATCH = 256
#: config fields a resumed run must share with the checkpoint
RESUME_FIELDS = ("model", "dataset", "synthetic_shape", "synthetic_samples", "global_batch_size",
                 "seed", "dtype", "n_layer", "n_head", "n_embd", "block_size", "digits")


class ConfigError(ValueError):
    """A configuration, data or checkpoint problem (found alike on every rank, or agreed on).

    The message is a template that names TrainConfig fields in braces, "{epochs}: expected ...":
    `str()` writes the field names, `message(name)` whatever `name(field)` returns.
    """

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.template = template

    def message(self, name: Callable[[str], str] = str) -> str:
        return self.template.format_map(_Names(name))

    def __str__(self) -> str:
        return self.message()


class _Names(dict):
    def __init__(self, name: Callable[[str], str]) -> None:
        super().__init__()
        self.name = name

    def __missing__(self, field: str) -> str:
        return self.name(field)


def literal(text: str) -> str:
    """text as a part of a ConfigError template (its braces are not fields)."""
    return text.replace("{", "{{").replace("}", "}}")


def agreed(comm: Any, fn: Callable[[], Any]) -> Any:
    """fn() on every rank of comm; when it fails on any rank (ConfigError, ValueError, OSError),
    ConfigError with the first failing rank's message on every rank, so that all stop alike."""
    result, error = None, None
    try:
        result = fn()
    except ConfigError as exc:
        error = exc.template
    except (ValueError, OSError) as exc:  # DatasetError and CheckpointError among them
        error = literal(str(exc) or type(exc).__name__)
    error = next((e for e in comm.allgather_object(error) if e), None)
    if error:
        raise ConfigError(error)
    return result


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run (the flags of `mpdl train`)."""

    model: str = "mlp"
    dataset: str = "digits"
    data: str | None = None
    epochs: int = 15
    global_batch_size: int = 64
    lr: float | None = None
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_epochs: float = 0.0
    scale_lr: bool = False
    lr_schedule: str = "cosine"
    algorithm: str = "auto"
    #: None: DDP's 25 MiB; ZeRO's units at most 1/16 of the model and 25 MiB
    bucket_mb: float | None = None
    first_bucket_mb: float = 1.0
    overlap: bool = True
    seed: int = 0
    checkpoint: str | None = None
    resume: bool = False
    #: also checkpoint every this many steps (0: at the end of each epoch only)
    checkpoint_every: int = 0
    #: copies of old checkpoints kept in CHECKPOINT/history (0: none)
    keep: int = 0
    json: str | None = None
    timeline: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    synthetic_shape: str = "mnist"
    synthetic_samples: int = 4096
    drop_last: bool = False
    progress: bool = True
    compression: str = "none"
    ratio: float = 0.01
    levels: int = 127
    powersgd_rank: int = 2
    sync_every: int = 1
    post_local_warmup: int = 0
    mode: str = "allreduce"
    servers: int = 1
    staleness: int | None = None
    ps_async: bool = False
    emulate: str | None = None
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int | None = None
    digits: int = 3
    zero: int = 0
    prefetch: bool = True
    zero_hybrid: bool = False
    #: the process grid (dp × pp × tp = world size); dp None: the world size / (pp × tp)
    dp: int | None = None
    pp: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    verbose_comm: bool = False
    #: recompute in backward: none, selective (each attention core) or full (each block)
    recompute: str = "none"

    def ps_mode(self) -> str:
        """The parameter server's synchronisation: sync, ssp (staleness) or async (ps_async)."""
        return "async" if self.ps_async else "ssp" if self.staleness is not None else "sync"

    def data_ranks(self, world_size: int) -> int:
        """Ranks that train on different data: all of them, the workers of a parameter server,
        or the data-parallel degree of a process grid."""
        if self.mode == "ps":
            return world_size - self.servers
        return world_size // (self.pp * self.tp) if self.model_parallel() else world_size

    def model_parallel(self) -> bool:
        """Whether the run splits the model (pipeline or tensor parallelism)."""
        return self.pp > 1 or self.tp > 1

    def base_lr(self) -> float:
        """The learning rate after warmup: lr, or the default of the model, optimizer and
        compression; times global_batch_size / BASE_BATCH under scale_lr."""
        lr = default_lr(self.model, self.optimizer, self.compression) if self.lr is None \
            else self.lr
        return scale_lr(lr, self.global_batch_size, BASE_BATCH) if self.scale_lr else lr


def model_defaults(model: str) -> dict[str, object]:
    """The TrainConfig fields whose default depends on the model, with their value for `model`."""
    base = {f.name: f.default for f in dataclasses.fields(TrainConfig)
            if f.name in ("dataset", "optimizer", "epochs", "global_batch_size", "warmup_epochs")}
    return {**base, **MODEL_DEFAULTS.get(model, {})}


def default_lr(model: str, optimizer: str, compression: str = "none") -> float:
    """The learning rate a run of `model` with `optimizer` and `compression` gets by default."""
    lr = MODEL_LR.get((model, optimizer), DEFAULT_LR[optimizer])
    return lr * COMPRESSION_LR_SCALE.get(compression, 1.0)


def validate(config: TrainConfig, world_size: int) -> None:
    """ConfigError with a one-line message for an inconsistent configuration (no communication:
    every rank reaches the same verdict)."""
    choices = {"model": MODELS, "dataset": DATASETS, "optimizer": OPTIMIZERS,
               "lr_schedule": SCHEDULES, "device": ("cpu", "gpu"),
               "dtype": ("float32", "float64"), "synthetic_shape": ("mnist", "cifar"),
               "algorithm": ("auto", *algorithms("allreduce"))}
    for field, allowed in choices.items():
        value = getattr(config, field)
        if value not in allowed:
            raise ConfigError(f"{{{field}}}: expected one of {', '.join(allowed)}, got "
                              f"{literal(repr(value))}")
    for field in ("epochs", "global_batch_size", "bucket_mb", "first_bucket_mb",
                  "synthetic_samples"):
        if getattr(config, field) is not None and not getattr(config, field) > 0:
            raise ConfigError(f"{{{field}}}: expected a positive number, got "
                              f"{getattr(config, field)}")
    for field in ("momentum", "weight_decay", "warmup_epochs"):
        if getattr(config, field) < 0:
            raise ConfigError(f"{{{field}}}: expected a number >= 0, got "
                              f"{getattr(config, field)}")
    if config.lr is not None and not config.lr > 0:
        raise ConfigError(f"{{lr}}: expected a positive learning rate, got {config.lr}")
    validate_communication(config, world_size)
    validate_grid(config, world_size)
    validate_recompute(config)
    ranks = config.data_ranks(world_size)
    if config.global_batch_size < ranks:
        what = "workers" if config.mode == "ps" else "ranks"
        raise ConfigError(f"{{global_batch_size}} {config.global_batch_size} is smaller than the "
                          f"number of {what} ({ranks}): every {what[:-1]} needs at least one "
                          f"sample")
    validate_sequence(config)
    if config.dataset == "mnist" and not config.data:
        raise ConfigError("{dataset} mnist needs {data} PATH (a folder with the IDX files, "
                          "gzipped or not, or an .npz); nothing is downloaded")
    if config.data and config.dataset not in ("mnist", "text"):
        raise ConfigError(f"{{data}} is only read with {{dataset}} mnist or text, not "
                          f"{config.dataset}")
    if config.resume and not config.checkpoint:
        raise ConfigError("{resume} needs {checkpoint} DIR")
    for field in ("checkpoint_every", "keep"):
        value = getattr(config, field)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{{{field}}}: expected a number >= 0, got {literal(repr(value))}")
        if value and not config.checkpoint:
            raise ConfigError(f"{{{field}}} needs {{checkpoint}} DIR")
    if config.checkpoint_every and config.sync_every > 1:
        raise ConfigError("{checkpoint_every} cannot be combined with {sync_every} H > 1 (between "
                          "two averages the replicas differ, and a checkpoint holds one of them)")
    if config.lr_schedule == "cosine" and config.warmup_epochs >= config.epochs:
        raise ConfigError("{lr_schedule} cosine needs {warmup_epochs} below {epochs}")
    if config.emulate is not None:
        try:
            emulation.resolve(config.emulate)
        except ValueError as exc:
            raise ConfigError(f"{{emulate}}: {literal(str(exc))}") from None


#: the model pieces a pipeline can cut the zoo's models into (the GPT: n_layer + 2)
PIPELINE_PIECES = {"mlp": 2, "lenet": 5}
PIPELINE_SCHEDULES = ("afab", "1f1b")


def validate_recompute(config: TrainConfig) -> None:
    """Activation recomputation: a known mode, on a model made of transformer blocks."""
    if config.recompute not in RECOMPUTE:
        raise ConfigError(f"{{recompute}}: expected one of {', '.join(RECOMPUTE)}, got "
                          f"{literal(repr(config.recompute))}")
    if config.recompute != "none" and config.model != "gpt":
        raise ConfigError(f"{{recompute}} {config.recompute} needs a model of transformer blocks "
                          f"({{model}} gpt), got {{model}} {config.model}")


def validate_grid(config: TrainConfig, world_size: int) -> None:
    """The process grid (dp × pp × tp), the pipeline's fields and what they cannot combine with."""
    for field in ("pp", "tp", "microbatches", *(("dp",) if config.dp is not None else ())):
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{{{field}}}: expected a positive number, got "
                              f"{literal(repr(value))}")
    if config.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"{{schedule}}: expected one of {', '.join(PIPELINE_SCHEDULES)}, got "
                          f"{literal(repr(config.schedule))}")
    if config.dp is None and world_size % (config.pp * config.tp):
        raise ConfigError(f"{{pp}} x {{tp}} = {config.pp} x {config.tp} = "
                          f"{config.pp * config.tp} must divide the number of ranks "
                          f"({world_size})")
    dp = config.dp if config.dp is not None else world_size // (config.pp * config.tp)
    if dp * config.pp * config.tp != world_size:
        raise ConfigError(f"{{dp}} x {{pp}} x {{tp}} = {dp} x {config.pp} x {config.tp} = "
                          f"{dp * config.pp * config.tp} must equal the number of ranks "
                          f"({world_size})")
    if not config.model_parallel():
        for field, default in (("microbatches", 1), ("schedule", "1f1b"),
                               ("verbose_comm", False)):
            if getattr(config, field) != default:
                raise ConfigError(f"{{{field}}} needs {{pp}} > 1 (a pipeline) or {{tp}} > 1")
        return
    if config.tp > 1 and config.model != "gpt":
        raise ConfigError(f"{{tp}} > 1 needs {{model}} gpt (attention heads and the MLP are "
                          f"split), not {config.model}")
    if config.tp > 1 and config.n_head % config.tp:
        raise ConfigError(f"{{tp}} {config.tp} must divide {{n_head}} {config.n_head} (each "
                          f"tensor-parallel rank computes n_head / tp heads)")
    pieces = config.n_layer + 2 if config.model == "gpt" else PIPELINE_PIECES.get(config.model)
    if pieces is None:
        raise ConfigError(f"{{pp}} needs {{model}} mlp, lenet or gpt (a sequence of layers), not "
                          f"{config.model}")
    if config.pp > pieces:
        raise ConfigError(f"{{pp}} {config.pp}: {{model}} {config.model} has {pieces} pieces to "
                          f"cut into stages" + (" (n_layer + 2)" if config.model == "gpt" else ""))
    if config.zero not in (0, 1):
        raise ConfigError(f"{{pp}} > 1 or {{tp}} > 1 combine with {{zero}} 1 only (the "
                          f"optimizer state sharded over the data-parallel axis), not "
                          f"{{zero}} {config.zero}")
    if config.zero_hybrid:
        raise ConfigError("{pp} > 1 or {tp} > 1 cannot be combined with {zero_hybrid}")
    for field, default in (("mode", "allreduce"), ("compression", "none"), ("sync_every", 1)):
        if getattr(config, field) != default:
            raise ConfigError(f"{{pp}} > 1 or {{tp}} > 1 cannot be combined with {{{field}}} "
                              f"(not supported with model parallelism yet)")


def validate_sequence(config: TrainConfig) -> None:
    """The GPT's shape fields and its datasets."""
    if (config.model == "gpt") != (config.dataset in SEQUENCE_DATASETS):
        if config.model == "gpt":
            raise ConfigError(f"{{model}} gpt trains on {{dataset}} addition or text, not "
                              f"{config.dataset}")
        raise ConfigError(f"{{dataset}} {config.dataset} is a token sequence task: it needs "
                          f"{{model}} gpt, not {config.model}")
    for field in ("n_layer", "n_head", "n_embd", "block_size", "digits"):
        value = getattr(config, field)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"{{{field}}}: expected a positive number, got {value}")
    if config.n_embd % config.n_head:
        raise ConfigError(f"{{n_embd}} {config.n_embd} must be divisible by {{n_head}} "
                          f"{config.n_head} (each head gets n_embd / n_head dimensions)")
    if config.digits > 9:
        raise ConfigError(f"{{digits}}: expected 1 to 9 digits, got {config.digits}")
    length = 3 * config.digits + 2
    if config.dataset == "addition" and config.block_size is not None \
            and config.block_size < length:
        raise ConfigError(f"{{block_size}} {config.block_size} is shorter than the sequences of "
                          f"{{dataset}} addition with {{digits}} {config.digits} (3 x digits + 2 "
                          f"= {length} tokens)")
    if config.dataset == "text" and not config.data:
        raise ConfigError("{dataset} text needs {data} FILE (a UTF-8 text file)")


def validate_communication(config: TrainConfig, world_size: int) -> None:
    """The compression, local SGD and parameter-server fields, and their combinations."""
    if config.mode not in MODES:
        raise ConfigError(f"{{mode}}: expected one of {', '.join(MODES)}, got "
                          f"{literal(repr(config.mode))}")
    if config.compression not in COMPRESSORS:
        raise ConfigError(f"{{compression}}: expected one of {', '.join(COMPRESSORS)}, got "
                          f"{literal(repr(config.compression))}")
    make_compression(config.compression, ratio=config.ratio, levels=config.levels,
                     rank=config.powersgd_rank)
    if config.sync_every < 1:
        raise ConfigError(f"{{sync_every}}: expected a positive number of steps, got "
                          f"{config.sync_every}")
    if config.post_local_warmup < 0:
        raise ConfigError(f"{{post_local_warmup}}: expected a number of steps >= 0, got "
                          f"{config.post_local_warmup}")
    if config.post_local_warmup and config.sync_every == 1:
        raise ConfigError("{post_local_warmup} needs {sync_every} H > 1 (local SGD)")
    if config.sync_every > 1 and config.compression != "none":
        raise ConfigError("{sync_every} (local SGD averages parameters) and {compression} "
                          "(compresses gradients) cannot be combined")
    validate_zero(config)
    if config.mode != "ps":
        if config.staleness is not None:
            raise ConfigError("{staleness} needs {mode} ps (bounded staleness is a "
                              "parameter-server mode)")
        if config.servers != 1:
            raise ConfigError("{servers} needs {mode} ps")
        if config.ps_async:
            raise ConfigError("{ps_async} needs {mode} ps (asynchronous parameter server)")
        return
    if config.ps_async and config.staleness is not None:
        raise ConfigError("{ps_async} and {staleness} exclude each other ({staleness} s bounds "
                          "the staleness, {ps_async} leaves it unbounded)")
    check_config(world_size, config.servers, config.ps_mode(), config.staleness)
    if config.compression != "none" or config.sync_every > 1:
        raise ConfigError("{mode} ps cannot be combined with {compression} or {sync_every}")
    if config.optimizer != "sgd":
        raise ConfigError(f"{{mode}} ps: the servers run sgd (with {{momentum}}), not "
                          f"{{optimizer}} {config.optimizer}")
    if config.device != "cpu":
        raise ConfigError("{mode} ps runs on {device} cpu only")
    if config.checkpoint or config.resume:
        raise ConfigError("{mode} ps cannot be combined with {checkpoint} or {resume} (the "
                          "servers' shards and momentum are not saved)")


def validate_zero(config: TrainConfig) -> None:
    """The ZeRO stage and what it cannot be combined with."""
    if config.zero == 0:
        if not config.prefetch:
            raise ConfigError("{prefetch} needs {zero} 3 (prefetch of the next unit's parameters)")
        if config.zero_hybrid:
            raise ConfigError("{zero_hybrid} needs {zero} 1, 2 or 3")
        return
    if config.zero not in ZERO_STAGES:
        raise ConfigError(f"{{zero}}: expected a stage 1, 2 or 3, got {config.zero!r}")
    if config.mode == "ps":
        raise ConfigError("{zero} cannot be combined with {mode} ps (the servers hold the "
                          "parameters)")
    if config.sync_every > 1:
        raise ConfigError("{zero} (sharded optimizer state) cannot be combined with {sync_every} "
                          "(local SGD keeps whole replicas)")
    if config.compression != "none":
        raise ConfigError(f"{{zero}} reduce-scatters gradients into shards; {{compression}} "
                          f"{config.compression} compresses all-reduced buckets and cannot apply")
    if config.algorithm not in ZERO_ALGORITHMS:
        raise ConfigError(f"{{algorithm}} {config.algorithm} has no reduce-scatter and "
                          f"all-gather; with {{zero}} use {', '.join(ZERO_ALGORITHMS)}")
    if not config.prefetch and config.zero != 3:
        raise ConfigError("{prefetch} needs {zero} 3 (prefetch of the next unit's parameters)")


def resume_mismatch(config: TrainConfig, saved: dict) -> str | None:
    """Why a run with `config` cannot continue a checkpoint written with `saved` (a ConfigError
    template), or None when it can."""
    for field in RESUME_FIELDS:
        if field in saved and saved[field] != getattr(config, field):
            return (f"{{resume}}: the checkpoint in {literal(str(config.checkpoint))} was written "
                    f"with {field}={literal(repr(saved[field]))}, this run has "
                    f"{literal(repr(getattr(config, field)))}")
    if config.lr_schedule == "cosine" and saved.get("epochs", config.epochs) != config.epochs:
        return (f"{{resume}}: the checkpoint in {literal(str(config.checkpoint))} was written "
                f"with epochs={saved['epochs']!r}, this run has {config.epochs!r}; the cosine "
                f"schedule's length is the number of epochs, so a different number would change "
                f"the learning rates already used. Resume with {{epochs}} {saved['epochs']}, or "
                f"continue with {{lr_schedule}} constant to train for more epochs")
    return None


def load_data(config: TrainConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) with images as (N, C, H, W) in config.dtype."""
    if config.dataset == "digits":
        xtr, ytr, xte, yte = datasets.load_digits(seed=0)
        xtr, xte = xtr.reshape(-1, 1, 8, 8), xte.reshape(-1, 1, 8, 8)
    elif config.dataset == "mnist":
        xtr, ytr, xte, yte = datasets.load_mnist(config.data)
    else:
        n_test = max(config.synthetic_samples // 4, 1)
        xtr, ytr, xte, yte = datasets.synthetic(config.synthetic_shape, config.synthetic_samples,
                                                n_test, seed=config.seed)
    dtype = np.dtype(config.dtype)
    return xtr.astype(dtype, copy=False), ytr, xte.astype(dtype, copy=False), yte

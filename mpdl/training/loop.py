"""The data-parallel training loop behind `mpdl train`.

Each step: this rank's slice of the global batch (DistributedSampler), forward, backward (the
DDP hooks start each bucket's all-reduce as it fills), `ddp.finish()` (wait, write the averaged
gradients back), optimizer step. Per epoch: loss, train and test accuracy, samples/s, and the
mean step time split into compute, communication (time the communication thread spent in
all-reduce) and exposed communication (time the main thread waited for it).

With --mode ps the last --servers ranks are parameter servers (mpdl.parallel.ps) that run SGD on
their shards and read no data; the other ranks, the workers, split each global batch among
themselves, and after backward push their gradient and pull the parameters (communication = the
push/pull time, all of it exposed). Metrics are over the workers; the summary's test accuracy is
that of the servers' final parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from mpdl.parallel.sampler import split_bounds

OPTIMIZERS = ("sgd", "adam", "lars", "lamb")
DATASETS = ("digits", "mnist", "synthetic")
SCHEDULES = ("constant", "cosine")
DEFAULT_LR = {"sgd": 0.2, "adam": 1e-3, "lars": 2.0, "lamb": 1e-2}
#: the batch size --lr refers to under --scale-lr (Goyal et al. 2017)
BASE_BATCH = 256
#: config fields a resumed run must share with the checkpoint
RESUME_FIELDS = ("model", "dataset", "synthetic_shape", "synthetic_samples", "global_batch_size",
                 "seed", "dtype")


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
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    overlap: bool = True
    seed: int = 0
    checkpoint: str | None = None
    resume: bool = False
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

    def ps_mode(self) -> str:
        """The parameter server's synchronisation: sync, ssp (--staleness) or async (--async)."""
        return "async" if self.ps_async else "ssp" if self.staleness is not None else "sync"

    def data_ranks(self, world_size: int) -> int:
        """Ranks that train on data: all of them, or the workers under --mode ps."""
        return world_size - self.servers if self.mode == "ps" else world_size

    def base_lr(self) -> float:
        lr = DEFAULT_LR[self.optimizer] if self.lr is None else self.lr
        if self.scale_lr:
            from mpdl.autograd.optim import scale_lr  # noqa: PLC0415

            lr = scale_lr(lr, self.global_batch_size, BASE_BATCH)
        return lr


def validate(config: TrainConfig, world_size: int) -> None:
    """ValueError with a one-line message for an inconsistent configuration (no communication:
    every rank reaches the same verdict)."""
    from mpdl.collectives.registry import algorithms  # noqa: PLC0415
    from mpdl.training.models import MODELS  # noqa: PLC0415

    choices = {"model": MODELS, "dataset": DATASETS, "optimizer": OPTIMIZERS,
               "lr_schedule": SCHEDULES, "device": ("cpu", "gpu"),
               "dtype": ("float32", "float64"), "synthetic_shape": ("mnist", "cifar"),
               "algorithm": ("auto", *algorithms("allreduce"))}
    for field, allowed in choices.items():
        value = getattr(config, field)
        if value not in allowed:
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"{flag}: expected one of {', '.join(allowed)}, got {value!r}")
    positive = {"epochs": config.epochs, "global_batch_size": config.global_batch_size,
                "bucket_mb": config.bucket_mb, "first_bucket_mb": config.first_bucket_mb,
                "synthetic_samples": config.synthetic_samples}
    for field, value in positive.items():
        if not value > 0:
            raise ValueError(f"--{field.replace('_', '-')}: expected a positive number, got {value}")
    for field in ("momentum", "weight_decay", "warmup_epochs"):
        if getattr(config, field) < 0:
            raise ValueError(f"--{field.replace('_', '-')}: expected a number >= 0, got "
                             f"{getattr(config, field)}")
    if config.lr is not None and not config.lr > 0:
        raise ValueError(f"--lr: expected a positive learning rate, got {config.lr}")
    validate_communication(config, world_size)
    ranks = config.data_ranks(world_size)
    if config.global_batch_size < ranks:
        what = "workers" if config.mode == "ps" else "ranks"
        raise ValueError(f"--global-batch-size {config.global_batch_size} is smaller than the "
                         f"number of {what} ({ranks}): every {what[:-1]} needs at least one "
                         f"sample")
    if config.dataset == "mnist" and not config.data:
        raise ValueError("--dataset mnist needs --data PATH (a folder with the IDX files, "
                         "gzipped or not, or an .npz); nothing is downloaded")
    if config.data and config.dataset != "mnist":
        raise ValueError(f"--data is only read with --dataset mnist, not {config.dataset}")
    if config.resume and not config.checkpoint:
        raise ValueError("--resume needs --checkpoint DIR")
    if config.lr_schedule == "cosine" and config.warmup_epochs >= config.epochs:
        raise ValueError("--lr-schedule cosine needs --warmup-epochs below --epochs")
    parse_emulation(config.emulate)


def parse_emulation(spec: str | None) -> Any:
    """The mpdl.emulation.Emulation of --emulate SPEC: None for off, ValueError for a bad spec."""
    from mpdl import emulation  # noqa: PLC0415

    if spec is None or spec.strip().lower() in ("off", "none", "0"):
        return None
    try:
        return emulation.parse(spec)
    except ValueError as exc:
        raise ValueError(f"--emulate: {exc}") from None


def validate_communication(config: TrainConfig, world_size: int) -> None:
    """The compression, local SGD and parameter-server flags, and their combinations."""
    from mpdl.parallel.compression import COMPRESSORS, make_compression  # noqa: PLC0415
    from mpdl.parallel.ps import check_config  # noqa: PLC0415

    if config.mode not in ("allreduce", "ps"):
        raise ValueError(f"--mode: expected one of allreduce, ps, got {config.mode!r}")
    if config.compression not in COMPRESSORS:
        raise ValueError(f"--compression: expected one of {', '.join(COMPRESSORS)}, got "
                         f"{config.compression!r}")
    make_compression(config.compression, ratio=config.ratio, levels=config.levels,
                     rank=config.powersgd_rank)
    if config.sync_every < 1:
        raise ValueError(f"--sync-every: expected a positive number of steps, got "
                         f"{config.sync_every}")
    if config.post_local_warmup < 0:
        raise ValueError(f"--post-local-warmup: expected a number of steps >= 0, got "
                         f"{config.post_local_warmup}")
    if config.post_local_warmup and config.sync_every == 1:
        raise ValueError("--post-local-warmup needs --sync-every H > 1 (local SGD)")
    if config.sync_every > 1 and config.compression != "none":
        raise ValueError("--sync-every (local SGD averages parameters) and --compression "
                         "(compresses gradients) cannot be combined")
    if config.mode != "ps":
        if config.staleness is not None:
            raise ValueError("--staleness needs --mode ps (bounded staleness is a "
                             "parameter-server mode)")
        if config.servers != 1:
            raise ValueError("--servers needs --mode ps")
        if config.ps_async:
            raise ValueError("--async needs --mode ps (asynchronous parameter server)")
        return
    if config.ps_async and config.staleness is not None:
        raise ValueError("--async and --staleness exclude each other (--staleness s bounds the "
                         "staleness, --async leaves it unbounded)")
    check_config(world_size, config.servers, config.ps_mode(), config.staleness)
    if config.compression != "none" or config.sync_every > 1:
        raise ValueError("--mode ps cannot be combined with --compression or --sync-every")
    if config.optimizer != "sgd":
        raise ValueError(f"--mode ps: the servers run sgd (with --momentum), not "
                         f"--optimizer {config.optimizer}")
    if config.device != "cpu":
        raise ValueError("--mode ps runs on --device cpu only")
    if config.checkpoint or config.resume:
        raise ValueError("--mode ps cannot be combined with --checkpoint or --resume (the "
                         "servers' shards and momentum are not saved)")


def load_data(config: TrainConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) with images as (N, C, H, W) in config.dtype."""
    from mpdl import datasets  # noqa: PLC0415

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


def apply_emulation(comm: Any, emulated: Any) -> None:
    """Slow comm's messages down as `emulated` (an mpdl.emulation.Emulation; None: off) says,
    and every communicator made from now on, through MPDL_EMULATE. Collective over comm."""
    from mpdl import emulation  # noqa: PLC0415
    from mpdl.collectives import costmodel  # noqa: PLC0415

    if emulated is None:
        os.environ.pop(emulation.ENV, None)
    else:
        os.environ[emulation.ENV] = emulated.describe()
    costmodel.forget()
    emulation.install(comm, emulated)


def agree(comm: Any, error: str | None) -> str | None:
    """The first rank's error message if any rank has one (every rank gets the same answer)."""
    errors = comm.allgather_object(error)
    return next((e for e in errors if e), None)


class ConfigError(ValueError):
    """A configuration, data or checkpoint problem found on some rank, reported on all."""


class Trainer:
    """One training run over `comm` (default MPI.COMM_WORLD)."""

    def __init__(self, config: TrainConfig, comm: Any = None, out: TextIO | None = None) -> None:
        from mpdl.comm import as_communicator  # noqa: PLC0415

        self.config = config
        self.comm = as_communicator(comm)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.out = out if out is not None else sys.stdout
        self.rows: list[dict[str, Any]] = []
        self.timeline = None
        self.ddp: Any = None
        self.ps: Any = None
        if config.emulate is not None:
            apply_emulation(self.comm, parse_emulation(config.emulate))

    # -- setup ------------------------------------------------------------------------------------
    def _checked(self, fn: Callable[[], Any]) -> Any:
        """fn() on every rank; if it fails on any rank, ConfigError with that message on all."""
        from mpdl.datasets import DatasetError  # noqa: PLC0415
        from mpdl.training.checkpoint import CheckpointError  # noqa: PLC0415

        result, error = None, None
        try:
            result = fn()
        except (DatasetError, CheckpointError, ValueError, OSError) as exc:
            error = str(exc) or type(exc).__name__
        error = agree(self.comm, error)
        if error:
            raise ConfigError(error)
        return result

    def setup(self) -> None:
        from mpdl.autograd import optim  # noqa: PLC0415
        from mpdl.parallel import DistributedDataParallel, DistributedSampler  # noqa: PLC0415
        from mpdl.training import checkpoint  # noqa: PLC0415
        from mpdl.training.models import build_model  # noqa: PLC0415

        c = self.config
        validate(c, self.size)
        server = self.rank >= c.data_ranks(self.size)  # parameter servers read no data
        data = self._checked(lambda: None if server else load_data(c))
        if data is not None:
            self.xtr, self.ytr, self.xte, self.yte = data
            classes = int(max(self.ytr.max(), self.yte.max() if len(self.yte) else 0)) + 1
            shape = (tuple(self.xtr.shape[1:]), classes, len(self.xtr))
        if c.mode == "ps":
            shape = self.comm.allgather_object(None if server else shape)[0]
        self.model = build_model(c.model, shape[0], shape[1], seed=c.seed,
                                 dtype=np.dtype(c.dtype))
        if c.device == "gpu":
            from mpdl.backend import use_local_gpu  # noqa: PLC0415

            node = self.comm.node_groups()[self.comm.node_of_rank()[self.rank]]
            use_local_gpu(node.index(self.rank), len(node))
            self.model.to("gpu")
        if c.mode == "ps":
            self._setup_ps(shape[2])
            return
        self.sampler = DistributedSampler(len(self.xtr), c.global_batch_size, rank=self.rank,
                                          num_replicas=self.size, seed=c.seed,
                                          drop_last=c.drop_last)
        self.steps_per_epoch = len(self.sampler)
        from mpdl.parallel.compression import make_compression  # noqa: PLC0415
        from mpdl.parallel.localsgd import LocalSGD  # noqa: PLC0415

        dgc = c.compression == "topk" and c.optimizer == "sgd" and c.momentum > 0
        compression = make_compression(c.compression, ratio=c.ratio, levels=c.levels,
                                       rank=c.powersgd_rank, momentum=c.momentum if dgc else 0.0,
                                       algorithm=c.algorithm)
        self.ddp = DistributedDataParallel(self.model, comm=self.comm, algorithm=c.algorithm,
                                           bucket_mb=c.bucket_mb,
                                           first_bucket_mb=c.first_bucket_mb, overlap=c.overlap,
                                           compression=compression)
        self.local_sgd = (LocalSGD(self.model, comm=self.comm, sync_every=c.sync_every,
                                   warmup_steps=c.post_local_warmup, algorithm=c.algorithm,
                                   broadcast_initial=False) if c.sync_every > 1 else None)
        params = self.model.parameters()
        lr = c.base_lr()
        if c.optimizer == "sgd":
            # DGC: top-k's momentum correction takes the momentum over from the optimizer
            self.optimizer = optim.SGD(params, lr=lr, momentum=0.0 if dgc else c.momentum,
                                       weight_decay=c.weight_decay)
        elif c.optimizer == "adam":
            self.optimizer = optim.Adam(params, lr=lr, weight_decay=c.weight_decay)
        elif c.optimizer == "lars":
            self.optimizer = optim.LARS(params, lr=lr, momentum=c.momentum,
                                        weight_decay=c.weight_decay)
        else:
            self.optimizer = optim.LAMB(params, lr=lr, weight_decay=c.weight_decay)
        total = c.epochs * self.steps_per_epoch
        warmup = int(round(c.warmup_epochs * self.steps_per_epoch))
        self.schedule = optim.WarmupSchedule(lr, warmup_steps=min(warmup, total),
                                             total_steps=total, kind=c.lr_schedule)
        self.start_epoch, self.step = 0, 0
        if c.resume:
            seen = self.comm.allgather_object(checkpoint.has_checkpoint(c.checkpoint))
            if any(seen) and not all(seen):
                raise ConfigError(f"--checkpoint {c.checkpoint}: the checkpoint is visible on "
                                  f"some ranks only; put it on a filesystem every rank shares")
            if all(seen):
                self._checked(self._resume)
            elif self.rank == 0:
                print(f"# no checkpoint in {c.checkpoint} yet: starting from epoch 1",
                      file=self.out)

    def _setup_ps(self, train_samples: int) -> None:
        from mpdl.autograd import optim  # noqa: PLC0415
        from mpdl.parallel import DistributedSampler  # noqa: PLC0415
        from mpdl.parallel.ps import ParameterServer  # noqa: PLC0415

        c = self.config
        self.ps = ParameterServer(self.model, comm=self.comm, servers=c.servers,
                                  mode=c.ps_mode(), staleness=c.staleness)
        self.workers = self.ps.workers
        self.sampler = DistributedSampler(train_samples, c.global_batch_size,
                                          rank=min(self.rank, self.workers - 1),
                                          num_replicas=self.workers, seed=c.seed,
                                          drop_last=c.drop_last)
        self.steps_per_epoch = len(self.sampler)
        lr = c.base_lr()
        total = c.epochs * self.steps_per_epoch
        warmup = int(round(c.warmup_epochs * self.steps_per_epoch))
        self.schedule = optim.WarmupSchedule(lr, warmup_steps=min(warmup, total),
                                             total_steps=total, kind=c.lr_schedule)
        self.lr = lr
        self.start_epoch, self.step = 0, 0

    def server_momentum(self) -> float:
        """The servers' SGD momentum: --momentum when synchronous; at most 0.5 otherwise, since
        stale gradients already act as momentum (Mitliagkas et al. 2016)."""
        c = self.config
        return c.momentum if c.ps_mode() == "sync" else min(c.momentum, 0.5)

    def _resume(self) -> None:
        from mpdl.training.checkpoint import CheckpointError, load_checkpoint  # noqa: PLC0415

        model_state, optim_state, state = load_checkpoint(self.config.checkpoint)
        saved = state.get("config", {})
        for field in RESUME_FIELDS + (("epochs",) if self.config.lr_schedule == "cosine" else ()):
            if field in saved and saved[field] != getattr(self.config, field):
                raise CheckpointError(f"--resume: the checkpoint in {self.config.checkpoint} was "
                                      f"written with {field}={saved[field]!r}, this run has "
                                      f"{getattr(self.config, field)!r}")
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optim_state)
        self.sampler.load_state_dict(state["sampler"])
        for name, module in self.model.named_modules():
            rng = getattr(module, "rng", None)
            if isinstance(rng, np.random.Generator) and name in state.get("rng", {}):
                rng.bit_generator.state = state["rng"][name]
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.rows = [r for r in state.get("history", []) if r.get("epoch", 0) <= self.start_epoch]

    def _save(self, epoch: int) -> None:
        from mpdl.training.checkpoint import save_checkpoint  # noqa: PLC0415

        rngs = {name: module.rng.bit_generator.state for name, module in self.model.named_modules()
                if isinstance(getattr(module, "rng", None), np.random.Generator)}
        state = {"epoch": epoch, "step": self.step, "sampler": self.sampler.state_dict(),
                 "rng": rngs, "config": dataclasses.asdict(self.config), "ranks": self.size,
                 "history": self.rows}
        save_checkpoint(self.config.checkpoint, self.model.state_dict(),
                        self.optimizer.state_dict(), state)

    # -- running ------------------------------------------------------------------------------------
    def _to_device(self, a: np.ndarray) -> Any:
        if self.config.device == "gpu":
            from mpdl.backend import cupy_module  # noqa: PLC0415

            return cupy_module().asarray(a)
        return a

    def _start_epoch(self, epoch: int) -> tuple[dict[str, float], Any]:
        """Enter training mode and the epoch's sample order; return zeroed sums and the progress
        bar (on rank 0 only, and not with --no-progress)."""
        self.model.train()
        self.sampler.set_epoch(epoch)
        sums = dict.fromkeys(("loss", "correct", "n", "compute", "comm", "exposed", "wall"), 0.0)
        if not (self.config.progress and self.rank == 0):
            return sums, None
        from tqdm import tqdm  # noqa: PLC0415

        return sums, tqdm(total=self.steps_per_epoch, desc=f"epoch {epoch + 1}", file=sys.stderr,
                          leave=False, disable=None, unit="step")

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch; returns this rank's sums (loss·n, correct, n, times)."""
        from mpdl.autograd import functional as F  # noqa: PLC0415
        from mpdl.autograd.tensor import Tensor  # noqa: PLC0415

        sums, bar = self._start_epoch(epoch)
        tl = self.timeline
        epoch_start = time.perf_counter()
        for idx, global_batch in self.sampler:
            self.optimizer.lr = self.schedule(self.step)
            self.ddp.set_local_batch(len(idx), global_batch)
            t0 = time.perf_counter()
            t1 = t2 = t0
            local = self.local_sgd is not None and self.local_sgd.local
            with self.ddp.no_sync() if local else contextlib.nullcontext():
                if len(idx):
                    x, y = self._to_device(self.xtr[idx]), self.ytr[idx]
                    logits = self.model(Tensor(x))
                    loss = F.cross_entropy(logits, self._to_device(y))
                    t1 = time.perf_counter()
                    loss.backward()
                    t2 = time.perf_counter()
                    sums["loss"] += float(loss.item()) * len(idx)
                    pred = logits.data.argmax(axis=1)
                    sums["correct"] += float((pred == self._to_device(y)).sum())
                    sums["n"] += len(idx)
                self.ddp.finish()
            t3 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.local_sgd is not None:
                self.local_sgd.step()
            t4 = time.perf_counter()
            exposed = 0.0 if local else self.ddp.last_exposed_s
            sums["compute"] += (t4 - t0) - exposed
            sums["comm"] += 0.0 if local else self.ddp.last_comm_s
            sums["exposed"] += exposed
            if tl is not None:
                tl.add("forward", t0, t1, step=self.step)
                tl.add("backward", t1, t2, step=self.step)
                tl.add("finish (wait for all-reduce)", t2, t3, cat="wait", step=self.step)
                tl.add("optimizer step", t3, t4, step=self.step)
                for b in self.ddp.buckets:
                    tl.add(f"all-reduce bucket {b.index}", b.span[0], b.span[1], thread="comm",
                           cat="communication", bytes=b.nbytes, step=self.step)
            self.step += 1
            if bar is not None:
                bar.update()
        sums["wall"] = time.perf_counter() - epoch_start
        if bar is not None:
            bar.close()
        return sums

    def evaluate(self, rank: int | None = None, parts: int | None = None) -> tuple[float, float]:
        """(correct, count) of this rank's contiguous share of the test set (share `rank` of
        `parts`; default: this rank of all)."""
        from mpdl.autograd.tensor import Tensor, no_grad  # noqa: PLC0415

        self.model.eval()
        rank = self.rank if rank is None else rank
        bounds = split_bounds(len(self.xte), self.size if parts is None else parts)
        lo, hi = bounds[rank], bounds[rank + 1]
        correct = 0.0
        with no_grad():
            for start in range(lo, hi, 512):
                stop = min(start + 512, hi)
                logits = self.model(Tensor(self._to_device(self.xte[start:stop])))
                correct += float((logits.data.argmax(axis=1) ==
                                  self._to_device(self.yte[start:stop])).sum())
        return correct, float(hi - lo)

    def run(self) -> list[dict[str, Any]]:
        """Train from start_epoch to config.epochs; return one row per epoch plus a summary."""
        from mpdl.collectives import allreduce  # noqa: PLC0415
        from mpdl.training.timeline import Timeline  # noqa: PLC0415

        c = self.config
        if c.timeline:
            self.comm.barrier()
            self.timeline = Timeline(self.rank, time.perf_counter())
        if self.ps is not None:
            return self._run_ps()
        if self.rank == 0:
            self._print_header()
        run_start = time.perf_counter()
        for epoch in range(self.start_epoch, c.epochs):
            s = self.train_epoch(epoch)
            test_correct, test_n = self.evaluate()
            vec = np.array([s["loss"], s["correct"], s["n"], s["compute"], s["comm"],
                            s["exposed"], s["wall"], test_correct, test_n], dtype=np.float64)
            tot = allreduce(vec, op="sum", comm=self.comm)
            self._add_row(epoch, tot, self.size, self.optimizer.lr)
        summary = self._summary(time.perf_counter() - run_start)
        self._finish(summary)
        return [*self.rows, summary]

    def _add_row(self, epoch: int, tot: np.ndarray, ranks: int, lr: float) -> None:
        """Record, print and write the epoch's row from the sums over the `ranks` that train."""
        c = self.config
        steps = self.steps_per_epoch
        row = {"epoch": epoch + 1, "loss": tot[0] / tot[2], "train_acc": tot[1] / tot[2],
               "test_acc": tot[7] / tot[8] if tot[8] else float("nan"),
               "samples_per_s": tot[2] / (tot[6] / ranks),
               "compute_s": tot[3] / ranks / steps, "comm_s": tot[4] / ranks / steps,
               "exposed_comm_s": tot[5] / ranks / steps, "ranks": self.size,
               "algorithm": f"ps-{c.ps_mode()}" if self.ps is not None else c.algorithm,
               "lr": lr, "mode": c.mode, "emulated": self.emulated()}
        if self.ps is not None:
            row.update(workers=self.workers, servers=c.servers, ps_mode=c.ps_mode())
        self.rows.append(row)
        if self.rank == 0:
            self._print_row(row)
            if c.checkpoint:
                self._save(epoch + 1)
            if c.json:
                from mpdl.cli.output import write_json_lines  # noqa: PLC0415

                write_json_lines(c.json, self.rows)

    def _finish(self, summary: dict[str, Any]) -> None:
        """Print and write the summary, gather and write the timeline."""
        from mpdl.training.timeline import write_trace  # noqa: PLC0415

        c = self.config
        if self.rank == 0:
            self._print_summary(summary)
            if c.json:
                from mpdl.cli.output import write_json_lines  # noqa: PLC0415

                write_json_lines(c.json, [*self.rows, summary])
        if self.timeline is not None:
            events = self.comm.allgather_object(self.timeline.metadata() + self.timeline.events)
            if self.rank == 0:
                write_trace(c.timeline, events)

    def emulated(self) -> str:
        """The emulated links of this run ('' when none), e.g. 'inter=10Gbit/s,20us'."""
        from mpdl import emulation  # noqa: PLC0415

        active = emulation.active(self.comm)
        return active.describe() if active is not None else ""

    # -- parameter server -------------------------------------------------------------------------
    def _run_ps(self) -> list[dict[str, Any]]:
        """Servers serve until every worker is done; workers train, push and pull each step."""
        from mpi4py import MPI  # noqa: PLC0415

        from mpdl.autograd import optim  # noqa: PLC0415

        c, ps = self.config, self.ps
        run_start = time.perf_counter()
        if ps.is_server:
            ps.serve(lambda params: optim.SGD(params, lr=self.lr, momentum=self.server_momentum(),
                                              weight_decay=c.weight_decay))
            summary = self._summary(time.perf_counter() - run_start)
        else:
            if self.rank == 0:
                self._print_header()
            wrank = ps.worker_comm.Get_rank()
            for epoch in range(self.start_epoch, c.epochs):
                s = self._train_epoch_ps(epoch)
                test_correct, test_n = self.evaluate(wrank, self.workers)
                tot = np.array([s["loss"], s["correct"], s["n"], s["compute"], s["comm"],
                                s["exposed"], s["wall"], test_correct, test_n], dtype=np.float64)
                ps.worker_comm.Allreduce(MPI.IN_PLACE, tot, op=MPI.SUM)
                self._add_row(epoch, tot, self.workers, self.lr)
            ps.close()  # every worker now holds the servers' final parameters
            final = np.array(self.evaluate(wrank, self.workers), dtype=np.float64)
            ps.worker_comm.Allreduce(MPI.IN_PLACE, final, op=MPI.SUM)
            summary = self._summary(time.perf_counter() - run_start)
            summary["test_acc"] = final[0] / final[1] if final[1] else None
        self._finish(summary)
        ps.free()
        return [*self.rows, summary]

    def _train_epoch_ps(self, epoch: int) -> dict[str, float]:
        """One epoch on a worker: forward and backward on its slice of each global batch, then
        push the gradient and pull the parameters; returns this worker's sums."""
        from mpdl.autograd import functional as F  # noqa: PLC0415
        from mpdl.autograd.tensor import Tensor  # noqa: PLC0415

        synchronous = self.config.ps_mode() == "sync"
        sums, bar = self._start_epoch(epoch)
        tl = self.timeline
        epoch_start = time.perf_counter()
        for idx, global_batch in self.sampler:
            self.lr = self.schedule(self.step)
            t0 = time.perf_counter()
            t1 = t2 = t0
            if len(idx):
                x, y = self.xtr[idx], self.ytr[idx]
                logits = self.model(Tensor(x))
                loss = F.cross_entropy(logits, y)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                sums["loss"] += float(loss.item()) * len(idx)
                sums["correct"] += float((logits.data.argmax(axis=1) == y).sum())
                sums["n"] += len(idx)
            share = len(idx) / global_batch
            # async and ssp apply each worker's mean gradient as a step of its own: the rate is
            # scaled by the worker's share of the global batch (twice it: stale gradients damp)
            self.ps.push_pull(self.lr if synchronous else 2 * self.lr * share, weight=share)
            self.model.zero_grad()
            t3 = time.perf_counter()
            sums["compute"] += t2 - t0
            sums["comm"] += t3 - t2
            sums["exposed"] += t3 - t2
            if tl is not None:
                tl.add("forward", t0, t1, step=self.step)
                tl.add("backward", t1, t2, step=self.step)
                tl.add("push/pull", t2, t3, cat="communication", step=self.step)
            self.step += 1
            if bar is not None:
                bar.update()
        sums["wall"] = time.perf_counter() - epoch_start
        if bar is not None:
            bar.close()
        return sums

    def _summary(self, seconds: float) -> dict[str, Any]:
        last = self.rows[-1] if self.rows else {}
        if self.ps is not None:
            stats = self.ps.stats
            comm = {"algorithm": f"ps-{self.config.ps_mode()}", "mode": "ps",
                    "ps_mode": stats["mode"], "servers": stats["servers"],
                    "workers": stats["workers"], "staleness_bound": stats["staleness_bound"],
                    "updates": stats["updates"], "worker_steps": stats["worker_steps"],
                    "staleness": {str(k): v for k, v in stats["staleness"].items()}}
        else:
            buckets = [b.nbytes for b in self.ddp.buckets]
            comm = {"algorithm": self.config.algorithm, "mode": "allreduce",
                    "bucket_algorithms": self.ddp.bucket_algorithms(),
                    "buckets": len(buckets), "bucket_bytes": buckets}
        return {"summary": True, "epochs": self.config.epochs, "ranks": self.size, **comm,
                "emulated": self.emulated(),
                "model": self.config.model, "dataset": self.config.dataset,
                "global_batch_size": self.config.global_batch_size,
                "optimizer": self.config.optimizer, "overlap": self.config.overlap,
                "loss": last.get("loss"), "train_acc": last.get("train_acc"),
                "test_acc": last.get("test_acc"),
                "samples_per_s": (float(np.mean([r["samples_per_s"] for r in self.rows]))
                                  if self.rows else None),
                "seconds": seconds}

    # -- output ---------------------------------------------------------------------------------
    def _print_header(self) -> None:
        c = self.config
        emulated = self.emulated()
        if self.ps is not None:
            mode = c.ps_mode() + (f" (staleness <= {c.staleness})" if c.ps_mode() == "ssp"
                                  else "")
            servers = f"{c.servers} server{'s' if c.servers > 1 else ''}"
            ranks = (f"{self.size} ranks ({self.workers} worker{'s' if self.workers > 1 else ''}, "
                     f"{servers})")
            per_rank = f"{c.global_batch_size / self.workers:g} per worker"
            comm = (f"parameter server {mode}, server momentum {self.server_momentum():g}")
        else:
            ranks = f"{self.size} rank{'s' if self.size > 1 else ''}"
            per_rank = f"{c.global_batch_size / self.size:g} per rank"
            bucket_sizes = ", ".join(f"{b.nbytes / 1024:.0f} KiB" for b in self.ddp.buckets)
            comm = (f"all-reduce {c.algorithm}, buckets [{bucket_sizes}], overlap "
                    f"{'on' if c.overlap else 'off'}")
        print(f"# mpdl train: {c.model} on {c.dataset} ({len(self.xtr)} train / {len(self.xte)} "
              f"test), {ranks}, global batch {c.global_batch_size} ({per_rank}), {c.optimizer} "
              f"lr {c.base_lr():g}, {comm}"
              + (f", EMULATED links {emulated}" if emulated else ""), file=self.out)
        if self.start_epoch:
            print(f"# resumed from {c.checkpoint} after epoch {self.start_epoch}", file=self.out)
        print(f"{'epoch':>5} {'loss':>8} {'train_acc':>9} {'test_acc':>8} {'samples/s':>10} "
              f"{'step_ms':>8} {'compute':>8} {'comm':>8} {'exposed':>8}", file=self.out)
        self.out.flush()

    def _print_row(self, r: dict[str, Any]) -> None:
        step_ms = (r["compute_s"] + r["exposed_comm_s"]) * 1e3
        print(f"{r['epoch']:>5} {r['loss']:>8.4f} {r['train_acc']:>9.4f} {r['test_acc']:>8.4f} "
              f"{r['samples_per_s']:>10.0f} {step_ms:>8.2f} {r['compute_s'] * 1e3:>8.2f} "
              f"{r['comm_s'] * 1e3:>8.2f} {r['exposed_comm_s'] * 1e3:>8.2f}", file=self.out)
        self.out.flush()

    def _print_summary(self, s: dict[str, Any]) -> None:
        if self.ps is not None:
            from mpdl.parallel.ps import format_histogram  # noqa: PLC0415

            print(f"# parameter server {s['ps_mode']}: {sum(s['updates'])} updates on "
                  f"{s['servers']} server(s); {format_histogram(self.ps.stats['staleness'])}",
                  file=self.out)
        acc = s["test_acc"]
        acc_text = f"test accuracy {acc:.4f}, " if acc is not None else ""
        print(f"# done: {acc_text}{s['seconds']:.2f} s; times are per step (ms), averaged over "
              f"ranks; exposed = communication not hidden behind backward", file=self.out)
        self.out.flush()


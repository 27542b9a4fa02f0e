"""The training loop behind `mpdl train`: one epoch loop over a strategy.

Each step: this rank's slice of the global batch (DistributedSampler over the ranks that train),
then the strategy's step (forward, backward, communication, update; see mpdl.parallel.strategy).
Per epoch: loss, train and test accuracy, samples/s, and the mean step time split into compute,
communication and exposed communication (the part the step waited for), summed over the ranks
that train. `make_strategy` maps a configuration to its strategy: all-reduce DDP (optionally
compressed), local SGD (sync_every > 1) or the parameter server (mode "ps": the last `servers`
ranks serve and read no data; the summary's test accuracy is that of their final parameters).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from mpdl import emulation
from mpdl.autograd import optim
from mpdl.autograd.tensor import Tensor, no_grad
from mpdl.backend import cupy_module, use_local_gpu
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator
from mpdl.datasets import DatasetError
from mpdl.parallel import DistributedSampler, split_bounds
from mpdl.parallel.strategy import Batch
from mpdl.training import checkpoint
from mpdl.training.config import ConfigError, TrainConfig, literal, load_data, resume_mismatch, validate
from mpdl.training.factory import make_optimizer, make_strategy
from mpdl.training.models import build_model
from mpdl.training.report import Report, ranks_text, write_timeline
from mpdl.training.timeline import Timeline

__all__ = ["ConfigError", "TrainConfig", "Trainer", "validate"]

#: the sums of an epoch, over this rank's steps
SUMS = ("loss", "correct", "n", "compute", "comm", "exposed", "wall")


class Trainer:
    """One training run over `comm` (default MPI.COMM_WORLD): `setup()`, then `run()`."""

    def __init__(self, config: TrainConfig, comm: Any = None, out: TextIO | None = None) -> None:
        self.config = config
        self.comm = as_communicator(comm)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.report = Report(out if out is not None else sys.stdout, config.json, self.rank == 0)
        self.rows: list[dict[str, Any]] = []
        self.timeline: Timeline | None = None
        self.strategy: Any = None
        self._restore: Callable[[], None] | None = None

    @property
    def optimizer(self) -> Any:
        return self.strategy.optimizer

    def _checked(self, fn: Callable[[], Any]) -> Any:
        """fn() on every rank; if it fails on any rank, ConfigError with that message on all."""
        result, error = None, None
        try:
            result = fn()
        except ConfigError as exc:
            error = exc.template
        except (DatasetError, checkpoint.CheckpointError, ValueError, OSError) as exc:
            error = literal(str(exc) or type(exc).__name__)
        errors = self.comm.allgather_object(error)
        error = next((e for e in errors if e), None)
        if error:
            raise ConfigError(error)
        return result

    def setup(self) -> None:
        """Check the configuration, load the data, build the model and the strategy, resume."""
        c = self.config
        validate(c, self.size)
        if c.emulate is not None:
            self._restore = emulation.apply(self.comm, emulation.resolve(c.emulate))
        try:
            self._setup()
        except BaseException:
            self._end_emulation()
            raise

    def _setup(self) -> None:
        c = self.config
        self.strategy = self._checked(lambda: make_strategy(c, self.comm))
        trains = self.strategy.trains
        data = self._checked(lambda: load_data(c) if trains else None)
        shape = None
        if data is not None:
            self.xtr, self.ytr, self.xte, self.yte = data
            classes = int(max(self.ytr.max(), self.yte.max() if len(self.yte) else 0)) + 1
            shape = (tuple(self.xtr.shape[1:]), classes)
        shape = self.comm.allgather_object(shape)[0]  # servers read no data
        self.model = build_model(c.model, shape[0], shape[1], seed=c.seed, dtype=np.dtype(c.dtype))
        if c.device == "gpu":
            node = self.comm.node_groups()[self.comm.node_of_rank()[self.rank]]
            use_local_gpu(node.index(self.rank), len(node))
            self.model.to("gpu")
        self.strategy.setup(self.model, make_optimizer(c))
        self.lr = c.base_lr()
        self.start_epoch, self.step = 0, 0
        if not trains:
            return
        data_comm = self.strategy.data_comm
        self.sampler = DistributedSampler(len(self.xtr), c.global_batch_size, rank=data_comm.rank,
                                          num_replicas=data_comm.size, seed=c.seed,
                                          drop_last=c.drop_last)
        self.steps_per_epoch = len(self.sampler)
        total = c.epochs * self.steps_per_epoch
        warmup = int(round(c.warmup_epochs * self.steps_per_epoch))
        self.schedule = optim.WarmupSchedule(self.lr, warmup_steps=min(warmup, total),
                                             total_steps=total, kind=c.lr_schedule)
        if c.resume:
            seen = self.comm.allgather_object(checkpoint.has_checkpoint(c.checkpoint))
            if any(seen) and not all(seen):
                raise ConfigError(f"{{checkpoint}} {literal(c.checkpoint)}: the checkpoint is "
                                  f"visible on some ranks only; put it on a filesystem every "
                                  f"rank shares")
            if all(seen):
                self._checked(self._resume)
            else:
                self.report.print(f"# no checkpoint in {c.checkpoint} yet: starting from epoch 1")

    def _resume(self) -> None:
        model_state, optim_state, state = checkpoint.load_checkpoint(self.config.checkpoint)
        mismatch = resume_mismatch(self.config, state.get("config", {}))
        if mismatch:
            raise ConfigError(mismatch)
        with self.strategy.gathered():
            self.model.load_state_dict(model_state)
        self.strategy.load_state_dict(optim_state)
        self.sampler.load_state_dict(state["sampler"])
        for name, module in self.model.named_modules():
            rng = getattr(module, "rng", None)
            if isinstance(rng, np.random.Generator) and name in state.get("rng", {}):
                rng.bit_generator.state = state["rng"][name]
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.rows = [r for r in state.get("history", []) if r.get("epoch", 0) <= self.start_epoch]

    def _run_state(self, epoch: int) -> dict[str, Any]:
        """What a checkpoint holds besides the model and the optimizer."""
        rngs = {name: module.rng.bit_generator.state for name, module in self.model.named_modules()
                if isinstance(getattr(module, "rng", None), np.random.Generator)}
        return {"epoch": epoch, "step": self.step, "sampler": self.sampler.state_dict(),
                "rng": rngs, "config": dataclasses.asdict(self.config), "ranks": self.size,
                "history": self.rows}

    def _save(self, epoch: int) -> None:
        checkpoint.save_checkpoint(self.config.checkpoint, self.model.state_dict(),
                                   self.strategy.state_dict(), self._run_state(epoch))

    def _to_device(self, a: np.ndarray) -> Any:
        return cupy_module().asarray(a) if self.config.device == "gpu" else a

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch; returns this rank's sums (loss·n, correct, n, times)."""
        self.model.train()
        self.sampler.set_epoch(epoch)
        sums = dict.fromkeys(SUMS, 0.0)
        bar = None
        if self.config.progress and self.rank == 0:
            bar = tqdm(total=self.steps_per_epoch, desc=f"epoch {epoch + 1}", file=sys.stderr,
                       leave=False, disable=None, unit="step")
        epoch_start = time.perf_counter()
        for idx, global_batch in self.sampler:
            self.lr = self.schedule(self.step)
            batch = Batch(self._to_device(self.xtr[idx]), self._to_device(self.ytr[idx]),
                          global_batch, self.lr)
            r = self.strategy.step(batch)
            for key, value in (("loss", r.loss), ("correct", r.correct), ("n", r.samples),
                               ("compute", r.compute_s), ("comm", r.comm_s),
                               ("exposed", r.exposed_s)):
                sums[key] += value
            if self.timeline is not None:
                for s in r.spans:
                    self.timeline.add(s.name, s.start, s.end, thread=s.thread, cat=s.cat,
                                      **s.args, step=self.step)
            self.step += 1
            if bar is not None:
                bar.update()
        sums["wall"] = time.perf_counter() - epoch_start
        if bar is not None:
            bar.close()
        return sums

    def evaluate(self) -> tuple[float, float]:
        """(correct, count) of this rank's contiguous share of the test set (among the ranks
        that train)."""
        self.model.eval()
        data_comm = self.strategy.data_comm
        bounds = split_bounds(len(self.xte), data_comm.size)
        lo, hi = bounds[data_comm.rank], bounds[data_comm.rank + 1]
        correct = 0.0
        with no_grad():
            for start in range(lo, hi, 512):
                stop = min(start + 512, hi)
                logits = self.model(Tensor(self._to_device(self.xte[start:stop])))
                correct += float((logits.data.argmax(axis=1) ==
                                  self._to_device(self.yte[start:stop])).sum())
        return correct, float(hi - lo)

    def run(self) -> list[dict[str, Any]]:
        """Train from start_epoch to config.epochs; return one row per epoch plus a summary.
        Puts the emulation setting in force before setup back at the end."""
        try:
            return self._run()
        finally:
            self._end_emulation()

    def _end_emulation(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _run(self) -> list[dict[str, Any]]:
        c, strategy = self.config, self.strategy
        if c.timeline:
            self.comm.barrier()
            self.timeline = Timeline(self.rank, time.perf_counter())
        run_start = time.perf_counter()
        if not strategy.trains:
            strategy.serve()
            summary = self._summary(time.perf_counter() - run_start)
        else:
            self._print_header()
            data_comm = strategy.data_comm
            for epoch in range(self.start_epoch, c.epochs):
                s = self.train_epoch(epoch)
                with strategy.gathered(optimizer_state=bool(c.checkpoint) and
                                       not strategy.sharded_checkpoint):
                    vec = np.array([s["loss"], s["correct"], s["n"], s["compute"], s["comm"],
                                    s["exposed"], s["wall"], *self.evaluate()], dtype=np.float64)
                    self._add_row(epoch, allreduce(vec, op="sum", comm=data_comm),
                                  data_comm.size)
            final = None
            if strategy.finish():
                with strategy.gathered():
                    final = allreduce(np.array(self.evaluate(), dtype=np.float64), op="sum",
                                      comm=data_comm)
            summary = self._summary(time.perf_counter() - run_start)
            if final is not None:
                summary["test_acc"] = final[0] / final[1] if final[1] else None
        self.report.summary(summary, self.rows, strategy.describe(final=True))
        if self.timeline is not None:
            write_timeline(self.comm, self.timeline, c.timeline)
        return [*self.rows, summary]

    def emulated(self) -> str:
        """The emulated links of this run ('' when none), e.g. 'inter=10Gbit/s,20us'."""
        links = emulation.active(self.comm)
        return links.describe() if links is not None else ""

    def _add_row(self, epoch: int, tot: np.ndarray, ranks: int) -> None:
        """Record, print and write the epoch's row from the sums over the `ranks` that train."""
        steps = self.steps_per_epoch
        fields = self.strategy.report()
        row = {"epoch": epoch + 1, "loss": tot[0] / tot[2], "train_acc": tot[1] / tot[2],
               "test_acc": tot[7] / tot[8] if tot[8] else float("nan"),
               "samples_per_s": tot[2] / (tot[6] / ranks),
               "compute_s": tot[3] / ranks / steps, "comm_s": tot[4] / ranks / steps,
               "exposed_comm_s": tot[5] / ranks / steps, "ranks": self.size,
               "algorithm": fields.pop("algorithm"), "lr": self.lr, "mode": fields.pop("mode"),
               "emulated": self.emulated(), **fields}
        self.rows.append(row)
        self.report.row(row, self.rows)
        if self.config.checkpoint and self.strategy.sharded_checkpoint:
            shard, manifest = self.strategy.checkpoint_shard()
            checkpoint.save_sharded_checkpoint(self.config.checkpoint, self.comm, shard,
                                               {**self._run_state(epoch + 1),
                                                "manifest": manifest})
        elif self.rank == 0 and self.config.checkpoint:
            self._save(epoch + 1)

    def _summary(self, seconds: float) -> dict[str, Any]:
        c, last = self.config, self.rows[-1] if self.rows else {}
        return {"summary": True, "epochs": c.epochs, "ranks": self.size,
                **self.strategy.report(final=True), "emulated": self.emulated(),
                "model": c.model, "dataset": c.dataset, "global_batch_size": c.global_batch_size,
                "optimizer": c.optimizer, "overlap": c.overlap,
                "loss": last.get("loss"), "train_acc": last.get("train_acc"),
                "test_acc": last.get("test_acc"),
                "samples_per_s": (float(np.mean([r["samples_per_s"] for r in self.rows]))
                                  if self.rows else None),
                "seconds": seconds}

    def _print_header(self) -> None:
        c = self.config
        ranks, per_rank = ranks_text(self.strategy.roles(), c.global_batch_size)
        emulated = self.emulated()
        what = (f"{c.model} on {c.dataset} ({len(self.xtr)} train / {len(self.xte)} test), "
                f"{ranks}, global batch {c.global_batch_size} ({per_rank}), {c.optimizer} lr "
                f"{c.base_lr():g}, {self.strategy.describe()}"
                + (f", EMULATED links {emulated}" if emulated else ""))
        resumed = (f"# resumed from {c.checkpoint} after epoch {self.start_epoch}"
                   if self.start_epoch else None)
        self.report.header(what, resumed, zero="model_state_bytes" in self.strategy.report())

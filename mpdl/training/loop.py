"""The training loop behind `mpdl train`: one epoch loop over a strategy.

Each step: this rank's slice of the global batch (DistributedSampler over the ranks that train),
then the strategy's step (forward, backward, communication, update; see mpdl.parallel.strategy).
Per epoch: loss, train and test accuracy, samples/s, and the mean step time split into compute,
communication and exposed communication (the part the step waited for), summed over the ranks
that train. `make_strategy` maps a configuration to its strategy: all-reduce DDP (optionally
compressed), local SGD (sync_every > 1) or the parameter server (mode "ps": the last `servers`
ranks serve and read no data; the summary's test accuracy is that of their final parameters).
The data and its evaluation are the task's (`mpdl.training.tasks`); a GPT's rows add tokens/s,
model FLOPs and MFU (`mpdl.training.throughput`).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from mpdl import emulation, faults, memory
from mpdl.autograd import optim
from mpdl.backend import cupy_module, use_local_gpu
from mpdl.collectives import allreduce
from mpdl.comm import as_communicator, check_every_call
from mpdl.models.zoo import build_model, describe_model
from mpdl.parallel import DistributedSampler, split_bounds
from mpdl.parallel.deterministic import param_sha256
from mpdl.parallel.strategy import Batch
from mpdl.training import checkpoint, guard, hf, precision, throughput
from mpdl.training.config import ConfigError, TrainConfig, agreed, literal, resume_mismatch, validate
from mpdl.training.factory import make_optimizer, make_strategy
from mpdl.training.report import (
    FP16_COLUMNS,
    ZERO_COLUMNS,
    Report,
    describe_run,
    memory_fields,
    resumed_text,
    summary_row,
    write_timeline,
)
from mpdl.training.tasks import load_task
from mpdl.training.timeline import Timeline

__all__ = ["ConfigError", "TrainConfig", "Trainer", "validate"]

#: the first steps, in which every collective compares its arguments across the ranks (as under
#: MPDL_CHECK=1): a rank whose program calls other collectives stops there with CollectiveMismatch
CHECKED_STEPS = 3
#: the sums of an epoch, over this rank's steps
SUMS = ("loss", "correct", "n", "compute", "comm", "exposed", "wall")


class Trainer:
    """One training run over `comm` (default MPI.COMM_WORLD): `setup()`, then `run()`."""

    def __init__(self, config: TrainConfig, comm: Any = None, out: TextIO | None = None) -> None:
        self.config = config
        self.comm = as_communicator(comm)
        self.rank, self.size = self.comm.rank, self.comm.size
        self.report = Report(out if out is not None else sys.stdout, config.output.json,
                             self.rank == 0, first={"config": dataclasses.asdict(config)})
        self.rows: list[dict[str, Any]] = []
        self.timeline: Timeline | None = None
        self.strategy: Any = None
        self._restore: Callable[[], None] | None = None
        #: this rank's memory ledger (mpdl.memory): what setup and training hold, by category
        self.ledger = memory.Ledger()
        self._memory_peaks: dict[str, int] = {}
        #: the ranks that train (all of them but a parameter server's servers), set by run()
        self.trainers: Any = None
        self.guard: guard.Guard | None = None
        #: the step after which the collectives' arguments are no longer compared across ranks
        self._checked_until = -1

    @property
    def optimizer(self) -> Any:
        return self.strategy.optimizer

    def setup(self) -> None:
        """Check the configuration, load the data, build the model and the strategy, resume."""
        c = self.config
        validate(c, self.size)
        if c.communication.emulate is not None:
            self._restore = emulation.apply(self.comm,
                                            emulation.resolve(c.communication.emulate))
        try:
            with self.ledger.installed():
                self._setup()
        except BaseException:
            self._end_emulation()
            raise

    def _setup(self) -> None:
        c = self.config
        self.strategy = agreed(self.comm, lambda: make_strategy(c, self.comm))
        trains = self.strategy.trains
        self.task = agreed(self.comm, lambda: load_task(c) if trains else None)
        if self.task is not None:
            self.report.columns = self.task.columns
        shape = self.comm.allgather_object(self.task and self.task.shape)[0]  # servers: no data
        m, o, ck = c.model, c.optim, c.checkpoint
        self.model = self.strategy.build(lambda: build_model(
            m.name, shape[0], shape[1], seed=o.seed, dtype=np.dtype(m.dtype), n_layer=m.n_layer,
            n_head=m.n_head, n_embd=m.n_embd, moe=m.moe()))
        if m.recompute != "none":
            self.model.set_recompute(m.recompute)
        self.peak = throughput.peak_flops(self.comm) if m.name == "gpt" else None
        if m.device == "gpu":
            node = self.comm.node_groups()[self.comm.node_of_rank()[self.rank]]
            use_local_gpu(node.index(self.rank), len(node))
            self.model.to("gpu")
        precision.prepare(self.model, c)
        self.strategy.setup(self.model, precision.optimizer_factory(make_optimizer(c), c))
        memory.hold_all([p.data for p in self.model.parameters()], "parameters")
        memory.hold_all([b.data for b in self.model.buffers()], "other")
        self.lr = c.base_lr()
        self.start_epoch, self.step = 0, 0
        self.partial, self.resumed_at = None, None
        self.initialized = ""  # the header's note on --init-from
        if not trains:
            return
        data_comm = self.strategy.data_comm
        self.sampler = DistributedSampler(len(self.task.xtr), o.global_batch_size,
                                          rank=data_comm.rank, num_replicas=data_comm.size,
                                          seed=o.seed, drop_last=c.data.drop_last,
                                          atoms=o.atoms if o.deterministic else 0)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = total_steps(c, self.steps_per_epoch)
        self.schedule = make_schedule(c, self.lr, self.steps_per_epoch)
        if ck.init_from:
            agreed(self.comm, self._init_from)
        if ck.resume:
            seen = self.comm.allgather_object(checkpoint.has_checkpoint(ck.dir))
            if any(seen) and not all(seen):
                raise ConfigError(f"{{checkpoint.dir}} {literal(ck.dir)}: the checkpoint is "
                                  f"visible on some ranks only; put it on a filesystem every "
                                  f"rank shares")
            if all(seen):
                agreed(self.comm, self._resume)
            else:
                agreed(self.comm, self._check_no_orphans)
                self.report.print(f"# no checkpoint in {ck.dir} yet: starting from epoch 1")
        elif ck.dir and not ck.force:
            agreed(self.comm, self._check_not_overwriting)

    def _init_from(self) -> None:
        """Load the weights of the --init-from file or directory (`mpdl export`) into the GPT."""
        c = self.config
        if c.model.name != "gpt":
            raise ConfigError(f"{{checkpoint.init_from}} needs {{model.name}} gpt, not "
                              f"{c.model.name}")
        info = self.task.model_info() or {}
        source = c.checkpoint.init_from
        try:
            state = hf.import_weights(source, self.model, info.get("vocab"))
        except ValueError as exc:
            raise ConfigError("{checkpoint.init_from}: " + literal(str(exc))) from None
        with self.strategy.gathered():
            self.model.load_state_dict(state)
        self.initialized = (f"# weights loaded from {source} (--init-from): {len(state)} tensors, "
                            f"{sum(int(v.size) for v in state.values()):,} parameters")

    def _check_no_orphans(self) -> None:
        """ConfigError when --resume finds the archives of a checkpoint without its state.json
        (unless --force): starting over would overwrite them."""
        ck = self.config.checkpoint
        orphans = checkpoint.orphan_arrays(ck.dir)
        if orphans and not ck.force:
            raise ConfigError(f"{{checkpoint.resume}}: {literal(ck.dir)} holds "
                              f"{literal(', '.join(orphans[:3]))} but no state.json; refusing to "
                              f"start over and overwrite them (restore state.json, or give "
                              f"{{checkpoint.force}} to start over)")

    def _check_not_overwriting(self) -> None:
        """ConfigError when DIR holds a checkpoint (or its arrays) and the run neither resumes
        it nor was told to overwrite it."""
        ck = self.config.checkpoint
        found = checkpoint.has_checkpoint(ck.dir) or checkpoint.orphan_arrays(ck.dir)
        if found:
            raise ConfigError(f"{{checkpoint.dir}} {literal(ck.dir)} holds the checkpoint of "
                              f"another run; refusing to overwrite it (give {{checkpoint.resume}} "
                              f"to continue it, {{checkpoint.force}} to start over in its place, "
                              f"or another DIR)")

    def _resume(self) -> None:
        ck = self.config.checkpoint
        model_state, optim_state, state = checkpoint.load_checkpoint(ck.dir, ck.accept_unchecked)
        checkpoint.check_keys(ck.dir, state)
        mismatch = resume_mismatch(self.config, state.get("config", {}))
        if mismatch:
            raise ConfigError(mismatch)
        if ck.accept_unchecked and self.rank == 0 and checkpoint.add_checksum(ck.dir):
            self.report.print(f"# {ck.dir}/state.json had no checksum: accepted once, its "
                              f"checksum written")
        with self.strategy.gathered():
            self.model.load_state_dict(model_state)
        self.strategy.load_state_dict(optim_state)
        self.sampler.load_state_dict(state["sampler"])
        checkpoint.restore_rngs(self.model, state.get("rng", {}))
        self.start_epoch, self.step = int(state["epoch"]), int(state["step"])
        self.rows = [r for r in state.get("history", []) if r.get("epoch", 0) <= self.start_epoch]
        self.partial = state.get("partial")  # the sums over all ranks of the epoch's first steps
        self.resumed_at = self.step

    def _run_state(self, epoch: int, partial: dict[str, float] | None) -> dict[str, Any]:
        """What a checkpoint holds besides the model and the optimizer."""
        state = {"epoch": epoch, "step": self.step, "sampler": self.sampler.state_dict(),
                 "rng": checkpoint.module_rngs(self.model), "config": dataclasses.asdict(self.config),
                 "ranks": self.size, "history": self.rows, "partial": partial}
        if self.task.model_info() is not None:
            state["model_info"] = self.task.model_info()
        return state

    def _save(self, epoch: int, partial: dict[str, float] | None = None) -> None:
        """Checkpoint after `epoch` epochs (partial: the sums of the next one so far); collective
        over the ranks that train, inside the strategy's gathered(). Refuses (NonFiniteStop) to
        write a NaN or inf."""
        ck = self.config.checkpoint
        if self.strategy.sharded_checkpoint:
            shard, manifest = self.strategy.checkpoint_shard()
            guard.check_saved(self.trainers, guard.walk("", shard or {}), self.step, ck.dir)
            checkpoint.save_sharded_checkpoint(ck.dir, self.comm, shard, {
                **self._run_state(epoch, partial), "manifest": manifest}, keep=ck.keep)
            return
        model_state, optim_state = ((self.model.state_dict(), self.strategy.state_dict())
                                    if self.rank == 0 else ({}, {}))
        guard.check_saved(self.trainers, [*guard.walk("model", model_state),
                                          *guard.walk("optimizer", optim_state)],
                          self.step, ck.dir)
        error = None
        if self.rank == 0:
            try:
                checkpoint.save_checkpoint(ck.dir, model_state, optim_state,
                                           self._run_state(epoch, partial), keep=ck.keep)
            except checkpoint.CheckpointWriteError as exc:
                error = str(exc)
        error = next((e for e in self.trainers.allgather_object(error) if e), None)
        if error:
            raise checkpoint.CheckpointWriteError(error)

    def _save_within(self, epoch: int, sums: dict[str, float]) -> None:
        """Checkpoint in the middle of epoch (every checkpoint_every steps) with the sums of the
        epoch so far over all ranks, so that a resumed run reports the whole epoch."""
        vec = np.array([sums[k] for k in SUMS], dtype=np.float64)
        total = allreduce(vec, op="sum", comm=self.strategy.data_comm)
        with self.strategy.gathered(optimizer_state=not self.strategy.sharded_checkpoint):
            self._save(epoch, dict(zip(SUMS, map(float, total), strict=True)))

    def _to_device(self, a: np.ndarray) -> Any:
        return cupy_module().asarray(a) if self.config.model.device == "gpu" else a

    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One epoch; returns this rank's sums (loss·n, correct, n, times)."""
        self.model.train()
        self.sampler.set_epoch(epoch)
        sums = dict.fromkeys(SUMS, 0.0)
        if self.partial and self.strategy.data_comm.rank == 0:
            sums.update(self.partial)
        self.partial, every = None, self.config.checkpoint.every
        bar = None
        if self.config.output.progress and self.rank == 0:
            bar = tqdm(total=self.steps_per_epoch, desc=f"epoch {epoch + 1}", file=sys.stderr,
                       leave=False, disable=None, unit="step")
        epoch_start = time.perf_counter()
        self.ledger.reset_peaks()
        for idx, global_batch in self.sampler:
            if self.step >= self.total_steps:  # --max-steps or a fraction of an epoch
                break
            self.lr = self.schedule(self.step)
            batch = Batch(self._to_device(self.task.xtr[idx]),
                          self._to_device(self.task.ytr[idx]), global_batch, self.lr,
                          count=int((self.task.ytr[self.sampler.batch] >= 0).sum()))
            if self.sampler.atoms:
                batch.atoms = self.sampler.local_atoms(global_batch)
            with np.errstate(over="ignore", invalid="ignore"):  # the guard below reports them
                r = self.strategy.step(batch)
            for key, value in zip(SUMS[:-1], (r.loss, r.correct, r.samples, r.compute_s,
                                              r.comm_s, r.exposed_s), strict=True):  # not "wall"
                sums[key] += value
            if self.timeline is not None:
                for s in r.spans:
                    self.timeline.add(s.name, s.start, s.end, thread=s.thread, cat=s.cat,
                                      **s.args, step=self.step)
            self.step += 1
            if self.step == self._checked_until:
                check_every_call(False)
            self.guard.after_step(self.step, r.loss, r.samples, self.model.parameters(),
                                  getattr(self.optimizer, "scaler", None),
                                  self.config.base_lr(), batch.x)
            faults.after_step(self.rank, self.step, self.resumed_at, self.model.parameters())
            if every and self.step % every == 0 and self.sampler.position < self.steps_per_epoch:
                self._save_within(epoch, sums)
            if bar is not None:
                bar.update()
        sums["wall"] = time.perf_counter() - epoch_start
        self._memory_peaks = {**self.ledger.peak, "total": self.ledger.peak_total,
                              "model_state": self.ledger.peak_state}
        if bar is not None:
            bar.close()
        return sums

    def evaluate(self) -> list[float]:
        """The task's evaluation sums over this rank's contiguous share of the held-out items
        (among the ranks that train)."""
        self.model.eval()
        data_comm = self.strategy.data_comm
        bounds = split_bounds(self.task.eval_size(), data_comm.size)
        return self.task.evaluate(self.model, bounds[data_comm.rank], bounds[data_comm.rank + 1],
                                  self._to_device)

    def run(self) -> list[dict[str, Any]]:
        """Train from start_epoch to config.optim.epochs; return one row per epoch plus a summary.
        Puts the emulation setting in force before setup back at the end."""
        try:
            with self.ledger.installed():
                return self._run()
        finally:
            check_every_call(False)
            self._end_emulation()

    def _end_emulation(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def _run(self) -> list[dict[str, Any]]:
        c, strategy = self.config, self.strategy
        if c.output.timeline:
            self.comm.barrier()
            self.timeline = Timeline(self.rank, time.perf_counter())
            self.ledger.trace()
        run_start = time.perf_counter()
        # the memory peaks are the max over the ranks that train: every rank (pipeline stages
        # too) unless some only serve
        everyone = all(self.comm.allgather_object(strategy.trains))
        if not strategy.trains:
            strategy.serve()
            summary = self._summary(time.perf_counter() - run_start)
        else:
            self._print_header()
            data_comm = strategy.data_comm
            trainers = self.trainers = self.comm if everyone else data_comm
            self.guard = guard.Guard(trainers, c.optim.nan_patience, c.optim.precision)
            if everyone:
                self._checked_until = self.step + CHECKED_STEPS
                check_every_call(True)
            for epoch in range(self.start_epoch, -(-self.total_steps // self.steps_per_epoch)):
                s = self.train_epoch(epoch)
                peaks = memory_fields(self._memory_peaks, trainers)
                with strategy.gathered(optimizer_state=bool(c.checkpoint.dir) and
                                       not strategy.sharded_checkpoint):
                    vec = np.array([s["loss"], s["correct"], s["n"], s["compute"], s["comm"],
                                    s["exposed"], s["wall"], *self.evaluate()], dtype=np.float64)
                    self._add_row(epoch, allreduce(vec, op="sum", comm=data_comm),
                                  data_comm.size, peaks)
            final = None
            # a run resumed at its end trained nothing: its closing line evaluates the loaded
            # weights, not the saved history
            if strategy.finish() or self.start_epoch >= c.optim.epochs:
                with strategy.gathered():
                    final = allreduce(np.array(self.evaluate(), dtype=np.float64), op="sum",
                                      comm=data_comm)
            with strategy.gathered():
                digest = param_sha256(self.model.named_parameters())
            summary = self._summary(time.perf_counter() - run_start)
            if final is not None:
                summary.update(self.task.metrics(final))
            summary["param_sha256"] = digest
        self.report.summary(summary, self.rows, strategy.describe(final=True))
        if self.timeline is not None:
            self.timeline.counters("memory (bytes)", memory.CATEGORIES, self.ledger.samples or [])
            write_timeline(self.comm, self.timeline, c.output.timeline)
        return [*self.rows, summary]

    def _add_row(self, epoch: int, tot: np.ndarray, ranks: int,
                 memory_peaks: dict[str, Any]) -> None:
        """Record, print and write the epoch's row from the sums over the `ranks` that train."""
        steps = min(self.steps_per_epoch, self.total_steps - epoch * self.steps_per_epoch)
        fields = self.strategy.report()
        row = {"epoch": epoch + 1, "loss": tot[0] / tot[2], "train_acc": tot[1] / tot[2],
               **self.task.metrics(tot[7:]), "samples_per_s": tot[2] / (tot[6] / ranks),
               "compute_s": tot[3] / ranks / steps, "comm_s": tot[4] / ranks / steps,
               "exposed_comm_s": tot[5] / ranks / steps, "ranks": self.size,
               "algorithm": fields.pop("algorithm"), "lr": self.lr, "mode": fields.pop("mode"),
               "emulated": emulation.describe_active(self.comm), **fields,
               **precision.fields(self.optimizer),
               **memory_peaks}
        if self.peak is not None:
            row.update(throughput.fields(row["samples_per_s"], self.task.seq_len,
                                         self.model.flops_per_token(self.task.seq_len), self.peak,
                                         self.size))
        self.rows.append(row)
        self.report.row(row, self.rows)
        if self.config.checkpoint.dir:
            self._save(epoch + 1)

    def _summary(self, seconds: float) -> dict[str, Any]:
        c = self.config
        return {**summary_row(c, self.rows, self.size, self.strategy.report(final=True),
                              emulation.describe_active(self.comm), seconds),
                "precision": c.optim.precision, "grad_accum": c.optim.grad_accum,
                **precision.fields(self.optimizer)}

    def _print_header(self) -> None:
        c = self.config
        what = describe_run(c, describe_model(c.model.name, self.model), self.task,
                            self.strategy.roles(), self.size, self.strategy.describe(),
                            emulation.describe_active(self.comm))
        notes = [*self.task.notes(), self.initialized,
                 self.peak and throughput.note(self.model, self.task.seq_len, self.peak, self.size),
                 resumed_text(c.checkpoint.dir, self.start_epoch, self.step, self.sampler.position,
                              self.steps_per_epoch)]
        if "model_state_bytes" in self.strategy.report():
            self.report.columns = (*self.report.columns, *ZERO_COLUMNS)
        if c.optim.precision == "fp16":
            self.report.columns = (*self.report.columns, *FP16_COLUMNS)
        self.report.header(what, [note for note in notes if note])


def total_steps(config: TrainConfig, steps_per_epoch: int) -> int:
    """The optimizer steps of the whole run: --max-steps, else the epochs' (at least one)."""
    o = config.optim
    if o.max_steps is not None:
        return o.max_steps
    return max(1, round(o.epochs * steps_per_epoch))


def make_schedule(config: TrainConfig, lr: float, steps_per_epoch: int) -> Callable[[int], float]:
    """The learning rate by step: with --warmup-steps or --lr-decay-steps nanoGPT's (warmup,
    cosine to --min-lr ending at the decay's step, counted from step 0), else the warmup over
    --warmup-epochs and the cosine over the run's steps."""
    o, total = config.optim, total_steps(config, steps_per_epoch)
    warmup = o.warmup_steps if o.warmup_steps is not None else \
        min(int(round(o.warmup_epochs * steps_per_epoch)), total)
    if o.lr_schedule == "cosine" and (o.warmup_steps is not None or o.lr_decay_steps is not None):
        decay = o.lr_decay_steps or total
        return optim.CosineSchedule(lr, min(warmup, decay), decay, o.min_lr)
    if o.lr_schedule == "cosine" and warmup >= total:
        warmup = total - 1
    return optim.WarmupSchedule(lr, warmup_steps=warmup, total_steps=total, kind=o.lr_schedule,
                                min_lr=o.min_lr)

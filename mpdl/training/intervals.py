"""What a run does every N steps within its epochs, and how its batches are drawn.

- `make_sampler`: --batch-sampling epoch (`DistributedSampler`: a shuffled pass per epoch) or
  random (`RandomBatchSampler`: each step's global batch drawn from (seed, step), as nanoGPT's
  get_batch; an epoch stands for as many samples as the epoch sampler's).
- `Intervals`: every --log-interval steps a line and a JSON line (step, loss of the step's global
  batch, lr, grad_norm, step_ms and tokens_per_s over the steps since the last line, on rank 0's
  clock); every --eval-interval steps, at step 0 and after the last step, the validation loss on
  --eval-steps fixed batches (`validation_indices`), split over the data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl.collectives import allreduce
from mpdl.parallel.sampler import DistributedSampler, RandomBatchSampler, split_bounds
from mpdl.training.config import ConfigError, TrainConfig
from mpdl.training.tasks import Task, validation_indices


def make_sampler(config: TrainConfig, task: Task, data_comm: Any) -> DistributedSampler:
    """The sampler of the run's training batches, for this rank of the data-parallel ranks."""
    o, d = config.optim, config.data
    atoms = o.atoms if o.deterministic else 0
    if d.batch_sampling == "epoch":
        return DistributedSampler(len(task.xtr), o.global_batch_size, rank=data_comm.rank,
                                  num_replicas=data_comm.size, seed=o.seed,
                                  drop_last=d.drop_last, atoms=atoms)
    full, rest = divmod(task.epoch_samples(), o.global_batch_size)
    steps = max(1, full + (1 if rest and not d.drop_last else 0))
    return RandomBatchSampler(len(task.xtr), o.global_batch_size, steps, rank=data_comm.rank,
                              num_replicas=data_comm.size, seed=o.seed, atoms=atoms)


class Intervals:
    """The step logs and interval evaluations of a run on `task` (None on a rank that serves)."""

    def __init__(self, config: TrainConfig, task: Task | None) -> None:
        self.config, self.task = config, task
        self.validation = None
        if config.output.eval_interval and task is not None:
            self.validation = self._validation(config, task)
        #: rank 0's seconds, the samples and the steps since the last log line
        self.since = dict.fromkeys(("seconds", "samples", "steps"), 0.0)
        self.evaluated_at: int | None = None

    @staticmethod
    def _validation(config: TrainConfig, task: Task) -> np.ndarray:
        """The validation pool's indices of the --eval-steps batches; ConfigError when they ask
        more sequences than the pool holds."""
        o, k = config.optim, config.output.eval_steps
        pool = len(task.validation_pool()[0])
        if k * o.global_batch_size > pool:
            raise ConfigError(f"{{output.eval_steps}} {k} x {{optim.global_batch_size}} "
                              f"{o.global_batch_size} = {k * o.global_batch_size} validation "
                              f"sequences, more than the {pool} that the validation split holds")
        return validation_indices(pool, k, o.global_batch_size, o.seed,
                                  config.data.batch_sampling == "random")

    def start(self, trainer: Any) -> None:
        """Before the first step of the run: the evaluation at step 0 (not when resumed)."""
        if self.validation is not None and trainer.step == 0:
            self.evaluate(trainer)

    def after_step(self, trainer: Any, result: Any, seconds: float, samples: int) -> None:
        """After each step: the log line and the evaluation when their interval comes."""
        out = self.config.output
        if out.log_interval:
            for key, value in (("seconds", seconds), ("samples", samples), ("steps", 1)):
                self.since[key] += value
            if trainer.step % out.log_interval == 0:
                self.log(trainer, result)
        if self.validation is not None and trainer.step % out.eval_interval == 0:
            self.evaluate(trainer)

    def end(self, trainer: Any) -> None:
        """After the last step: its evaluation, unless it had one."""
        if self.validation is not None and self.evaluated_at != trainer.step:
            self.evaluate(trainer)

    def log(self, trainer: Any, result: Any) -> None:
        """The step's loss over the global batch, its learning rate and gradient norm, and the
        mean step time and throughput since the last line (collective over the data ranks)."""
        total = allreduce(np.array([result.loss, result.samples], dtype=np.float64), op="sum",
                          comm=trainer.strategy.data_comm)
        grad_norm = getattr(result, "grad_norm", None)
        step_ms = 1e3 * self.since["seconds"] / self.since["steps"]
        rate, unit = self.since["samples"] / self.since["seconds"], "samples"
        if self.task.seq_len:
            rate, unit = rate * self.task.seq_len, "tokens"
        loss = float(total[0] / total[1]) if total[1] else float("nan")
        norm = "-" if grad_norm is None else f"{grad_norm:.4f}"
        trainer.report.event(
            f"step {trainer.step}: loss {loss:.4f}, lr {trainer.lr:.3g}, grad norm {norm}, "
            f"{step_ms:.2f} ms/step, {rate:,.0f} {unit}/s",
            {"step": trainer.step, "loss": loss, "lr": trainer.lr, "grad_norm": grad_norm,
             "step_ms": step_ms, f"{unit}_per_s": rate}, trainer.rows)
        self.since = dict.fromkeys(self.since, 0.0)

    def evaluate(self, trainer: Any) -> None:
        """The validation loss on the --eval-steps batches, each data-parallel rank taking its
        contiguous share of them; printed and as a JSON line (collective)."""
        data_comm, model = trainer.strategy.data_comm, trainer.model
        with trainer.strategy.gathered():
            model.eval()
            bounds = split_bounds(len(self.validation), data_comm.size)
            mine = self.validation[bounds[data_comm.rank]:bounds[data_comm.rank + 1]]
            sums = allreduce(np.array(self.task.loss_sums(model, mine, trainer._to_device),
                                      dtype=np.float64), op="sum", comm=data_comm)
        model.train()
        loss = float(sums[0] / sums[1])
        self.evaluated_at = trainer.step
        trainer.report.event(f"step {trainer.step}: val loss {loss:.4f}",
                             {"step": trainer.step, "val_loss": loss}, trainer.rows)

"""The non-finite guard of `mpdl train`: stop a run whose loss or weights turned NaN or inf, and
never write such values into a checkpoint.

After every step each rank that trains sums its loss, the gradients it still holds (fp32, bf16)
and its parameters after the update, each in float32 (a NaN or inf anywhere makes the sum
non-finite); one all-reduce of three numbers gives every rank the same verdict. A step is bad when
the loss or one of those sums is not finite; under fp16 a non-finite loss or gradient counts only
once the loss scale is at its floor (before that, the loss scaler skips the step and backs off),
while non-finite parameters always count. `patience` bad steps in a row stop the run with
`NonFiniteStop` on every rank (exit status 3 from `mpdl train`). `check_saved` refuses a
checkpoint holding a non-finite value, so the last good checkpoint stays.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from mpdl.backend import get_array_module
from mpdl.collectives import allreduce


class NonFiniteStop(RuntimeError):
    """The run stopped on a NaN or inf (the message names the step and the value)."""

    #: `mpdl train`'s exit status for it, which `mpdl launch` does not retry
    exit_status = 3


def _sum32(a: Any) -> float:
    """The sum of a's elements in float32 (NaN or inf when one of them is)."""
    if a is None or a.size == 0 or a.dtype.kind not in "fc" and a.dtype.kind != "V":
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return float(get_array_module(a).sum(a, dtype=np.float32))


def _held(a: Any) -> bool:
    """Whether a parameter's data is its values on this rank, not a read-only placeholder."""
    flags = getattr(a, "flags", None)
    return flags is None or flags.writeable or any(a.strides)


def _hint(lr: float, precision: str) -> str:
    fp32 = ", or --precision fp32" if precision != "fp32" else ""
    return f"try a lower --lr (now {lr:g}) or a longer --warmup-epochs{fp32}"


class Guard:
    """The per-step check of one run (see the module docstring)."""

    def __init__(self, comm: Any, patience: int, precision: str) -> None:
        self.comm, self.patience, self.precision = comm, patience, precision
        self.bad_steps = 0

    def after_step(self, step: int, loss: float, samples: int, params: Iterable[Any],
                   scaler: Any, lr: float, inputs: Any = None) -> None:
        """Check step `step` (collective over the ranks that train): this rank's summed loss over
        `samples`, its parameters (and their gradients) after the update; NonFiniteStop after
        `patience` bad steps in a row, naming the data when the batch's `inputs` hold a NaN or
        inf on some rank."""
        # a pipeline stage's or shard's placeholders of parameters other ranks hold are NaN
        params = [p for p in params if _held(p.data)]
        grads = 0.0 if scaler is not None else sum(_sum32(p.grad) for p in params)
        weights = sum(_sum32(p.data) for p in params)
        total = allreduce(np.array([loss, samples, grads, weights]),
                          op="sum", comm=self.comm)
        mean_loss = total[0] / total[1] if total[1] else total[0]
        loss_bad = not math.isfinite(mean_loss) or not math.isfinite(total[2])
        weights_bad = not math.isfinite(total[3])
        counts = weights_bad or (loss_bad and (scaler is None or scaler.at_floor))
        self.bad_steps = self.bad_steps + 1 if counts else 0
        if self.bad_steps < self.patience:
            return
        if not math.isfinite(mean_loss):
            what = f"the loss is {mean_loss}"
        elif not math.isfinite(total[2]):
            what = f"the gradients hold {total[2]}"
        else:
            what = f"the parameters hold {total[3]} after the update (loss {mean_loss:.4g})"
        if scaler is not None:
            what += f", loss scale {scaler.scale:g}" + (" (its floor)" if scaler.at_floor else "")
        n = self.bad_steps
        inputs_sum = allreduce(np.array([_sum32(inputs)]), op="sum", comm=self.comm)[0]
        hint = (_hint(lr, self.precision) if math.isfinite(inputs_sum) else
                "the batch's inputs hold NaN or inf: check the data first, no --lr fixes that")
        raise NonFiniteStop(f"stopped at step {step}: {what} ({n} step{'s' * (n > 1)} in a row, "
                            f"--nan-patience {self.patience}); no checkpoint of it was written; "
                            f"{hint}")


def nonfinite_arrays(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the arrays (or numbers) among `named` that hold a NaN or inf."""
    return [name for name, a in named if not math.isfinite(_sum32(np.asarray(a)))]


def walk(prefix: str, value: Any) -> Iterable[tuple[str, Any]]:
    """(name, array or number) of every floating-point leaf of a nested state dict."""
    if isinstance(value, dict):
        for key, v in value.items():
            yield from walk(f"{prefix}/{key}" if prefix else str(key), v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from walk(f"{prefix}/{i}", v)
    elif isinstance(value, float) or hasattr(value, "dtype"):
        yield prefix, value


def check_saved(comm: Any, named: Iterable[tuple[str, Any]], step: int, where: str) -> None:
    """NonFiniteStop on every rank of comm (collective) when an array this rank is about to write
    into the checkpoint at `where` holds a NaN or inf."""
    bad = nonfinite_arrays(named)
    flags = comm.allgather_object(bad[:3])
    found = next(((rank, names) for rank, names in enumerate(flags) if names), None)
    if found is not None:
        rank, names = found
        raise NonFiniteStop(f"stopped at step {step}: the checkpoint would hold NaN or inf (rank "
                            f"{rank}: {', '.join(names)}); not written, the last good one in "
                            f"{where} stays")

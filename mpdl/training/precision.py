"""`mpdl train --precision fp32|bf16|fp16` and `--grad-accum N`: what they need of a run.

`prepare(model, config)` turns the model's parameters into their 16-bit compute copy before the
strategy sets up (so its buckets and shards are 16-bit and gradients travel in 16 bits), and
`optimizer_factory` wraps the configured optimizer in `mpdl.autograd.amp.MixedPrecisionOptimizer`
(float32 master weights; for fp16 a loss scaler starting at `loss_scale_init`). `check` says
which combinations of flags cannot work, one line naming the flag.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl.autograd import amp
from mpdl.backend import get_array_module, precision_dtype

PRECISIONS = ("fp32", "bf16", "fp16")


class PrecisionError(ValueError):
    """A --precision or --grad-accum combination that cannot run (a ConfigError template)."""


def check(config: Any) -> None:
    """PrecisionError (a message template naming fields in braces) for flags that cannot work."""
    c = config
    if c.precision not in PRECISIONS:
        raise PrecisionError(f"{{precision}}: expected one of {', '.join(PRECISIONS)}, got "
                             f"{c.precision!r}")
    if not isinstance(c.grad_accum, int) or c.grad_accum < 1:
        raise PrecisionError(f"{{grad_accum}}: expected a positive number of microbatches per "
                             f"step, got {c.grad_accum!r}")
    if not (c.loss_scale_init > 0 and np.isfinite(c.loss_scale_init)):
        raise PrecisionError(f"{{loss_scale_init}}: expected a finite loss scale > 0, got "
                             f"{c.loss_scale_init!r}")
    if c.precision != "fp32":
        if c.dtype != "float32":
            raise PrecisionError(f"{{precision}} {c.precision} keeps float32 master weights: it "
                                 f"needs {{dtype}} float32, not {c.dtype}")
        if c.pp > 1 or c.tp > 1:
            raise PrecisionError(f"{{precision}} {c.precision} is not supported with {{pp}} > 1 "
                                 f"or {{tp}} > 1 yet")
    if c.precision == "fp16":
        cannot = ("{mode} ps (the servers apply each push as it comes)" if c.mode == "ps" else
                  "{compression} (its error feedback is spent before the step is known to be "
                  "finite)" if c.compression != "none" else
                  "{sync_every} > 1 (local steps are not agreed on)" if c.sync_every > 1 else None)
        if cannot:
            raise PrecisionError(f"{{precision}} fp16 skips the optimizer step on every rank when "
                                 f"a gradient overflows; the optimizer of {cannot} cannot skip a "
                                 f"step")
    if c.grad_accum > 1:
        other = ("{mode} ps" if c.mode == "ps" else "{pp} > 1 or {tp} > 1 (use {microbatches})"
                 if c.pp > 1 or c.tp > 1 else "{zero} (ZeRO reduce-scatters each gradient as "
                 "backward produces it)" if c.zero else "{sync_every} > 1" if c.sync_every > 1
                 else "{compression}" if c.compression != "none" else None)
        if other:
            raise PrecisionError(f"{{grad_accum}} > 1 cannot be combined with {other}")


def prepare(model: Any, config: Any) -> None:
    """Replace the model's floating-point parameters by their 16-bit compute copy (nothing for
    fp32). Buffers (batch-norm statistics) stay as they are."""
    if config.precision == "fp32":
        return
    for p in model.parameters():
        if p.data.dtype.kind == "f":
            p.data = p.data.astype(precision_dtype(config.precision, get_array_module(p.data)))


def optimizer_factory(make_optimizer: Callable[[list[Any]], Any], config: Any
                      ) -> Callable[[list[Any]], Any]:
    """The optimizer factory of the run: the configured one, or (bf16, fp16) it over float32
    master weights, with dynamic loss scaling for fp16."""
    if config.precision == "fp32":
        return make_optimizer

    def build(params: list[Any]) -> amp.MixedPrecisionOptimizer:
        scaler = amp.LossScaler(config.loss_scale_init) if config.precision == "fp16" else None
        return amp.MixedPrecisionOptimizer(params, make_optimizer, scaler)

    return build


def fields(optimizer: Any) -> dict[str, Any]:
    """The JSON fields of mixed precision: the loss scale now, the steps skipped and the times
    the scale backed off so far (none for fp32 and bf16)."""
    scaler = getattr(optimizer, "scaler", None)
    if scaler is None:
        return {}
    return {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped_steps,
            "scale_backoffs": scaler.backoffs}

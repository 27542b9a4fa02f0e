"""`mpdl train --precision fp32|bf16|fp16` and `--grad-accum N`: what they need of a run.

`prepare(model, config)` turns the model's parameters into their 16-bit compute copy before the
strategy sets up (so its buckets and shards are 16-bit and gradients travel in 16 bits), and
`optimizer_factory` wraps the configured optimizer in `mpdl.autograd.amp.MixedPrecisionOptimizer`
(float32 master weights; for fp16 a loss scaler starting at `loss_scale_init`). `check` says
which combinations of options cannot work, one line naming the option.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpdl.autograd import amp
from mpdl.backend import get_array_module, precision_dtype
from mpdl.models.moe import MoE

PRECISIONS = ("fp32", "bf16", "fp16")


class PrecisionError(ValueError):
    """A --precision or --grad-accum combination that cannot run (a ConfigError template)."""


def check(config: Any) -> None:
    """PrecisionError (a message template naming options in braces) for --precision and
    --grad-accum combined with options they cannot work with."""
    o, p, comm = config.optim, config.parallel, config.communication
    if o.precision != "fp32":
        if config.model.dtype != "float32":
            raise PrecisionError(f"{{optim.precision}} {o.precision} keeps float32 master "
                                 f"weights: it needs {{model.dtype}} float32, not "
                                 f"{config.model.dtype}")
    if o.precision == "fp16":
        cannot = ("{parallel.mode} ps (the servers apply each push as it comes)"
                  if p.mode == "ps" else
                  "{communication.compression} (its error feedback is spent before the step is "
                  "known to be finite)" if comm.compression != "none" else
                  "{communication.sync_every} > 1 (local steps are not agreed on)"
                  if comm.sync_every > 1 else None)
        if cannot:
            raise PrecisionError(f"{{optim.precision}} fp16 skips the optimizer step on every "
                                 f"rank when a gradient overflows; the optimizer of {cannot} "
                                 f"cannot skip a step")
    if config.model.moe_experts and o.precision != "fp32" and p.zero:
        raise PrecisionError(f"{{optim.precision}} {o.precision} with {{model.moe_experts}} "
                             f"cannot be combined with {{parallel.zero}} 1 yet (the sharded "
                             f"optimizers of the dense parameters and of the experts would each "
                             f"decide to skip a step)")
    if o.grad_accum > 1:
        other = ("{parallel.mode} ps" if p.mode == "ps" else
                 "{parallel.pp}, {parallel.tp} or {parallel.cp} > 1 (use {parallel.microbatches})"
                 if p.model_parallel() else
                 "{parallel.zero} (ZeRO reduce-scatters each gradient as backward produces it)"
                 if p.zero and not config.model.moe_experts else
                 "{communication.sync_every} > 1" if comm.sync_every > 1 else
                 "{communication.compression}" if comm.compression != "none" else None)
        if other:
            raise PrecisionError(f"{{optim.grad_accum}} > 1 cannot be combined with {other}")


def prepare(model: Any, config: Any) -> None:
    """Replace the model's floating-point parameters by their 16-bit compute copy (nothing for
    fp32), except the routers of mixture-of-experts layers, which stay float32. Buffers
    (batch-norm statistics) stay as they are; a parameter a pipeline stage does not hold (a
    zero-byte placeholder, all of its elements one value) stays a placeholder."""
    name = config.optim.precision
    if name == "fp32":
        return
    routers = {id(p) for _, m in model.named_modules() if isinstance(m, MoE)
               for p in m.router.parameters()}
    for p in model.parameters():
        if p.data.dtype.kind == "f" and id(p) not in routers:
            xp = get_array_module(p.data)
            dtype = precision_dtype(name, xp)
            if p.data.size > 1 and not any(p.data.strides):
                p.data = xp.broadcast_to(p.data.reshape(-1)[:1].astype(dtype), p.data.shape)
            else:
                p.data = p.data.astype(dtype)


def optimizer_factory(make_optimizer: Callable[[list[Any]], Any], config: Any
                      ) -> Callable[[list[Any]], Any]:
    """The optimizer factory of the run: the configured one, or (bf16, fp16) it over float32
    master weights, with dynamic loss scaling for fp16."""
    o = config.optim
    if o.precision == "fp32":
        return make_optimizer

    def build(params: list[Any]) -> amp.MixedPrecisionOptimizer:
        scaler = amp.LossScaler(o.loss_scale_init) if o.precision == "fp16" else None
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

"""What a TrainConfig builds: its strategy and its optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpdl.autograd import optim
from mpdl.comm import Communicator
from mpdl.parallel.compression import make_compression
from mpdl.parallel.data_parallel import (
    AllReduceStrategy,
    DiLoCoStrategy,
    LocalSGDStrategy,
    ParameterServerStrategy,
)
from mpdl.parallel.deterministic import DeterministicStrategy
from mpdl.parallel.exact_expert import ExactExpertStrategy
from mpdl.parallel.expert import ExpertParallelStrategy
from mpdl.parallel.expert_pipeline import ExpertPipelineStrategy
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.pipeline.exact import ExactPipeline
from mpdl.parallel.strategy import Strategy
from mpdl.parallel.zero import DEFAULT_BUCKET_MB as DDP_BUCKET_MB
from mpdl.parallel.zero import ZeroStrategy
from mpdl.training.config import TrainConfig


def make_strategy(config: TrainConfig, comm: Communicator) -> Strategy:
    """The strategy a (valid) configuration asks for."""
    p, c, o = config.parallel, config.communication, config.optim
    if o.deterministic and p.pp > 1:
        return ExactPipeline(comm, dp=p.data_ranks(comm.size), pp=p.pp,
                             microbatches=p.microbatches, algorithm=c.algorithm, atoms=o.atoms)
    if o.deterministic and p.ep > 1:
        return ExactExpertStrategy(comm, ep=p.ep, algorithm=c.algorithm, atoms=o.atoms)
    if o.deterministic:
        return DeterministicStrategy(comm, algorithm=c.algorithm, zero=p.zero, atoms=o.atoms)
    if p.mode == "ps":
        return ParameterServerStrategy(comm, servers=p.servers, mode=p.ps_mode(),
                                       staleness=p.staleness, lr=config.base_lr(),
                                       momentum=o.momentum, weight_decay=o.weight_decay)
    if p.model_parallel():
        grid = dict(dp=p.data_ranks(comm.size), pp=p.pp, tp=p.tp, microbatches=p.microbatches,
                    schedule=p.schedule, algorithm=c.algorithm, verbose=p.verbose_comm,
                    zero=p.zero, virtual_stages=p.virtual_stages)
        if config.model.moe_experts:  # the experts of each stage over its dp ranks
            return ExpertPipelineStrategy(comm, ep=p.ep, **grid)
        return PipelineStrategy(comm, cp=p.cp, cp_mode=p.cp_mode, cp_balance=p.cp_balance,
                                sp=p.sp, **grid)
    if config.model.moe_experts:
        bucket_mb = c.bucket_mb if c.bucket_mb is not None else DDP_BUCKET_MB
        return ExpertParallelStrategy(comm, ep=p.ep, algorithm=c.algorithm, bucket_mb=bucket_mb,
                                      first_bucket_mb=c.first_bucket_mb, zero=p.zero,
                                      grad_accum=o.grad_accum)
    common = dict(algorithm=c.algorithm, first_bucket_mb=c.first_bucket_mb, overlap=c.overlap)
    if p.zero:
        return ZeroStrategy(comm, stage=p.zero, prefetch=p.prefetch, hybrid=p.zero_hybrid,
                            bucket_mb=c.bucket_mb, **common)
    common["bucket_mb"] = c.bucket_mb if c.bucket_mb is not None else DDP_BUCKET_MB
    if c.diloco:
        return DiLoCoStrategy(comm, sync_every=c.sync_every, outer_lr=c.outer_lr,
                              outer_momentum=c.outer_momentum, fragments=c.diloco_fragments,
                              compress=c.outer_compress, **common)
    if c.sync_every > 1:
        return LocalSGDStrategy(comm, sync_every=c.sync_every, warmup_steps=c.post_local_warmup,
                                **common)
    compression = make_compression(c.compression, ratio=c.ratio, levels=c.levels,
                                   rank=c.powersgd_rank,
                                   momentum=o.momentum if dgc(config) else 0.0,
                                   algorithm=c.algorithm)
    return AllReduceStrategy(comm, compression=compression, grad_accum=o.grad_accum, **common)


def dgc(config: TrainConfig) -> bool:
    """Whether top-k's momentum correction (DGC) takes the momentum over from the optimizer."""
    return (config.communication.compression == "topk" and config.optim.optimizer == "sgd"
            and config.optim.momentum > 0)


def make_optimizer(config: TrainConfig) -> Callable[[list[Any]], Any]:
    """The factory of the configured optimizer at the base learning rate, clipping the gradient
    to --grad-clip (the strategy says how its gradients make the whole model's:
    `Optimizer.global_norm`)."""
    build = _optimizer(config)

    def make(params: list[Any]) -> Any:
        optimizer = build(params)
        optimizer.max_grad_norm = config.optim.grad_clip
        return optimizer

    return make


def _optimizer(config: TrainConfig) -> Callable[[list[Any]], Any]:
    c, lr = config.optim, config.base_lr()
    if c.optimizer == "sgd":
        return lambda p: optim.SGD(p, lr=lr, momentum=0.0 if dgc(config) else c.momentum,
                                   weight_decay=c.weight_decay)
    adam = dict(lr=lr, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay)
    if c.optimizer == "adam":
        return lambda p: optim.Adam(p, **adam)
    if c.optimizer == "adamw":
        return lambda p: optim.AdamW(p, **adam, decay="matrices")
    if c.optimizer == "muon":
        return lambda p: optim.Muon(p, **adam)
    if c.optimizer == "lars":
        return lambda p: optim.LARS(p, lr=lr, momentum=c.momentum, weight_decay=c.weight_decay)
    return lambda p: optim.LAMB(p, lr=lr, weight_decay=c.weight_decay)

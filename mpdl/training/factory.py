"""What a TrainConfig builds: its strategy and its optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpdl.autograd import optim
from mpdl.comm import Communicator
from mpdl.parallel.compression import make_compression
from mpdl.parallel.pipeline import PipelineStrategy
from mpdl.parallel.strategies import AllReduceStrategy, LocalSGDStrategy, ParameterServerStrategy
from mpdl.parallel.strategy import Strategy
from mpdl.parallel.zero import DEFAULT_BUCKET_MB as DDP_BUCKET_MB
from mpdl.parallel.zero import ZeroStrategy
from mpdl.training.config import TrainConfig


def make_strategy(config: TrainConfig, comm: Communicator) -> Strategy:
    """The strategy a (valid) configuration asks for."""
    c = config
    if c.mode == "ps":
        return ParameterServerStrategy(comm, servers=c.servers, mode=c.ps_mode(),
                                       staleness=c.staleness, lr=c.base_lr(),
                                       momentum=c.momentum, weight_decay=c.weight_decay)
    if c.model_parallel():
        return PipelineStrategy(comm, dp=c.data_ranks(comm.size), pp=c.pp, tp=c.tp,
                                microbatches=c.microbatches, schedule=c.schedule,
                                algorithm=c.algorithm, verbose=c.verbose_comm, zero=c.zero)
    common = dict(algorithm=c.algorithm, first_bucket_mb=c.first_bucket_mb, overlap=c.overlap)
    if c.zero:
        return ZeroStrategy(comm, stage=c.zero, prefetch=c.prefetch, hybrid=c.zero_hybrid,
                            bucket_mb=c.bucket_mb, **common)
    common["bucket_mb"] = c.bucket_mb if c.bucket_mb is not None else DDP_BUCKET_MB
    if c.sync_every > 1:
        return LocalSGDStrategy(comm, sync_every=c.sync_every, warmup_steps=c.post_local_warmup,
                                **common)
    compression = make_compression(c.compression, ratio=c.ratio, levels=c.levels,
                                   rank=c.powersgd_rank, momentum=c.momentum if dgc(c) else 0.0,
                                   algorithm=c.algorithm)
    return AllReduceStrategy(comm, compression=compression, **common)


def dgc(config: TrainConfig) -> bool:
    """Whether top-k's momentum correction (DGC) takes the momentum over from the optimizer."""
    return config.compression == "topk" and config.optimizer == "sgd" and config.momentum > 0


def make_optimizer(config: TrainConfig) -> Callable[[list[Any]], Any]:
    """The factory of the configured optimizer at the base learning rate."""
    c, lr = config, config.base_lr()
    if c.optimizer == "sgd":
        return lambda p: optim.SGD(p, lr=lr, momentum=0.0 if dgc(c) else c.momentum,
                                   weight_decay=c.weight_decay)
    if c.optimizer == "adam":
        return lambda p: optim.Adam(p, lr=lr, weight_decay=c.weight_decay)
    if c.optimizer == "lars":
        return lambda p: optim.LARS(p, lr=lr, momentum=c.momentum, weight_decay=c.weight_decay)
    return lambda p: optim.LAMB(p, lr=lr, weight_decay=c.weight_decay)

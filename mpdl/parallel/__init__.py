"""Data parallelism: DistributedDataParallel (bucketed, overlapped gradient all-reduce) and the
DistributedSampler that makes p ranks follow the trajectory of one."""

from mpdl.parallel.ddp import DistributedDataParallel
from mpdl.parallel.sampler import DistributedSampler, split_bounds

__all__ = ["DistributedDataParallel", "DistributedSampler", "split_bounds"]

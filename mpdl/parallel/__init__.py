"""Data parallelism: the naive versions to read first (`naive`: an all-reduce per gradient after
backward, and ZeRO-1 as the paper draws it), DistributedDataParallel (bucketed, overlapped
gradient all-reduce), the DistributedSampler that makes p ranks follow the trajectory of one,
gradient compression, local SGD and the parameter server; each way of training as a strategy for
the training loop (`strategy` holds the interface, `data_parallel` the data-parallel ones, the
other modules their own)."""

from mpdl.parallel.compression import COMPRESSORS, GradientCompression, make_compression
from mpdl.parallel.ddp import DistributedDataParallel
from mpdl.parallel.localsgd import LocalSGD
from mpdl.parallel.naive import NaiveDataParallel, NaiveZero
from mpdl.parallel.ps import ParameterServer
from mpdl.parallel.sampler import DistributedSampler, split_bounds

__all__ = ["NaiveDataParallel", "NaiveZero", "DistributedDataParallel", "DistributedSampler",
           "split_bounds", "COMPRESSORS", "GradientCompression", "make_compression", "LocalSGD",
           "ParameterServer"]

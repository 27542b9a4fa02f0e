"""Gradient buckets: the parameters grouped, in the order backward produces their gradients, into
flat buffers of at most a given size. DDP all-reduces its buckets (`mpdl.parallel.ddp`); ZeRO
stages 1-2 reduce-scatter them as units (`mpdl.parallel.zero`, `mpdl.parallel.shards`).

As PyTorch DDP's Reducer does it (Li et al., "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB 2020): a model registers w1 b1 w2 b2 w3 b3, and backward produces
their gradients from the last layer back, b3 first. `by_size` walks that reverse order, and each
bucket takes parameters until the next would take it past its cap:

    registered      w1 b1 w2 b2 w3 b3
    backward        b3 w3 b2 w2 b1 w1
    buckets         [b3 w3] [b2 w2 b1] [w1]      the first under first_cap, the others under cap
    bucket 1        |b2.....|w2..............|b1...|      one flat buffer; each parameter a view
                    0       b2.size          b2.size + w2.size

- A bucket is one flat array, so a parameter of another array module or dtype starts a new one.
- The first bucket has its own cap, small, so that its collective starts early in backward.
- A parameter is never split: one larger than the cap gets a bucket of its own.

`FlatLayout` says where each parameter lies in its bucket's flat buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpdl.backend import get_array_module

MB = 1 << 20


def by_size(params: Sequence[Any], cap: float, first_cap: float) -> list[list[Any]]:
    """`params` (anything with `.data`, in registration order) in buckets, in reverse order: each
    bucket one array module and dtype and at most `cap` bytes (the first: `first_cap`), but a
    parameter larger than that alone."""
    buckets: list[list[Any]] = []
    current: list[Any] = []
    nbytes = 0
    for p in reversed(params):
        if current:
            same_kind = (get_array_module(p.data) is get_array_module(current[0].data)
                         and p.data.dtype == current[0].data.dtype)
            if not same_kind or nbytes + p.data.nbytes > (cap if buckets else first_cap):
                buckets.append(current)
                current, nbytes = [], 0
        current.append(p)
        nbytes += p.data.nbytes
    if current:
        buckets.append(current)
    return buckets


class FlatLayout:
    """Where each of `params` lies in one flat buffer holding their elements back to back, in
    order: parameter i at elements [offsets[i], offsets[i] + its size), `count` in all."""

    def __init__(self, params: Sequence[Any]) -> None:
        self.params = list(params)
        self.offsets: list[int] = []
        #: id(parameter) -> its number in `params`
        self.position: dict[int, int] = {}
        count = 0
        for i, p in enumerate(self.params):
            self.offsets.append(count)
            self.position[id(p)] = i
            count += p.data.size
        self.count = count

    def slot(self, buf: Any, p: Any) -> Any:
        """p's part of a flat buffer laid out so, shaped like p."""
        offset = self.offsets[self.position[id(p)]]
        return buf[offset:offset + p.data.size].reshape(p.data.shape)

    def views(self, buf: Any) -> list[Any]:
        """Each parameter's part of a flat buffer laid out so, shaped like the parameter."""
        return [buf[o:o + p.data.size].reshape(p.data.shape)
                for o, p in zip(self.offsets, self.params, strict=True)]

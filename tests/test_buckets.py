"""mpdl.parallel.buckets against a plain oracle on random parameter lists and caps, and DDP and
ZeRO building their buckets through it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpdl.autograd import nn, optim
from mpdl.models.gpt import GPT
from mpdl.parallel import DistributedDataParallel, buckets
from mpdl.parallel.buckets import MB, FlatLayout, by_size
from mpdl.parallel.zero import ZeroStrategy
from mpdl.threadworld import run_world

DTYPES = (np.float16, np.float32, np.float64)


class Param:
    """A stand-in parameter: by_size and FlatLayout read only `.data`."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self.data = np.zeros(shape, dtype=dtype)


def random_params(rng: np.random.Generator) -> list[Param]:
    """0 to 12 parameters of 1 to 3 dims (a dim may be 0), one dtype or a mix."""
    dtypes = DTYPES if rng.random() < 0.4 else (DTYPES[rng.integers(3)],)
    return [Param(tuple(int(d) for d in rng.integers(0, 9, rng.integers(1, 4))),
                  dtypes[rng.integers(len(dtypes))]) for _ in range(rng.integers(0, 13))]


def random_cap(rng: np.random.Generator, sizes: list[int]) -> float:
    """0, inf, one byte under or at the largest parameter, a sum of the last k parameters exactly
    (the boundary: a bucket may fill to its cap) or one byte under it, or anything between."""
    largest = max(sizes, default=0)
    tail = sum(sizes[len(sizes) - rng.integers(0, len(sizes) + 1):])
    choices = [0.0, math.inf, largest - 1, largest, tail, tail - 1, rng.random() * sum(sizes) * 1.2]
    return float(choices[rng.integers(len(choices))])


def oracle(sizes: list[int], kinds: list, cap: float, first_cap: float) -> list[list[int]]:
    """The buckets as lists of parameter numbers: walk from the last parameter to the first; a
    parameter joins the open bucket when it has the kind of the bucket's first parameter and the
    bucket's bytes with it stay within the bucket's cap (first_cap for the first bucket, cap for
    every later one), else it opens the next bucket."""
    out: list[list[int]] = []
    for j in range(len(sizes) - 1, -1, -1):
        if out:
            bucket = out[-1]
            limit = first_cap if len(out) == 1 else cap
            if kinds[j] == kinds[bucket[0]] and sum(sizes[i] for i in bucket) + sizes[j] <= limit:
                bucket.append(j)
                continue
        out.append([j])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_by_size_follows_the_oracle_and_its_rules(seed):
    rng = np.random.default_rng(seed)
    for _ in range(100):
        params = random_params(rng)
        sizes = [p.data.nbytes for p in params]
        kinds = [p.data.dtype for p in params]
        cap, first_cap = random_cap(rng, sizes), random_cap(rng, sizes)
        number = {id(p): i for i, p in enumerate(params)}
        got = [[number[id(p)] for p in b] for b in by_size(params, cap, first_cap)]
        assert got == oracle(sizes, kinds, cap, first_cap), (sizes, kinds, cap, first_cap)
        # every parameter in exactly one bucket, in reverse registration order
        assert [i for b in got for i in b] == list(range(len(params)))[::-1]
        for k, b in enumerate(got):
            limit = first_cap if k == 0 else cap
            assert b, "an empty bucket"
            assert len({kinds[i] for i in b}) == 1, "a bucket of two dtypes"
            assert sum(sizes[i] for i in b) <= limit or len(b) == 1, "a bucket over its cap"
            if k + 1 < len(got):  # closed only when the next parameter could not join
                nxt = got[k + 1][0]
                assert kinds[nxt] != kinds[b[0]] or sum(sizes[i] for i in b) + sizes[nxt] > limit


@pytest.mark.parametrize("seed", range(3))
def test_layout_lays_the_parameters_back_to_back(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(50):
        dtype = DTYPES[rng.integers(3)]
        params = [p for p in random_params(rng) if p.data.dtype == dtype] or [Param((2,), dtype)]
        layout = FlatLayout(params)
        sizes = [p.data.size for p in params]
        assert layout.offsets == [sum(sizes[:i]) for i in range(len(params))]
        assert layout.count == sum(sizes)
        buf = np.zeros(layout.count + 3, dtype=dtype)[:layout.count]
        views = layout.views(buf)
        for i, (p, v) in enumerate(zip(params, views, strict=True)):
            assert v.shape == p.data.shape and layout.slot(buf, p).shape == p.data.shape
            assert v.size == 0 or np.shares_memory(v, buf)
            v[...] = i + 1
        assert np.array_equal(buf, np.repeat(np.arange(1, len(params) + 1), sizes).astype(dtype))
        for i, p in enumerate(params):
            assert np.all(layout.slot(buf, p) == i + 1)


def mixed_gpt() -> nn.Module:
    """A small GPT with every third parameter in float64: buckets split at each dtype change."""
    model = GPT(14, 11, 2, 4, 32, rng=np.random.default_rng(0))
    for i, p in enumerate(model.parameters()):
        if i % 3 == 1:
            p.data = p.data.astype(np.float64)
    return model


MODELS = {"gpt": lambda: GPT(14, 11, 2, 4, 64, rng=np.random.default_rng(0)),
          "mixed": mixed_gpt,
          "mlp": lambda: nn.Sequential(nn.Linear(64, 128, seed=0), nn.ReLU(),
                                       nn.Linear(128, 10, seed=1))}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("bucket_mb, first_bucket_mb",
                         [(25.0, 1.0), (0.001, 0.001), (0.05, 0.002), (0.0625, 0.0005),
                          (math.inf, 0.01)])
def test_ddp_and_zero_build_their_buckets_here(model, bucket_mb, first_bucket_mb, monkeypatch):
    """DDP's buckets and ZeRO stage 1-2's units are the oracle's, through by_size, called once by
    each."""
    calls = []

    def spy(params, cap, first_cap):
        calls.append((cap, first_cap))
        return by_size(params, cap, first_cap)

    monkeypatch.setattr(buckets, "by_size", spy)

    def build(comm):
        m = MODELS[model]()
        params = [p for p in m.parameters() if p.requires_grad]
        expected = [[params[i] for i in b] for b in oracle(
            [p.data.nbytes for p in params], [p.data.dtype for p in params],
            bucket_mb * MB, first_bucket_mb * MB)]
        ddp = DistributedDataParallel(m, comm=comm, algorithm="ring", bucket_mb=bucket_mb,
                                      first_bucket_mb=first_bucket_mb)
        ddp.remove_hooks()
        layouts = {"ddp": [b.params for b in ddp.buckets]}
        for stage in (1, 2):
            zero = ZeroStrategy(comm, stage, algorithm="ring", bucket_mb=bucket_mb,
                                first_bucket_mb=first_bucket_mb)
            zero.setup(m, lambda ps: optim.SGD(ps, lr=0.1))
            layouts[f"zero{stage}"] = [u.params for u in zero.units]
        return {who: [[id(p) for p in b] for b in groups] == [[id(p) for p in b] for b in expected]
                for who, groups in layouts.items()}

    assert run_world(2, build) == [{"ddp": True, "zero1": True, "zero2": True}] * 2
    assert calls == [(bucket_mb * MB, first_bucket_mb * MB)] * 6  # 2 ranks x (DDP, ZeRO 1, 2)

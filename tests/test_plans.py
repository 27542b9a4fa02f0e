"""Persistent plans on the in-process world: any p, awkward counts, bit-identical, bound arrays."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import tuning as T
from mpdl.threadworld import run_world
from mpdl.tuning import plan as plans

OURS = [a for a in C.algorithms("allreduce") if a != "mpi"]


def data(p: int, n: int, seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


@pytest.mark.parametrize("algorithm", OURS)
def test_allreduce_plans_match_the_one_shot_call_bit_for_bit(algorithm):
    for p in (1, 2, 3, 5, 8):
        for n in sorted({0, 1, p - 1, p + 1, 13, 97}):
            for op, dtype in (("sum", np.float32), ("avg", np.float64), ("max", np.int64)):
                xs = data(p, n, p * 1000 + n, dtype)

                def body(c, xs=xs, op=op):
                    x = xs[c.rank].copy()
                    expected = C.allreduce(x, op=op, algorithm=algorithm, comm=c)
                    h = T.allreduce_init(x, op=op, algorithm=algorithm, comm=c,
                                         out=np.empty_like(x))
                    first, second = h().copy(), h.start(x).wait()
                    return expected, first, second

                for expected, first, second in run_world(p, body):
                    assert first.tobytes() == expected.tobytes() == second.tobytes(), \
                        f"p={p} n={n} {op}"


def test_reduce_scatter_and_allgather_plans_every_p():
    for p in (1, 2, 3, 5):
        for n in sorted({0, 1, p + 1, 13}):
            xs = data(p, n, p + n)

            def body(c, xs=xs, n=n):
                rs = [T.reduce_scatter_init(xs[c.rank], algorithm=a, comm=c)()
                      for a in C.algorithms("reduce_scatter") if a != "mpi"]
                mine = np.array_split(xs[c.rank], c.size)[c.rank].copy()
                ag = [T.allgather_init(mine, algorithm=a, comm=c, count=n)()
                      for a in C.algorithms("allgather") if a != "mpi"]
                return rs, ag

            for rank, (rs, ag) in enumerate(run_world(p, body)):
                for r in rs:
                    np.testing.assert_allclose(r, np.array_split(np.sum(xs, axis=0), p)[rank],
                                               rtol=1e-12, atol=1e-12)
                for a in ag:
                    np.testing.assert_array_equal(a, xs[0][:0] if n == 0 else
                                                  np.concatenate([np.array_split(x, p)[i]
                                                                  for i, x in enumerate(xs)]))


def test_the_cache_serves_each_array_its_own_result():
    def body(c):
        outs = []
        for i in range(6):
            x = np.full(7, float(c.rank + i))
            out = np.empty(7)
            outs.append(C.allreduce(x, algorithm="ring", comm=c, out=out).copy())
        same = np.arange(5.0) + c.rank
        res = [C.allreduce(same, algorithm="tree", comm=c, out=np.empty(5)).copy()
               for _ in range(2)]
        return outs, res

    p = 3
    for outs, res in run_world(p, body):
        for i, o in enumerate(outs):
            np.testing.assert_array_equal(o, np.full(7, sum(r + i for r in range(p))))
        for r in res:
            np.testing.assert_array_equal(r, p * np.arange(5.0) + 3)
    assert len(plans.cache) <= plans.CACHE_PLANS


def test_another_array_is_refused_with_a_clear_error():
    def body(c):
        x = np.ones(4)
        h = T.allreduce_init(x, algorithm="ring", comm=c)
        with pytest.raises(ValueError, match="made for another array"):
            h(np.ones(4))
        return h().tolist()

    assert run_world(2, body) == [[2.0] * 4] * 2


def test_the_cache_keeps_plans_of_reused_arrays_only():
    def body(c):
        x, out = np.ones(9), np.empty(9)
        for _ in range(3):
            C.allreduce(x, algorithm="recursive_doubling", comm=c, out=out)
        kept = [p for p in plans.cache.values() if p.x is x]
        for _ in range(3):  # fresh arrays every call: seen weakly, never planned nor kept
            C.allreduce(np.ones(9), algorithm="ring", comm=c, out=np.empty(9))
        fresh = [p for p in plans.cache.values() if p.algorithm == "ring" and p.comm is c]
        return len(kept), len(fresh), out.tolist()

    plans.clear_cache()
    assert run_world(2, body) == [(1, 0, [2.0] * 9)] * 2


def test_allreduce_plans_large_arrays_and_the_cache_keeps_its_bytes_bounded(monkeypatch):
    """allreduce(out=) plans arrays above CACHE_MAX_BYTES up to ALLREDUCE_CACHE_MAX_BYTES (its
    plans verify auto's choice), reduce_scatter does not; the arrays the cached plans keep alive
    stay within CACHE_BYTES, the oldest plan dropped first, and results stay right."""
    monkeypatch.setattr(plans, "CACHE_MAX_BYTES", 64)
    monkeypatch.setattr(plans, "ALLREDUCE_CACHE_MAX_BYTES", 800)
    p = 2  # in-process ranks share the cache: three plans of 50 float64s (x and out) per rank
    monkeypatch.setattr(plans, "CACHE_BYTES", p * 3 * 2 * 400)

    def body(c):
        pairs = [(np.full(50, float(i + c.rank)), np.empty(50)) for i in range(5)]
        results = []
        for x, out in pairs:
            for _ in range(3):
                results.append(C.allreduce(x, algorithm="ring", comm=c, out=out).copy())
        kept = [i for i, (x, _) in enumerate(pairs)
                if any(p.x is x for p in list(plans.cache.values()))]
        big, bigout = np.ones(101), np.empty(101)  # 808 bytes: above the bound
        for _ in range(3):
            C.allreduce(big, algorithm="ring", comm=c, out=bigout)
        unplanned = not any(p.x is big for p in list(plans.cache.values()))
        rs = np.ones(16 * c.size)  # 128 bytes a rank: above CACHE_MAX_BYTES
        for _ in range(3):
            C.reduce_scatter(rs, algorithm="ring", comm=c)
        scattered = any(p.x is rs for p in list(plans.cache.values()))
        return kept, unplanned, scattered, results

    plans.clear_cache()
    for kept, unplanned, scattered, results in run_world(p, body):
        assert kept == [2, 3, 4]  # the two oldest were dropped for the bytes
        assert unplanned and not scattered
        for k, r in enumerate(results):
            np.testing.assert_array_equal(r, np.full(50, float(2 * (k // 3) + 1)))
    plans.clear_cache()


def test_plans_of_one_array_count_it_once_against_the_cache_bytes(monkeypatch):
    """A sweep's plans of one x over several algorithms (each with its own out) keep x alive once:
    they fit in CACHE_BYTES when x and the outs do, and a plan of new arrays that does not fit
    drops the oldest."""
    monkeypatch.setattr(plans, "CACHE_MAX_BYTES", 64)
    p = 2  # in-process ranks share the cache: per rank x and four outs of 50 float64s
    monkeypatch.setattr(plans, "CACHE_BYTES", p * 5 * 400)
    names = ("ring", "tree", "recursive_doubling", "rabenseifner")

    def body(c):
        x = np.full(50, float(c.rank + 1))
        outs = {name: np.empty(50) for name in names}
        for _ in range(3):
            for name in names:
                C.allreduce(x, algorithm=name, comm=c, out=outs[name])
        held = sorted(p.algorithm for p in list(plans.cache.values()) if p.x is x)
        right = all(np.array_equal(out, np.full(50, 3.0)) for out in outs.values())
        c.barrier()
        y, yout = np.ones(50), np.empty(50)  # one more x and out: 800 bytes a rank too many
        for _ in range(2):
            C.allreduce(y, algorithm="ring", comm=c, out=yout)
        c.barrier()
        after = [p.algorithm for p in list(plans.cache.values()) if p.x is x]
        return held, right, after, plans._kept_bytes(list(plans.cache.values()))

    plans.clear_cache()
    for held, right, after, kept in run_world(p, body):
        assert held == sorted(names) and right
        # the oldest plans went (ring's first) until the new arrays fit
        assert "ring" not in after and after == list(names[len(names) - len(after):])
        assert kept <= plans.CACHE_BYTES
    plans.clear_cache()


def test_the_cache_notices_an_array_changed_in_place():
    """The ordinary call's cached plan is keyed by the arrays' ids: an array reshaped in place
    or viewed as another dtype in place must not run the old plan."""
    def body(c):
        x, out = np.arange(6.0) + c.rank, np.empty(6)
        for _ in range(3):
            C.allreduce(x, algorithm="ring", comm=c, out=out)
        first = out.copy()
        x.shape = (2, 3)
        with pytest.raises(ValueError, match="out"):  # out (6,) no longer fits x (2, 3)
            C.allreduce(x, algorithm="ring", comm=c, out=out)
        out.shape = (2, 3)
        reshaped = C.allreduce(x, algorithm="ring", comm=c, out=out).copy()
        y, yout = np.arange(4, dtype=np.int64) + c.rank, np.empty(4, np.int64)
        for _ in range(3):
            C.allreduce(y, algorithm="ring", comm=c, out=yout)
        y.dtype, yout.dtype = np.float64, np.float64  # the same bytes read as floats
        y[:] = np.arange(4.0) + c.rank
        floats = C.allreduce(y, algorithm="ring", comm=c, out=yout).copy()
        return first, reshaped, floats

    p = 3
    for first, reshaped, floats in run_world(p, body):
        np.testing.assert_array_equal(first, p * np.arange(6.0) + 3)
        np.testing.assert_array_equal(reshaped, (p * np.arange(6.0) + 3).reshape(2, 3))
        np.testing.assert_array_equal(floats, p * np.arange(4.0) + 3)

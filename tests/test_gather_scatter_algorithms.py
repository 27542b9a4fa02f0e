"""The all-gather, reduce-scatter, broadcast and reduce algorithms on the in-process world: larger
p, uneven blocks, small segments, and the message schedules their textbooks describe.

The same algorithms run over real MPI in tests/mpi/test_collectives.py and test_dtypes.py."""

from __future__ import annotations

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl import settings
from mpdl.threadworld import run_world

SIZES = [1, 2, 3, 4, 5, 6, 7, 9, 16, 24, 31]


def ours(collective: str) -> list[str]:
    return [a for a in C.algorithms(collective) if a != "mpi"]


def integers(p: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(p * 1000 + n)
    return [rng.integers(-2**40, 2**40, n) for _ in range(p)]


@pytest.mark.parametrize("segment", [1 << 20, 24])
def test_allgather_of_uneven_blocks_every_p(segment):
    settings.update(segment_bytes=segment)  # 24 bytes: three int64 per message, PAT splits steps
    for algorithm in ours("allgather"):
        for p in SIZES:
            for n in sorted({0, 1, p - 1, p + 1, 97}):
                whole = integers(p, n)[0]
                parts = np.array_split(whole, p)
                res = run_world(p, lambda c: C.allgather(parts[c.rank], algorithm=algorithm,
                                                         comm=c, count=n))
                for r in res:
                    np.testing.assert_array_equal(r, whole, err_msg=f"{algorithm} p={p} n={n}")


@pytest.mark.parametrize("segment", [1 << 20, 24])
def test_reduce_scatter_sums_integers_exactly_every_p(segment):
    settings.update(segment_bytes=segment)
    for algorithm in ours("reduce_scatter"):
        for p in SIZES:
            for n in sorted({0, 1, p - 1, p + 1, 97}):
                xs = integers(p, n)
                res = run_world(p, lambda c: C.reduce_scatter(xs[c.rank], algorithm=algorithm,
                                                              comm=c))
                for r, block in zip(res, np.array_split(np.sum(xs, axis=0), p), strict=True):
                    np.testing.assert_array_equal(r, block, err_msg=f"{algorithm} p={p} n={n}")


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_rooted_collectives_every_root(collective):
    for algorithm in ours(collective):
        for p in (1, 2, 3, 5, 6, 9):
            for root in sorted({0, 1 % p, p - 1}):
                for n in (0, 1, p + 1, 4099):
                    xs = integers(p, n)
                    if collective == "broadcast":
                        res = run_world(p, lambda c: C.broadcast(xs[c.rank], root, algorithm,
                                                                 comm=c))
                        assert all(np.array_equal(r, xs[root]) for r in res), (algorithm, p)
                    else:
                        res = run_world(p, lambda c: C.reduce(xs[c.rank], root, "sum", algorithm,
                                                              comm=c))
                        np.testing.assert_array_equal(res[root], np.sum(xs, axis=0))
                        assert all(r is None for i, r in enumerate(res) if i != root)


def sent(log, rank: int) -> list[tuple[int, int]]:
    """(destination, bytes) of each message rank sent, in order."""
    return [(m[3], m[4]) for m in log if m[2] == rank]


def test_pat_allgather_goes_farthest_first_and_splits_at_the_segment():
    p, block = 8, 4
    xs = [np.full(block, r, np.float64) for r in range(p)]
    _, log = run_world(p, lambda c: C.allgather(xs[c.rank], "pat", comm=c), message_log=True)
    for r in range(p):  # lg p messages of 1, 2 and 4 blocks, to r-4, r-2, r-1
        assert sent(log, r) == [((r - 4) % p, 32), ((r - 2) % p, 64), ((r - 1) % p, 128)]
    settings.update(segment_bytes=block * 8)  # one block per message: 1 + 2 + 4 messages
    _, log = run_world(p, lambda c: C.allgather(xs[c.rank], "pat", comm=c), message_log=True)
    assert [d for d, _ in sent(log, 0)] == [4, 6, 6, 7, 7, 7, 7]


def test_pat_reduce_scatter_is_the_allgather_backwards():
    p = 8
    xs = [np.ones(8 * p) for _ in range(p)]
    _, log = run_world(p, lambda c: C.reduce_scatter(xs[c.rank], algorithm="pat", comm=c),
                       message_log=True)
    for r in range(p):  # 4, 2 and 1 partial blocks of 8 float64, to r+1, r+2, r+4
        assert sent(log, r) == [((r + 1) % p, 256), ((r + 2) % p, 128), ((r + 4) % p, 64)]


@pytest.mark.parametrize("algorithm,p,messages", [("bruck", 6, 3), ("recursive_doubling", 8, 3),
                                                  ("ring", 6, 5)])
def test_allgather_message_counts(algorithm, p, messages):
    xs = [np.ones(5) for _ in range(p)]
    _, log = run_world(p, lambda c: C.allgather(xs[c.rank], algorithm, comm=c),
                       message_log=True)
    for r in range(p):
        assert len(sent(log, r)) == messages
        assert sum(b for _, b in sent(log, r)) == (p - 1) * 5 * 8


def test_pairwise_reduce_scatter_sends_each_block_to_its_owner():
    p = 5
    xs = [np.ones(p * 3) for _ in range(p)]
    _, log = run_world(p, lambda c: C.reduce_scatter(xs[c.rank], algorithm="pairwise", comm=c),
                       message_log=True)
    for r in range(p):
        assert sent(log, r) == [((r + i) % p, 24) for i in range(1, p)]


def test_scatter_allgather_broadcast_unloads_the_root():
    p, n, root = 8, 8000, 3
    _, log = run_world(p, lambda c: C.broadcast(np.ones(n), root, "scatter_allgather",
                                                comm=c), message_log=True)
    block = n // p * 8
    # the root scatters 4 + 2 + 1 blocks, then passes 7 on the ring: 2n(p-1)/p, not n·lg p
    assert sum(b for _, b in sent(log, root)) == 14 * block
    assert max(sum(b for _, b in sent(log, r)) for r in range(p)) == 14 * block
    _, log = run_world(p, lambda c: C.broadcast(np.ones(n), root, "binomial", comm=c),
                       message_log=True)
    assert sent(log, root) == [((root + 4) % p, n * 8), ((root + 2) % p, n * 8),
                                    ((root + 1) % p, n * 8)]

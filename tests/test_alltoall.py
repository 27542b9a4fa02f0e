"""The all-to-all family on the in-process world: every algorithm, p = 1..9, awkward counts, every
dtype, in place and not, varying counts with zeros, persistent and asynchronous calls, bad input.

The expected results are NumPy transpositions of the inputs (block j of rank i lands as block i
of rank j); tests/mpi/test_alltoall.py compares the same algorithms with MPI_Alltoall(v).
"""

from __future__ import annotations

import numpy as np
import pytest

from mpdl import collectives as C
from mpdl.threadworld import run_world

OURS = [a for a in C.algorithms("alltoall") if a != "mpi"]
DTYPES = ["float16", "float32", "float64", "int32", "int64"]


def inputs(p: int, block: int, dtype: str = "float64", tail: tuple = ()) -> list[np.ndarray]:
    """Rank r's x: p blocks of `block` rows, random bits (every bit pattern must arrive)."""
    rng = np.random.default_rng(1000 * p + block)
    item = np.dtype(dtype).itemsize
    shape = (p, block, *tail)
    return [rng.integers(0, 256, int(np.prod(shape)) * item, dtype=np.uint8).view(dtype)
            .reshape(shape) for _ in range(p)]


def expected(xs: list[np.ndarray], rank: int) -> np.ndarray:
    return np.stack([x[rank] for x in xs])


def assert_bits(result: np.ndarray, want: np.ndarray) -> None:
    assert result.dtype == want.dtype and result.shape == want.shape
    assert result.tobytes() == want.tobytes()


def ranks_per_node(p: int) -> int | None:
    """Emulated nodes of 2 ranks (uneven at odd p) from p = 3 on: hierarchical's two levels."""
    return 2 if p >= 3 else None


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoall_every_p_and_count(algorithm):
    for p in range(1, 10):
        for block in (0, 1, 7):
            xs = inputs(p, block)
            for in_place in (False, True):
                def call(c, in_place=in_place):
                    x = xs[c.rank].copy()
                    result = C.alltoall(x, comm=c, algorithm=algorithm,
                                        out=x if in_place else None)
                    assert (result is x) == in_place
                    if not in_place:
                        assert_bits(x, xs[c.rank])  # the input is left alone
                    return result

                for r, result in enumerate(run_world(p, call, ranks_per_node=ranks_per_node(p))):
                    assert_bits(result, expected(xs, r))


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoall_every_dtype_and_multidimensional_blocks(algorithm):
    for dtype in DTYPES:
        for p in (3, 4, 5):
            xs = inputs(p, 3, dtype, tail=(2,))
            out = run_world(p, lambda c: C.alltoall(xs[c.rank], comm=c, algorithm=algorithm),
                            ranks_per_node=2)
            for r, result in enumerate(out):
                assert_bits(result, expected(xs, r))


def v_inputs(p: int, seed: int, dtype: str = "float32", zeros: float = 0.3):
    """(counts[i][j]: rows rank i sends rank j, with zeros: from p = 3 on, rank 1 sends nothing
    and rank 2 receives nothing; each rank's rows of 3 values)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (p, p)) * (rng.random((p, p)) > zeros)
    if p > 2:
        counts[1, :] = 0
        counts[:, 2] = 0
    rows = [rng.integers(-99, 99, (int(counts[i].sum()), 3)).astype(dtype) for i in range(p)]
    return counts, rows


def v_expected(counts, rows, rank: int) -> np.ndarray:
    parts = [np.split(rows[i], np.cumsum(counts[i])[:-1])[rank] for i in range(len(rows))]
    return np.concatenate(parts)


@pytest.mark.parametrize("algorithm", [*OURS, "auto"])
def test_alltoallv_uneven_counts_with_zeros(algorithm):
    for p in range(1, 10):
        counts, rows = v_inputs(p, p)

        def call(c, counts=counts, rows=rows):
            return C.alltoallv(rows[c.rank], counts[c.rank], comm=c, algorithm=algorithm)

        for r, (result, got) in enumerate(run_world(p, call, ranks_per_node=ranks_per_node(p))):
            assert got == [int(v) for v in counts[:, r]]
            assert_bits(result, v_expected(counts, rows, r))


@pytest.mark.parametrize("algorithm", OURS)
def test_alltoallv_with_known_recv_counts_every_dtype(algorithm):
    for dtype in DTYPES:
        p = 4
        counts, rows = v_inputs(p, 7, dtype)

        def call(c, counts=counts, rows=rows):
            return C.alltoallv(rows[c.rank], list(counts[c.rank]), comm=c, algorithm=algorithm,
                               recv_counts=counts[:, c.rank])

        for r, (result, got) in enumerate(run_world(p, call, ranks_per_node=2)):
            assert got == [int(v) for v in counts[:, r]]
            assert_bits(result, v_expected(counts, rows, r))


def errors_on_every_rank(p: int, call) -> list[str]:
    """Each rank's ValueError message (a rank that raised nothing fails the test)."""
    def body(c):
        try:
            call(c)
        except ValueError as exc:
            return str(exc)
        return None

    messages = run_world(p, body)
    assert all(m is not None for m in messages), messages
    return messages


def test_alltoall_first_axis_must_be_the_world_size():
    for algorithm in [*OURS, "auto"]:
        messages = errors_on_every_rank(
            3, lambda c, a=algorithm: C.alltoall(np.ones((4, 2)), comm=c, algorithm=a))
        assert all("x: expected a first axis of length 3" in m for m in messages)
    messages = errors_on_every_rank(2, lambda c: C.alltoall(np.float64(1.0), comm=c))
    assert all("x: expected a first axis of length 2" in m for m in messages)
    messages = errors_on_every_rank(
        2, lambda c: C.alltoall(np.ones((2, 3)), comm=c, out=np.ones((2, 4))))
    assert all(m.startswith("out:") for m in messages)


@pytest.mark.parametrize("algorithm", [*OURS, "auto"])
def test_alltoallv_bad_counts_on_one_rank_raise_on_every_rank(algorithm):
    p = 3
    good = [1, 2, 0]
    bad = {"sum": ([1, 1, 0], "send_counts: expected counts adding up to x's 3 rows"),
           "negative": ([4, -1, 0], "send_counts: expected row counts >= 0"),
           "length": ([1, 2], "send_counts: expected 3 row counts (one per rank), got 2"),
           "type": ([1.0, 2, 0], "send_counts: expected integer row counts")}
    for counts, own in bad.values():
        def call(c, counts=counts):
            x = np.arange(6.0).reshape(3, 2)
            return C.alltoallv(x, counts if c.rank == 1 else good, comm=c, algorithm=algorithm)

        messages = errors_on_every_rank(p, call)
        assert messages[1].startswith(own), messages[1]
        for r in (0, 2):
            assert messages[r].startswith("send_counts: rank 1 passed counts"), messages[r]
    # the world still works afterwards: nothing was left in flight
    out = run_world(p, lambda c: C.alltoallv(np.arange(6.0).reshape(3, 2), good, comm=c,
                                             algorithm=algorithm))
    assert [got for _, got in out] == [[1, 1, 1], [2, 2, 2], [0, 0, 0]]


def test_alltoallv_recv_counts_that_do_not_match_raise_on_every_rank():
    def call(c):
        theirs = [1, 1, 1] if c.rank != 2 else [1, 1, 2]
        return C.alltoallv(np.arange(3.0), [1, 1, 1], comm=c, recv_counts=theirs)

    messages = errors_on_every_rank(3, call)
    assert messages[2].startswith("recv_counts: the ranks send this one [1, 1, 1] rows")
    assert messages[0].startswith("recv_counts: rank(s) [2] passed counts")
    messages = errors_on_every_rank(
        2, lambda c: C.alltoallv(np.arange(2.0), [1, 1], comm=c, recv_counts=[1, -1]))
    assert all(m.startswith("recv_counts: expected row counts >= 0") for m in messages)


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match="algorithm: expected 'auto' or one of pairwise"):
        run_world(2, lambda c: C.alltoall(np.ones(2), comm=c, algorithm="ring"))

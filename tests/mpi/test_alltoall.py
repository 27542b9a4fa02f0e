"""Every all-to-all algorithm against MPI_Alltoall and MPI_Alltoallv, over real mpiexec (any world
size): bit for bit, every dtype, awkward counts, in place and not, bad counts on one rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import collectives as C
from mpdl import tuning as T

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
ALGORITHMS = C.algorithms("alltoall")
BLOCKS = sorted({0, 1, 7, P + 1})


def local_bits(shape: tuple, dtype: str, seed: int) -> np.ndarray:
    """Random bits, different on every rank (every bit pattern must arrive as it left)."""
    rng = np.random.default_rng(seed * 1000 + RANK)
    item = np.dtype(dtype).itemsize
    return rng.integers(0, 256, int(np.prod(shape)) * item, dtype=np.uint8).view(dtype).reshape(
        shape)


def mpi_alltoall(x: np.ndarray) -> np.ndarray:
    """MPI_Alltoall of x's bytes: the reference."""
    expected = np.empty_like(x)
    COMM.Alltoall(x.view(np.uint8).reshape(-1), expected.view(np.uint8).reshape(-1))
    return expected


def mpi_alltoallv(rows: np.ndarray, send_counts: list[int], recv_counts: list[int]) -> np.ndarray:
    """MPI_Alltoallv of whole rows (counts in bytes): the reference."""
    row_bytes = rows[0:1].nbytes if rows.shape[0] else rows.itemsize * int(np.prod(rows.shape[1:]))
    expected = np.empty((sum(recv_counts), *rows.shape[1:]), rows.dtype)
    sc = [c * row_bytes for c in send_counts]
    rc = [c * row_bytes for c in recv_counts]
    COMM.Alltoallv([np.ascontiguousarray(rows).view(np.uint8).reshape(-1),
                    (sc, np.cumsum([0, *sc[:-1]])), MPI.BYTE],
                   [expected.view(np.uint8).reshape(-1), (rc, np.cumsum([0, *rc[:-1]])),
                    MPI.BYTE])
    return expected


def assert_bits(result: np.ndarray, want: np.ndarray) -> None:
    assert result.dtype == want.dtype and result.shape == want.shape
    assert result.tobytes() == want.tobytes()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_alltoall_matches_mpi_every_count_and_dtype(algorithm):
    cases = [("float32", block) for block in BLOCKS] + [(d, 7) for d in DTYPES if d != "float32"]
    for dtype, block in cases:
        x = local_bits((P, block), dtype, block)
        want = mpi_alltoall(x)
        before = x.copy()
        assert_bits(C.alltoall(x, algorithm=algorithm), want)
        assert_bits(x, before)
        assert C.alltoall(x, algorithm=algorithm, out=x) is x
        assert_bits(x, want)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_alltoall_large_and_multidimensional(algorithm):
    x = local_bits((P, 4099, 3), "float32", 1)
    out = np.empty_like(x)
    assert C.alltoall(x, algorithm=algorithm, out=out) is out
    assert_bits(out, mpi_alltoall(x))


def v_counts(seed: int) -> np.ndarray:
    """counts[i][j]: rows rank i sends rank j (the same matrix on every rank), with zeros, primes
    and, from 3 ranks on, a rank that sends nothing and one that receives nothing."""
    rng = np.random.default_rng(seed)
    counts = rng.choice([0, 0, 1, 2, 3, 7, 13], (P, P))
    if P > 2:
        counts[1, :] = 0
        counts[:, 2] = 0
    return counts


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_alltoallv_matches_mpi_every_dtype(algorithm):
    for seed, dtype in enumerate(DTYPES):
        counts = v_counts(seed)
        mine, theirs = [int(v) for v in counts[RANK]], [int(v) for v in counts[:, RANK]]
        rows = local_bits((sum(mine), 2), dtype, seed)
        want = mpi_alltoallv(rows, mine, theirs)
        result, got = C.alltoallv(rows, mine, algorithm=algorithm)
        assert got == theirs
        assert_bits(result, want)
        result, got = C.alltoallv(rows, np.array(mine), algorithm=algorithm, recv_counts=theirs)
        assert got == theirs
        assert_bits(result, want)


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_bad_input_raises_on_every_rank(algorithm):
    with pytest.raises(ValueError, match=f"x: expected a first axis of length {P}"):
        C.alltoall(np.ones((P + 1, 2), np.float32), algorithm=algorithm)
    good = [1] * P
    x = np.ones((P, 2), np.float32)
    faults = {"sum": [2] * P, "negative": [-1, *([1] * P)][:P] if P > 1 else [-1],
              "length": [1] * (P + 1)}
    for counts in faults.values():
        # only the last rank is wrong; every rank must raise, before any row moves
        with pytest.raises(ValueError, match="send_counts"):
            C.alltoallv(x, counts if RANK == P - 1 else good, algorithm=algorithm)
    # nothing was left in flight: a following call works
    result, got = C.alltoallv(x, good, algorithm=algorithm)
    assert got == good and result.shape == (P, 2)


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_persistent_plans_and_cached_calls_match_mpi(algorithm):
    """alltoall_init (persistent requests where the algorithm has them) and repeated calls with
    out= (a cached plan from the second call), in place and not, on values that change."""
    from mpdl.tuning import plan as plans

    x = local_bits((P, 5), "float32", 3)
    out = np.empty_like(x)
    held = x.copy()
    plan = T.alltoall_init(x, algorithm=algorithm, out=out)
    in_place = T.alltoall_init(held, algorithm=algorithm, out=held)
    for seed in range(plans.COMPILED_AFTER + 2):  # past the runs that wait from Python
        x[...] = local_bits((P, 5), "float32", 10 + seed)
        held[...] = x
        want = mpi_alltoall(x)
        assert plan() is out
        assert_bits(out, want)
        assert_bits(in_place.start().wait(), want)
        assert_bits(C.alltoall(x, algorithm=algorithm, out=out), want)
    plan.free()
    in_place.free()
    wide = local_bits((P, 6), "int32", 4)
    strided = T.alltoall_init(wide[:, :3], algorithm=algorithm)  # x's flat form is a copy
    for seed in range(2):
        wide[...] = local_bits((P, 6), "int32", 30 + seed)
        assert_bits(strided(), mpi_alltoall(np.ascontiguousarray(wide[:, :3])))
    strided.free()


@pytest.mark.parametrize("algorithm", [*ALGORITHMS, "auto"])
def test_one_shot_calls_of_one_shape_match_mpi(algorithm):
    """alltoall(x) without out, again and again on new arrays of one shape (from the second call a
    plan kept for the shape runs it: x copied in, the result copied out), x strided: every result
    is bit-exact and an array of its own, and x is left as it was."""
    from mpdl.comm import as_communicator
    from mpdl.tuning import plan as plans

    results, wants = [], []
    for seed in range(3):
        wide = local_bits((P, 6), "float64", 20 + seed)
        x = wide[:, ::2]
        wants.append(mpi_alltoall(np.ascontiguousarray(x)))
        results.append(C.alltoall(x, algorithm=algorithm))
        assert_bits(wide, local_bits((P, 6), "float64", 20 + seed))
    for result, want in zip(results, wants, strict=True):
        assert_bits(result, want)
    kept = (id(as_communicator(None)), algorithm, (P, 3), np.dtype("float64")) in plans.shaped
    assert kept == (P > 1)


def test_async_handles_complete_in_issue_order():
    xs = [local_bits((P, 100 * (i + 1)), "int32", i) for i in range(len(ALGORITHMS))]
    handles = [C.alltoall_async(x, algorithm=a) for x, a in zip(xs, ALGORITHMS, strict=True)]
    blocking = C.alltoall(xs[0], algorithm="pairwise")  # queued behind the async ones
    for x, handle in zip(xs, handles, strict=True):
        assert_bits(handle.wait(), mpi_alltoall(x))
    assert_bits(blocking, mpi_alltoall(xs[0]))


@pytest.mark.skipif(P < 2, reason="a sub-communicator of the even ranks needs two ranks")
def test_a_sub_communicator():
    from mpdl.comm import as_communicator

    world = as_communicator(None)
    evens = list(range(0, P, 2))
    if RANK % 2:
        return
    sub = world.sub(evens)
    x = np.full((len(evens), 2), RANK, np.int64)
    for algorithm in [a for a in ALGORITHMS if a != "mpi"]:
        result = C.alltoall(x, comm=sub, algorithm=algorithm)
        np.testing.assert_array_equal(result[:, 0], evens)


def test_device_arrays_are_staged_and_come_back_on_the_device():
    from mpdl.backend import standin

    x = local_bits((P, 1001), "float32", 4)
    counts = v_counts(9)
    rows = local_bits((int(counts[RANK].sum()), 3), "int64", 5)
    want_v = mpi_alltoallv(rows, list(counts[RANK]), list(counts[:, RANK]))
    for algorithm in ALGORITHMS:
        result = C.alltoall(standin.asarray(x), algorithm=algorithm)
        assert isinstance(result, standin.ndarray)
        assert_bits(standin.asnumpy(result), mpi_alltoall(x))
        received, _ = C.alltoallv(standin.asarray(rows), counts[RANK], algorithm=algorithm)
        assert isinstance(received, standin.ndarray)
        assert_bits(standin.asnumpy(received), want_v)

"""Every collective algorithm against MPI's own result, over real mpiexec (any world size)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from mpi4py import MPI
from rankdata import local_data

from mpdl import collectives as C
from mpdl import settings
from mpdl.backend import bfloat16

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
DTYPES = ["float16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "prod", "max", "min", "avg"]
COUNTS = sorted({0, 1, max(P - 1, 0), P, P + 1, 7, 13, 31})
TOL = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}
_MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}


def mpi_reference(x: np.ndarray, op: str) -> np.ndarray:
    expected = np.empty_like(x)
    COMM.Allreduce(x, expected, op=_MPI_OP[op])
    if op == "avg":
        expected = (expected / P).astype(x.dtype)
    return expected


def assert_same_everywhere(result: np.ndarray) -> None:
    digest = hashlib.sha256(np.ascontiguousarray(result).tobytes()).hexdigest()
    digests = COMM.allgather(digest)
    assert len(set(digests)) == 1, f"ranks hold different results: {digests}"


def assert_close(result: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert result.dtype == expected.dtype and result.shape == expected.shape
    if dtype.startswith("float"):
        scale = max(1.0, float(np.max(np.abs(expected.astype(np.float64)), initial=0.0)))
        np.testing.assert_allclose(result.astype(np.float64), expected.astype(np.float64),
                                   rtol=TOL[dtype], atol=TOL[dtype] * scale * P)
    else:
        np.testing.assert_array_equal(result, expected)


ALLREDUCE = [a for a in C.algorithms("allreduce")]


@pytest.mark.parametrize("algorithm", ALLREDUCE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_every_op_and_count(algorithm, dtype):
    for op in OPS:
        if op == "avg" and not dtype.startswith("float"):
            continue
        for count in COUNTS:
            x = local_data(count, dtype, op)
            before = x.copy()
            result = C.allreduce(x, op=op, algorithm=algorithm)
            np.testing.assert_array_equal(x, before, err_msg="input was modified")
            assert_close(result, mpi_reference(x, op), dtype)
            assert_same_everywhere(result)


@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_allreduce_large_count(algorithm):
    count = 2**20 + 3
    x = local_data(count, "float32", "sum", seed=1)
    result = C.allreduce(x, algorithm=algorithm)
    assert_close(result, mpi_reference(x, "sum"), "float32")
    assert_same_everywhere(result)


@pytest.mark.parametrize("algorithm", ALLREDUCE)
def test_allreduce_in_place_and_multidimensional(algorithm):
    x = local_data(3 * 5 * 7, "float64", "sum").reshape(3, 5, 7)
    expected = mpi_reference(x, "sum")
    out = C.allreduce(x, algorithm=algorithm, out=x)
    assert out is x
    assert_close(x, expected, "float64")


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce"])
def test_other_collectives_match_mpi(collective):
    for algorithm in C.algorithms(collective):
        for dtype in ("float32", "int64"):
            for count in COUNTS + [100003]:
                x = local_data(count, dtype, "sum", seed=2)
                before = x.copy()
                if collective == "reduce_scatter":
                    for op in ("sum", "max"):
                        mine = C.reduce_scatter(x, op=op, algorithm=algorithm)
                        full = mpi_reference(x, op)
                        assert_close(mine, np.array_split(full, P)[RANK], dtype)
                elif collective == "allgather":
                    result = C.allgather(x, algorithm=algorithm)
                    expected = np.empty(count * P, dtype)
                    COMM.Allgather(x, expected)
                    np.testing.assert_array_equal(result, expected)
                elif collective == "broadcast":
                    for root in {0, P - 1}:
                        result = C.broadcast(x, root=root, algorithm=algorithm)
                        np.testing.assert_array_equal(result, COMM.bcast(x, root=root))
                else:
                    expected = mpi_reference(x, "sum")
                    for root in {0, P - 1}:
                        result = C.reduce(x, root=root, op="sum", algorithm=algorithm)
                        if RANK == root:
                            assert_close(result, expected, dtype)
                        else:
                            assert result is None
                np.testing.assert_array_equal(x, before, err_msg="input was modified")


def sixteen_bit_data(count: int, dtype: str, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed * 1000 + RANK).standard_normal(count)
    return values.astype(bfloat16 if dtype == "bfloat16" else dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_floats_every_reducing_algorithm(dtype):
    """Every all-reduce and reduce-scatter algorithm (the MPI library's too: it upcasts bfloat16)
    within the rounding bound of the float64 sum, and the same bytes on every rank."""
    eps = 2.0 ** (-7 if dtype == "bfloat16" else -10)
    for count in sorted({0, 1, P + 1, 31}):
        x = sixteen_bit_data(count, dtype, seed=3)
        wide = x.astype(np.float64)
        exact, magnitude = np.empty_like(wide), np.empty_like(wide)
        COMM.Allreduce(wide, exact)
        COMM.Allreduce(np.abs(wide), magnitude)
        bound = P * eps * magnitude
        for algorithm in C.algorithms("allreduce"):
            result = C.allreduce(x, algorithm=algorithm)
            assert result.dtype == x.dtype
            assert np.all(np.abs(result.astype(np.float64) - exact) <= bound), algorithm
            assert_same_everywhere(result)
        for algorithm in C.algorithms("reduce_scatter"):
            mine = C.reduce_scatter(x, algorithm=algorithm)
            assert mine.dtype == x.dtype
            lo = sum(len(b) for b in np.array_split(exact, P)[:RANK])
            assert np.all(np.abs(mine.astype(np.float64) - exact[lo:lo + mine.size])
                          <= bound[lo:lo + mine.size]), algorithm
        for algorithm in C.algorithms("allgather"):
            gathered = C.allgather(x, algorithm=algorithm)
            everyone = COMM.allgather(x.view(np.uint16))
            np.testing.assert_array_equal(gathered.view(np.uint16), np.concatenate(everyone))


def test_allreduce_async_completes_in_issue_order():
    xs = [local_data(1000 * (i + 1), "float32", "sum", seed=i) for i in range(6)]
    algorithms = ["ring", "tree", "recursive_doubling", "shm", "double_tree", "auto"]
    handles = [C.allreduce_async(x, algorithm=a) for x, a in zip(xs, algorithms, strict=True)]
    blocking = C.allreduce(xs[0], algorithm="rabenseifner")  # queued behind the async ones
    for x, h in zip(xs, handles, strict=True):
        assert_close(h.wait(), mpi_reference(x, "sum"), "float32")
        assert h.test()
    assert_close(blocking, mpi_reference(xs[0], "sum"), "float32")


def test_bad_arguments_raise_on_every_rank_before_sending():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="op"):
        C.allreduce(np.ones(4, np.int32), op="avg")
    with pytest.raises(TypeError, match="complex128"):
        C.allreduce(np.ones(4, np.complex128))
    with pytest.raises(ValueError, match="algorithm"):
        C.allreduce(x, algorithm="butterfly")
    with pytest.raises(ValueError, match="root"):
        C.broadcast(x, root=P)
    with pytest.raises(ValueError, match="out"):
        C.allreduce(x, out=np.empty(5, np.float32))
    # Nothing was left in flight: a following collective still works.
    assert_close(C.allreduce(x, algorithm="ring"), np.full(4, P, np.float32), "float32")


@pytest.mark.skipif(P == 1, reason="a mismatch needs two ranks")
def test_check_mode_reports_mismatched_counts(monkeypatch):
    from mpdl.comm import as_communicator

    monkeypatch.setattr(as_communicator(None), "check", True)  # what MPDL_CHECK=1 sets at start
    x = np.ones(10 + RANK, np.float32)
    with pytest.raises(ValueError, match="ranks disagree"):
        C.allreduce(x, algorithm="ring")
    with pytest.raises(ValueError, match="ranks disagree"):
        C.allreduce(np.ones(4, np.float32 if RANK else np.float64), algorithm="tree")


def assert_staging_buffers_released_and_reused(comm, algorithms) -> None:
    """No staging buffer is still lent out, and a second round of large staged all-reduces
    allocates none."""
    from mpdl.backend import standin

    pool = comm.staging_pool(standin)
    assert not pool.in_flight, "a staging buffer was never released"
    allocations = pool.allocations
    for algorithm in algorithms:
        C.allreduce(standin.asarray(local_data(300001, "float32", "sum")), algorithm=algorithm)
    assert pool.allocations == allocations, "staging buffers were allocated again"


def test_device_arrays_are_staged_through_reused_host_buffers(monkeypatch):
    from mpdl.backend import standin
    from mpdl.comm import as_communicator

    # Small segments: hundreds of staged messages in flight at once, each needing its own buffer.
    settings.update(segment_bytes=4096)
    comm = as_communicator(None)
    for algorithm in ALLREDUCE:
        for count in (0, 1, 13, 300001):
            host = local_data(count, "float32", "sum", seed=3)
            start = dict(standin.transfers)
            result = C.allreduce(standin.asarray(host), algorithm=algorithm)
            assert isinstance(result, standin.ndarray)
            assert_close(standin.asnumpy(result), mpi_reference(host, "sum"), "float32")
            if P > 1 and count > 0 and algorithm not in ("mpi", "shm"):
                assert standin.transfers["d2h"] > start["d2h"] + 1, "nothing was staged"
    assert_staging_buffers_released_and_reused(comm, ALLREDUCE)


@pytest.mark.skipif(P == 1, reason="one rank sends nothing")
def test_large_staged_messages_travel_in_chunks(monkeypatch):
    """Above the staging chunk, a device message is copied and sent chunk by chunk (the copies of
    one chunk overlap the transfer of another); the stand-in's copies report done only when asked
    twice, so the waiting path runs. Results are exact and buffers are released and reused."""
    from mpdl.backend import standin
    from mpdl.comm import as_communicator

    comm = as_communicator(None)
    monkeypatch.setattr(comm, "staging_chunk", 4096)
    settings.update(segment_bytes=1 << 20)
    whole_buffer = [a for a in ("recursive_doubling", "rabenseifner", "tree", "ring")
                    if a in ALLREDUCE]
    for algorithm in whole_buffer:
        for count in (0, 1, 1023, 1025, 4099, 300001):
            host = local_data(count, "float32", "sum", seed=5)
            start = dict(standin.transfers)
            result = C.allreduce(standin.asarray(host), algorithm=algorithm)
            assert_close(standin.asnumpy(result), mpi_reference(host, "sum"), "float32")
            if count == 300001:
                # the largest message of any algorithm here is at least count/P elements
                chunks = (count // P) * 4 // 4096
                assert standin.transfers["d2h"] - start["d2h"] >= chunks, "not sent in chunks"
                assert standin.transfers["h2d"] - start["h2d"] >= chunks, "not received in chunks"
    assert_staging_buffers_released_and_reused(comm, whole_buffer)

"""Every dtype the collectives carry, through every algorithm, against MPI's own result.

Moved data (all-gather, broadcast, all-to-all, the blocks of a max all-reduce) must be the same
bytes; integer reductions must equal the wrap-around result of MPI (bool: logical or/and);
a 16- or 8-bit float sum must be the float32 sum rounded once.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import backend
from mpdl import collectives as C

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
INTEGERS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"]
FLOATS = ["float16", "float32", "float64", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
#: the awkward counts of every algorithm are in test_collectives.py; here each dtype meets an
#: empty array, one of p+1 and a prime of blocks of unequal length
COUNTS = sorted({0, P + 1, 4099})
#: every rank's bool reduction by MPI on bytes: or for sum and max, and for min
_MPI_OP = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
_BOOL_OP = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND}


def raw_data(count: int, dtype: np.dtype, seed: int) -> np.ndarray:
    """Random bytes of count elements (every bit pattern, NaNs included), different per rank."""
    rng = np.random.default_rng(seed * 1000 + RANK)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)


def words(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


def assert_same_bytes(result: np.ndarray, expected: np.ndarray, what) -> None:
    assert result.dtype == expected.dtype, what
    np.testing.assert_array_equal(words(result), words(expected), err_msg=str(what))


@pytest.mark.parametrize("name", INTEGERS + FLOATS)
def test_data_movement_is_bit_exact(name):
    dtype = backend.check_dtype(name)
    for count in COUNTS:
        x = raw_data(count, dtype, seed=1)
        everyone = np.concatenate([e.view(dtype) for e in COMM.allgather(words(x))])
        for algorithm in C.algorithms("allgather"):
            assert_same_bytes(C.allgather(x, algorithm=algorithm), everyone,
                              ("allgather", algorithm, count))
        for algorithm in C.algorithms("broadcast"):
            root = P - 1
            expected = everyone[root * count:(root + 1) * count]
            assert_same_bytes(C.broadcast(x, root=root, algorithm=algorithm), expected,
                              ("broadcast", algorithm, count))
        blocks = raw_data(P * count, dtype, seed=2).reshape(P, count)
        received = COMM.alltoall(list(words(blocks)))
        expected = np.stack(received).view(dtype)
        for algorithm in C.algorithms("alltoall"):
            assert_same_bytes(C.alltoall(blocks, algorithm=algorithm), expected,
                              ("alltoall", algorithm, count))


def mpi_integer_reduction(x: np.ndarray, op: str) -> np.ndarray:
    """MPI's reduction in 64 bits, wrapped to x's width (NumPy's wrap-around; Open MPI's own
    8- and 16-bit sums saturate, open-mpi/ompi#8045)."""
    if x.dtype.kind == "b":
        out = np.empty_like(x)
        COMM.Allreduce(x, out, op=_BOOL_OP[op])
        return out
    wide = x.astype(f"{x.dtype.kind}8")
    out = np.empty_like(wide)
    COMM.Allreduce(wide, out, op=_MPI_OP[op])
    return out.astype(x.dtype)


@pytest.mark.parametrize("name", INTEGERS)
def test_integer_reductions_wrap_around_like_mpi(name):
    """Sums through every algorithm; prod, max and min (elementwise, whatever the algorithm)
    through the ring and the library's."""
    dtype = backend.check_dtype(name)
    for op in ["sum", "max", "min"] + ([] if name == "bool" else ["prod"]):
        x = raw_data(4099 if op == "sum" else P + 1, dtype, seed=3)
        expected = mpi_integer_reduction(x, op)
        chosen = (lambda c: C.algorithms(c)) if op == "sum" else (lambda c: ["ring", "mpi"])
        for algorithm in chosen("allreduce"):
            assert_same_bytes(C.allreduce(x, op=op, algorithm=algorithm), expected,
                              ("allreduce", algorithm, op))
        for algorithm in chosen("reduce_scatter"):
            assert_same_bytes(C.reduce_scatter(x, op=op, algorithm=algorithm),
                              np.array_split(expected, P)[RANK], ("reduce_scatter", algorithm))
        for algorithm in chosen("reduce"):
            result = C.reduce(x, root=0, op=op, algorithm=algorithm)
            if RANK == 0:
                assert_same_bytes(result, expected, ("reduce", algorithm, op))


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_narrow_float_sums_round_once_and_max_moves_bytes(name):
    """A sum is the float32 sum in rank order rounded once (tests/mpi/test_rounded_once.py says
    why that oracle); a max is the largest value's bytes."""
    dtype = backend.check_dtype(name)
    rng = np.random.default_rng(RANK)
    for count in (P + 1, 4099):
        x = rng.standard_normal(count).astype(dtype)
        wide = x.astype(np.float32)
        every = COMM.allgather(wide)
        once = every[0].copy()
        for other in every[1:]:
            once += other
        for algorithm in C.algorithms("allreduce"):
            assert_same_bytes(C.allreduce(x, algorithm=algorithm), once.astype(dtype),
                              ("sum", algorithm, count))
            assert_same_bytes(C.allreduce(x, op="max", algorithm=algorithm),
                              np.maximum.reduce(np.stack(every)).astype(dtype),
                              ("max", algorithm))


def test_unsupported_combinations_get_one_line():
    with pytest.raises(ValueError, match="'avg' needs a floating-point dtype, got int8"):
        C.allreduce(np.zeros(3, np.int8), op="avg")
    with pytest.raises(ValueError, match="'prod' is not defined for bool"):
        C.reduce_scatter(np.zeros(3, bool), op="prod")
    with pytest.raises(TypeError, match="unsupported dtype 'complex64'"):
        C.allgather(np.zeros(3, np.complex64))

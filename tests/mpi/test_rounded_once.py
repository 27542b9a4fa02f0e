"""16- and 8-bit sums, averages and products are the float32 result rounded once, on every
algorithm (the MPI library's too), one-shot and planned, over real mpiexec at any world size.

The oracle: every rank's input gathered, reduced in float32 in rank order (0, 1, ..., p-1),
divided by p in float32 for avg, and rounded once into the narrow dtype. On the exactly reducible
inputs every float32 partial result is exact, so any algorithm's order gives the same float32
value; on the normal inputs (the case of issue #63: 100,003 elements) the rank-order float32 sum
is the one compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpdl import backend, tuning
from mpdl import collectives as C

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()
NARROW = ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"]
COUNTS = sorted({0, 1, max(P - 1, 0), P + 1, 13, 4099})


def words(x: np.ndarray) -> np.ndarray:
    return x.view(f"u{x.itemsize}")


def everyone(x: np.ndarray) -> list[np.ndarray]:
    """Every rank's x, in rank order."""
    return [w.view(x.dtype) for w in COMM.allgather(words(x))]


def rounded_once(x: np.ndarray, op: str) -> np.ndarray:
    """The oracle of the module's docstring for this rank's x."""
    xs = everyone(x)
    acc = xs[0].astype(np.float32)
    for other in xs[1:]:
        acc = acc * other.astype(np.float32) if op == "prod" else acc + other.astype(np.float32)
    if op == "avg":
        acc = acc / np.float32(P)
    return acc.astype(x.dtype)


def exactly_reducible(count: int, name: str, op: str, seed: int) -> np.ndarray:
    """count narrow floats of this rank, random signs, whose float32 partial results over p <= 8
    ranks are exact in any order: magnitudes in [2^-6, 8] for sums, 3-bit significands for
    products."""
    rng = np.random.default_rng(seed * 1000 + RANK)
    if op == "prod":
        values = rng.choice([0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0], size=count)
    else:
        values = 2.0 ** rng.uniform(-6, 3, size=count)
    return (values * rng.choice([-1.0, 1.0], size=count)).astype(backend.check_dtype(name))


def assert_same_bytes(result: np.ndarray, expected: np.ndarray, what) -> None:
    assert result.dtype == expected.dtype, what
    np.testing.assert_array_equal(words(result), words(expected), err_msg=str(what))


@pytest.mark.parametrize("name", ["bfloat16", "float8_e5m2", "float16", "float8_e4m3fn"])
def test_every_allreduce_algorithm_sums_100003_normal_values_rounded_once(name):
    x = np.random.default_rng(7000 + RANK).standard_normal(100_003).astype(
        backend.check_dtype(name))
    expected = rounded_once(x, "sum")
    for algorithm in [*C.algorithms("allreduce"), "auto"]:
        assert_same_bytes(C.allreduce(x, algorithm=algorithm), expected, algorithm)


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_every_reducing_algorithm_rounds_once_at_awkward_counts(name, op):
    for count in COUNTS:
        x = exactly_reducible(count, name, op, seed=count)
        before = x.copy()
        expected = rounded_once(x, op)
        mine = np.array_split(expected, P)[RANK]
        for algorithm in [*C.algorithms("allreduce"), "auto"]:
            assert_same_bytes(C.allreduce(x, op=op, algorithm=algorithm), expected,
                              ("allreduce", algorithm, count))
            out = np.empty_like(x)
            assert_same_bytes(C.allreduce(x, op=op, algorithm=algorithm, out=out), expected,
                              ("allreduce out=", algorithm, count))
        for algorithm in [*C.algorithms("reduce_scatter"), "auto"]:
            assert_same_bytes(C.reduce_scatter(x, op=op, algorithm=algorithm), mine,
                              ("reduce_scatter", algorithm, count))
        for algorithm in [*C.algorithms("reduce"), "auto"]:
            result = C.reduce(x, root=P - 1, op=op, algorithm=algorithm)
            if RANK == P - 1:
                assert_same_bytes(result, expected, ("reduce", algorithm, count))
        assert_same_bytes(x, before, "the input")


@pytest.mark.parametrize("name", ["bfloat16", "float8_e5m2"])
def test_plans_round_once(name):
    for count in (P + 1, 4099):
        for op in ("sum", "avg"):
            x = exactly_reducible(count, name, op, seed=count + 1)
            expected = rounded_once(x, op)
            for algorithm in C.algorithms("allreduce"):
                plan = tuning.allreduce_init(x, op=op, algorithm=algorithm)
                for _ in range(2):
                    assert_same_bytes(plan(), expected, ("allreduce plan", algorithm, op))
            for algorithm in C.algorithms("reduce_scatter"):
                for in_place in (False, True):
                    work = x.copy()
                    plan = tuning.reduce_scatter_init(work, op=op, algorithm=algorithm,
                                                      in_place=in_place)
                    assert_same_bytes(plan(), np.array_split(expected, P)[RANK],
                                      ("reduce_scatter plan", algorithm, op, in_place))

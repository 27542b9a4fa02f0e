"""Test data for the collectives under mpiexec: different on every rank."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

RANK = MPI.COMM_WORLD.Get_rank()


def local_data(count: int, dtype: str, op: str, seed: int = 0) -> np.ndarray:
    """Different data on every rank; small values for prod so nothing overflows."""
    rng = np.random.default_rng(seed * 1000 + RANK)
    if op == "prod":
        values = rng.uniform(0.5, 1.5, count) if dtype.startswith("float") else rng.integers(-2, 3, count)
    elif dtype.startswith("float"):
        values = rng.standard_normal(count)
    else:
        values = rng.integers(-1000, 1000, count)
    return values.astype(dtype)

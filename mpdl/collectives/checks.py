"""The argument checks and the algorithm choice every public collective and plan shares."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpdl import backend
from mpdl.collectives import auto, registry
from mpdl.collectives.ops import block_bounds
from mpdl.comm import CollectiveMismatch, Communicator


def pick(collective: str, algorithm: str, comm: Communicator, nbytes: int) -> registry.Algorithm:
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm: expected a name, got {type(algorithm).__name__}")
    if algorithm == "auto":
        return auto.algorithm_for(collective, nbytes, comm)
    return registry.resolve(collective, algorithm)


def agree(comm: Communicator, *signature: Any) -> None:
    """With MPDL_CHECK=1 (`comm.check`), make sure every rank called the same collective with the
    same arguments. Costs one small all-gather of Python objects per call (tens of microseconds)."""
    if not comm.check:
        return
    everyone = comm.allgather_object(signature)
    if any(s != everyone[0] for s in everyone):
        lines = "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
        seq = f" #{comm.flight.next_seq(comm.flight_group())}" if comm.flight is not None else ""
        raise CollectiveMismatch(f"{signature[0]}{seq}: ranks disagree on the call "
                                 f"(collective, algorithm, shape, dtype, op, root): {lines}")


def check_out(out: Any, x: Any, xp: Any) -> None:
    if backend.get_array_module(out) is not xp:
        raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out: expected shape {x.shape} and dtype {x.dtype}, "
                         f"got {out.shape} and {out.dtype}")
    if not out.flags["C_CONTIGUOUS"]:
        raise ValueError("out: expected a C-contiguous array")


def check_blocks(x: Any, p: int) -> int:
    """Elements per block of an all-to-all of x over p ranks (x's first axis must be p)."""
    if x.ndim == 0 or x.shape[0] != p:
        raise ValueError(f"x: expected a first axis of length {p} (one block per rank), got shape "
                         f"{tuple(x.shape)}")
    return x.size // p


def allgather_bounds(x: Any, c: Communicator, count: Any) -> tuple[list[int], int]:
    """(block bounds, total elements) of an all-gather of x (see `allgather`'s count)."""
    if count is None:
        bounds = [i * x.size for i in range(c.size + 1)]
    else:
        if not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(f"count: expected a number of elements >= 0, got {count!r}")
        bounds = block_bounds(int(count), c.size)
        if x.size != bounds[c.rank + 1] - bounds[c.rank]:
            raise ValueError(f"x: expected block {c.rank} of {count} elements over {c.size} "
                             f"ranks ({bounds[c.rank + 1] - bounds[c.rank]} elements), got "
                             f"{x.size}")
    return bounds, bounds[-1]


def check_allgather_out(out: Any, xp: Any, dtype: Any, total: int) -> None:
    if out is not None:
        if backend.get_array_module(out) is not xp:
            raise TypeError("out: expected an array of the same kind as x (NumPy or CuPy)")
        if out.shape != (total,) or out.dtype != dtype or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"out: expected a C-contiguous 1-D array of {total} {dtype}, got "
                             f"shape {out.shape} and {out.dtype}")

"""Reduction operators and the argument checks every collective shares."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mpdl import backend, settings

#: op name -> the ufunc name that combines two arrays elementwise
OPS: dict[str, str] = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum",
                       "avg": "add"}


def check_op(op: Any, dtype: np.dtype) -> str:
    """The op name if it is valid for dtype; ValueError naming the allowed ops otherwise."""
    if op not in OPS:
        raise ValueError(f"op: expected one of {', '.join(OPS)}, got {op!r}")
    if op == "avg" and dtype.kind != "f":
        raise ValueError(f"op: 'avg' needs a floating-point dtype, got {dtype.name}; "
                         f"use 'sum' and divide")
    return op


def reducer(op: str, xp: Any):
    """The elementwise function f(a, b, out=...) for op on the array module xp."""
    return getattr(xp, OPS[op])


def check_array(x: Any, argument: str = "x") -> tuple[Any, np.dtype]:
    """(array module, dtype) of x; TypeError for non-arrays and unsupported dtypes."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{argument}: expected a NumPy or CuPy array, got {type(x).__name__}")
    return backend.get_array_module(x), backend.check_dtype(x.dtype, argument)


def block_bounds(count: int, parts: int) -> list[int]:
    """Offsets of `parts` blocks of `count` elements split like numpy.array_split:
    the first count % parts blocks are one element longer. Block i is [b[i], b[i+1])."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


def segment_elements(itemsize: int) -> int:
    """Elements per pipeline segment of the ring and tree algorithms: the settings' segment_bytes
    (MPDL_SEGMENT_BYTES, default 1 MiB) of them, at least one."""
    return max(1, settings.current().segment_bytes // itemsize)


def with_reducer(algorithm):
    """Adapt algorithm(comm, buf, reduce, *extra) to run(comm, buf, op, *extra)."""

    @functools.wraps(algorithm)
    def run(comm, buf, op: str, *extra, **kwargs):
        return algorithm(comm, buf, reducer(op, backend.get_array_module(buf)), *extra, **kwargs)

    return run

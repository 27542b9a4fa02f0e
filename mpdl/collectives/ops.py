"""Reduction operators and the argument checks every collective shares.

float16, bfloat16 and the 8-bit floats reduce like any dtype: each elementwise result of two
operands is computed in float32 and rounded once (NumPy's float16 loops and ml_dtypes' loops do
so). Where a rank adds several incoming arrays into one chunk (a tree node's children, a node's
shared-memory peers), it accumulates them in float32 and rounds once at the end (`accumulator`,
`settle`). The partial sums that travel between ranks stay in the narrow dtype: that is what
saves the bytes. Integers wrap around as NumPy's do; bool's sum is logical or, its max and min
logical or and and (its prod is refused: say min).
"""

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
    if op == "avg" and not backend.is_floating(dtype):
        raise ValueError(f"op: 'avg' needs a floating-point dtype, got {dtype.name}; "
                         f"use 'sum' and divide")
    if op == "prod" and dtype.kind == "b":
        raise ValueError("op: 'prod' is not defined for bool; use 'min' (logical and)")
    return op


def reducer(op: str, xp: Any):
    """The elementwise function f(a, b, out=...) for op on the array module xp."""
    return getattr(xp, OPS[op])


def accumulator(part: Any, operands: int) -> Any:
    """Where `operands` arrays will be reduced into `part` one after another: part itself, or a
    float32 copy of it when part is float16, bfloat16 or an 8-bit float and more than one operand
    comes (reduce into the copy, then `settle`)."""
    if operands > 1 and backend.accumulates_wide(part.dtype):
        return part.astype(np.float32)
    return part


def settle(part: Any, acc: Any) -> None:
    """Round the float32 accumulator of `accumulator` back into part (nothing if acc is part)."""
    if acc is not part:
        part[...] = acc


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

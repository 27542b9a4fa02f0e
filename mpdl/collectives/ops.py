"""Reduction operators and the argument checks every collective shares.

A sum, average or product of float16, bfloat16 or an 8-bit float is the float32 result rounded
once, whatever the algorithm (`reduces_wide`): the public calls reduce a float32 copy, so the
partial results that travel between ranks are float32 (twice a 16-bit message's bytes, four
times an 8-bit one's), and round it into the narrow dtype at the end; MPDL_ROUND_PER_HOP=1 opts
out (narrow messages, each combination rounded). Their max and min are exact in any dtype and
move as they are. Integers wrap around as NumPy's do; bool's sum is logical or, its max and min
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


#: the ops whose 16- and 8-bit results are computed in float32 and rounded once
WIDENED_OPS = ("sum", "avg", "prod")


def reduces_wide(dtype: np.dtype, op: str) -> bool:
    """Whether op on dtype reduces a float32 copy and rounds the result once: sum, avg and prod
    of float16, bfloat16 and the 8-bit floats, unless the settings' round_per_hop
    (MPDL_ROUND_PER_HOP=1) asks for narrow messages rounded at every hop."""
    return (op in WIDENED_OPS and backend.accumulates_wide(dtype)
            and not settings.current().round_per_hop)


def reduced_bytes(x: Any, op: str) -> int:
    """The bytes of x as its reduction moves them (what `auto` chooses by): 4 per element where
    `reduces_wide`, else x's own."""
    return 4 * x.size if reduces_wide(x.dtype, op) else x.nbytes


def in_float32(comm, source: Any, xp: Any, op: str, reduce_wide, wide: Any = None) -> Any:
    """source (a flat float16, bfloat16 or 8-bit float array) copied into float32 (into `wide`
    where given, else a new array: calls queued on a communication thread each need their own),
    reduced there by `reduce_wide(buffer)` and divided by p for avg: the float32 result, for the
    caller to round once into the narrow dtype."""
    if wide is None:
        wide = source.astype(np.float32)
    else:
        wide[...] = source
    reduce_wide(wide)
    if op == "avg":
        xp.true_divide(wide, comm.size, out=wide)
    return wide


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

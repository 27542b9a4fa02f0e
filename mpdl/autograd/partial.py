"""Building part of a model: the parameters outside a chosen set get no values.

A model's constructor draws every initial value from one random generator, in order, so a part of
the model equal to the whole model's part must make the same draws. `build(make, keep)` runs the
constructor with every `nn.Parameter` created outside `keep` (its index in creation order) given
an `Unbuilt` stand-in: it has the shape and dtype, holds nothing, and discards what is written into
it, so a drawn value lives only until the next line. The part built holds the kept parameters'
bytes plus, for a moment, one drawn array. `skeleton(make)` builds nothing and says which
creation index each parameter has, so a caller can choose by structure (a pipeline's stages).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

_building = threading.local()


class Unbuilt:
    """The value of a parameter that is not built: shape, dtype and the parameter's creation
    index only; writes are dropped."""

    __slots__ = ("shape", "dtype", "index")

    def __init__(self, shape: tuple[int, ...], dtype: Any, index: int) -> None:
        self.shape, self.dtype, self.index = tuple(shape), np.dtype(dtype), index

    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    ndim = property(lambda self: len(self.shape))
    nbytes = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        """Drop the value (the constructor's initialisation of a parameter not built)."""

    def __repr__(self) -> str:
        return f"Unbuilt(shape={self.shape}, dtype={self.dtype})"


def admit(data: Any) -> Any:
    """The value a new parameter gets: `data`, or an Unbuilt stand-in while `build` or `skeleton`
    runs and the parameter (by creation index) is not kept. Called by nn.Parameter."""
    keep = getattr(_building, "keep", None)
    if keep is None:
        return data
    index = _building.created
    _building.created += 1
    return data if keep(index) else Unbuilt(data.shape, data.dtype, index)


@contextmanager
def _keeping(keep: Callable[[int], bool]) -> Iterator[None]:
    if getattr(_building, "keep", None) is not None:
        raise RuntimeError("partial.build: already building a model")
    _building.keep, _building.created = keep, 0
    try:
        yield
    finally:
        _building.keep = None


def build(make: Callable[[], Any], keep: set[int], placeholder: Callable[[Any], Any]) -> Any:
    """make() with the parameters whose creation index is in `keep` built and the others given
    `placeholder(parameter)` (e.g. a zero-byte read-only array) once make() returns."""
    with _keeping(keep.__contains__):
        model = make()
    for p in model.parameters():
        if isinstance(p.data, Unbuilt):
            p.data = placeholder(p)
    return model


def skeleton(make: Callable[[], Any]) -> tuple[Any, dict[int, int]]:
    """(make() with no parameter built, id(parameter) -> its creation index)."""
    with _keeping(lambda index: False):
        model = make()
    return model, {id(p): p.data.index for p in model.parameters()}

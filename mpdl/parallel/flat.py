"""Flat buffers of many tensors: one collective per (array module, dtype) instead of one per tensor.

    for group in by_kind(tensors):
        result = allreduce(pack([t.data for t in group]), op="avg", comm=comm)
        for t, piece in zip(group, unpack(result, group)):
            t.data[...] = piece
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from mpdl.backend import get_array_module
from mpdl.collectives import broadcast
from mpdl.parallel.buckets import FlatLayout


def by_kind(tensors: Iterable[Any]) -> list[list[Any]]:
    """The tensors (anything with `.data`) grouped by array module and dtype, each group and the
    groups in first-seen order, so that every rank with the same tensors forms the same groups."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for t in tensors:
        groups.setdefault((get_array_module(t.data).__name__, str(t.data.dtype)), []).append(t)
    return list(groups.values())


def pack(arrays: Sequence[Any]) -> Any:
    """One new 1-D array holding the values of `arrays` (one array module and dtype), in order."""
    xp = get_array_module(arrays[0])
    return xp.concatenate([a.reshape(-1) for a in arrays])


def unpack(flat: Any, tensors: Sequence[Any]) -> list[Any]:
    """Views of `flat` shaped like each tensor's `.data`: the inverse of `pack`."""
    return FlatLayout(tensors).views(flat)


def broadcast_model(model: Any, comm: Any) -> None:
    """Rank 0's parameters and buffers on every rank (one flat broadcast per dtype)."""
    if comm.size == 1:
        return
    tensors = [t for _, t in model.named_parameters()] + model.buffers()
    for group in by_kind(tensors):
        result = broadcast(pack([t.data for t in group]), root=0, comm=comm)
        for t, piece in zip(group, unpack(result, group), strict=True):
            t.data[...] = piece

"""Whole matrices from flat shards (Moonlight's distributed Muon, Liu et al. 2025): each matrix of
the units (`mpdl.parallel.shards.Unit`) has one owner rank; every rank sends the owner its piece,
the owner applies a function to the whole matrix and sends each rank its piece of the result back.

    rank q's piece of matrix M ──all-to-all──▶ owner(M): M whole, fn(M) ──all-to-all──▶ rank q

Owners are balanced over the ranks by size (largest matrix first, to the least loaded rank), the
same on every rank. Both exchanges are one `alltoallv` each, in float32, of every matrix's pieces
at once. A matrix of n elements crosses the wire twice, less the part its owner holds: spread
evenly, 2n(p-1)/p in all, 2Ψ_m(p-1)/p² per rank for Ψ_m matrix elements, beside the 2Ψ(p-1)/p
of ZeRO's reduce-scatter and all-gather: 1 + Ψ_m/(pΨ) times AdamW's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl.autograd.tensor import Tensor
from mpdl.collectives import alltoallv
from mpdl.comm import Communicator
from mpdl.parallel.shards import Piece, Unit


def balanced_owners(sizes: list[int], ranks: int) -> list[int]:
    """An owner rank for each matrix of `sizes` elements: the largest first, each to the rank with
    the fewest elements so far (the lower rank on a tie)."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owner[i]] += sizes[i]
    return owner


class MatrixOwners:
    """`Optimizer.split`'s whole_map for the pieces of `units` sharded over `comm` (see the
    module docstring); `parents` maps each piece tensor to its whole parameter."""

    def __init__(self, units: list[Unit], pieces: list[Piece], comm: Communicator) -> None:
        self.units, self.comm = units, comm
        self.parents: dict[int, Tensor] = {id(piece.tensor): piece.param for piece in pieces
                                           if piece.end > piece.start}
        self._piece = {id(piece.param): piece for piece in pieces if piece.end > piece.start}
        #: bytes this rank sent in the last call (both exchanges)
        self.sent_bytes = 0

    def _ranges(self, unit: Unit, index: int) -> list[tuple[int, int]]:
        """Each rank's [start, end) of the parameter's flat elements (empty where none)."""
        offset, n = unit.offsets[index], math.prod(unit.params[index].shape)
        spans = [(max(lo, offset), min(hi, offset + n))
                 for lo, hi in zip(unit.bounds[:-1], unit.bounds[1:], strict=True)]
        return [(a - offset, max(a, b) - offset) for a, b in spans]

    def __call__(self, parts: dict[int, Any], fn: Callable[[Any], Any],
                 select: Callable[[Tensor], bool]) -> dict[int, Any]:
        matrices = [(u, i, p) for u in self.units for i, p in enumerate(u.params)
                    if len(p.shape) == 2 and select(p)]
        if not matrices:
            return {}
        xp, size, me = self.units[0].xp, self.comm.size, self.comm.rank
        owners = balanced_owners([math.prod(p.shape) for _, _, p in matrices], size)
        ranges = [self._ranges(u, i) for u, i, _ in matrices]
        mine = [k for k, owner in enumerate(owners) if owner == me]

        def my_part(k: int) -> Any:
            piece = self._piece.get(id(matrices[k][2]))
            return (xp.empty(0, np.float32) if piece is None
                    else parts[id(piece.tensor)].reshape(-1).astype(np.float32, copy=False))

        def span(k: int, q: int) -> int:
            return ranges[k][q][1] - ranges[k][q][0]

        by_owner = [[k for k in range(len(matrices)) if owners[k] == r] for r in range(size)]
        to_owners = [sum(span(k, me) for k in by_owner[r]) for r in range(size)]
        of_mine = [sum(span(k, q) for k in mine) for q in range(size)]  # rank q's share of mine
        send = [my_part(k) for r in range(size) for k in by_owner[r]]
        received, _ = alltoallv(_join(xp, send), to_owners, comm=self.comm, recv_counts=of_mine)
        wholes, at = {k: xp.empty(math.prod(matrices[k][2].shape), np.float32) for k in mine}, 0
        for q in range(size):
            for k in mine:
                lo, hi = ranges[k][q]
                wholes[k][lo:hi] = received[at:at + hi - lo]
                at += hi - lo
        results = {k: fn(wholes[k].reshape(matrices[k][2].shape)).reshape(-1) for k in mine}
        back = [results[k][slice(*ranges[k][q])] for q in range(size) for k in mine]
        returned, _ = alltoallv(_join(xp, back), of_mine, comm=self.comm, recv_counts=to_owners)
        self.sent_bytes = 4 * (sum(to_owners) - to_owners[me] + sum(of_mine) - of_mine[me])
        out, at = {}, 0
        for r in range(size):
            for k in by_owner[r]:
                n = span(k, me)
                piece = self._piece.get(id(matrices[k][2]))
                if piece is not None:
                    out[id(piece.tensor)] = returned[at:at + n]
                at += n
        return out


def _join(xp: Any, arrays: list[Any]) -> Any:
    """The arrays end to end (float32; empty for none)."""
    return xp.concatenate(arrays) if arrays else xp.empty(0, np.float32)

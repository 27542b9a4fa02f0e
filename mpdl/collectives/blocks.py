"""The block layout of an all-to-all: how many elements each rank sends to and receives from every
rank, and where those blocks lie in the flat send and receive buffers.

Every all-to-all algorithm takes (comm, recv, send, blocks): `send` and `recv` are flat 1-D arrays
(the same array for an in-place call), block j of `send` goes to rank j and block i of `recv`
comes from rank i. `matrix`, when known, holds every rank's send counts (row i: what rank i
sends to each rank); algorithms whose intermediate messages carry other ranks' blocks (Bruck,
hierarchical) need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpdl.backend import get_array_module


def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    offsets, total = [], 0
    for c in counts:
        offsets.append(total)
        total += c
    return tuple(offsets)


@dataclass(frozen=True)
class Blocks:
    """Counts and offsets in elements. `block` is the common count of a uniform all-to-all (None
    for varying counts); `matrix[i][j]` the count rank i sends to rank j, when known."""

    send_counts: tuple[int, ...]
    send_offsets: tuple[int, ...]
    recv_counts: tuple[int, ...]
    recv_offsets: tuple[int, ...]
    block: int | None = None
    matrix: tuple[tuple[int, ...], ...] | None = None

    def send_block(self, send: Any, rank: int) -> Any:
        """The view of what goes to `rank`."""
        start = self.send_offsets[rank]
        return send[start:start + self.send_counts[rank]]

    def recv_block(self, recv: Any, rank: int) -> Any:
        """The view of what comes from `rank`."""
        start = self.recv_offsets[rank]
        return recv[start:start + self.recv_counts[rank]]

    def count(self, src: int, dst: int) -> int:
        """Elements rank src sends to rank dst (needs the matrix unless uniform)."""
        if self.block is not None:
            return self.block
        if self.matrix is None:
            raise ValueError("the count matrix of this all-to-all was not exchanged")
        return self.matrix[src][dst]


def uniform(p: int, block: int) -> Blocks:
    """p blocks of `block` elements each way."""
    counts = (block,) * p
    offsets = tuple(i * block for i in range(p))
    return Blocks(counts, offsets, counts, offsets, block=block)


def varying(send_counts: list[int], recv_counts: list[int],
            matrix: list[list[int]] | None = None) -> Blocks:
    """Blocks of the given counts, packed in rank order."""
    s, r = tuple(send_counts), tuple(recv_counts)
    full = None if matrix is None else tuple(tuple(row) for row in matrix)
    return Blocks(s, _offsets(s), r, _offsets(r), matrix=full)


def separate_input(comm, recv: Any, send: Any) -> Any:
    """The send buffer to read from: send itself, or a copy of it when the call is in place
    (send is recv, which the algorithm overwrites before it has sent everything)."""
    if send is not recv:
        return send
    copy = comm.workspace("alltoall.input", send.size, send.dtype, get_array_module(send))
    get_array_module(send).copyto(copy, send)
    return copy


def copy_own_block(comm, recv: Any, send: Any, blocks: Blocks) -> None:
    """This rank's block to itself, copied locally."""
    r = comm.rank
    mine = blocks.recv_block(recv, r)
    if mine.size:
        get_array_module(recv).copyto(mine, blocks.send_block(send, r))

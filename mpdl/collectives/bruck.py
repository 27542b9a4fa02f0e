"""Bruck's algorithms: all-to-all and all-gather (Bruck, Ho, Kipnis, Upfal & Weathersby 1997; MPICH's
alltoall_intra_brucks and allgather_intra_brucks).

Few messages for many ranks, at the price of forwarding: ceil(lg p) steps instead of p-1.
1. Rotate: position i of a work array takes the block for rank r+i (mod p), so a block's
   position says how far it still has to travel.
2. Step k (distance d = 2^k): send every block whose position has bit k set to rank r+d, and
   receive the blocks of the same positions from rank r-d. After all steps each block has moved
   by exactly its position, so position i holds the block from rank r-i.
3. Rotate back: block i of the result (from rank i) is position r-i (mod p).
Each step carries about half the blocks: T = ceil(lg p)·α + (n/2)·ceil(lg p)·β, plus the packing
and unpacking copies of each step and the two rotations (n each).

With varying counts a forwarded block's size belongs to other ranks; it is read from the count
matrix every rank holds (`blocks.Blocks.matrix`): the block at position i of rank r after the
steps below distance d left rank r - (i mod d), bound for that rank + i.
"""

from __future__ import annotations

import functools

import numpy as np

from mpdl.backend import get_array_module
from mpdl.collectives.blocks import Blocks, copy_own_block, separate_input


@functools.lru_cache(maxsize=256)
def moving(p: int, distance: int) -> np.ndarray:
    """The positions whose blocks move at the step of this distance (bit set in their index)."""
    return np.array([i for i in range(p) if i & distance], dtype=np.intp)


def bruck_alltoall(comm, recv, send, blocks: Blocks) -> None:
    """All-to-all in ceil(lg p) steps; recv may be send (in place)."""
    if comm.size == 1 or blocks.block == 0:
        copy_own_block(comm, recv, separate_input(comm, recv, send), blocks)
    elif blocks.block is not None:
        _equal_blocks(comm, recv, send, blocks.block)
    else:
        _varying_blocks(comm, recv, separate_input(comm, recv, send), blocks)


def _equal_blocks(comm, recv, send, b: int) -> None:
    p, r = comm.size, comm.rank
    xp = get_array_module(recv)
    work = comm.workspace("bruck.work", p * b, recv.dtype, xp).reshape(p, b)
    source = send.reshape(p, b)
    work[:p - r] = source[r:]  # position i: the block for rank r+i
    work[p - r:] = source[:r]
    half = len(moving(p, 1)) * b
    outgoing = comm.workspace("bruck.out", half, recv.dtype, xp)
    incoming = comm.workspace("bruck.in", half, recv.dtype, xp)
    distance = 1
    while distance < p:
        positions = moving(p, distance)
        rows = positions.size
        out, into = outgoing[:rows * b].reshape(rows, b), incoming[:rows * b].reshape(rows, b)
        out[...] = work[positions]
        comm.sendrecv(outgoing[:rows * b], (r + distance) % p, incoming[:rows * b],
                      (r - distance) % p, distance)
        work[positions] = into
        distance *= 2
    result = recv.reshape(p, b)
    result[r::-1] = work[:r + 1]  # position i holds the block from rank r-i
    result[p - 1:r:-1] = work[r + 1:]


def _varying_blocks(comm, recv, send, blocks: Blocks) -> None:
    p, r = comm.size, comm.rank
    xp = get_array_module(recv)
    held = [blocks.send_block(send, (r + i) % p) for i in range(p)]
    distance = 1
    while distance < p:
        positions = moving(p, distance).tolist()
        src = (r - distance) % p
        outgoing = [held[i] for i in positions]
        out = xp.concatenate(outgoing) if outgoing else held[0][:0]
        # the blocks arriving: position i of rank src, which left rank src - (i mod distance)
        sizes = []
        for i in positions:
            origin = (src - (i % distance)) % p
            sizes.append(blocks.count(origin, (origin + i) % p))
        into = xp.empty(sum(sizes), dtype=recv.dtype)
        requests = []
        if into.size:
            requests.append(comm.irecv(into, src, distance))
        if out.size:
            requests.append(comm.isend(out, (r + distance) % p, distance))
        comm.waitall(requests)
        edges = np.cumsum([0, *sizes])
        for k, i in enumerate(positions):
            held[i] = into[edges[k]:edges[k + 1]]
        distance *= 2
    for i in range(p):
        target = blocks.recv_block(recv, (r - i) % p)
        if target.size:
            xp.copyto(target, held[i])


def bruck_allgather(comm, buf, bounds: list[int]) -> None:
    """Bruck's all-gather in place, any p, ceil(lg p) steps: position i of a work array holds the
    block of rank r+i; at distance d = 2^k a rank sends its first min(d, p-d) positions to rank
    r-d and takes rank r+d's into positions [d, d + min(d, p-d)); a last rotation puts the
    blocks in rank order. T = ceil(lg p)·α + n(p-1)/p·β + 2 local copies."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    total, start = buf.size, bounds[r]
    work = comm.workspace("bruck.gather", total, buf.dtype, get_array_module(buf))

    def end(positions: int) -> int:
        """Where position `positions` starts in the work array (the blocks r, r+1, … before)."""
        last = r + positions
        return bounds[last] - start if last <= p else total - start + bounds[last - p]

    work[:end(1)] = buf[start:bounds[r + 1]]
    distance = 1
    while distance < p:
        count = min(distance, p - distance)
        comm.sendrecv(work[:end(count)], (r - distance) % p,
                      work[end(distance):end(distance + count)], (r + distance) % p, distance)
        distance *= 2
    buf[start:] = work[:total - start]
    buf[:start] = work[total - start:]

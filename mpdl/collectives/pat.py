"""PAT, parallel aggregated trees (NCCL 2.23; Jeaugey 2025): all-gather and reduce-scatter in a
logarithmic number of steps with a bounded buffer.

Every rank's block is broadcast along its own binomial tree; the p trees are shifted copies of
one another, so at each step all the blocks that cross the same link travel in one message
(aggregated). The tree's dimensions are walked from the farthest: the step of distance p/2
carries one block, the step of distance 1 about p/2, so long-distance links carry the least.
Offsets are relative: offset j of rank r is the block of rank r+j (mod p). Before the all-gather's
step of distance d a rank holds the offsets that are multiples of 2d; it sends those with
j + d < p to rank r-d, for which they are offsets j+d. The reduce-scatter is the same schedule
run backwards: nearest first, partial sums of offsets d, 3d, 5d, … go to rank r+d, which adds
them into its offsets 0, 2d, 4d, … At most `segment_bytes` (MPDL_SEGMENT_BYTES) of blocks are
aggregated into one message; a step with more sends several: small operations take ceil(lg p)
messages, large ones more, and the buffer never grows with the operation.
T = Σ_k ceil(m_k / a)·α + n(p-1)/p·β (+ n(p-1)/p·γ), m_k blocks at step k, a blocks a message.
"""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.ops import segment_elements


def _largest_block(bounds: list[int]) -> int:
    return max(b - a for a, b in zip(bounds, bounds[1:], strict=False))


def _aggregate(buf, bounds: list[int]) -> int:
    """Blocks per message: as many of the largest block as fit in a segment, at least one."""
    return max(1, segment_elements(buf.itemsize) // max(1, _largest_block(bounds)))


def _chunks(offsets: range, size: int) -> list[range]:
    return [offsets[i:i + size] for i in range(0, len(offsets), size)]


def _walk(comm, buf, bounds: list[int], distances, reduce=None) -> None:
    """One PAT schedule: at each distance d, offsets j = 0, 2d, 4d, … < p-d travel in aggregated
    messages. Without `reduce` (all-gather) offset j goes to rank r-d and offset j+d is copied in
    from r+d; with it (reduce-scatter) offset j+d goes to r+d and is reduced into offset j."""
    p, r = comm.size, comm.rank
    xp = get_array_module(buf)
    per_message = _aggregate(buf, bounds)
    room = per_message * _largest_block(bounds)
    outgoing = comm.workspace("pat.out", room, buf.dtype, xp)
    incoming = comm.workspace("pat.in", room, buf.dtype, xp)

    def block(rank: int):
        rank %= p
        return buf[bounds[rank]:bounds[rank + 1]]

    for distance in distances:
        gives, gets = (0, distance) if reduce is None else (distance, 0)
        to = r - distance if reduce is None else r + distance
        for chunk in _chunks(range(0, p - distance, 2 * distance), per_message):
            sent = received = 0
            for j in chunk:
                given = block(r + gives + j)
                outgoing[sent:sent + given.size] = given
                sent += given.size
                received += block(r + gets + j).size
            comm.sendrecv(outgoing[:sent], to % p, incoming[:received],
                          (2 * r - to) % p, ("pat", distance, chunk.start))
            at = 0
            for j in chunk:
                got = block(r + gets + j)
                if reduce is None:
                    got[...] = incoming[at:at + got.size]
                else:
                    reduce(got, incoming[at:at + got.size], out=got)
                at += got.size


def pat_allgather(comm, buf, bounds: list[int]) -> None:
    """All-gather in place: farthest distance first, aggregated blocks, bounded messages."""
    if comm.size > 1:
        _walk(comm, buf, bounds, [1 << k for k in reversed(range((comm.size - 1).bit_length()))])


def pat_reduce_scatter(comm, buf, reduce, bounds: list[int]) -> None:
    """Reduce-scatter in place: the all-gather's schedule backwards, nearest distance first;
    afterwards block r of rank r holds the reduced values."""
    if comm.size > 1:
        _walk(comm, buf, bounds, [1 << k for k in range((comm.size - 1).bit_length())], reduce)

"""Recursive doubling all-gather and recursive halving reduce-scatter (Thakur, Rabenseifner &
Gropp 2005; MPICH's allgather_intra_recursive_doubling and reduce_scatter_intra_recursive_halving),
for any p.

On a power-of-two group, step k pairs rank r with r XOR 2^k: the all-gather swaps everything
gathered so far (the range doubles), the reduce-scatter sends the half of its remaining blocks
that the partner keeps and reduces the other half (the range halves). For other p the fold of
`recursive` is applied: of the first 2·rem ranks (rem = p - 2^⌊lg p⌋) each even rank hands its
data to the odd rank above it, which stands for both in the group; its block range is the pair's
two blocks, so every group member's range stays contiguous. At the end the odd rank hands back
what the even one needs (all-gather: the whole result; reduce-scatter: its block).
All-gather: lg p·α + n(p-1)/p·β; reduce-scatter: lg p·α + n(p-1)/p·(β+γ) (+ the fold: 2α + n·β).
"""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.recursive import _halving, _real_rank


def _member(p: int, r: int) -> tuple[list[int], int, bool, int]:
    """The first real rank (and block) of each member of the folded power-of-two group, and p;
    the group's size; whether rank r is one of the folded first 2·rem; and its member index.
    Member i < rem stands for ranks 2i and 2i+1, member i >= rem for rank i + rem."""
    group = 1 << (p.bit_length() - 1)
    rem = p - group
    folded = r < 2 * rem
    firsts = [2 * i if i < rem else i + rem for i in range(group + 1)]
    return firsts, group, folded, r // 2 if folded else r - rem


def recursive_doubling_allgather(comm, buf, bounds: list[int]) -> None:
    """All-gather in place in lg p steps: each step swaps everything gathered so far with the
    partner at distance 2^k, so the gathered range doubles. For p not a power of two, each even
    rank of the first 2·rem first hands its block to the odd rank above it, and gets the whole
    result back at the end."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    firsts, group, folded, me = _member(p, r)
    if folded and r % 2 == 0:
        comm.send(buf[bounds[r]:bounds[r + 1]], r + 1, "fold")
        comm.recv(buf, r + 1, "unfold")
        return
    if folded:
        comm.recv(buf[bounds[r - 1]:bounds[r]], r - 1, "fold")
    distance = 1
    while distance < group:
        partner = me ^ distance
        mine, theirs = me & -distance, partner & -distance  # the aligned ranges gathered so far
        comm.sendrecv(buf[bounds[firsts[mine]]:bounds[firsts[mine + distance]]],
                      _real_rank(comm, partner),
                      buf[bounds[firsts[theirs]]:bounds[firsts[theirs + distance]]],
                      _real_rank(comm, partner), distance)
        distance *= 2
    if folded:
        comm.send(buf, r - 1, "unfold")


def recursive_halving_reduce_scatter(comm, buf, reduce, bounds: list[int]) -> None:
    """Reduce-scatter in place in lg p steps: each step sends the half of the remaining blocks
    that the partner at distance p/2^k keeps, and reduces the half it keeps; afterwards block r
    of rank r holds the reduced values. For p not a power of two, each even rank of the first
    2·rem first hands its whole buffer to the odd rank above it and gets its block back last."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    firsts, group, folded, me = _member(p, r)
    if folded and r % 2 == 0:
        comm.send(buf, r + 1, "fold")
        comm.recv(buf[bounds[r]:bounds[r + 1]], r + 1, "unfold")
        return
    tmp = comm.workspace("rh.incoming", buf.size, buf.dtype, get_array_module(buf))
    if folded:
        comm.recv(tmp[:buf.size], r - 1, "fold")
        reduce(tmp[:buf.size], buf, out=buf)  # the lower rank's data first
    _halving(comm, buf, tmp, reduce, [bounds[f] for f in firsts], me, group)
    if folded:
        comm.send(buf[bounds[r - 1]:bounds[r]], r - 1, "unfold")

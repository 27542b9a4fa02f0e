"""Pairwise exchanges (Thakur, Rabenseifner & Gropp): all-to-all and reduce-scatter.

All-to-all (MPICH's alltoall_intra_pairwise): p-1 steps; at step i every
rank exchanges one block with one partner: rank r XOR i when p is a power of two (both directions
between the same two ranks), otherwise it sends to r+i and receives from r-i (mod p). Each rank
sends its n(p-1)/p bytes in p-1 messages, one at a time, so no link is asked to carry more than
one message at once: T = (p-1)α + n(p-1)/p·β. Reduce-scatter sends
each block straight to its owner the same way and reduces as it comes: + n(p-1)/p·γ.
"""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.blocks import Blocks, copy_own_block, separate_input


def partners(rank: int, p: int, step: int) -> tuple[int, int]:
    """(the rank this one sends to, the rank it receives from) at step 1 <= step < p."""
    if p & (p - 1) == 0:
        return rank ^ step, rank ^ step
    return (rank + step) % p, (rank - step) % p


def pairwise_alltoall(comm, recv, send, blocks: Blocks) -> None:
    """All-to-all by p-1 pairwise exchanges; recv may be send (in place)."""
    send = separate_input(comm, recv, send)
    copy_own_block(comm, recv, send, blocks)
    p, r = comm.size, comm.rank
    for step in range(1, p):
        dst, src = partners(r, p, step)
        incoming, outgoing = blocks.recv_block(recv, src), blocks.send_block(send, dst)
        requests = []
        if incoming.size:
            requests.append(comm.irecv(incoming, src, step))
        if outgoing.size:
            requests.append(comm.isend(outgoing, dst, step))
        comm.waitall(requests)


def pairwise_reduce_scatter(comm, buf, reduce, bounds: list[int]) -> None:
    """Reduce-scatter in place by p-1 exchanges (MPICH's reduce_scatter_intra_pairwise): at step
    i, rank r sends its contribution to block r+i to rank r+i, and adds rank r-i's contribution
    to its own block r."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    mine = buf[bounds[r]:bounds[r + 1]]
    incoming = comm.workspace("pairwise.incoming", mine.size, buf.dtype, get_array_module(buf))
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        comm.sendrecv(buf[bounds[dst]:bounds[dst + 1]], dst, incoming, src, step)
        reduce(mine, incoming, out=mine)

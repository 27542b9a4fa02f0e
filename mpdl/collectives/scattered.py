"""Scattered all-to-all (MPICH's alltoall_intra_scattered, its choice for medium sizes).

Every rank posts non-blocking receives and sends to many peers at once, in batches of at most
THROTTLE peers (MPICH's MPIR_CVAR_ALLTOALL_THROTTLE, 32), and waits for each batch before the
next. The peers are staggered: at position i of the batches rank r receives from r+i and sends to
r-i, so no rank is the first destination of every other. The messages of a batch overlap each
other's latency: T ≈ ceil((p-1)/THROTTLE)·α + (p-1)·o + n(p-1)/p·β, o the cost of posting one
message.
"""

from __future__ import annotations

from mpdl.collectives.blocks import Blocks, copy_own_block, separate_input

#: peers whose messages are in flight at once (MPICH's default throttle)
THROTTLE = 32


def scattered_alltoall(comm, recv, send, blocks: Blocks) -> None:
    """All-to-all by batches of non-blocking messages; recv may be send (in place)."""
    send = separate_input(comm, recv, send)
    copy_own_block(comm, recv, send, blocks)
    p, r = comm.size, comm.rank
    for first in range(1, p, THROTTLE):
        batch = range(first, min(p, first + THROTTLE))
        requests = []
        for i in batch:
            src = (r + i) % p
            incoming = blocks.recv_block(recv, src)
            if incoming.size:
                requests.append(comm.irecv(incoming, src, i))
        for i in batch:
            dst = (r - i) % p
            outgoing = blocks.send_block(send, dst)
            if outgoing.size:
                requests.append(comm.isend(outgoing, dst, i))
        comm.waitall(requests)

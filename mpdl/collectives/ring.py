"""Ring algorithms (Patarasuk & Yuan; Baidu's ring all-reduce).

The p ranks form a ring; each step every rank sends one block to its right neighbour and receives
one from its left. All-reduce = reduce-scatter (p-1 steps) + all-gather (p-1 steps), so each rank
sends 2(p-1)/p of the data whatever p is: bandwidth-optimal, but 2(p-1) latency terms.
"""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.ops import block_bounds, segment_elements


def ring_reduce_scatter(comm, buf, reduce, bounds: list[int]) -> None:
    """Reduce buf over the ring in place; afterwards block r (buf[bounds[r]:bounds[r+1]]) of rank r
    holds the reduced values of block r."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    largest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    incoming = comm.workspace("ring.incoming", largest, buf.dtype, get_array_module(buf))
    seg = segment_elements(buf.itemsize)
    for step in range(p - 1):
        send_block = (r - step - 1) % p
        recv_block = (r - step - 2) % p
        out = buf[bounds[send_block]:bounds[send_block + 1]]
        acc = buf[bounds[recv_block]:bounds[recv_block + 1]]
        tmp = incoming[: acc.size]
        if 0 < acc.size <= seg and 0 < out.size <= seg:  # one segment each way: the common case
            recv, send = comm.irecv(tmp, left, step), comm.isend(out, right, step)
            comm.waitall((recv,))
            reduce(tmp, acc, out=acc)
            comm.waitall((send,))
            continue
        # Post every segment at once, then reduce each as it lands: reduction overlaps transfer.
        recvs = [comm.irecv(tmp[i:i + seg], left, step) for i in range(0, acc.size, seg)]
        sends = [comm.isend(out[i:i + seg], right, step) for i in range(0, out.size, seg)]
        for k, i in enumerate(range(0, acc.size, seg)):
            comm.waitall([recvs[k]])
            reduce(tmp[i:i + seg], acc[i:i + seg], out=acc[i:i + seg])
        comm.waitall(sends)


def ring_allgather(comm, buf, bounds: list[int]) -> None:
    """Circulate the blocks in place: rank r starts with block r and ends with all of them."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_block = (r - step) % p
        recv_block = (r - step - 1) % p
        comm.sendrecv(buf[bounds[send_block]:bounds[send_block + 1]], right,
                      buf[bounds[recv_block]:bounds[recv_block + 1]], left, step)


def ring_allreduce(comm, buf, reduce) -> None:
    """All-reduce buf in place: ring reduce-scatter, then ring all-gather."""
    bounds = block_bounds(buf.size, comm.size)
    ring_reduce_scatter(comm, buf, reduce, bounds)
    ring_allgather(comm, buf, bounds)


def ring_broadcast(comm, buf, root: int) -> None:
    """Pipelined chain broadcast: root -> root+1 -> ... ; segments flow down the chain."""
    p, r = comm.size, comm.rank
    if p == 1 or buf.size == 0:
        return
    rel = (r - root) % p
    left, right = (r - 1) % p, (r + 1) % p
    seg = segment_elements(buf.itemsize)
    sends = []
    for step, i in enumerate(range(0, buf.size, seg)):
        part = buf[i:i + seg]
        if rel > 0:
            comm.recv(part, left, step)
        if rel < p - 1:
            sends.append(comm.isend(part, right, step))
    comm.waitall(sends)


def ring_reduce(comm, buf, reduce, root: int) -> None:
    """Reduce to root: ring reduce-scatter, then every rank sends its reduced block to root."""
    p, r = comm.size, comm.rank
    bounds = block_bounds(buf.size, p)
    ring_reduce_scatter(comm, buf, reduce, bounds)
    if r == root:
        comm.waitall([comm.irecv(buf[bounds[i]:bounds[i + 1]], i, "gather")
                      for i in range(p) if i != root])
    elif p > 1:
        comm.send(buf[bounds[r]:bounds[r + 1]], root, "gather")


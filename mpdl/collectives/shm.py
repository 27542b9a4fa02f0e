"""Shared-memory all-reduce: the ranks of a node reduce straight out of each other's memory.

Each rank copies its data into its segment of a shared window (MPI.Win.Allocate_shared), then
reduces one slice of the array by reading that slice from every peer's segment in rank order,
and finally every rank copies all the reduced slices out. No message is sent inside a node.
Across nodes, each slice owner all-reduces its slice with the owners of the same slice on the
other nodes (equal node sizes) or the node leaders do it for the whole array (uneven nodes).

Two halves of the window alternate between calls, so a rank may start the next call while a slower
peer still copies out of the last one: two node barriers per call instead of three.
Device arrays are staged through the host window; the reductions then run on the host.
"""

from __future__ import annotations

import numpy as np

from mpdl import backend
from mpdl.collectives.hierarchical import inter_node_allreduce
from mpdl.collectives.ops import block_bounds

#: the largest chunk (bytes per rank) that goes through the window at once
WINDOW_BYTES = 16 << 20


def shm_allreduce(comm, buf, reduce_device) -> None:
    """All-reduce buf in place through per-node shared memory, in chunks of WINDOW_BYTES."""
    if comm.size == 1 or buf.size == 0:
        return
    xp = backend.get_array_module(buf)
    reduce = reduce_device if xp is np else getattr(np, reduce_device.__name__.removeprefix("cupy_"))
    chunk = max(1, WINDOW_BYTES // buf.itemsize)
    segments, node_barrier = comm.shared_segments(2 * min(buf.size, chunk) * buf.itemsize)
    for start in range(0, buf.size, chunk):
        comm.shm_calls += 1
        _allreduce_chunk(comm, buf[start:start + chunk], reduce, xp, segments,
                         comm.shm_calls % 2, node_barrier)


def _allreduce_chunk(comm, part, reduce, xp, segments, half, node_barrier) -> None:
    n, dtype = part.size, part.dtype
    offset = half * (segments[0].nbytes // 2)
    views = [s[offset:offset + n * dtype.itemsize].view(dtype) for s in segments]
    groups = comm.node_groups()
    node = comm.node_of_rank()[comm.rank]
    local_rank = groups[node].index(comm.rank)
    g = len(groups[node])
    mine = views[local_rank]
    if xp is np:
        np.copyto(mine, part)
    else:
        xp.asnumpy(part, out=mine)
    node_barrier()

    bounds = block_bounds(n, g)
    lo, hi = bounds[local_rank], bounds[local_rank + 1]
    acc = comm.workspace("shm.acc", hi - lo, dtype, np)
    if g == 1:
        np.copyto(acc, views[0][lo:hi])
    else:
        reduce(views[0][lo:hi], views[1][lo:hi], out=acc)
        for v in views[2:]:
            reduce(acc, v[lo:hi], out=acc)
    equal_nodes = len({len(grp) for grp in groups}) == 1
    if len(groups) > 1 and equal_nodes:
        inter_node_allreduce(comm.sub([grp[local_rank] for grp in groups]), acc, reduce)
    mine[lo:hi] = acc  # only this rank reads or writes this slice of its own segment now
    node_barrier()

    if len(groups) > 1 and not equal_nodes:
        # Uneven nodes: leaders combine whole node sums, then every rank reads its leader's copy.
        whole = comm.workspace("shm.whole", n, dtype, np)
        for r in range(g):
            whole[bounds[r]:bounds[r + 1]] = views[r][bounds[r]:bounds[r + 1]]
        if local_rank == 0:
            inter_node_allreduce(comm.sub([grp[0] for grp in groups]), whole, reduce)
            views[0][:] = whole
        node_barrier()
        _copy_out(part, xp, [(0, n, views[0])])
        node_barrier()
        return
    _copy_out(part, xp, [(bounds[r], bounds[r + 1], views[r]) for r in range(g)])


def _copy_out(part, xp, pieces) -> None:
    for lo, hi, view in pieces:
        if hi == lo:
            continue
        if xp is np:
            np.copyto(part[lo:hi], view[lo:hi])
        else:
            backend.upload(part[lo:hi], view[lo:hi])

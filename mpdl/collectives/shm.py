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

import weakref

import numpy as np

from mpdl import backend
from mpdl.collectives.hierarchical import inter_node_allreduce
from mpdl.collectives.ops import accumulator, block_bounds, settle

#: bytes per rank that go through the window at once: small enough to stay in cache
WINDOW_BYTES = 1 << 20

#: chunks each communicator has all-reduced so far; their parity picks the half of the window
_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shm_allreduce(comm, buf, reduce_device, src=None) -> None:
    """All-reduce in place through per-node shared memory, in chunks of WINDOW_BYTES.

    When `src` is given, the input is read from it rather than from buf (saving one copy).
    """
    if comm.size == 1 or buf.size == 0:
        if src is not None and src is not buf:
            backend.get_array_module(buf).copyto(buf, src)
        return
    xp = backend.get_array_module(buf)
    reduce = reduce_device if xp is np else getattr(np, reduce_device.__name__.removeprefix("cupy_"))
    src = buf if src is None else src
    chunk = max(1, WINDOW_BYTES // buf.itemsize)
    segments, node_barrier = comm.shared_segments(2 * min(buf.size, chunk) * buf.itemsize)
    for start in range(0, buf.size, chunk):
        calls = _calls[comm] = _calls.get(comm, 0) + 1
        _allreduce_chunk(comm, src[start:start + chunk], buf[start:start + chunk], reduce, xp,
                         segments, calls % 2, node_barrier)


def _allreduce_chunk(comm, src, part, reduce, xp, segments, half, node_barrier) -> None:
    n, dtype = part.size, part.dtype
    offset = half * (segments[0].nbytes // 2)
    views = [s[offset:offset + n * dtype.itemsize].view(dtype) for s in segments]
    groups = comm.node_groups()
    node = comm.node_of_rank()[comm.rank]
    local_rank = groups[node].index(comm.rank)
    g = len(groups[node])
    if xp is np:
        np.copyto(views[local_rank], src)
    else:
        xp.asnumpy(src, out=views[local_rank])
    node_barrier()

    # Slice [lo, hi) of every segment is read and written by this rank alone until the next
    # barrier, so the reduced slice can be accumulated in place in segment 0, in rank order.
    bounds = block_bounds(n, g)
    lo, hi = bounds[local_rank], bounds[local_rank + 1]
    result = views[0]
    acc = accumulator(result[lo:hi], g - 1)
    for v in views[1:]:
        reduce(acc, v[lo:hi], out=acc)
    settle(result[lo:hi], acc)
    equal_nodes = len({len(grp) for grp in groups}) == 1
    if len(groups) > 1 and equal_nodes:
        inter_node_allreduce(comm.sub([grp[local_rank] for grp in groups]), result[lo:hi], reduce)
    node_barrier()
    if len(groups) > 1 and not equal_nodes:
        # Uneven nodes: the leaders combine their node sums, then every rank reads its leader's.
        if local_rank == 0:
            inter_node_allreduce(comm.sub([grp[0] for grp in groups]), result, reduce)
        node_barrier()
    if xp is np:
        np.copyto(part, result)
    else:
        backend.upload(part, result)

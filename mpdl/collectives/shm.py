"""Shared-memory all-reduce: the ranks of a node reduce straight out of each other's memory.

Each rank copies its data into its segment of a shared window (MPI.Win.Allocate_shared), then
reduces one slice of the array by reading that slice from every peer's segment in rank order,
and finally every rank copies all the reduced slices out. No message is sent inside a node.
Across nodes, each slice owner all-reduces its slice with the owners of the same slice on the
other nodes (equal node sizes) or the node leaders do it for the whole array (uneven nodes).

Two halves of the window alternate between calls, so a rank may start the next call while a slower
peer still copies out of the last one: two node barriers per call instead of three.
Device arrays are staged through the host window; the reductions then run on the host.

An array that already lies in shared memory (`shared_array`, as DDP's gradient buckets on one node)
is all-reduced where it lies: each rank sums its slice out of every rank's array and writes the
sum into every rank's array, so the data is read once and written once per rank, with no copy in
or out and the same bits as the copying path.
"""

from __future__ import annotations

import weakref

import numpy as np

from mpdl import backend
from mpdl.collectives.hierarchical import inter_node_allreduce
from mpdl.collectives.ops import block_bounds

#: bytes per rank that go through the window at once: small enough to stay in cache
WINDOW_BYTES = 1 << 20

#: elements of a slice summed and written out at once in place (so they are still in cache when
#: written to every rank's array)
SHARED_BLOCK_BYTES = 1 << 17

#: chunks each communicator has all-reduced so far; their parity picks the half of the window
_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: the shared arrays made on each communicator: (address of this rank's segment, every rank's
#: segment, the node barrier)
_shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_array(comm, count: int, dtype) -> np.ndarray:
    """This rank's array of `count` zeros of dtype, in a shared-memory window of the ranks of
    comm's node made for it alone. Collective over comm: every rank makes its array at the same
    point, and an in-place shm all-reduce of the array on comm (all ranks of comm on one node)
    runs where the arrays lie. The window lives as long as comm."""
    dtype = np.dtype(dtype)
    segments, node_barrier = comm.shared_segments(max(count, 1) * dtype.itemsize, own=True)
    node = comm.node_of_rank()[comm.rank]
    mine = segments[comm.node_groups()[node].index(comm.rank)]
    array = mine[:count * dtype.itemsize].view(dtype)
    array[...] = 0
    _shared.setdefault(comm, []).append((_address(mine), mine.nbytes, segments, node_barrier))
    return array


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def in_shared_memory(comm, buf) -> bool:
    """Whether buf lies in a `shared_array` of comm whose ranks are all on one node (an shm
    all-reduce of it in place then sums it where it lies)."""
    return _in_place_views(comm, buf) is not None


def _in_place_views(comm, buf) -> tuple[list[np.ndarray], object] | None:
    """(every rank's array at buf's place, the node barrier) when buf lies in a shared array of
    comm whose ranks are all on one node; None otherwise."""
    regions = _shared.get(comm)
    if not regions or not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        return None
    where = _address(buf)
    for start, nbytes, segments, node_barrier in regions:
        if start <= where and where + buf.nbytes <= start + nbytes:
            if len(comm.node_groups()) > 1:
                return None
            offset = where - start
            return ([s[offset:offset + buf.nbytes].view(buf.dtype) for s in segments],
                    node_barrier)
    return None


def shm_allreduce(comm, buf, reduce_device, src=None) -> None:
    """All-reduce in place through per-node shared memory, in chunks of WINDOW_BYTES.

    When `src` is given, the input is read from it rather than from buf (saving one copy).
    """
    if comm.size == 1 or buf.size == 0:
        if src is not None and src is not buf:
            backend.get_array_module(buf).copyto(buf, src)
        return
    if src is None or src is buf:
        shared = _in_place_views(comm, buf)
        if shared is not None:
            _allreduce_in_place(comm.rank, *shared, reduce_device)
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


def _allreduce_in_place(rank: int, views: list[np.ndarray], node_barrier, reduce) -> None:
    """Sum slice `rank` of every rank's array (views, in rank order) in rank order, and write it
    into every rank's array, a cache-sized block at a time; between two node barriers."""
    node_barrier()  # every rank's input is in place
    bounds = block_bounds(views[0].size, len(views))
    block = max(1, SHARED_BLOCK_BYTES // views[0].itemsize)
    for lo in range(bounds[rank], bounds[rank + 1], block):
        hi = min(lo + block, bounds[rank + 1])
        result = views[0][lo:hi]
        for v in views[1:]:
            reduce(result, v[lo:hi], out=result)
        for v in views[1:]:
            np.copyto(v[lo:hi], result)
    node_barrier()  # every slice is summed into every rank's array


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
    for v in views[1:]:
        reduce(result[lo:hi], v[lo:hi], out=result[lo:hi])
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

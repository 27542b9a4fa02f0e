"""Hierarchical all-reduce: reduce inside each node, all-reduce across nodes, spread inside each node.

With equal-sized nodes of g ranks: intra-node ring reduce-scatter (each local rank owns 1/g of the
data), an inter-node all-reduce of each shard among the ranks with the same local index, then an
intra-node ring all-gather. With uneven nodes, the shards would not line up, so each node reduces
to its first rank, those leaders all-reduce, and each leader broadcasts inside its node.
Nodes come from MPI's shared-memory split, or MPDL_RANKS_PER_NODE=k for emulated nodes.
"""

from __future__ import annotations

from mpdl.collectives.ops import block_bounds
from mpdl.collectives.recursive import recursive_doubling_allreduce
from mpdl.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from mpdl.collectives.tree import tree_broadcast, tree_reduce

#: shards below this many bytes cross nodes by recursive doubling (latency-bound), above by ring
INTER_RING_BYTES = 64 * 1024


def inter_node_allreduce(comm, buf, reduce) -> None:
    """All-reduce among one rank per node: recursive doubling for small data, ring for large."""
    if buf.nbytes < INTER_RING_BYTES:
        recursive_doubling_allreduce(comm, buf, reduce)
    else:
        ring_allreduce(comm, buf, reduce)


def hierarchical_allreduce(comm, buf, reduce) -> None:
    """All-reduce in place, in three levels: intra-node, inter-node, intra-node."""
    groups = comm.node_groups()
    node = comm.node_of_rank()[comm.rank]
    local = comm.sub(groups[node])
    sizes = {len(g) for g in groups}
    if len(groups) == 1:
        ring_allreduce(local, buf, reduce)
    elif len(sizes) == 1:
        bounds = block_bounds(buf.size, local.size)
        ring_reduce_scatter(local, buf, reduce, bounds)
        shard = buf[bounds[local.rank]:bounds[local.rank + 1]]
        inter_node_allreduce(comm.sub([g[local.rank] for g in groups]), shard, reduce)
        ring_allgather(local, buf, bounds)
    else:
        tree_reduce(local, buf, reduce, 0)
        if local.rank == 0:
            inter_node_allreduce(comm.sub([g[0] for g in groups]), buf, reduce)
        tree_broadcast(local, buf, 0)

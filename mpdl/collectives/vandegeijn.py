"""Large-message broadcast and reduce built from a scatter and an all-gather (van de Geijn; Barnett
et al. 1994; Thakur, Rabenseifner & Gropp 2005; MPICH's bcast_intra_scatter_ring_allgather and
reduce_intra_reduce_scatter_gather).

Broadcast: the root scatters the p blocks along a binomial tree, then a ring all-gather spreads
them: lg p·α + n(p-1)/p·β + (p-1)α + n(p-1)/p·β, about 2n·β however large p is, where the
binomial broadcast costs n·lg p·β. Reduce is its mirror image: a recursive-halving
reduce-scatter, then a binomial gather of the reduced blocks to the root:
2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ. Both work on the ranks renumbered from the root.
"""

from __future__ import annotations

from mpdl.collectives.doubling import recursive_halving_reduce_scatter
from mpdl.collectives.ops import block_bounds
from mpdl.collectives.ring import ring_allgather
from mpdl.collectives.tree import tree_gather_blocks, tree_scatter_blocks


def _from_root(comm, root: int):
    """The communicator's ranks renumbered so that root is rank 0."""
    return comm.sub([(root + i) % comm.size for i in range(comm.size)])


def scatter_allgather_broadcast(comm, buf, root: int = 0) -> None:
    """Broadcast root's buf in place: binomial scatter of its blocks, then ring all-gather."""
    if comm.size == 1:
        return
    ranks = _from_root(comm, root)
    bounds = block_bounds(buf.size, comm.size)
    tree_scatter_blocks(ranks, buf, bounds)
    ring_allgather(ranks, buf, bounds)


def reduce_scatter_gather_reduce(comm, buf, reduce, root: int = 0) -> None:
    """Reduce to root in place: recursive-halving reduce-scatter, then binomial gather."""
    if comm.size == 1:
        return
    ranks = _from_root(comm, root)
    bounds = block_bounds(buf.size, comm.size)
    recursive_halving_reduce_scatter(ranks, buf, reduce, bounds)
    tree_gather_blocks(ranks, buf, bounds)

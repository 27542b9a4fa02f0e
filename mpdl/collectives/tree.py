"""Tree algorithms: binomial trees (reduce, broadcast, scatter, gather) and NCCL-style double binary
trees. Segments flow through the tree one after another, so large messages pipeline."""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.ops import segment_elements


def binomial_parent_children(rel: int, p: int) -> tuple[int | None, list[int]]:
    """Parent and children (relative ranks, children nearest first) in a binomial tree rooted at 0."""
    children = []
    mask = 1
    while mask < p:
        if rel & mask:
            return rel - mask, children
        if rel + mask < p:
            children.append(rel + mask)
        mask <<= 1
    return None, children


def _segments(buf):
    seg = segment_elements(buf.itemsize)
    return [(i, min(i + seg, buf.size)) for i in range(0, buf.size, seg)] or [(0, 0)]


def tree_reduce(comm, buf, reduce, root: int = 0) -> None:
    """Binomial-tree reduce to root, in place (only root's buf holds the result)."""
    p = comm.size
    if p == 1:
        return
    rel = (comm.rank - root) % p
    parent, children = binomial_parent_children(rel, p)
    _pipelined_reduce(comm, buf, reduce, parent, children, root)


def tree_broadcast(comm, buf, root: int = 0) -> None:
    """Binomial-tree broadcast of root's buf, in place."""
    p = comm.size
    if p == 1:
        return
    rel = (comm.rank - root) % p
    parent, children = binomial_parent_children(rel, p)
    _pipelined_broadcast(comm, buf, parent, children[::-1], root)


def binomial_broadcast(comm, buf, root: int = 0) -> None:
    """Binomial-tree broadcast of root's whole buf, in place (MPICH's bcast_intra_binomial):
    lg p rounds of one whole message, no segments: lg p·(α + n·β)."""
    p = comm.size
    if p == 1:
        return
    parent, children = binomial_parent_children((comm.rank - root) % p, p)
    if parent is not None:
        comm.recv(buf, (parent + root) % p, "bcast")
    comm.waitall([comm.isend(buf, (c + root) % p, "bcast") for c in children[::-1]])


def binomial_reduce(comm, buf, reduce, root: int = 0) -> None:
    """Binomial-tree reduce of whole buffers to root, in place (MPICH's reduce_intra_binomial):
    lg p rounds of one whole message: lg p·(α + n·β + n·γ)."""
    p = comm.size
    if p == 1:
        return
    parent, children = binomial_parent_children((comm.rank - root) % p, p)
    incoming = comm.workspace("binomial.incoming", buf.size, buf.dtype, get_array_module(buf))
    for child in children:  # children hold higher ranks: own data first keeps the order canonical
        comm.recv(incoming, (child + root) % p, "reduce")
        reduce(buf, incoming, out=buf)
    if parent is not None:
        comm.send(buf, (parent + root) % p, "reduce")


def tree_allreduce(comm, buf, reduce) -> None:
    """Binomial reduce to rank 0, then binomial broadcast from rank 0."""
    tree_reduce(comm, buf, reduce, 0)
    tree_broadcast(comm, buf, 0)


def _pipelined_reduce(comm, buf, reduce, parent, children, root) -> None:
    """Reduce up a tree segment by segment."""
    p = comm.size
    real = [(c + root) % p for c in children]
    tmp = comm.workspace("tree.incoming", min(buf.size, segment_elements(buf.itemsize)),
                         buf.dtype, get_array_module(buf))
    sends = []
    for step, (a, b) in enumerate(_segments(buf)):
        part = buf[a:b]
        incoming = tmp[: b - a]
        for child in real:  # children hold higher ranks: own data first keeps the order canonical
            comm.recv(incoming, child, ("reduce", step))
            reduce(part, incoming, out=part)
        if parent is not None:
            sends.append(comm.isend(part, (parent + root) % p, ("reduce", step)))
    comm.waitall(sends)


def _pipelined_broadcast(comm, buf, parent, children, root) -> None:
    p = comm.size
    real = [(c + root) % p for c in children]
    sends = []
    for step, (a, b) in enumerate(_segments(buf)):
        part = buf[a:b]
        if parent is not None:
            comm.recv(part, (parent + root) % p, ("bcast", step))
        sends.extend(comm.isend(part, child, ("bcast", step)) for child in real)
    comm.waitall(sends)


def tree_scatter_blocks(comm, buf, bounds: list[int]) -> None:
    """Binomial scatter from rank 0: each subtree receives the contiguous blocks of its ranks."""
    p, rel = comm.size, comm.rank
    parent, children = binomial_parent_children(rel, p)
    if parent is not None:
        span = rel & -rel  # a subtree covers ranks [rel, rel + lowest set bit)
        comm.recv(buf[bounds[rel]:bounds[min(rel + span, p)]], parent, "scatter")
    for child in children[::-1]:
        span = child - rel
        comm.send(buf[bounds[child]:bounds[min(child + span, p)]], child, "scatter")


def tree_gather_blocks(comm, buf, bounds: list[int]) -> None:
    """Binomial gather to rank 0: each rank collects the blocks of its subtree, then passes them up."""
    p, rel = comm.size, comm.rank
    parent, children = binomial_parent_children(rel, p)
    for child in children:
        span = child - rel
        comm.recv(buf[bounds[child]:bounds[min(child + span, p)]], child, "gather")
    if parent is not None:
        span = rel & -rel
        comm.send(buf[bounds[rel]:bounds[min(rel + span, p)]], parent, "gather")


def tree_reduce_scatter(comm, buf, reduce, bounds: list[int]) -> None:
    """Binomial reduce to rank 0, then binomial scatter of the blocks."""
    tree_reduce(comm, buf, reduce, 0)
    tree_scatter_blocks(comm, buf, bounds)


def tree_allgather(comm, buf, bounds: list[int]) -> None:
    """Binomial gather of the blocks to rank 0, then binomial broadcast."""
    tree_gather_blocks(comm, buf, bounds)
    tree_broadcast(comm, buf, 0)


def inorder_tree(order: list[int]) -> dict[int, tuple[int | None, list[int]]]:
    """A balanced binary tree over `order` (in-order layout): rank -> (parent, children).

    About half the ranks are leaves: those at even positions of `order`.
    """
    links: dict[int, tuple[int | None, list[int]]] = {}

    def build(lo: int, hi: int, parent: int | None) -> int | None:
        if lo >= hi:
            return None
        mid = (lo + hi) // 2
        node = order[mid]
        kids = [k for k in (build(lo, mid, node), build(mid + 1, hi, node)) if k is not None]
        links[node] = (parent, kids)
        return node

    build(0, len(order), None)
    return links


def double_tree_allreduce(comm, buf, reduce) -> None:
    """NCCL-style double binary tree: two complementary trees each reduce and broadcast half the data.

    The second tree is the first shifted by one rank, so a rank that is a leaf in one tree is an
    inner node in the other and every rank's links carry about the same load.
    """
    p = comm.size
    if p == 1:
        return
    half = buf.size // 2
    halves = (buf[:half], buf[half:])
    trees = (inorder_tree(list(range(p))), inorder_tree([(i + 1) % p for i in range(p)]))
    segs = [_segments(h) for h in halves]
    tmp = comm.workspace("dtree.incoming", segment_elements(buf.itemsize), buf.dtype,
                         get_array_module(buf))
    up_sends: list[list] = [[], []]
    down_sends = []
    # Process segments of both trees in one global order; sends never block, so no cycle can form.
    for step in range(max(len(s) for s in segs)):
        # each tree's segment of this step (its part of the buffer) and this rank's place in it
        live = [(t, halves[t][a:b], *trees[t][comm.rank])
                for t in (0, 1) if step < len(segs[t]) for a, b in [segs[t][step]]]
        for t, part, parent, children in live:
            for child in sorted(children):
                incoming = tmp[:part.size]
                comm.recv(incoming, child, ("up", t, step))
                if child < comm.rank:
                    reduce(incoming, part, out=part)
                else:
                    reduce(part, incoming, out=part)
            if parent is not None:
                up_sends[t].append(comm.isend(part, parent, ("up", t, step)))
        for t, part, parent, children in live:
            if parent is not None:
                comm.waitall([up_sends[t][step]])  # the buffer is rewritten below
                comm.recv(part, parent, ("down", t, step))
            down_sends.extend(comm.isend(part, child, ("down", t, step)) for child in children)
    comm.waitall(down_sends)

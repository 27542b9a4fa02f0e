"""Hierarchical all-to-all: one message per pair of nodes, gathered and scattered inside the nodes.

A direct all-to-all sends p-g messages per rank across nodes (g ranks per node); this one sends
about (m-1)/g (m nodes), which pays where an inter-node message costs much more than one inside
a node. Nodes come from MPI's shared-memory split, or MPDL_RANKS_PER_NODE=k for emulated nodes;
they may differ in size. For every pair of nodes (A, B) one rank of A, its agent for B, handles
what A sends to B and what B sends to A; the remote nodes are dealt out over A's ranks in turn.
0. Inside the node, every rank exchanges its blocks with the others directly (pairwise).
1. Gather: every rank sends its blocks for the ranks of B (one message) to A's agent for B,
   which orders them by destination rank.
2. Exchange: A's agent for B and B's agent for A swap what their nodes send each other.
3. Scatter: the agent sends each rank of A the blocks it received for it (one message).
Cost, with m nodes of g ranks, b = n/p bytes per block and k = ceil((m-1)/g) remote nodes per
agent (α, β inside a node; α', β' between nodes; c a local copy per byte):
  T = (g-1)(α + bβ) + 2[(m-1)α + (m-1)(g-1)bβ] + k(α' + g²bβ') + k·g²b·c
Across nodes each rank sends k messages instead of g(m-1), the same n(m-1)/m bytes; inside the
node it sends and receives 2(m-1)(g-1)b bytes more than a direct all-to-all (docs/alltoall.md).
"""

from __future__ import annotations

import numpy as np

from mpdl.backend import get_array_module
from mpdl.collectives.blocks import Blocks, copy_own_block, separate_input
from mpdl.collectives.pairwise import partners


def agent(groups: list[list[int]], node: int, remote: int) -> int:
    """The rank of `node` that handles its traffic with `remote`: remote nodes are dealt out over
    the node's ranks in turn, starting with the next node."""
    members = groups[node]
    return members[((remote - node) % len(groups) - 1) % len(members)]


def _run_of(ranks: list[int], offsets: tuple[int, ...], counts: tuple[int, ...], buf):
    """The view of the blocks of these ranks when they lie back to back in buf, else None."""
    first, last = ranks[0], ranks[-1]
    if ranks != list(range(first, last + 1)):
        return None
    return buf[offsets[first]:offsets[last] + counts[last]]


def hierarchical_alltoall(comm, recv, send, blocks: Blocks) -> None:
    """All-to-all in place or not, in the four phases above."""
    send = separate_input(comm, recv, send)
    copy_own_block(comm, recv, send, blocks)
    groups = comm.node_groups()
    r = comm.rank
    home = comm.node_of_rank()[r]
    mine = groups[home]
    _inside_the_node(comm, recv, send, blocks, mine)
    remotes = [b for b in range(len(groups)) if b != home]
    if not remotes:
        return
    gathered = _gather(comm, send, blocks, groups, home, remotes)
    arrived = _exchange(comm, blocks, groups, home, gathered)
    _scatter(comm, recv, blocks, groups, home, remotes, arrived)


def _inside_the_node(comm, recv, send, blocks: Blocks, mine: list[int]) -> None:
    g, local = len(mine), mine.index(comm.rank)
    for step in range(1, g):
        to, frm = partners(local, g, step)
        dst, src = mine[to], mine[frm]
        incoming, outgoing = blocks.recv_block(recv, src), blocks.send_block(send, dst)
        requests = []
        if incoming.size:
            requests.append(comm.irecv(incoming, src, ("node", step)))
        if outgoing.size:
            requests.append(comm.isend(outgoing, dst, ("node", step)))
        comm.waitall(requests)


def _gather(comm, send, blocks: Blocks, groups, home: int, remotes: list[int]) -> dict:
    """Phase 1. Returns {remote node: what this node sends it, ordered by destination rank then
    source rank} for the remote nodes this rank is the agent of."""
    r, xp = comm.rank, get_array_module(send)
    mine = groups[home]
    requests, staged = [], {}
    for b in remotes:
        theirs = groups[b]
        a = agent(groups, home, b)
        own = _run_of(theirs, blocks.send_offsets, blocks.send_counts, send)
        if own is None:
            own = xp.concatenate([blocks.send_block(send, t) for t in theirs])
        if a != r:
            if own.size:
                requests.append(comm.isend(own, a, ("gather", b)))
            continue
        sizes = np.array([[blocks.count(q, t) for t in theirs] for q in mine], dtype=np.int64)
        parts = []
        for q, row in zip(mine, sizes, strict=True):
            if q == r:
                parts.append(own)
                continue
            part = xp.empty(int(row.sum()), dtype=send.dtype)
            if part.size:
                requests.append(comm.irecv(part, q, ("gather", b)))
            parts.append(part)
        staged[b] = (sizes, parts)
    comm.waitall(requests)
    gathered = {}
    for b, (sizes, parts) in staged.items():
        # reorder source-major parts (per source q: its blocks for each t) destination-major
        edges = np.concatenate([np.zeros((len(parts), 1), np.int64), np.cumsum(sizes, axis=1)],
                               axis=1)
        pieces = [parts[q][edges[q, t]:edges[q, t + 1]]
                  for t in range(sizes.shape[1]) for q in range(len(parts))]
        gathered[b] = xp.concatenate(pieces) if pieces else send[:0]
    return gathered


def _exchange(comm, blocks: Blocks, groups, home: int, gathered: dict) -> dict:
    """Phase 2: {remote node: what it sends this node, ordered by destination rank then source
    rank} for the remote nodes this rank is the agent of."""
    requests, arrived = [], {}
    mine = groups[home]
    for b, outgoing in gathered.items():
        peer = agent(groups, b, home)
        size = sum(blocks.count(q, t) for t in mine for q in groups[b])
        incoming = arrived[b] = get_array_module(outgoing).empty(size, dtype=outgoing.dtype)
        if incoming.size:
            requests.append(comm.irecv(incoming, peer, ("nodes", home)))
        if outgoing.size:
            requests.append(comm.isend(outgoing, peer, ("nodes", b)))
    comm.waitall(requests)
    return arrived


def _scatter(comm, recv, blocks: Blocks, groups, home: int, remotes: list[int],
             arrived: dict) -> None:
    """Phase 3: each rank of this node gets, from the agent for each remote node, the blocks that
    node's ranks send it, and puts them in place."""
    r, xp = comm.rank, get_array_module(recv)
    mine = groups[home]
    requests, unpack = [], []
    for b in remotes:
        theirs = groups[b]
        a = agent(groups, home, b)
        if a == r:
            edge = 0
            for t in mine:
                size = sum(blocks.count(q, t) for q in theirs)
                part = arrived[b][edge:edge + size]
                edge += size
                if t == r:
                    unpack.append((theirs, part))
                elif part.size:
                    requests.append(comm.isend(part, t, ("scatter", b)))
            continue
        size = sum(blocks.recv_counts[q] for q in theirs)
        if not size:
            continue
        place = _run_of(theirs, blocks.recv_offsets, blocks.recv_counts, recv)
        if place is None:
            place = xp.empty(size, dtype=recv.dtype)
            unpack.append((theirs, place))
        requests.append(comm.irecv(place, a, ("scatter", b)))
    comm.waitall(requests)
    for theirs, part in unpack:
        edge = 0
        for q in theirs:
            target = blocks.recv_block(recv, q)
            if target.size:
                xp.copyto(target, part[edge:edge + target.size])
            edge += target.size

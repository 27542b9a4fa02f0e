"""Recursive doubling and Rabenseifner's halving-doubling all-reduce (Thakur, Rabenseifner & Gropp).

Both work on a power-of-two group. For other p, the standard fold is applied first: of the first
2·rem ranks (rem = p - 2^⌊lg p⌋), each even rank hands its data to the odd rank above it and
sits out; at the end the odd rank hands the result back.
"""

from __future__ import annotations

from mpdl.backend import get_array_module
from mpdl.collectives.ops import block_bounds


def _fold_in(comm, buf, reduce) -> int:
    """Fold p ranks onto a power of two; return this rank's index in it, or -1 if it sits out."""
    p, r = comm.size, comm.rank
    rem = p - (1 << (p.bit_length() - 1))
    if r >= 2 * rem:
        return r - rem
    if r % 2 == 0:
        comm.send(buf, r + 1, "fold")
        return -1
    tmp = comm.workspace("fold.incoming", buf.size, buf.dtype, get_array_module(buf))
    comm.recv(tmp, r - 1, "fold")
    reduce(tmp, buf, out=buf)
    return r // 2


def _fold_out(comm, buf) -> None:
    """Return the result to the ranks that sat out of the power-of-two group."""
    p, r = comm.size, comm.rank
    rem = p - (1 << (p.bit_length() - 1))
    if r < 2 * rem:
        if r % 2 == 0:
            comm.recv(buf, r + 1, "unfold")
        else:
            comm.send(buf, r - 1, "unfold")


def _real_rank(comm, new_rank: int) -> int:
    rem = comm.size - (1 << (comm.size.bit_length() - 1))
    return 2 * new_rank + 1 if new_rank < rem else new_rank + rem


def _halving(comm, buf, tmp, reduce, edges: list[int], me: int, group: int) -> tuple[int, int]:
    """Recursive halving over a power-of-two group whose member i holds buf[edges[i]:edges[i+1]]:
    each step sends the half the partner keeps and reduces the other; returns the members
    (lo, hi) whose range this rank ends up holding reduced."""
    lo, hi = 0, group
    distance = group // 2
    while distance >= 1:
        partner, mid = me ^ distance, (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if me & distance else ((lo, mid), (mid, hi))
        kept = buf[edges[keep[0]]:edges[keep[1]]]
        incoming = tmp[:kept.size]
        comm.sendrecv(buf[edges[give[0]]:edges[give[1]]], _real_rank(comm, partner),
                      incoming, _real_rank(comm, partner), ("halving", distance))
        # Canonical order (lower rank's data first) keeps every rank's result bit-identical.
        if partner < me:
            reduce(incoming, kept, out=kept)
        else:
            reduce(kept, incoming, out=kept)
        lo, hi = keep
        distance //= 2
    return lo, hi


def recursive_doubling_allreduce(comm, buf, reduce) -> None:
    """All-reduce in lg p steps; each step swaps the whole buffer with the partner at distance 2^k."""
    if comm.size == 1:
        return
    me = _fold_in(comm, buf, reduce)
    if me >= 0:
        group = 1 << (comm.size.bit_length() - 1)
        tmp = comm.workspace("rd.incoming", buf.size, buf.dtype, get_array_module(buf))
        distance = 1
        while distance < group:
            partner = me ^ distance
            comm.sendrecv(buf, _real_rank(comm, partner), tmp, _real_rank(comm, partner), distance)
            # Canonical order (lower rank's data first) keeps every rank's result bit-identical.
            if partner < me:
                reduce(tmp, buf, out=buf)
            else:
                reduce(buf, tmp, out=buf)
            distance *= 2
    _fold_out(comm, buf)


def rabenseifner_allreduce(comm, buf, reduce) -> None:
    """All-reduce by recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    if comm.size == 1:
        return
    me = _fold_in(comm, buf, reduce)
    if me >= 0:
        group = 1 << (comm.size.bit_length() - 1)
        bounds = block_bounds(buf.size, group)
        tmp = comm.workspace("rab.incoming", (buf.size + 1) // 2 + group, buf.dtype,
                             get_array_module(buf))
        lo, hi = _halving(comm, buf, tmp, reduce, bounds, me, group)
        distance = 1
        while distance < group:
            partner = me ^ distance
            # The partner owns the sibling range of the same size.
            size = hi - lo
            plo = lo + size if not me & distance else lo - size
            comm.sendrecv(buf[bounds[lo]:bounds[hi]], _real_rank(comm, partner),
                          buf[bounds[plo]:bounds[plo + size]], _real_rank(comm, partner),
                          ("doubling", distance))
            lo, hi = min(lo, plo), max(hi, plo + size)
            distance *= 2
    _fold_out(comm, buf)


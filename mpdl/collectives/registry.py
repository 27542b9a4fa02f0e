"""The one table of algorithms: which exist for each collective, what each does and costs.

Every algorithm is registered with a one-line summary and its α-β-γ cost (Thakur, Rabenseifner &
Gropp 2005) so that `mpdl bench --list`, the cost model (`costmodel.FORMULAS` is checked against
this table) and `auto` (`mpdl.tuning.auto`) read the same names. It imports no cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpdl.collectives import native
from mpdl.collectives.bruck import bruck_allgather, bruck_alltoall
from mpdl.collectives.doubling import recursive_doubling_allgather, recursive_halving_reduce_scatter
from mpdl.collectives.hierarchical import hierarchical_allreduce
from mpdl.collectives.hierarchical_alltoall import hierarchical_alltoall
from mpdl.collectives.ops import with_reducer
from mpdl.collectives.pairwise import pairwise_alltoall, pairwise_reduce_scatter
from mpdl.collectives.pat import pat_allgather, pat_reduce_scatter
from mpdl.collectives.recursive import rabenseifner_allreduce, recursive_doubling_allreduce
from mpdl.collectives.ring import (
    ring_allgather,
    ring_allreduce,
    ring_broadcast,
    ring_reduce,
    ring_reduce_scatter,
)
from mpdl.collectives.scattered import scattered_alltoall
from mpdl.collectives.shm import shm_allreduce
from mpdl.collectives.torus import torus2d_allreduce
from mpdl.collectives.tree import (
    binomial_broadcast,
    binomial_reduce,
    double_tree_allreduce,
    tree_allgather,
    tree_allreduce,
    tree_broadcast,
    tree_reduce,
    tree_reduce_scatter,
)
from mpdl.collectives.vandegeijn import reduce_scatter_gather_reduce, scatter_allgather_broadcast

#: the collectives, in the order of the table below and of `mpdl bench`'s help
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "alltoall")


@dataclass(frozen=True)
class Algorithm:
    """A registered algorithm. `run` takes (comm, flat buffer, op, extra) per collective:
    allreduce (op), reduce_scatter (op, bounds), allgather (bounds), broadcast (root), reduce (op, root),
    alltoall (send, blocks: the result buffer first, then the input and its `blocks.Blocks`)."""

    name: str
    run: Callable
    summary: str
    cost: str
    baseline: bool = False
    #: reads the input from a separate `src` array (so the caller need not copy it into buf first)
    reads_input: bool = False
    #: (all-to-all) forwards other ranks' blocks, so with varying counts it needs every rank's
    #: counts (`blocks.Blocks.matrix`)
    needs_matrix: bool = False


def _a(name, run, summary, cost, baseline=False, reads_input=False,
       needs_matrix=False) -> Algorithm:
    return Algorithm(name, run, summary, cost, baseline, reads_input, needs_matrix)


_MPI = "the MPI library's own implementation (baseline, not ours)"

REGISTRY: dict[str, dict[str, Algorithm]] = {
    "allreduce": {a.name: a for a in [
        _a("ring", with_reducer(ring_allreduce), "ring reduce-scatter + ring all-gather, "
           "pipelined segments", "2(p-1)α + 2n(p-1)/p·β + n(p-1)/p·γ"),
        _a("recursive_doubling", with_reducer(recursive_doubling_allreduce),
           "lg p pairwise exchanges of the whole buffer (fold for p not 2^k)",
           "lg p·α + n·lg p·(β+γ)"),
        _a("rabenseifner", with_reducer(rabenseifner_allreduce),
           "recursive-halving reduce-scatter + recursive-doubling all-gather",
           "2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ"),
        _a("tree", with_reducer(tree_allreduce), "binomial reduce + binomial broadcast, "
           "pipelined segments", "2 lg p·α + 2n·lg p·β + n·lg p·γ"),
        _a("double_tree", with_reducer(double_tree_allreduce),
           "two complementary binary trees, each reducing and broadcasting half the data",
           "≈ 2 lg p·α + n·β·(1+ε) + n/2·γ"),
        _a("hierarchical", with_reducer(hierarchical_allreduce),
           "intra-node reduce-scatter, inter-node all-reduce of shards, intra-node all-gather",
           "2(g-1)α_intra + 2n(g-1)/g·β_intra + inter-node all-reduce of n/g over p/g nodes"),
        _a("torus2d", with_reducer(torus2d_allreduce),
           "X×Y grid: reduce-scatter along rows, all-reduce along columns, all-gather along rows",
           "2(X-1)+2(Y-1) α + ≈ 2n(p-1)/p·β"),
        _a("shm", with_reducer(shm_allreduce),
           "ranks of a node reduce straight from each other's memory (MPI shared window)",
           "2 barriers + n·(copy in + copy out) + n(g-1)/g·γ, then inter-node of n/g",
           reads_input=True),
        _a("mpi", native.mpi_allreduce, _MPI, "library's choice", baseline=True),
    ]},
    "reduce_scatter": {a.name: a for a in [
        _a("ring", with_reducer(ring_reduce_scatter), "ring reduce-scatter",
           "(p-1)α + n(p-1)/p·(β+γ)"),
        _a("tree", with_reducer(tree_reduce_scatter), "binomial reduce to rank 0 + binomial scatter",
           "2 lg p·α + n·lg p·(β+γ) + n·β"),
        _a("recursive_halving", with_reducer(recursive_halving_reduce_scatter),
           "lg p exchanges of half the remaining blocks (fold for p not 2^k)",
           "lg p·α + n(p-1)/p·(β+γ) (+ 2α + n·β + n·γ to fold)"),
        _a("pairwise", with_reducer(pairwise_reduce_scatter),
           "p-1 exchanges: each block straight to its owner, reduced as it comes",
           "(p-1)α + n(p-1)/p·(β+γ)"),
        _a("pat", with_reducer(pat_reduce_scatter),
           "parallel aggregated trees (NCCL 2.23): Bruck's tree backwards, nearest first, "
           "at most a segment per message", "Σ_k ceil(m_k/a)·α + n(p-1)/p·(β+γ)"),
        _a("mpi", native.mpi_reduce_scatter, _MPI, "library's choice", baseline=True),
    ]},
    "allgather": {a.name: a for a in [
        _a("ring", ring_allgather, "ring all-gather", "(p-1)α + n(p-1)/p·β"),
        _a("tree", tree_allgather, "binomial gather to rank 0 + binomial broadcast",
           "2 lg p·α + n·(1 + lg p)·β"),
        _a("recursive_doubling", recursive_doubling_allgather,
           "lg p exchanges of everything gathered so far (fold for p not 2^k)",
           "lg p·α + n(p-1)/p·β (+ 2α + n·β to fold)"),
        _a("bruck", bruck_allgather, "ceil(lg p) steps to rank r-2^k, any p, then a rotation",
           "ceil(lg p)·α + n(p-1)/p·β + 2 copies of n"),
        _a("pat", pat_allgather, "parallel aggregated trees (NCCL 2.23): Bruck's tree farthest "
           "first, at most a segment per message", "Σ_k ceil(m_k/a)·α + n(p-1)/p·β"),
        _a("mpi", native.mpi_allgather, _MPI, "library's choice", baseline=True),
    ]},
    "broadcast": {a.name: a for a in [
        _a("ring", ring_broadcast, "pipelined chain root → root+1 → …", "(p-1 + segments)·α + n·β"),
        _a("tree", tree_broadcast, "binomial tree, pipelined segments", "lg p·α + n·lg p·β"),
        _a("binomial", binomial_broadcast, "binomial tree of whole messages",
           "lg p·(α + n·β)"),
        _a("scatter_allgather", scatter_allgather_broadcast, "binomial scatter of p blocks + "
           "ring all-gather (van de Geijn)", "(lg p + p-1)·α + 2n(p-1)/p·β"),
        _a("mpi", native.mpi_broadcast, _MPI, "library's choice", baseline=True),
    ]},
    "reduce": {a.name: a for a in [
        _a("ring", with_reducer(ring_reduce), "ring reduce-scatter + gather of blocks to root",
           "2(p-1)α + 2n(p-1)/p·β + n(p-1)/p·γ"),
        _a("tree", with_reducer(tree_reduce), "binomial tree, pipelined segments",
           "lg p·α + n·lg p·(β+γ)"),
        _a("binomial", with_reducer(binomial_reduce), "binomial tree of whole messages",
           "lg p·(α + n·β + n·γ)"),
        _a("reduce_scatter_gather", with_reducer(reduce_scatter_gather_reduce),
           "recursive-halving reduce-scatter + binomial gather (Rabenseifner)",
           "2 lg p·α + 2n(p-1)/p·β + n(p-1)/p·γ"),
        _a("mpi", native.mpi_reduce, _MPI, "library's choice", baseline=True),
    ]},
    "alltoall": {a.name: a for a in [
        _a("pairwise", pairwise_alltoall, "p-1 exchanges, partner r XOR i (p = 2^k) or send to "
           "r+i, receive from r-i", "(p-1)α + n(p-1)/p·β", reads_input=True),
        _a("bruck", bruck_alltoall, "ceil(lg p) steps forwarding the blocks whose position has "
           "bit k set, between two local rotations",
           "ceil(lg p)·α + (n/2)·ceil(lg p)·β + copies (2n + n·ceil(lg p))", reads_input=True,
           needs_matrix=True),
        _a("scattered", scattered_alltoall, "non-blocking messages to all peers, in batches of "
           "32 with staggered peers (MPICH's medium sizes)",
           "ceil((p-1)/32)·α + (p-1-ceil((p-1)/32))·α/2 + n(p-1)/p·β", reads_input=True),
        _a("hierarchical", hierarchical_alltoall, "direct inside a node; gathered per remote "
           "node, one message per node pair, scattered inside the node",
           "(g-1)(α+bβ) + 2(m-1)(α + (g-1)bβ) + k(α'+g²bβ') + k·g²b·c, b = n/p, m = p/g, "
           "k = ceil((m-1)/g)", reads_input=True, needs_matrix=True),
        _a("mpi", native.mpi_alltoall, _MPI + ": MPI_Alltoall / MPI_Alltoallv",
           "library's choice", baseline=True, reads_input=True),
    ]},
}


def algorithms(collective: str) -> list[str]:
    """The algorithm names available for a collective (plus "auto", always accepted)."""
    if collective not in REGISTRY:
        raise ValueError(f"collective: expected one of {', '.join(COLLECTIVES)}, got {collective!r}")
    return list(REGISTRY[collective])


def resolve(collective: str, algorithm: str) -> Algorithm:
    """The registered algorithm; ValueError naming the allowed names otherwise."""
    table = REGISTRY[collective]
    if algorithm not in table:
        raise ValueError(f"algorithm: expected 'auto' or one of {', '.join(table)} for "
                         f"{collective}, got {algorithm!r}")
    return table[algorithm]

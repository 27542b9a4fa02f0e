"""The process grid of model parallelism: `world = dp × pp × cp × tp`, row-major.

World rank r holds grid coordinates (d, p, c, t) with

    r = ((d · pp + p) · cp + c) · tp + t,    t = r mod tp,   c = (r // tp) mod cp,
    p = (r // (tp · cp)) mod pp,            d = r // (tp · cp · pp)

so the tensor-parallel ranks of a layer are neighbours (the axis that talks most stays on a node),
the context-parallel ranks that share a sequence are `tp` apart, a pipeline is `cp · tp` ranks
apart, and data-parallel replicas are `pp · cp · tp` apart (picotron's order). Each axis has a
sub-communicator of the ranks that share the other coordinates, built with `Communicator.sub` (no
communication; the same on MPI and the in-process world): its rank is the coordinate along that
axis. `dcp_comm` joins the dp and cp axes: the ranks that hold the same parameters and see
different tokens, over which gradients are summed.
"""

from __future__ import annotations

from mpdl.comm import Communicator


class ProcessGrid:
    """The (dp, pp, cp, tp) grid over `comm`; `dp_comm`, `pp_comm`, `cp_comm`, `tp_comm` are
    this rank's axes and `dcp_comm` its dp × cp plane."""

    def __init__(self, comm: Communicator, dp: int, pp: int, tp: int, cp: int = 1) -> None:
        for name, value in (("dp", dp), ("pp", pp), ("cp", cp), ("tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ProcessGrid: {name} must be a positive int, not {value!r}")
        if dp * pp * cp * tp != comm.size:
            raise ValueError(f"ProcessGrid: dp × pp × cp × tp = {dp} × {pp} × {cp} × {tp} = "
                             f"{dp * pp * cp * tp} must equal the number of ranks ({comm.size})")
        self.comm, self.dp, self.pp, self.cp, self.tp = comm, dp, pp, cp, tp
        self.d, self.p, self.c, self.t = self.coords(comm.rank)
        d, p, c, t = self.d, self.p, self.c, self.t
        self.dp_comm = comm.sub([self.rank_of(i, p, c, t) for i in range(dp)])
        self.pp_comm = comm.sub([self.rank_of(d, i, c, t) for i in range(pp)])
        self.cp_comm = comm.sub([self.rank_of(d, p, i, t) for i in range(cp)])
        self.tp_comm = comm.sub([self.rank_of(d, p, c, i) for i in range(tp)])
        self.dcp_comm = comm.sub([self.rank_of(i, p, j, t) for i in range(dp) for j in range(cp)])
        # which ranks share a node is looked up collectively over all of comm (MPI): now, while
        # every rank takes part, not when an axis' first collective asks for it on one stage
        # while the others wait for that stage's activations
        comm.node_of_rank()

    def rank_of(self, d: int, p: int, c: int, t: int) -> int:
        """The rank of `comm` at grid coordinates (d, p, c, t)."""
        return ((d * self.pp + p) * self.cp + c) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """The grid coordinates (d, p, c, t) of a rank of `comm`."""
        return (rank // (self.tp * self.cp * self.pp), (rank // (self.tp * self.cp)) % self.pp,
                (rank // self.tp) % self.cp, rank % self.tp)

    def __repr__(self) -> str:
        return (f"ProcessGrid(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}; rank "
                f"{self.comm.rank} at (d, p, c, t) = ({self.d}, {self.p}, {self.c}, {self.t}))")

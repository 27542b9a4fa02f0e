"""The process grid of model parallelism: `world = dp × pp × tp`, row-major.

World rank r holds grid coordinates (d, p, t) with

    r = (d · pp + p) · tp + t,    t = r mod tp,   p = (r // tp) mod pp,   d = r // (tp · pp)

so the tensor-parallel ranks of a layer are neighbours (the axis that talks most stays on a node),
a pipeline is `tp` ranks apart, and data-parallel replicas are `pp · tp` apart. Each axis has a
sub-communicator of the ranks that share the other two coordinates, built with
`Communicator.sub` (no communication; the same on MPI and the in-process world): its rank is the
coordinate along that axis.
"""

from __future__ import annotations

from mpdl.comm import Communicator


class ProcessGrid:
    """The (dp, pp, tp) grid over `comm`; `dp_comm`, `pp_comm`, `tp_comm` are this rank's axes."""

    def __init__(self, comm: Communicator, dp: int, pp: int, tp: int) -> None:
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ProcessGrid: {name} must be a positive int, not {value!r}")
        if dp * pp * tp != comm.size:
            raise ValueError(f"ProcessGrid: dp × pp × tp = {dp} × {pp} × {tp} = {dp * pp * tp} "
                             f"must equal the number of ranks ({comm.size})")
        self.comm, self.dp, self.pp, self.tp = comm, dp, pp, tp
        self.d, self.p, self.t = self.coords(comm.rank)
        self.dp_comm = comm.sub([self.rank_of(d, self.p, self.t) for d in range(dp)])
        self.pp_comm = comm.sub([self.rank_of(self.d, p, self.t) for p in range(pp)])
        self.tp_comm = comm.sub([self.rank_of(self.d, self.p, t) for t in range(tp)])

    def rank_of(self, d: int, p: int, t: int) -> int:
        """The rank of `comm` at grid coordinates (d, p, t)."""
        return (d * self.pp + p) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """The grid coordinates (d, p, t) of a rank of `comm`."""
        return rank // (self.tp * self.pp), (rank // self.tp) % self.pp, rank % self.tp

    def __repr__(self) -> str:
        return (f"ProcessGrid(dp={self.dp}, pp={self.pp}, tp={self.tp}; rank {self.comm.rank} "
                f"at (d, p, t) = ({self.d}, {self.p}, {self.t}))")

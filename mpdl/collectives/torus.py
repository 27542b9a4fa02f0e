"""2D-torus all-reduce (Mikami et al. 2018): ranks on an X×Y grid.

Reduce-scatter along each row (X ranks), all-reduce each shard along its column (Y ranks), then
all-gather along each row: 2(X-1) + 2(Y-1) latency steps instead of the ring's 2(p-1).
"""

from __future__ import annotations

import math

from mpdl.collectives.ops import block_bounds
from mpdl.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter


def grid_shape(p: int) -> tuple[int, int]:
    """(X, Y) with X·Y = p and X the largest divisor of p not above √p (a prime p gives 1×p)."""
    x = next(d for d in range(math.isqrt(p), 0, -1) if p % d == 0)
    return x, p // x


def torus2d_allreduce(comm, buf, reduce) -> None:
    """All-reduce in place over the most square X×Y grid; rank r sits at (r % X, r // X)."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    nx, _ = grid_shape(p)
    x, y = r % nx, r // nx
    row = comm.sub([y * nx + i for i in range(nx)])
    column = comm.sub(list(range(x, p, nx)))
    bounds = block_bounds(buf.size, nx)
    ring_reduce_scatter(row, buf, reduce, bounds)
    ring_allreduce(column, buf[bounds[x]:bounds[x + 1]], reduce)
    ring_allgather(row, buf, bounds)

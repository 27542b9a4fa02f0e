"""The one hook through which the collectives reach the tuning layer (`mpdl.tuning`, the layer
above them): which algorithm an "auto" call runs, and the persistent plan a call may run through.

`import mpdl` installs its tuner (`mpdl.tuning.TUNER`). Without one (`install(None)`, or inside
`off()`) "auto" takes the size rule `simple_choice` and every call runs its algorithm
directly; a call that names its algorithm sends the same messages either way, since a plan
replays the messages of its algorithm.

The tuner is any object with these methods (each may return None for "run the call directly"):
- `algorithm_for(collective, nbytes, comm)` and `plan_choice(collective, nbytes, comm, shared)`:
  the registered algorithm of an "auto" call, of a one-shot call and of a persistent plan;
- `cached_allreduce(x, op, algorithm, comm, out)`, `cached_reduce_scatter(x, op, algorithm, comm,
  in_place)`, `cached_allgather(x, algorithm, comm, count, out)`, `cached_alltoall(x, algorithm,
  comm, out)`: a plan of these arrays to run the call through;
- `shaped_alltoall(x, comm, algorithm)`: the result of a one-shot all-to-all run by a plan kept
  for x's shape;
and a dictionary `cache` of its plans by call, which the API looks up in line: a hit stands while
x keeps the plan's `dtype` and `shape` and the plan notes its runs in its communicator's flight
recorder (`plan.flight is plan.comm.flight`; None for both: a bare plan).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mpdl.collectives import registry

#: the installed tuner; None: none
tuner: Any = None

#: below this size, allreduce is latency-bound and the size rule takes recursive doubling
AUTO_SMALL_BYTES = 32 * 1024
#: MPICH's all-to-all switch points, bytes per destination (MPIR_CVAR_ALLTOALL_SHORT_MSG_SIZE and
#: MPIR_CVAR_ALLTOALL_MEDIUM_MSG_SIZE): Bruck at or below the first when p >= 8, the scattered
#: algorithm at or below the second, pairwise exchange above it
MPICH_ALLTOALL_SHORT_BYTES = 256
MPICH_ALLTOALL_MEDIUM_BYTES = 32768


def simple_choice(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool) -> str:
    """The size rule "auto" takes when no cost model is usable (or no tuner installed)."""
    if collective == "alltoall":  # MPICH's rule, by bytes per destination
        per_destination = nbytes / max(1, p)
        if per_destination <= MPICH_ALLTOALL_SHORT_BYTES and p >= 8:
            return "bruck"
        return "scattered" if per_destination <= MPICH_ALLTOALL_MEDIUM_BYTES else "pairwise"
    if collective != "allreduce":
        return "ring"
    if nbytes <= AUTO_SMALL_BYTES:
        return "recursive_doubling"
    if shared_memory and nodes == 1:
        return "shm"
    return "hierarchical" if nodes > 1 else "ring"


def install(new: Any) -> Any:
    """Make `new` the tuner the collectives ask (None: none); returns the one it replaces."""
    global tuner
    previous, tuner = tuner, new
    return previous


@contextmanager
def off() -> Iterator[None]:
    """The collectives without the tuner inside the block (on every rank alike)."""
    previous = install(None)
    try:
        yield
    finally:
        install(previous)


def choose(collective: str, nbytes: int, comm: Any, plan: bool = False,
           shared: bool = False) -> registry.Algorithm:
    """The registered algorithm an "auto" call of nbytes on comm runs: the tuner's (for a
    persistent plan with `plan`, of an array in shared memory with `shared`), else the size
    rule's."""
    if tuner is None:
        nodes = len(comm.node_groups()) if comm.size > 1 else 1
        return registry.resolve(collective, simple_choice(
            collective, nbytes, comm.size, nodes, comm.has_shared_memory))
    if plan:
        return tuner.plan_choice(collective, nbytes, comm, shared)
    return tuner.algorithm_for(collective, nbytes, comm)

"""`auto`: which registered algorithm a collective call runs when the caller does not say.

The choice is the algorithm the cost model (`mpdl.collectives.costmodel`) predicts fastest for the
call's size, world size, node count and shared memory, with the calibrated parameters when
`mpdl calibrate` saved some (defaults otherwise) plus the settings' emulated links. When no model
is usable (`MPDL_COST_MODEL=off`, a broken parameter file) a size rule decides (`simple_choice`).

The choice depends on its arguments, the parameter file and the settings alone, so every rank picks
the same algorithm. Choices are remembered in one cache, valid for one `Settings` object and one
reading of the parameter files: a settings change (`mpdl.settings.use` / `update`) starts a fresh
cache by itself, and `forget()` (the same as `costmodel.forget()`, which `costmodel.save` calls)
drops it with the loaded parameter files.
"""

from __future__ import annotations

from mpdl import settings
from mpdl.collectives import costmodel, registry

#: below this size, allreduce is latency-bound and the size rule takes recursive doubling
AUTO_SMALL_BYTES = 32 * 1024


def simple_choice(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool) -> str:
    """The size rule `auto` uses when no cost model is usable."""
    if collective != "allreduce":
        return "ring"
    if nbytes <= AUTO_SMALL_BYTES:
        return "recursive_doubling"
    if shared_memory and nodes == 1:
        return "shm"
    return "hierarchical" if nodes > 1 else "ring"


def _model_or_rule(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool) -> str:
    try:
        params = costmodel.current_params(p)
    except costmodel.ModelUnavailable:
        return simple_choice(collective, nbytes, p, nodes, shared_memory)
    return costmodel.choose(collective, nbytes, p, nodes, shared_memory, params)


#: the one cache: [the Settings and the parameter-file generation the choices were made under,
#: {call signature: algorithm name}]
_cache: list = [None, -1, {}]


def choose(collective: str, nbytes: int, p: int, nodes: int, shared_memory: bool) -> str:
    """The algorithm `auto` runs for a call of nbytes on p ranks over `nodes` nodes.
    Remembered per call signature, so a repeated call costs a dictionary lookup."""
    current, generation = settings.current(), costmodel.generation()
    if _cache[0] is not current or _cache[1] != generation:
        _cache[:] = current, generation, {}
    key = (collective, nbytes, p, nodes, shared_memory)
    choices = _cache[2]
    name = choices.get(key)
    if name is None:
        name = choices[key] = _model_or_rule(collective, nbytes, p, nodes, shared_memory)
    return name


def algorithm_for(collective: str, nbytes: int, comm) -> registry.Algorithm:
    """The registered algorithm `auto` runs for a call of nbytes on comm (an mpdl Communicator)."""
    nodes = len(comm.node_groups()) if comm.size > 1 else 1
    return registry.resolve(collective, choose(collective, nbytes, comm.size, nodes,
                                               comm.has_shared_memory))


def forget() -> None:
    """Choose again from now on: drop the remembered choices and the loaded parameter files."""
    _cache[:] = None, -1, {}
    costmodel.forget()

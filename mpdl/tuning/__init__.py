"""The tuning layer: what chooses, measures or replays collectives.

`plan` (persistent plans: a call's schedule captured once, `capture`, and replayed; `flightplan`
notes their runs in the flight recorder), `auto` (the algorithm a call runs when the caller does
not say), `costmodel` (the predictions `auto` ranks by),
`measuring` and `firstuse` (the calibration of this machine), `verify` (a plan timing its
candidates online). The collectives reach it only through `mpdl.collectives.hook`, where importing
this package installs the tuner, `TUNER`.
"""

from __future__ import annotations

from typing import Any

from mpdl.collectives import hook
from mpdl.tuning import auto, plan
from mpdl.tuning.plan import Plan, allgather_init, allreduce_init, alltoall_init, reduce_scatter_init


class Tuner:
    """What `mpdl.collectives.hook` asks: `auto`'s choices and the plan cache of `plan` (looked up
    at each call, so that the modules' functions stay the ones that run)."""

    cache = plan.cache

    def algorithm_for(self, collective: str, nbytes: int, comm: Any) -> Any:
        return auto.algorithm_for(collective, nbytes, comm)

    def plan_choice(self, collective: str, nbytes: int, comm: Any, shared: bool) -> Any:
        return auto.plan_choice(collective, nbytes, comm, shared)

    def cached_allreduce(self, x: Any, op: Any, algorithm: Any, comm: Any, out: Any) -> Any:
        return plan.cached_allreduce(x, op, algorithm, comm, out)

    def cached_reduce_scatter(self, x: Any, op: Any, algorithm: Any, comm: Any,
                              in_place: bool) -> Any:
        return plan.cached_reduce_scatter(x, op, algorithm, comm, in_place)

    def cached_allgather(self, x: Any, algorithm: Any, comm: Any, count: Any, out: Any) -> Any:
        return plan.cached_allgather(x, algorithm, comm, count, out)

    def cached_alltoall(self, x: Any, algorithm: Any, comm: Any, out: Any) -> Any:
        return plan.cached_alltoall(x, algorithm, comm, out)

    def shaped_alltoall(self, x: Any, comm: Any, algorithm: Any) -> Any:
        return plan.shaped_alltoall(x, comm, algorithm)


TUNER = Tuner()
hook.install(TUNER)

__all__ = ["TUNER", "Tuner", "Plan", "allreduce_init", "reduce_scatter_init", "allgather_init",
           "alltoall_init"]

"""The tuning engine: what chooses, measures or replays collectives.

`plan` (persistent plans: a call's schedule recorded once, `recording`, and replayed), `auto` (the
algorithm a call runs when the caller does not say), `costmodel` (the predictions `auto` ranks by),
`measuring` and `firstuse` (the calibration of this machine), `verify` (a plan timing its
candidates online).
"""

from mpdl.tuning.plan import Plan, allgather_init, allreduce_init, alltoall_init, reduce_scatter_init

__all__ = ["Plan", "allreduce_init", "reduce_scatter_init", "allgather_init", "alltoall_init"]

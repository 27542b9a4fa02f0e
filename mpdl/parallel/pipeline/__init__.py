"""Pipeline parallelism: `schedule` (which op each stage runs when: plain data), `stage` (the
model cut into stages, each rank's built), `executor` (the strategy and its step), `driver` (a
rank's ops of the schedule and their messages), `state` (the whole model gathered, checkpoints),
`meter` (a step's figures) and `exact` (the deterministic pipeline: `mpdl train
--deterministic --pp`)."""

from mpdl.parallel.pipeline.driver import Microbatches
from mpdl.parallel.pipeline.executor import PipelineStrategy
from mpdl.parallel.pipeline.schedule import (
    SCHEDULES,
    bubble_formula,
    peak_in_flight,
    schedule_ops,
    slot_bubble,
    timed_bubble,
)
from mpdl.parallel.pipeline.stage import model_pieces, partition_by_weight

__all__ = ["SCHEDULES", "Microbatches", "PipelineStrategy", "bubble_formula", "model_pieces",
           "partition_by_weight", "peak_in_flight", "schedule_ops", "slot_bubble", "timed_bubble"]

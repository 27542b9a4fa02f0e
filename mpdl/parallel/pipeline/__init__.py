"""Pipeline parallelism (`executor`: the strategy and its step; `recorder`: a step's figures)."""

from mpdl.parallel.pipeline.executor import (
    SCHEDULES,
    Microbatches,
    PipelineStrategy,
    bubble_formula,
    model_pieces,
    partition,
    peak_in_flight,
    schedule_ops,
    slot_bubble,
    timed_bubble,
)

__all__ = ["SCHEDULES", "Microbatches", "PipelineStrategy", "bubble_formula", "model_pieces",
           "partition", "peak_in_flight", "schedule_ops", "slot_bubble", "timed_bubble"]

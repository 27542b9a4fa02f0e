"""Goodput under failures: the share of a run's wall time that trains, when the job is interrupted
at a rate per GPU-hour, writes a checkpoint every Young/Daly interval and restarts from the last.

Per interruption a job loses its restart time and, on average, half an interval of work since the
last checkpoint; between interruptions it spends δ of every τ + δ seconds writing. With the job's
mean time between interruptions M = 1/(rate · GPUs), Daly's (2006) first-order optimum of Young's
(1974) interval is τ = √(2δM) − δ, and the wasted share is δ/(τ + δ) + (R + (τ + δ)/2)/M.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Dubey et al. 2024 (Llama 3), section 3.3.4: 419 unexpected interruptions in a 54-day snapshot
#: of pre-training on 16,384 H100
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
LLAMA3_RATE = LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)


@dataclass(frozen=True)
class Failures:
    """Interruptions per GPU-hour, seconds to restart (reschedule, start, load the checkpoint)
    and the storage's sustained write bandwidth in bytes/s for the whole job."""

    rate_per_gpu_hour: float = LLAMA3_RATE
    #: assumed: Llama 3 does not state its restart time
    restart_s: float = 600.0
    #: Llama 3, section 3.3.1: Tectonic sustains 2 TB/s (7 TB/s at its peak)
    storage_bytes_per_s: float = 2e12


#: Llama 3's failures and storage, the restart assumed
LLAMA3 = Failures()


def checkpoint_interval(write_s: float, mtbf_s: float) -> float:
    """Daly's first-order optimum of Young's interval between checkpoints: √(2δM) − δ, at least
    δ (when writing takes longer than half the time between failures)."""
    return max(write_s, math.sqrt(2 * write_s * mtbf_s) - write_s)


def goodput(gpus: int, checkpoint_bytes: float, failures: Failures = LLAMA3) -> dict[str, float]:
    """The job's mean time between interruptions, checkpoint write time and interval, and the
    share of wall time that trains (0 when failures leave none)."""
    if failures.rate_per_gpu_hour <= 0:
        return {"mtbf_s": math.inf, "checkpoint_write_s": 0.0, "checkpoint_interval_s": math.inf,
                "restart_s": failures.restart_s, "goodput": 1.0}
    mtbf = 3600 / (failures.rate_per_gpu_hour * gpus)
    write = checkpoint_bytes / failures.storage_bytes_per_s
    tau = checkpoint_interval(write, mtbf) if write > 0 else 0.0
    waste = (write / (tau + write) if write > 0 else 0.0) \
        + (failures.restart_s + (tau + write) / 2) / mtbf
    return {"mtbf_s": mtbf, "checkpoint_write_s": write, "checkpoint_interval_s": tau,
            "restart_s": failures.restart_s, "goodput": max(0.0, 1 - waste)}

"""Tokens per second, model FLOPs and model-FLOPs utilisation (MFU) of a run, and the peak FLOP/s
they are measured against.

The peak is that of a float32 GEMM on one core (`gemm_flops`: 512×512 products, with the BLAS
threads in force; `mpdl train` runs one per rank): `mpdl calibrate` measures it on every rank at
once and stores the best with the cost model's parameters (`Params.gemm_flops`); a run finds it
there, or, when nothing was calibrated, measures it itself at the start (and says so). The job's
peak is the per-core figure times its ranks, one core each. MFU = model FLOPs per token × tokens
per second ÷ that peak (PaLM, appendix B; llm.c and nanoGPT report the same).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np

from mpdl import blas
from mpdl.tuning import costmodel

#: the side of the GEMM microbenchmark: large enough to reach a core's peak, small enough to
#: measure in a fraction of a second
GEMM_N = 512


def gemm_flops(n: int = GEMM_N, seconds: float = 0.2) -> float:
    """FLOP/s of an n×n float32 matrix product (2n³ FLOPs, through ``mpdl.blas``) on this
    process: the best of repeated products over about `seconds` (at least 3)."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(np.float32) for _ in range(2))
    blas.matmul(a, b)
    best, count, end = math.inf, 0, time.perf_counter() + seconds
    while count < 3 or time.perf_counter() < end:
        start = time.perf_counter()
        blas.matmul(a, b)
        best = min(best, time.perf_counter() - start)
        count += 1
    return 2.0 * n ** 3 / best


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak FLOP/s per rank (one core each) and where the figure comes from."""

    per_rank: float
    source: str

    def describe(self, ranks: int) -> str:
        return (f"peak {self.per_rank / 1e9:.1f} GFLOP/s per core x {ranks} = "
                f"{self.per_rank * ranks / 1e9:.1f} GFLOP/s (float32 {GEMM_N}x{GEMM_N} GEMM, "
                f"{self.source})")


def peak_flops(comm: Any, path: str | None = None) -> Peak:
    """The per-core peak calibrated for comm's world size (in the cost model's file, or `path`),
    else one measured now on every rank of comm (the best of them; collective)."""
    try:
        params = costmodel.load_params(comm.size, path)
    except costmodel.ModelUnavailable:
        params = None
    if params is not None and params.gemm_flops > 0:
        return Peak(params.gemm_flops, f"calibrated: {params.source}")
    measured = max(comm.allgather_object(gemm_flops()))
    return Peak(measured, "measured at the start of this run: no calibration holds it; "
                          "`mpdl calibrate` stores one")


def fields(samples_per_s: float, seq_len: int, flops_per_token: int, peak: Peak,
           ranks: int) -> dict[str, float]:
    """The JSON fields of an epoch: tokens_per_s, flops_per_token, achieved flops_per_s, mfu."""
    tokens = samples_per_s * seq_len
    achieved = tokens * flops_per_token
    return {"tokens_per_s": tokens, "flops_per_token": flops_per_token, "flops_per_s": achieved,
            "mfu": achieved / (peak.per_rank * ranks)}


def note(model: Any, seq_len: int, peak: Peak, ranks: int) -> str:
    """The header line on a GPT's model FLOPs and the peak."""
    return (f"# model FLOPs per token {model.flops_per_token(seq_len):,} = 6N + 12 x layers x "
            f"width x T (PaLM, appendix B; N = {model.num_parameters(non_embedding=True):,}, "
            f"T = {seq_len}); {peak.describe(ranks)}")

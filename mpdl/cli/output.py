"""Small output helpers shared by the verbs: which rank prints, JSON lines."""

from __future__ import annotations

import os

from mpdl.training.report import write_json_lines

__all__ = ["is_rank0", "world_rank", "world_size", "write_json_lines"]


def world_rank() -> int:
    """This process's rank from the launcher's environment, without initialising MPI."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def world_size() -> int:
    """The number of ranks from the launcher's environment, without initialising MPI."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        if var in os.environ:
            return int(os.environ[var])
    return 1


def is_rank0() -> bool:
    return world_rank() == 0

"""Waiting for persistent MPI requests in compiled code.

A rank that waits for its messages polls `MPI_Testall`. From Python each poll costs about a
microsecond of interpreter work, and where ranks outnumber cores that work is taken from the rank
being waited for; the MPI library's own collectives poll from C. `compiled_wait(requests)` gives a
wait that runs `MPI_Testall` in a loop compiled by numba (yielding the core every `yield_every`
polls), with no Python between polls, for at most a given number of polls: the caller's wait
policy (timeout, stall warning, sleeps) takes over after that.

Only persistent requests: a completed one keeps its handle, so the handles read once stay valid
(an ordinary request's handle becomes MPI_REQUEST_NULL, which mpi4py would not see). The library
(`libmpi`) is found among the process's loaded objects and called through its `MPI_Testall`;
where it, its handle size or numba is missing, `compiled_wait` returns None and callers poll from
Python.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: bytes kept per request for the statuses MPI_Testall writes (MPICH's MPI_Status is 20 bytes,
#: Open MPI's 24)
STATUS_BYTES = 64


def compiled_wait(requests: Sequence[Any]) -> Callable[[int, int], bool] | None:
    """`wait(polls, yield_every) -> bool`: poll these started persistent mpi4py requests with
    MPI_Testall up to `polls` times, yielding the core every `yield_every` polls; True once all
    are complete. None where no compiled wait is possible here."""
    functions = _functions()
    if functions is None or not requests:
        return None
    testall, sched_yield, request_bytes, poll = functions
    kind = {4: np.uint32, 8: np.uint64}[request_bytes]
    mask = (1 << (8 * request_bytes)) - 1
    handles = np.array([int(r.handle) & mask for r in requests], dtype=kind)
    flag = np.zeros(1, np.int32)
    statuses = np.zeros(STATUS_BYTES * len(requests), np.uint8)
    #: the loop's arguments as addresses: MPI_Testall, sched_yield, the count, the handles, the
    #: flag, the statuses (the arrays above live as long as the wait)
    block = np.array([testall, sched_yield, len(requests), handles.ctypes.data,
                      flag.ctypes.data, statuses.ctypes.data], dtype=np.int64)

    def wait(polls: int, yield_every: int) -> bool:
        return poll(block, polls, yield_every)

    wait.arrays = (handles, flag, statuses)  # type: ignore[attr-defined]
    return wait


def load() -> bool:
    """Load the compiled loop now (numba's import and its on-disk cache, about 0.2 s, otherwise
    paid by the first compiled wait; a benchmark does it before timing). True if available."""
    return _functions() is not None


@functools.cache
def _functions() -> tuple[int, int, int, Callable] | None:
    """(address of MPI_Testall, of sched_yield, bytes of an MPI_Request, the compiled loop), or
    None."""
    path = _libmpi_path()
    if path is None:
        return None
    try:
        from mpi4py import MPI  # noqa: PLC0415

        from mpdl.comm import _polling_loop  # noqa: PLC0415 (imports numba: slow)
    except ImportError:
        return None
    request_bytes = MPI._sizeof(MPI.Request)
    if request_bytes not in (4, 8):
        return None
    try:
        testall = ctypes.cast(ctypes.CDLL(path).MPI_Testall, ctypes.c_void_p).value
        sched_yield = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
    return testall, sched_yield, request_bytes, _polling_loop.poll


def _libmpi_path() -> str | None:
    """The path of the MPI library this process has loaded (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(" ", 1)[-1].strip()
                if "/libmpi.so" in name:
                    return name
    except OSError:
        return None
    return None


__all__ = ["compiled_wait", "load"]

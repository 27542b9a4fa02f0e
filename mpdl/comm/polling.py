"""Waiting for persistent MPI requests in compiled code.

A rank that waits for its messages polls `MPI_Testall`. From Python each poll costs about a
microsecond of interpreter work, and where ranks outnumber cores that work is taken from the rank
being waited for; the MPI library's own collectives poll from C. `compiled_wait(requests)` gives a
wait that runs `MPI_Testall` in a loop compiled by numba (yielding the core every `yield_every`
polls), with no Python between polls, for at most a given number of polls: the caller's wait
policy (timeout, stall warning, sleeps) takes over after that. `compiled_exchange` also starts the
requests and copies a block while they travel, in the same call (a one-step all-to-all).

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
    made = _block(requests)
    return None if made is None else _bound(made[2].poll, *made[:2])


def compiled_exchange(requests: Sequence[Any], dst: np.ndarray | None = None,
                      src: np.ndarray | None = None) -> Callable[[int, int], bool] | None:
    """`run(polls, yield_every) -> bool`: start these persistent mpi4py requests (MPI_Startall),
    copy src into dst (contiguous arrays of the same bytes, if given) while they travel, then wait
    as `compiled_wait`'s wait does; True once all are complete (else they are left started). One
    call, no Python between its steps. None where not possible here."""
    if dst is not None and not (dst.flags.c_contiguous and src.flags.c_contiguous
                                and dst.nbytes == src.nbytes):
        return None
    made = _block(requests, dst, src)
    return None if made is None else _bound(made[2].start_copy_poll, *made[:2])


def _bound(loop: Callable, block: np.ndarray, arrays: tuple) -> Callable[[int, int], bool]:
    """`call(polls, yield_every)`: the compiled loop on block (which points into arrays: they
    are kept with it)."""
    def call(polls: int, yield_every: int) -> bool:
        return loop(block, polls, yield_every)

    call.arrays = arrays  # type: ignore[attr-defined]
    return call


def load() -> bool:
    """Load the compiled loops now (numba's import and its on-disk cache, otherwise paid by the
    first compiled wait; a benchmark does it before timing). True if available."""
    return _functions() is not None


def _block(requests: Sequence[Any], dst: np.ndarray | None = None,
           src: np.ndarray | None = None) -> tuple[np.ndarray, tuple, Any] | None:
    """(the loops' argument block for these requests, the arrays it points into, the loops'
    module), or None."""
    functions = _functions()
    if functions is None or not requests:
        return None
    addresses, request_bytes, loops = functions
    kind = {4: np.uint32, 8: np.uint64}[request_bytes]
    mask = (1 << (8 * request_bytes)) - 1
    handles = np.array([int(r.handle) & mask for r in requests], dtype=kind)
    flag = np.zeros(1, np.int32)
    statuses = np.zeros(STATUS_BYTES * len(requests), np.uint8)
    block = np.zeros(loops.NBYTES + 1, np.int64)
    block[loops.TESTALL], block[loops.SCHED_YIELD] = addresses["testall"], addresses["yield"]
    block[loops.STARTALL], block[loops.MEMCPY] = addresses["startall"], addresses["memcpy"]
    block[loops.COUNT], block[loops.HANDLES] = len(requests), handles.ctypes.data
    block[loops.FLAG], block[loops.STATUSES] = flag.ctypes.data, statuses.ctypes.data
    if dst is not None and dst.nbytes:
        block[loops.DST], block[loops.SRC] = dst.ctypes.data, src.ctypes.data
        block[loops.NBYTES] = dst.nbytes
    return block, (handles, flag, statuses, dst, src), loops


@functools.cache
def _functions() -> tuple[dict[str, int], int, Any] | None:
    """(the C functions' addresses: MPI_Testall, MPI_Startall, sched_yield, memcpy; the bytes of
    an MPI_Request; the compiled loops' module), or None."""
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
        mpi, libc = ctypes.CDLL(path), ctypes.CDLL(None)
        addresses = {name: ctypes.cast(function, ctypes.c_void_p).value for name, function in (
            ("testall", mpi.MPI_Testall), ("startall", mpi.MPI_Startall),
            ("yield", libc.sched_yield), ("memcpy", libc.memcpy))}
    except (OSError, AttributeError):
        return None
    return addresses, request_bytes, _polling_loop


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


__all__ = ["compiled_exchange", "compiled_wait", "load"]

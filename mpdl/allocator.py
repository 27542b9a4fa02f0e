"""Heap reuse for NumPy temporaries under glibc.

By default glibc maps every allocation above a moving threshold (128 KiB at start) with mmap and
trims the heap top whenever more than twice that threshold is free. A training step allocates and
frees megabytes of activations and im2col columns, so each step can page-fault its memory in
afresh. `keep_heap` fixes the mmap threshold and turns trimming off, so the memory freed by one
step is reused by the next: the heap keeps its high-water mark, which every step reaches again.
A trim threshold, even of 64 MiB, still re-faults pages every step, since a GPT's backward frees
hundreds of MiB at once (docs/results/gpt.md#attention-in-cache-sized-chunks).
"""

from __future__ import annotations

import ctypes
import platform

from mpdl import settings

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the largest mmap threshold glibc accepts on 64-bit systems (DEFAULT_MMAP_THRESHOLD_MAX)
MMAP_THRESHOLD = 32 << 20
#: M_TRIM_THRESHOLD's value that turns trimming off (mallopt(3))
NEVER_TRIM = -1


def keep_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve allocations below `threshold` bytes from the heap and never trim it.
    Returns whether the setting took effect: False off glibc, or with MPDL_MALLOC=default."""
    if settings.current().malloc == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                        NEVER_TRIM))

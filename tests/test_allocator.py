"""Where arrays live. keep_heap: a step that allocates and frees megabytes reuses the heap instead of
faulting in fresh pages each time (counted as minor page faults, not timed). Page offsets: the
collectives' output and scratch buffers are placed so copies avoid 4K aliasing."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from mpdl import backend

glibc_only = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds are a glibc feature")

PROGRAM = """
import resource, numpy as np
from mpdl.allocator import keep_heap
took = keep_heap()
def step():
    arrays = [np.ones(1 << 20, dtype=np.float32) for _ in range(COUNT)]  # COUNT 4 MiB arrays
    del arrays
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(STEPS):
    step()
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / STEPS)
"""


def _faults_per_step(malloc: str, count: int = 5, steps: int = 20) -> tuple[bool, float]:
    env = {**os.environ, "MPDL_MALLOC": malloc}
    program = PROGRAM.replace("COUNT", str(count)).replace("STEPS", str(steps))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@glibc_only
def test_keep_heap_reuses_memory_between_steps():
    took, faults = _faults_per_step("keep")
    assert took
    assert faults < 100, f"{faults} page faults per step: the heap was trimmed and refilled"


@glibc_only
def test_keep_heap_reuses_memory_when_a_step_frees_more_than_64_mib():
    """A step that frees 100 MiB at once (as a GPT's backward frees its activations) does not
    give it back to the system only to fault it in again in the next step."""
    took, faults = _faults_per_step("keep", count=25, steps=5)
    assert took
    assert faults < 100, f"{faults} page faults per step: the heap was trimmed and refilled"


@glibc_only
def test_default_malloc_faults_memory_in_every_step():
    """The control: without keep_heap the same loop faults in pages every step, so the test above
    measures what it claims."""
    took, faults = _faults_per_step("default")
    assert not took
    assert faults > 1000


@pytest.mark.parametrize("offset", [0, 16, 48, 4080])
def test_output_starts_at_the_inputs_page_offset(offset):
    raw = np.empty(3 * 4096, np.uint8)
    start = (offset - raw.ctypes.data) % 4096
    x = raw[start:start + 4096].view(np.float32).reshape(32, 32)
    out = backend.empty_like_page_offset(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.flags["C_CONTIGUOUS"]
    assert out.ctypes.data % 4096 == x.ctypes.data % 4096 == offset
    assert not np.shares_memory(out, x)


@pytest.mark.parametrize("shape", [(), (0,), (1,), (1023,), (3, 5)])
def test_output_below_a_page_is_a_plain_array(shape):
    x = np.ones(shape, np.float32)
    out = backend.empty_like_page_offset(x)
    assert out.shape == x.shape and out.dtype == x.dtype and out.flags["C_CONTIGUOUS"]
    assert out.flags["WRITEABLE"] and not np.shares_memory(out, x)


def test_scratch_starts_half_a_page_in():
    for count in (1, 1000, 1 << 16):
        buf = backend.empty_half_page_in(count, np.float64, np)
        assert buf.shape == (count,) and buf.ctypes.data % 4096 == 2048

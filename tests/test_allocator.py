"""keep_heap: a step that allocates and frees megabytes reuses the heap instead of faulting in
fresh pages each time (counted as minor page faults, not timed)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="mallopt thresholds are a glibc feature")

PROGRAM = """
import resource, numpy as np
from mpdl.allocator import keep_heap
took = keep_heap()
def step():
    arrays = [np.ones(1 << 20, dtype=np.float32) for _ in range(5)]  # five 4 MiB arrays
    del arrays
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(took, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def _faults_per_step(malloc: str) -> tuple[bool, float]:
    env = {**os.environ, "MPDL_MALLOC": malloc}
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         env=env, timeout=60, check=True).stdout.split()
    return out[0] == "True", float(out[1])


def test_keep_heap_reuses_memory_between_steps():
    took, faults = _faults_per_step("keep")
    assert took
    assert faults < 100, f"{faults} page faults per step: the heap was trimmed and refilled"


def test_default_malloc_faults_memory_in_every_step():
    """The control: without keep_heap the same loop faults in pages every step, so the test above
    measures what it claims."""
    took, faults = _faults_per_step("default")
    assert not took
    assert faults > 1000

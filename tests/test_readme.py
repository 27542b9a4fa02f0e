"""The README's collective snippet runs under mpiexec as shown, and prints what the README says it
prints: the sum of every rank's vector and each rank's block of it (numpy.array_split)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def readme_section(title: str) -> str:
    return (ROOT / "README.md").read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_collective_snippet_prints_what_the_readme_shows(tmp_path):
    section = readme_section("A collective in ten lines")
    snippet, shown = re.findall(r"```(?:python)?\n(.*?)```", section, re.S)
    assert len(snippet.strip().splitlines()) <= 12
    (tmp_path / "demo.py").write_text(snippet)
    ranks = 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPDL_AUTO_CACHE": "off"}
    out = subprocess.run(["timeout", "-k", "5", "60", str(MPIEXEC), "-n", str(ranks),
                          sys.executable, "demo.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=75)
    assert out.returncode == 0, out.stderr[-2000:]
    # each rank's line, wherever the launcher put it: two ranks' writes can meet on one line of
    # the forwarded stdout
    printed = re.findall(r"rank \d+ of \d+: sum \[[^\]]*\], my block \[[^\]]*\]", out.stdout)
    assert sorted(printed) == sorted(shown.strip().splitlines())
    total = sum(np.arange(6, dtype=np.float32) * (r + 1) for r in range(ranks))
    for rank, block in enumerate(np.array_split(total, ranks)):
        assert f"rank {rank} of {ranks}: sum {total}, my block {block}" in printed

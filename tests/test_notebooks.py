"""The teaching notebooks run top to bottom (nbclient) and their own checks pass: each ends by
printing "CHECKS PASSED" after its assert cells, and draws at least one figure."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_seven_notebooks():
    assert len(NOTEBOOKS) == 7


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_checks_pass(path, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for var in ("MPDL_EMULATE", "MPDL_RANKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    book = nbformat.read(path, as_version=4)
    assert not any(c.get("outputs") for c in book.cells if c.cell_type == "code"), \
        "commit notebooks without outputs"
    start = time.perf_counter()
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "CHECKS PASSED" in text, text[-2000:]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure drawn"
    assert not any(o.get("output_type") == "error" for o in outputs)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    assert os.environ["OMP_NUM_THREADS"] == "1"

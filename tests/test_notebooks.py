"""The teaching notebooks run top to bottom (nbclient) and their own checks pass: each ends by
printing "CHECKS PASSED" and the checks it made after its assert cells, and draws at least one
figure. The notebooks found here are the ones the README's learning path and the docs site list.
With NOTEBOOK_OUT=DIR (`make notebooks`), each notebook that passes is written there as executed,
outputs and figures included: the docs site shows those copies."""

from __future__ import annotations

import base64
import os
import re
import struct
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHECK = re.compile(r'checks\.append\("([^"]+)"\)')


def linked_notebooks(text: str, prefix: str) -> set[str]:
    return set(re.findall(re.escape(prefix) + r"([\w-]+\.ipynb)", text))


def test_the_learning_path_and_the_site_list_every_notebook():
    """A notebook added to notebooks/ is run here; it must also be on the README's learning path
    and in the site's navigation, and everything they link must exist (this also catches a
    glob that finds nothing, which would run no notebook at all)."""
    found = {path.name for path in NOTEBOOKS}
    readme = (ROOT / "README.md").read_text()
    path_section = readme.split("## Learning path", 1)[1].split("\n## ", 1)[0]
    assert linked_notebooks(path_section, "](notebooks/") == found
    assert linked_notebooks((ROOT / "mkdocs.yml").read_text(), " notebooks/") == found
    for row in path_section.splitlines():
        if row.startswith("| ["):
            modules = re.findall(r"\]\((mpdl/[\w/]+\.py)\)", row)
            assert modules, f"no module linked on the learning path's row {row[:60]}"
            for module in modules:
                assert (ROOT / module).is_file(), module


def png_size(data: str) -> tuple[int, int]:
    raw = base64.b64decode(data)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", raw[16:24])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_its_checks_pass(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    for var in ("MPDL_EMULATE", "MPDL_RANKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    book = nbformat.read(path, as_version=4)
    code = [c for c in book.cells if c.cell_type == "code"]
    assert not any(c.get("outputs") for c in code), "commit notebooks without outputs"
    start = time.perf_counter()
    nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in code for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert not any(o.get("output_type") == "error" for o in outputs)
    # every code cell ran, once, in order
    assert [c.execution_count for c in code if c.source.strip()] == \
        list(range(1, sum(1 for c in code if c.source.strip()) + 1))
    # the closing line names every check the notebook's cells append, so none was skipped
    passed = [line for line in text.splitlines() if line.startswith("CHECKS PASSED:")]
    assert len(passed) == 1, text[-2000:]
    written = CHECK.findall("\n".join(c.source for c in code))
    assert written, "the notebook appends no check"
    missing = [check for check in written if check not in passed[0]]
    assert not missing, f"checks that did not run: {missing}"
    # at least one figure, and every figure a real image
    figures = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    assert figures, "no figure drawn"
    for figure in figures:
        width, height = png_size(figure)
        assert width >= 100 and height >= 100, (width, height)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    if os.environ.get("NOTEBOOK_OUT"):  # make notebooks: the executed copy, for the docs site
        out = Path(os.environ["NOTEBOOK_OUT"]) / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(book, str(out))

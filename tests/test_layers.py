"""mpdl's imports against its layer table (`.layers`): every module is placed in a layer, imports
only from its own layer or a lower one, and no modules import each other in a cycle. Imports
inside functions count too (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

# The line budget (docs/design.md), the docs' limits and the code the docs name run with the layer
# check, which every change runs before it lands.
from test_docs_paths import test_docs_name_only_code_that_exists  # noqa: F401
from test_line_budget import (  # noqa: F401
    test_concept_pages_teach_in_five_parts_and_stay_short,
    test_core_files_within_their_caps,
    test_docs_pages_short_but_the_journal,
    test_few_comments_carry_timings,
    test_readme_results_section_short,
)

ROOT = Path(__file__).resolve().parents[1]


def read_layers(path: Path) -> dict[str, int]:
    """The layer of each module prefix in a table of "LEVEL PREFIX" lines (# starts a comment)."""
    layers = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            level, prefix = line.split()
            layers[prefix] = int(level)
    return layers


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of the longest prefix that module falls under (None: none)."""
    matches = [p for p in layers if module == p or module.startswith(p + ".")]
    return layers[max(matches, key=len)] if matches else None


def modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under root, by dotted name (a package by its __init__.py)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules among `known` that the module `name` at path imports (anywhere in it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            while target and target not in known:  # mpdl.x.name -> the module mpdl.x
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def problems(root: Path, package: str) -> list[str]:
    """What is wrong with the imports of the package under root against root/.layers."""
    layers = read_layers(root / ".layers")
    names = modules(root, package)
    graph = {name: imports(path, name, set(names)) for name, path in names.items()}
    found = []
    for name, deps in graph.items():
        if name == package:
            continue  # the package's face may hand on names from any layer
        level = layer_of(name, layers)
        if level is None:
            found.append(f"unplaced module {name}: add it to .layers")
            continue
        for dep in sorted(deps):
            if (layer_of(dep, layers) or 0) > level:
                found.append(f"upward import: {name} (layer {level}) imports {dep} "
                             f"(layer {layer_of(dep, layers)})")
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        found.append("import cycle: " + " -> ".join(exc.args[1]))
    return found


def test_mpdl_imports_only_downward_and_without_cycles():
    assert problems(ROOT, "mpdl") == []


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def cycle_in(found: list[str]) -> set[str]:
    """The modules of the cycle among the problems (empty: none)."""
    cycles = [p.removeprefix("import cycle: ") for p in found if p.startswith("import cycle: ")]
    return set(cycles[0].split(" -> ")) if cycles else set()


def test_the_check_finds_upward_imports_cycles_and_unplaced_modules(tmp_path):
    write(tmp_path, {".layers": "# a table\n0 pkg.low\n1 pkg.mid\n2 pkg.top  # the top\n",
                     "pkg/__init__.py": "from pkg import top\n",
                     "pkg/low.py": "import os\n",
                     "pkg/mid/__init__.py": "from . import a\n",
                     "pkg/mid/a.py": "from pkg.low import x\n",
                     "pkg/mid/b.py": "import pkg.mid.a\n",
                     "pkg/top.py": "from .mid import a\n"})
    assert problems(tmp_path, "pkg") == []
    write(tmp_path, {"pkg/low.py": "def f():\n    from .mid.a import y\n"})  # a lazy import
    found = problems(tmp_path, "pkg")
    assert found[0] == "upward import: pkg.low (layer 0) imports pkg.mid.a (layer 1)"
    assert cycle_in(found) == {"pkg.low", "pkg.mid.a"} and len(found) == 2
    write(tmp_path, {"pkg/low.py": "import os\n", "pkg/mid/a.py": "from pkg.mid.b import f\n",
                     "pkg/extra.py": "import pkg.top\n"})
    found = problems(tmp_path, "pkg")
    assert found[0] == "unplaced module pkg.extra: add it to .layers"
    assert cycle_in(found) == {"pkg.mid.a", "pkg.mid.b"} and len(found) == 2

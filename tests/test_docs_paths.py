"""The docs name only code that exists: every repository path in the pages (mpdl/..., tests/...,
benchmarks/..., tools/..., notebooks/...), every `file.py:name` and `file.py::test_name`, every
`mpdl.module.name`, every name written as a link to a file ([`ring.ring_allreduce`](ring.py)),
every `module.name` or `Class.member` of mpdl's and every test named by its function
(`test_...`). A page that teaches a code path must stay true when the code moves."""

from __future__ import annotations

import ast
import inspect
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]

#: a repository path, optionally followed by :name or ::name (not a glob, not inside another path)
PATH = re.compile(r"(?<![\w/.~-])((?:mpdl|tests|benchmarks|tools|notebooks)/[\w/.-]*[\w/])(?![\w*])"
                  r"(?:(::?)([A-Za-z_]\w*(?:\.\w+)*)(?![\w*]))?")
#: a name written as a link to a Python file: [`module.name`](../mpdl/x/module.py)
LINKED = re.compile(r"\[`([A-Za-z_][\w.]*)(?:\(\))?`\]"
                    r"\((?:\.\./)*((?:mpdl|tests|benchmarks|tools)/[\w/.-]+\.py)\)")
#: a dotted name in the mpdl package: `mpdl.tuning.verify` or `mpdl.perf.bench.run`
DOTTED = re.compile(r"`(mpdl(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
#: a backticked attribute of an mpdl module or class: `ring.ring_allreduce`, `DDP.finish`
ATTRIBUTE = re.compile(r"`([A-Za-z_]\w*)\.([A-Za-z_]\w*)[\w.]*(?:\(\))?`")
#: module names that name something else in the pages: the TOML file's sections (`config.optim.lr`)
#: and mpi4py's communicator (`comm.Allreduce`)
NOT_MODULES = {"config", "comm"}
#: a test named by its function (two words at least: `test_acc` is a column of the training table)
TEST = re.compile(r"`(test_[A-Za-z0-9]+_\w+)`(?!\*)")


@cache
def names_in(path: Path) -> frozenset[str]:
    """The names a Python file defines: functions, classes, their methods (as Class.method and
    bare), module-level assignments and imports."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.update({prefix + node.name, node.name})
                if isinstance(node, ast.ClassDef):
                    visit(node.body, prefix + node.name + ".")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            found.update({prefix + name.id, name.id})
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body, prefix)
    visit(tree.body, "")
    return frozenset(found)


def defines(path: Path, name: str) -> bool:
    """Whether the file defines name (a leading component naming the file's module is dropped)."""
    parts = name.split(".")
    if len(parts) > 1 and parts[0] == path.stem:
        parts = parts[1:]
    return ".".join(parts) in names_in(path) or (len(parts) > 2 and ".".join(parts[-2:]) in names_in(path))


def module_file(dotted: list[str]) -> tuple[Path, list[str]] | None:
    """The longest prefix of mpdl.a.b.c that is a module or package, and the rest."""
    for i in range(len(dotted), 0, -1):
        base = ROOT.joinpath(*dotted[:i])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate, dotted[i:]
    return None


@cache
def mpdl_index() -> tuple[dict[str, list[Path]], dict[str, list[tuple[set[str], set[str]]]]]:
    """mpdl's modules by their file's stem, and its classes by name: (members, base names) each,
    members being methods, class attributes and the attributes their methods set on self."""
    modules: dict[str, list[Path]] = {}
    classes: dict[str, list[tuple[set[str], set[str]]]] = {}
    for f in sorted((ROOT / "mpdl").rglob("*.py")):
        if f.name != "__init__.py":
            modules.setdefault(f.stem, []).append(f)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                members |= {n.id for s in node.body if isinstance(s, (ast.Assign, ast.AnnAssign))
                            for n in ast.walk(s) if isinstance(n, ast.Name)}
                members |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                            and isinstance(n.value, ast.Name) and n.value.id == "self"
                            and isinstance(n.ctx, ast.Store)}
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                classes.setdefault(node.name, []).append((members, bases))
    return modules, classes


def has_member(cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
    """Whether an mpdl class of that name, or one of its bases, has the member."""
    classes = mpdl_index()[1]
    return any(name in members or any(has_member(b, name, seen | {cls}) for b in bases
                                      if b in classes and b not in seen)
               for members, bases in classes.get(cls, []))


@cache
def defined_tests() -> frozenset[str]:
    """The test functions under tests/."""
    return frozenset(m for f in (ROOT / "tests").rglob("*.py")
                     for m in re.findall(r"^\s*def (test_\w+)", f.read_text(), flags=re.M))


def missing_in(page: Path) -> list[str]:
    """What the page names that does not exist, as 'page: what'."""
    text, where, wrong = page.read_text(), page.relative_to(ROOT), []
    for m in PATH.finditer(text):
        path, sep, name = m.groups()
        target = ROOT / path
        if not (target.suffix or path.endswith("/") or text[m.start() - 1] == "`"):
            continue  # prose such as "mpdl/torch", a ratio
        if not target.exists():
            wrong.append(f"{where}: {path} does not exist")
        elif name and target.suffix == ".py" and not defines(target, name):
            wrong.append(f"{where}: {path}{sep}{name}: no {name} there")
    for name, path in LINKED.findall(text):
        target = ROOT / path
        if target.is_file() and name not in (target.name, target.stem) and not defines(target, name):
            wrong.append(f"{where}: [{name}]({path}): no {name} there")
    for dotted in DOTTED.findall(text):
        found = module_file(dotted.split("."))
        if found is None or (found[1] and not defines(found[0], ".".join(found[1]))):
            wrong.append(f"{where}: {dotted} does not exist")
    modules, classes = mpdl_index()
    for owner, name in ATTRIBUTE.findall(text):
        if owner in classes and not has_member(owner, name):
            wrong.append(f"{where}: {owner}.{name}: no {name} in class {owner}")
        elif owner not in classes and owner not in NOT_MODULES and name != "py" \
                and len(modules.get(owner, [])) == 1 and not defines(modules[owner][0], name):
            wrong.append(f"{where}: {owner}.{name}: no {name} in {modules[owner][0].relative_to(ROOT)}")
    wrong += [f"{where}: no test {name} in tests/" for name in TEST.findall(text)
              if name not in defined_tests()]
    return wrong


def test_checks_find_what_is_missing(tmp_path):
    page = ROOT / "docs" / "_probe_for_test_docs_paths.md"
    page.write_text("[`ring.ring_allreduce`](../mpdl/collectives/ring.py) and "
                    "[`ring.no_such`](../mpdl/collectives/ring.py); mpdl/collectives/ring.py:ring_allgather, "
                    "mpdl/collectives/ring.py:gone, mpdl/nowhere.py, tests/test_layers.py, mpdl/torch, "
                    "[`ring.py`](../mpdl/collectives/ring.py), "
                    "`mpdl.collectives.ring.ring_allreduce`, `mpdl.collectives.nothing`, "
                    "`test_no_such_test`, `tests/mpi/test_*.py`, `test_fp16_*`, `ring.ring_allgather`, "
                    "`ring.gone`, `Ledger.hold`, `Ledger.gone`, `DistributedSampler.position`\n")
    try:
        wrong = missing_in(page)
    finally:
        page.unlink()
    assert [w.split(": ", 1)[1] for w in wrong] == [
        "mpdl/collectives/ring.py:gone: no gone there", "mpdl/nowhere.py does not exist",
        "[ring.no_such](mpdl/collectives/ring.py): no ring.no_such there",
        "mpdl.collectives.nothing does not exist", "ring.no_such: no no_such in mpdl/collectives/ring.py",
        "ring.gone: no gone in mpdl/collectives/ring.py",
        "Ledger.gone: no gone in class Ledger", "no test test_no_such_test in tests/"]


def test_docs_name_only_code_that_exists():
    wrong = [w for page in PAGES for w in missing_in(page)]
    assert not wrong, "the docs name code that does not exist:\n" + "\n".join(wrong)


def test_the_quoted_one_f_one_b_is_the_codes_own():
    """docs/pipeline.md quotes the 1F1B generator beside its prose: the quote follows the code."""
    from mpdl.parallel.pipeline import schedule  # noqa: PLC0415

    source = inspect.getsource(schedule._one_f_one_b)
    assert f"```python\n{source}```" in (ROOT / "docs" / "pipeline.md").read_text()

"""The line budget: the teaching core's files (docs/design.md, "Reading order and line budget")
stay under their caps, no docs page but the results journal grows past 400 lines, and the
README's results section stays at most 25 lines."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE_CAP = 400
RESULTS_CAP = 25


def budget(design: str) -> list[tuple[str, int]]:
    """The (path, cap) rows of design.md's line-budget table, in reading order."""
    section = design.split("## Reading order and line budget\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| (\d+) \|", section, flags=re.M)
    return [(path, int(cap)) for path, cap in rows]


def lines_of(path: str) -> int:
    """Lines of a file, or of every .py file of a package; a path without .py may be either."""
    target = ROOT / path
    if target.is_dir():
        return sum(len(f.read_text().splitlines()) for f in sorted(target.rglob("*.py")))
    if not target.is_file() and not path.endswith(".py"):
        target = target.with_name(target.name + ".py")
    assert target.is_file(), f"design.md's line budget names {path}, which does not exist: update the table"
    return len(target.read_text().splitlines())


def test_budget_parses_its_table():
    design = "## Reading order and line budget\n\n| # | file | cap | what |\n|---|---|---|---|\n" \
             "| 1 | `a.py` | 10 | x |\n| 2 | `b` | 20 | y |\n\n## Tests\n| 3 | `c.py` | 5 | z |\n"
    assert budget(design) == [("a.py", 10), ("b", 20)]


def test_core_files_within_their_caps(capsys):
    rows = budget((ROOT / "docs" / "design.md").read_text())
    assert len(rows) >= 20, "the line-budget table in docs/design.md lost its rows"
    counted = [(path, lines_of(path), cap) for path, cap in rows]
    with capsys.disabled():
        print("\nline budget (docs/design.md):")
        for i, (path, n, cap) in enumerate(counted, 1):
            print(f"{i:3d}  {path:45s} {n:5d} / {cap:5d}{'  OVER' if n > cap else ''}")
        print(f"     {'total':45s} {sum(n for _, n, _ in counted):5d} / {sum(c for *_, c in counted):5d}")
    over = [f"{path} has {n} lines, over its cap of {cap}" for path, n, cap in counted if n > cap]
    assert not over, "; ".join(over)


def test_docs_pages_short_but_the_journal():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in sorted((ROOT / "docs").rglob("*.md"))
            if "results" not in p.relative_to(ROOT / "docs").parts
            and (n := len(p.read_text().splitlines())) > PAGE_CAP]
    assert not long, f"docs pages over {PAGE_CAP} lines (measurements go to docs/results/): {long}"


#: the concept pages, each the idea, a figure, the code path (links into mpdl/), the formula and
#: the check (links into tests/): short enough to read in one sitting
CONCEPT_PAGES = ("collectives", "autograd", "data_parallel", "zero", "pipeline", "context_parallel",
                 "moe", "memory", "precision", "inference", "simulate")
CONCEPT_CAP = 250
TEACHING_PARTS = ("## The idea", "](figures/", "## The code path", "## The formula", "## The check")


def test_concept_pages_teach_in_five_parts_and_stay_short():
    wrong = []
    for name in CONCEPT_PAGES:
        text = (ROOT / "docs" / f"{name}.md").read_text()
        wrong += [f"{name}.md lacks {part!r}" for part in TEACHING_PARTS if part not in text]
        for part, names in (("## The code path", "../mpdl/"), ("## The check", "../tests/")):
            section = text.split(part + "\n", 1)[-1].split("\n## ", 1)[0]
            if part in text and names not in section:
                wrong.append(f"{name}.md: {part!r} links no file of {names[3:]}")
        if (n := len(text.splitlines())) > CONCEPT_CAP:
            wrong.append(f"{name}.md has {n} lines, over {CONCEPT_CAP}")
    assert not wrong, "; ".join(wrong)


def test_readme_results_section_short():
    readme = (ROOT / "README.md").read_text()
    heads = re.findall(r"^## .*[Rr]esults.*$", readme, flags=re.M)
    assert len(heads) == 1, f"README should have one results section, found {heads}"
    section = readme.split(heads[0] + "\n", 1)[1].split("\n## ", 1)[0].strip()
    n = len(section.splitlines())
    assert n <= RESULTS_CAP, f"README's results section has {n} lines, over {RESULTS_CAP}"


#: a figure with a unit of time or of throughput, or a measured ratio of speeds ("1.1-1.4x
#: slower"), what a comment carrying a run's timing shows (not a link spec such as
#: inter=10Gbit/s,20us, whose latency follows a comma)
TIMING = re.compile(r"(?<![\w.,=-])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)? ?(?:ms|µs|us|ns|s|[GMK]i?B/s)\b"
                    r"|(?<![\w.])\d+(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)? ?[x×] (?:slower|faster|the time)")
TIMING_CAP = 10


def timing_lines(source: str) -> list[int]:
    """Lines of comments and docstrings that carry a figure in seconds or bytes per second."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT and TIMING.search(token.string):
            lines.add(token.start[0])
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            for i, line in enumerate(body[0].value.value.splitlines()):
                if TIMING.search(line):
                    lines.add(body[0].lineno + i)
    return sorted(lines)


def test_timing_lines_finds_comments_and_docstrings():
    source = ('"""Module.\n\nTook 9 us on 2 ranks."""\nx = 1  # 3.4-3.6 ms a call\ny = "5 ms"  # a reason\n'
              'z = 2  # e.g. inter=10Gbit/s,20us\nw = 3  # ran 1.11-1.37x slower\nv = 4  # a 3×3 kernel\n'
              'def f():\n    """Takes 1.10-1.15× the time of MKL\'s."""\n')
    assert timing_lines(source) == [3, 4, 7, 10]


def test_few_comments_carry_timings():
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted((ROOT / "mpdl").rglob("*.py"))
             for n in timing_lines(path.read_text())]
    assert len(found) <= TIMING_CAP, (
        f"{len(found)} lines of mpdl/ carry timings in comments or docstrings (at most {TIMING_CAP}: "
        f"give a one-line reason and link the entry of docs/results/): {found}")

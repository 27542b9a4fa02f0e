"""Links between the docs pages (and from the README into them) land on a heading that exists:
a page's anchors are its headings, made into ids as the site's Markdown does (Python-Markdown's
toc slugify)."""

from __future__ import annotations

import posixpath
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")


def slug(heading: str) -> str:
    """The id Python-Markdown's toc gives a heading."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings (outside code blocks); a repeated id gets _1, _2, ..."""
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := re.match(r"#{1,6} (.*)", line)):
            base = slug(m.group(1).replace("`", ""))
            name, i = base, 0
            while name in found:
                i += 1
                name = f"{base}_{i}"
            found.add(name)
    return found


def test_slug_is_the_sites():
    assert slug("`auto` out of the box: no calibration file") == "auto-out-of-the-box-no-calibration-file"
    assert slug("Judged (2026-12-02, 11:39–13:03 UTC)") == "judged-2026-12-02-11391303-utc"


def test_links_between_pages_land_on_a_heading():
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            path = Path(posixpath.normpath(page.parent / target)) if target else page
            if path.suffix == ".md" and path.exists() and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"

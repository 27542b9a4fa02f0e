"""MkDocs hooks for the docs site (`make docs`): the site is the repository's own Markdown.

The pages under docs/ link to each other and to the repository as GitHub shows it (README.md,
../notebooks/*.ipynb, ../mpdl/.../*.py). The site needs three things those files do not hold:

- the home page is README.md (a link to it from docs/ leads there), its links rewritten from
  the repository root to the site;
- the notebooks (notebooks/*.ipynb) are pages of the site, rendered by mkdocs-jupyter from their
  executed copies in build/notebooks/ (what they print and draw; `make docs` makes them), else
  as stored (code only);
- the API reference: one page per layer of `.layers`, generated from the docstrings by
  mkdocstrings (`::: mpdl.collectives` and the like), so a new package appears once it is in
  `.layers`.

A link into mpdl/ becomes a link to that module's entry in the API reference; a link to another
file of the repository that the site does not hold (benchmarks/, tools/, ...) keeps its text
and loses the link; a link to a file that does not exist is left as it is, and
`mkdocs build --strict` reports it. A page of docs/ that mkdocs.yml's nav does not list is
added at the end of its Topics section, a layer's reference page at the end of the API reference.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
LAYER_NAMES = {
    0: "settings, backend, data and the MPI runtime",
    1: "communicators, the in-process world and autograd",
    2: "collectives",
    3: "parallel strategies",
    4: "training",
    5: "measurement and tools",
    6: "the command line",
}
#: the notebooks as `make notebooks` executed them (outputs and figures), where it has
EXECUTED = ROOT / "build" / "notebooks"
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def layers() -> dict[int, list[str]]:
    """The packages and modules of `.layers` that are Python code, by layer."""
    table: dict[int, list[str]] = {}
    for line in (ROOT / ".layers").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) != 2:
            continue
        path = ROOT / fields[1].replace(".", "/")
        if (path / "__init__.py").exists() or path.with_suffix(".py").exists():
            table.setdefault(int(fields[0]), []).append(fields[1])
    return table


def reference_page(layer: int, modules: list[str]) -> str:
    """The Markdown of one layer's API reference page."""
    title = LAYER_NAMES.get(layer, ", ".join(modules))
    parts = [f"# Layer {layer}: {title}\n",
             "Generated from the docstrings. What the layers are: "
             "[design.md](../design.md#layers).\n"]
    parts += [f"::: {name}\n" for name in modules]
    return "\n".join(parts)


def module_anchor(repo_path: str, table: dict[int, list[str]]) -> str | None:
    """The site path of the reference entry for a file of mpdl/ (None when it has none)."""
    dotted = repo_path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    for layer, names in table.items():
        if any(dotted == name or dotted.startswith(name + ".") for name in names):
            return f"reference/layer-{layer}.md#{dotted}"
    return None


def site_link(target: str, anchor: str, page_repo_path: str, page_site_path: str,
              table: dict[int, list[str]]) -> str | None:
    """A link written for GitHub (relative to the page's place in the repository), for the site:
    None for a file of the repository that the site does not hold."""
    if "://" in target or target.startswith(("mailto:", "/")):
        return target + anchor
    repo_target = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo_path), target))
    if repo_target == "README.md":
        site_target = "index.md"
    elif repo_target.startswith("docs/"):
        site_target = repo_target.removeprefix("docs/")
    elif repo_target.startswith("notebooks/"):
        site_target = repo_target
    elif repo_target.startswith("mpdl/") and (entry := module_anchor(repo_target, table)):
        site_target, anchor = entry.split("#")
        anchor = "#" + anchor
    elif (ROOT / repo_target).exists() and not repo_target.startswith(".."):
        return None
    else:
        return target + anchor
    here = posixpath.dirname(page_site_path) or "."
    return posixpath.relpath(site_target, here) + anchor


def listed(nav) -> set[str]:
    """Every page path mkdocs.yml's nav lists."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(listed(value) for value in nav.values()))
    return set().union(*(listed(item) for item in nav)) if nav else set()


def section(nav: list, title: str) -> list:
    """The children of the nav's top-level section of that title (made when missing)."""
    for item in nav:
        if isinstance(item, dict) and title in item:
            return item[title]
    nav.append({title: []})
    return nav[-1][title]


def on_config(config):
    nav = config["nav"]
    have = listed(nav)
    docs = Path(config["docs_dir"])
    for page in sorted(docs.glob("*.md")):
        if page.name not in have:
            section(nav, "Topics").append(page.name)
    for layer in sorted(layers()):
        if f"reference/layer-{layer}.md" not in have:
            section(nav, "API reference").append(f"reference/layer-{layer}.md")
    return config


@event_priority(100)  # before mkdocs-jupyter turns the notebooks into pages
def on_files(files: Files, config) -> Files:
    table = layers()
    readme = (ROOT / "README.md").read_text()
    files.append(File.generated(config, "index.md", content=readme))
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        executed = EXECUTED / notebook.name
        source = executed.parent.parent if executed.exists() else ROOT
        files.append(File(f"notebooks/{notebook.name}", str(source), config["site_dir"],
                          config["use_directory_urls"]))
    for layer, modules in sorted(table.items()):
        files.append(File.generated(config, f"reference/layer-{layer}.md",
                                    content=reference_page(layer, modules)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    site_path = page.file.src_uri
    if site_path == "index.md":
        repo_path = "README.md"
    elif site_path.startswith(("reference/", "notebooks/")):
        return markdown
    else:
        repo_path = "docs/" + site_path
    table = layers()

    def rewrite(match: re.Match) -> str:
        image, text, target, anchor = match.group(1), match.group(2), match.group(3), match.group(4)
        new = site_link(target, anchor or "", repo_path, site_path, table)
        if new is None:
            return match.group(0) if image else text
        return f"{image}[{text}]({new})"

    return LINK.sub(rewrite, markdown)

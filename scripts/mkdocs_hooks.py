"""mkdocs hooks: a page in docs/ that mkdocs.yml's nav does not name still gets a nav entry;
and the site gets Pygments' stylesheet for its code blocks.

Pages added later (by other branches) then show on the site, under "More", until
someone gives them a place in the nav; nothing has to be remembered at merge time.
The stylesheet is generated at build time (nothing generated is committed), so the
site needs no CDN for highlighting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from pygments.formatters import HtmlFormatter

PYGMENTS_CSS = "pygments.css"  # mkdocs.yml's extra_css names it


def _named(nav: Any) -> set[str]:
    """Every page path the nav names, at any depth."""
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, dict):
        return set().union(*(_named(v) for v in nav.values()))
    if isinstance(nav, list):
        return set().union(*(_named(v) for v in nav)) if nav else set()
    return set()


def on_files(files: Files, config: MkDocsConfig) -> Files:
    nav = config.nav
    if nav is None:
        return files  # no nav: mkdocs lists every page by itself
    named = _named(nav)
    extra = sorted(
        f.src_uri for f in files.documentation_pages()
        if f.src_uri not in named and not f.src_uri.startswith("reference/")
    )
    if extra:
        nav.append({"More": extra})
    return files


def on_post_build(config: MkDocsConfig) -> None:
    """Write the stylesheet of pymdownx.highlight's ``.highlight`` blocks into the site."""
    css = HtmlFormatter(style="default").get_style_defs(".highlight")
    (Path(config.site_dir) / PYGMENTS_CSS).write_text(css + "\n")

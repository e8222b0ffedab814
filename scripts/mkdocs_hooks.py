"""mkdocs hooks: a page in docs/ that mkdocs.yml's nav does not name still gets a nav entry;
the site gets Pygments' stylesheet for its code blocks; and in the API reference, a
docstring's "docs/rings.md" (with a section: docs/rings.md, "CPU hotplug") becomes a link.

Pages added later (by other branches) then show on the site, under "More", until
someone gives them a place in the nav; nothing has to be remembered at merge time.
The stylesheet is generated at build time (nothing generated is committed), so the
site needs no CDN for highlighting.
"""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path
from typing import Any

from markdown.extensions.toc import slugify
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page
from pygments.formatters import HtmlFormatter

PYGMENTS_CSS = "pygments.css"  # mkdocs.yml's extra_css names it
# Docstrings say where to read more as plain text, which help() shows as it is:
# "docs/columnar.md", or "docs/rings.md, "CPU hotplug"" for a section of it.
DOC_MENTION = re.compile(r'docs/([a-z0-9_-]+)\.md(?:,\s*"([^"<]+)")?')
TAG = re.compile(r"(<[^>]+>)")
log = logging.getLogger("mkdocs.hooks.docstring_links")


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


def _headings(path: str) -> set[str]:
    """The headings of a Markdown page, as their text (not comments in its code blocks)."""
    found = set()
    fenced = False
    for line in Path(path).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif line.startswith("#") and not fenced:
            found.add(line.lstrip("#").strip())
    return found


def _doc_link(match: re.Match[str], page: Page, files: Files) -> str:
    name, section = match[1], match[2]
    target = files.get_file_from_path(f"{name}.md")
    if target is None or target.abs_src_path is None:
        log.warning("%s: a docstring names docs/%s.md, which is no page", page.file.src_uri, name)
        return match[0]
    href = target.url_relative_to(page.file)
    if section is not None:
        heading = " ".join(html.unescape(section).split())
        if heading not in _headings(target.abs_src_path):
            log.warning("%s: a docstring names the section %r of docs/%s.md, which has none",
                        page.file.src_uri, heading, name)
            return match[0]
        href += "#" + slugify(heading, "-")
    return f'<a href="{html.escape(href)}">{match[0]}</a>'


def on_page_content(text: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """In the API reference, docstrings' docs/NAME.md mentions become links (outside links
    already there); a mention of a page or section that does not exist fails the build."""
    if not page.file.src_uri.startswith("reference/"):
        return text
    parts = TAG.split(text)
    in_link = 0
    for index, part in enumerate(parts):
        if part.startswith("<"):
            if re.match(r"<a[\s>]", part):
                in_link += 1
            elif part.startswith("</a"):
                in_link = max(0, in_link - 1)
        elif not in_link and "docs/" in part:
            parts[index] = DOC_MENTION.sub(lambda m: _doc_link(m, page, files), part)
    return "".join(parts)

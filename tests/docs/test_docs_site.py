"""The docs site works offline: built with mkdocs, no page loads a script, a stylesheet,
an image or a font from another host (a CDN), directly or through CSS.

Plain hyperlinks (``<a href="https://...">``) are content and may point anywhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a browser fetches by itself while showing a page: tag -> attributes.
FETCHED = {
    "script": ("src",), "link": ("href",), "img": ("src", "srcset"), "source": ("src", "srcset"),
    "iframe": ("src",), "embed": ("src",), "object": ("data",), "video": ("src", "poster"),
    "audio": ("src",), "track": ("src",), "input": ("src",),
}
REMOTE = re.compile(r"^\s*(https?:)?//", re.I)
CSS_URL = re.compile(r"""url\(\s*(['"]?)(.*?)\1\s*\)|@import\s+(['"])(.*?)\3""", re.I)


class Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.remote: list[str] = []
        self.links = 0
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links += 1
        for name, value in attrs:
            if value is None:
                continue
            if name in FETCHED.get(tag, ()):
                urls = [part.split()[0] for part in value.split(",") if part.strip()]
                if name != "srcset":
                    urls = [value]
                self.remote += [f"<{tag} {name}={url}>" for url in urls if REMOTE.match(url)]
            if name == "style":
                self.remote += [f"<{tag} style> {url}" for url in remote_css(value)]
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.remote += [f"<style> {url}" for url in remote_css(data)]


def remote_css(text: str) -> list[str]:
    found = []
    for match in CSS_URL.finditer(text):
        url = match[2] if match[2] is not None else match[4]
        if url and REMOTE.match(url):
            found.append(url)
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_no_page_loads_anything_from_another_host(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 20
    remote, links = [], 0
    for page in pages:
        parser = Assets()
        parser.feed(page.read_text())
        links += parser.links
        remote += [f"{page.relative_to(site)}: {what}" for what in parser.remote]
    assert links > 100  # the parser saw the pages' links at all
    assert remote == []


def test_no_stylesheet_fetches_from_another_host(site: Path) -> None:
    sheets = sorted(site.rglob("*.css"))
    assert any(sheet.name == "pygments.css" for sheet in sheets)  # code is still coloured
    remote = [
        f"{sheet.relative_to(site)}: {url}"
        for sheet in sheets for url in remote_css(sheet.read_text())
    ]
    assert remote == []


def test_code_blocks_are_highlighted_at_build_time(site: Path) -> None:
    page = (site / "ctrl-c" / "index.html").read_text()
    assert '<div class="highlight">' in page
    assert '<span class="kn">import</span>' in page  # Pygments' token classes
    assert 'href="../pygments.css"' in page


def test_the_checker_sees_a_cdn(tmp_path: Path) -> None:
    parser = Assets()
    parser.feed(
        '<script src="https://cdn.example/x.js"></script><link rel="stylesheet" '
        'href="//cdn.example/x.css"><img srcset="a.png 1x, https://cdn.example/b.png 2x">'
        '<style>@import "https://fonts.example/f.css";</style>'
        '<div style="background: url(http://cdn.example/i.png)"></div>'
        '<a href="https://example.org/">a link is content</a><script src="local.js"></script>'
    )
    assert len(parser.remote) == 5, parser.remote
    assert remote_css("url('data:image/svg+xml,%3csvg xmlns=\"http://www.w3.org/2000/svg\"')") == []


class Text(HTMLParser):
    """A page's text outside links, and the links' targets."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: list[str] = []
        self.hrefs: list[str] = []
        self._in_link = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._in_link += 1
            self.hrefs += [v for k, v in attrs if k == "href" and v]

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self._in_link = max(0, self._in_link - 1)

    def handle_data(self, data: str) -> None:
        if not self._in_link:
            self.outside.append(data)


DOC_MENTION = re.compile(r"docs/[a-z0-9_-]+\.md")


def test_the_api_reference_links_the_pages_its_docstrings_name(site: Path) -> None:
    # Docstrings say "docs/columnar.md" (or docs/rings.md, "CPU hotplug"): plain text in
    # help(), a link on the site, to the page and its section, both of which exist.
    pages = sorted((site / "reference").rglob("index.html"))
    linked = 0
    for page in pages:
        text = Text()
        text.feed(page.read_text())
        assert not DOC_MENTION.findall("".join(text.outside)), page
        for href in text.hrefs:
            if href.startswith(("http", "#", "mailto:")):
                continue
            path, _, anchor = href.partition("#")
            target = (page.parent / path).resolve()
            target = target / "index.html" if target.is_dir() else target
            assert target.is_file(), (page, href)
            if anchor:
                assert f'id="{anchor}"' in target.read_text(), (page, href)
            linked += "/reference/" not in str(target)
    assert linked > 20  # the mentions were found and linked at all


def test_a_built_site_is_not_committed() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=REPO,
                             check=False)
    assert ignored.returncode == 0  # mkdocs build's default output directory

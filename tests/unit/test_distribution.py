"""The distribution's name (aperf-bpf: "aperf" on PyPI is another project) wherever a user
reads it: pyproject.toml, the installed metadata, and every ``pip install`` hint."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import tomllib

import aperf

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTION = "aperf-bpf"
# `pip install 'aperf-bpf[extra]'` or `pip install aperf-bpf`, as messages and docs write it.
HINT = re.compile(r"pip install '?(aperf[A-Za-z0-9_.-]*)")


def test_pyproject_names_the_distribution_and_the_import_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["name"] == DISTRIBUTION
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["aperf*"]


def test_installed_metadata_is_the_same_version_as_aperf() -> None:
    assert importlib.metadata.version(DISTRIBUTION) == aperf.__version__
    files = importlib.metadata.distribution(DISTRIBUTION).read_text("top_level.txt")
    assert files is None or "aperf" in files.split()


def test_every_install_hint_names_the_distribution() -> None:
    texts = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    texts += [*(REPO / "aperf").rglob("*.py"), *(REPO / "examples").rglob("*.py")]
    hints = [
        (str(path.relative_to(REPO)), match[0])
        for path in texts for match in HINT.finditer(path.read_text())
    ]
    assert len(hints) > 10  # the hints are found at all
    assert [(where, hint) for where, hint in hints if not hint.endswith(DISTRIBUTION)] == []

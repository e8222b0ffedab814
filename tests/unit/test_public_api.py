"""Every public name of aperf is in the API reference, documented, in Markdown.

ruff's pydocstyle rules skip private modules, and aperf's code lives in private
modules behind re-exporting namespaces: so the checks walk what users see. The
public namespaces are ``aperf`` and its submodules without a leading underscore
(found, not listed: a new one is checked as soon as it exists). The API
reference is docs/reference/*.md, where mkdocstrings renders each ``::: NAME``
from its docstring (mkdocs.yml); ``scripts/check.sh`` builds it with --strict.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Any

import griffe
import pytest

import aperf

from ..docs.snippets import REPO, reference_targets


def public_modules() -> list[str]:
    """aperf and every module below it whose dotted name has no part with a leading _."""
    found = [m.name for m in pkgutil.walk_packages(aperf.__path__, "aperf.")]
    public = [name for name in found if not any(p.startswith("_") for p in name.split("."))]
    return ["aperf", *sorted(public)]


def public_names() -> list[str]:
    """module.NAME for every NAME in a public module's ``__all__`` (submodules aside)."""
    names = []
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in module.__all__:
            if not inspect.ismodule(getattr(module, name)):
                names.append(f"{module_name}.{name}")
    return names


def shown_objects() -> list[tuple[str, Any]]:
    """The classes and functions the reference shows, and their public methods and properties."""
    out: list[tuple[str, Any]] = []
    for qualified in reference_targets():
        module_name, _, name = qualified.rpartition(".")
        obj = getattr(importlib.import_module(module_name), name)
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue  # constants and aliases: test_constants_are_documented
        out.append((qualified, obj))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_") or attr in _NAMED_TUPLE_FIELDS:
                    continue
                if isinstance(member, property | classmethod | staticmethod) or (
                    inspect.isfunction(member)
                ):
                    out.append((f"{qualified}.{attr}", member))
    return out


# NamedTuple fields are documented by the class docstring.
_NAMED_TUPLE_FIELDS = {"cpu", "data", "value", "count", "error"}


def _doc(obj: Any) -> str:
    target = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    target = target.fget if isinstance(target, property) else target
    return inspect.getdoc(target) or ""


def test_every_public_name_is_in_the_reference() -> None:
    shown = reference_targets()
    missing = sorted(set(public_names()) - set(shown))
    pages = {
        name.rpartition(".")[0].removeprefix("aperf.").replace(".", "-") or "aperf"
        for name in missing
    }
    assert not missing, (
        f"not in the API reference: {missing}; add '::: NAME' lines to "
        + ", ".join(f"docs/reference/{p}.md" for p in sorted(pages))
        + " (a new page also goes into mkdocs.yml's nav, under Reference)"
    )
    assert len(shown) == len(set(shown)), "a name is shown twice"


def test_the_reference_shows_only_public_names() -> None:
    private = sorted(set(reference_targets()) - set(public_names()))
    assert not private, f"shown, but not in a public module's __all__: {private}"


def test_every_reference_page_is_in_the_nav() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    for page in sorted((REPO / "docs" / "reference").glob("*.md")):
        assert f"reference/{page.name}" in nav, f"mkdocs.yml's nav lacks reference/{page.name}"


@pytest.mark.parametrize(
    ("name", "obj"), shown_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_public_name_has_a_docstring(name: str, obj: Any) -> None:
    assert _doc(obj).strip(), f"{name} has no docstring"


def test_constants_are_documented() -> None:
    # Attribute docstrings exist only in the source: read them as mkdocstrings does.
    for qualified in reference_targets():
        module_name, _, name = qualified.rpartition(".")
        obj = getattr(importlib.import_module(module_name), name)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            continue
        loaded = griffe.load(module_name, search_paths=[str(REPO)], resolve_aliases=True)
        docstring = loaded[name].docstring
        assert docstring is not None and docstring.value.strip(), f"{qualified}: no docstring"


_REST_ROLE = re.compile(r":(class|meth|func|attr|mod|exc|data|obj|ref):`")


def test_docstrings_are_markdown_not_rest() -> None:
    # mkdocstrings renders Markdown: a :class:`X` role would show up as it is.
    raw = [name for name, obj in shown_objects() if _REST_ROLE.search(_doc(obj))]
    assert not raw, f"reST roles in {raw}; write [`X`][aperf.X] or ``X`` instead"


def test_every_module_has_all() -> None:
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        assert sorted(module.__all__) == sorted(set(module.__all__)), module_name


def test_the_checks_see_the_api() -> None:
    # Discovery that found nothing would make every check above pass vacuously.
    assert {"aperf", "aperf.abc", "aperf.decoders", "aperf.testing", "aperf.fleet"} <= set(
        public_modules()
    )
    assert {
        "aperf.PerfStream", "aperf.testing.Producer", "aperf.decoders.from_btf",
        "aperf.abc.RingSource",
    } <= set(reference_targets())


def described_parameters(doc: str | None) -> list[str]:
    """The names in a Google-style docstring's Args section, as mkdocstrings reads them."""
    sections = griffe.Docstring(inspect.cleandoc(doc or ""), parser="google").parse()
    return [p.name for s in sections if s.kind is griffe.DocstringSectionKind.parameters
            for p in s.value]


@pytest.mark.parametrize(
    "documented",
    [aperf.PerfStream, aperf.PerfBuffer, aperf.PerfStream.run, aperf.PerfStream.run_batches,
     aperf.PerfStream.run_arrays],
    ids=lambda d: d.__qualname__,
)
def test_every_parameter_of_the_drivers_is_described(documented: Any) -> None:
    call = documented.__init__ if isinstance(documented, type) else documented
    parameters = [name for name in inspect.signature(call).parameters if name != "self"]
    assert described_parameters(documented.__doc__) == parameters


@pytest.mark.parametrize("driver", [aperf.PerfStream, aperf.PerfBuffer])
def test_help_shows_no_link_markup(driver: type) -> None:
    import pydoc

    text = pydoc.render_doc(driver, renderer=pydoc.plaintext)
    assert "called as on_sample(sample)" in text.replace("``", "")
    assert not re.search(r"\]\[[\w.]*\]", text), "raw mkdocs cross-reference in help()"


@pytest.mark.parametrize("cls", [aperf.PerfStream, aperf.PerfBuffer], ids=lambda c: c.__name__)
def test_help_ends_with_aperfs_text_not_typing_generics(cls: Any) -> None:
    import pydoc
    import typing

    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    for generic in ("typing.Generic", "Parameterizes a generic class", "__orig_bases__",
                    "__init_subclass__", "__parameters__"):
        assert generic not in text, generic
    assert text.rstrip().endswith("the class whose values are ``T``.")
    # Still generic where it matters: in annotations, for checkers and at run time.
    assert typing.get_origin(cls[int]) is cls and typing.get_args(cls[int]) == (int,)

"""Every public name of aperf is documented, and the public modules only re-export.

ruff's pydocstyle rules skip private modules, and aperf's code lives in private
modules behind a re-exporting namespace: so the check walks what users see.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

PUBLIC_MODULES = ["aperf", "aperf.decoders", "aperf.testing"]


def public_objects() -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue  # constants and typing aliases (documented where they are defined)
            out.append((f"{module_name}.{name}", obj))
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") or attr in _INHERITED_FROM_TUPLE:
                        continue
                    if isinstance(member, property | classmethod | staticmethod) or (
                        inspect.isfunction(member)
                    ):
                        out.append((f"{module_name}.{name}.{attr}", member))
    return out


# NamedTuple fields are documented by the class docstring.
_INHERITED_FROM_TUPLE = {"cpu", "data", "value", "count", "error"}


@pytest.mark.parametrize(
    ("name", "obj"), public_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_public_name_has_a_docstring(name: str, obj: Any) -> None:
    target = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    target = target.fget if isinstance(target, property) else target
    doc = inspect.getdoc(target)
    assert doc and doc.strip(), f"{name} has no docstring"


def test_every_module_has_all() -> None:
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        assert sorted(module.__all__) == sorted(set(module.__all__)), module_name

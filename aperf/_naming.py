"""Public classes show the name users import them by: ``aperf.UnknownNameError``, not
``aperf._errors.UnknownNameError``, in reprs, tracebacks and ``help()``.

Pickle finds a class by ``__module__`` and ``__qualname__``, so the public name
also unpickles: ``aperf.X`` is the same object. As trio does for its namespace.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

__all__ = ["Subscriptable", "show_public_names"]

if TYPE_CHECKING:
    from typing import Generic as Subscriptable
else:

    class Subscriptable:
        """What ``typing.Generic`` is to a type checker, for ``PerfStream[T]``, without
        its machinery at run time: ``help(aperf.PerfStream)`` then ends with aperf's
        text, not with Generic's ``__class_getitem__`` and ``__init_subclass__``."""

        __slots__ = ()

        def __class_getitem__(cls, params: Any) -> Any:
            """``Class[T]`` in an annotation: the class whose values are ``T``."""
            return cls if cls is Subscriptable else types.GenericAlias(cls, params)


def show_public_names(namespace: Mapping[str, object]) -> None:
    """Set ``__module__`` of each class in ``namespace["__all__"]`` that a private
    module (``aperf._x``, ``aperf.fleet._y``) defines to the namespace's own name."""
    module = namespace["__name__"]
    assert isinstance(module, str)
    for name in namespace["__all__"]:  # type: ignore[attr-defined]
        obj = namespace[name]
        defined_in = getattr(obj, "__module__", "") or ""
        private = any(part.startswith("_") for part in defined_in.split("."))
        if isinstance(obj, type) and defined_in.startswith("aperf.") and private:
            obj.__module__ = module

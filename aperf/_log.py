"""aperf's lifecycle log: structlog when the application configured it, else silent.

Library code never configures logging. An application that configured structlog
gets aperf's events through its own pipeline (``structlog.get_logger("aperf")``).
One that did not would get structlog's default, which prints to stdout, the very
stream a tool like the tracer uses for data; so then aperf's events go to the
standard library logger ``"aperf"`` instead, which has only a NullHandler and
shows them only if the application configures ``logging``.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

_stdlib = logging.getLogger("aperf")
_stdlib.addHandler(logging.NullHandler())
_fallback = structlog.wrap_logger(
    _stdlib,
    processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
    wrapper_class=structlog.stdlib.BoundLogger,
)


class _Log:
    """The logger aperf's modules use; picks its target at each (rare) call."""

    def _target(self) -> Any:
        if structlog.is_configured():
            return structlog.get_logger("aperf")
        return _fallback

    def debug(self, event: str, **fields: Any) -> None:
        self._target().debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._target().info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._target().warning(event, **fields)


log = _Log()

"""The errors aperf.fleet raises on purpose."""

from __future__ import annotations

from .._errors import AperfError


class FleetError(AperfError):
    """Base class of aperf.fleet's errors."""


class FleetConfigError(FleetError, ValueError):
    """The fleet cannot start as configured: no server answers, the server refused the
    credentials, JetStream is off, or the JetStream stream is missing or takes other subjects.

    ``argument`` names the argument to fix (``"servers"``, ``"jetstream"``, ...).
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{message} (check {argument}=)")
        self.argument = argument


class FleetClosedError(FleetError):
    """The sink or reader was closed, or its NATS connection closed for good."""


class FrameError(FleetError, ValueError):
    """A message is not an aperf.fleet frame (wrong magic, version, or truncated)."""

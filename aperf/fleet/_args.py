"""Checks of the arguments users give the sink and the reader: one message per mistake."""

from __future__ import annotations

MAX_NAME_BYTES = 255


def check_name(argument: str, value: object) -> bytes:
    """``value`` as the UTF-8 bytes of a name (1..255 bytes, printable, no spaces)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    raw = value.encode("utf-8")
    if not 1 <= len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"{argument} must be 1..{MAX_NAME_BYTES} bytes of UTF-8, not {value!r}")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise ValueError(f"{argument} must not hold spaces or control characters: {value!r}")
    return raw


def check_int(argument: str, value: object, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(f"{argument} must be an int in {least}..{most}, not {value!r}")
    return value


def check_seconds(argument: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{argument} must be positive seconds, not {value!r}")
    return float(value)

"""Checks of the arguments users give the sink and the reader: one message per mistake."""

from __future__ import annotations

import urllib.parse

MAX_NAME_BYTES = 255


def name_problem(value: str) -> str:
    """What is wrong with ``value`` as a host or stream name ("" if nothing)."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= MAX_NAME_BYTES:
        return f"must be 1..{MAX_NAME_BYTES} bytes of UTF-8, not {size}"
    if any(c.isspace() or not c.isprintable() for c in value):
        return "must not hold spaces or control characters"
    return ""


def check_name(argument: str, value: object) -> bytes:
    """``value`` as the UTF-8 bytes of a name (1..255 bytes, printable, no spaces)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    problem = name_problem(value)
    if problem:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ValueError(f"{argument} {problem}: {shown!r}")
    return value.encode("utf-8")


def url_problem(url: str) -> str:
    """What is wrong with ``url`` as a NATS server URL ("" if nothing), read the way
    nats-py reads it (no scheme: ``nats://``; no port: 4222)."""
    if not any(url.startswith(s) for s in ("nats://", "tls://", "ws://", "wss://")):
        if "://" in url:
            return "its scheme must be nats://, tls://, ws:// or wss://"
        url = f"nats://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # an unclosed [ of an IPv6 address, a port out of range ...
        return str(exc).lower()
    if not parts.hostname:
        return "it names no host"
    if port == 0:
        return "port 0 is not a server's port"
    return ""


def check_int(argument: str, value: object, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ValueError(f"{argument} must be an int in {least}..{most}, not {value!r}")
    return value


def check_seconds(argument: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{argument} must be positive seconds, not {value!r}")
    return float(value)

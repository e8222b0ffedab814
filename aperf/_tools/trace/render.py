"""Events as text: the table line, the JSON record, and raw bytes shown safely.

A process chooses its own ``comm`` (prctl(PR_SET_NAME), /proc/self/comm) and the
name of the file it runs. Neither is text in any encoding the kernel promises,
and either may hold a newline or a terminal escape. Printed as they are, a name
like ``"x\\n12:00:00 EXIT ..."`` forges a line of output (the C tool and BCC's
``execsnoop`` allow it). So the two are taken as raw bytes and escaped:
printable UTF-8 stays as it is, everything else becomes ``\\n``, ``\\x1b``,
``\\xff``, ``\\u202e``..., and a backslash becomes ``\\\\``, so the text maps back
to exactly one byte string.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import aperf

# The printf formats of libbpf-bootstrap's bootstrap_legacy.c, kept as printf formats.
HEADER_FORMAT = "%-8s %-5s %-16s %-7s %-7s %s"
LINE = "%-8s %-5s %-16s %-7d %-7d %s"
HEADER = HEADER_FORMAT % ("TIME", "EVENT", "COMM", "PID", "PPID", "FILENAME/EXIT CODE")

_NAMED = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_BYTE_ESCAPES = range(0xDC80, 0xDD00)  # surrogateescape's stand-ins for undecodable bytes


def _escape_char(char: str) -> str:
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code in _BYTE_ESCAPES:
        return f"\\x{code - 0xDC00:02x}"
    if char.isprintable():
        return char
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape(raw: bytes) -> str:
    """A C string's bytes (cut at the first NUL) as one printable, unambiguous line."""
    text = raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    if text.isprintable() and "\\" not in text:
        return text  # the usual case: nothing to escape
    return "".join(map(_escape_char, text))


def _field(obj: aperf.BPFObject, name: str) -> slice:
    offset, size = obj.get_global(f"event_{name}_offset"), obj.get_global(f"event_{name}_size")
    if not isinstance(offset, int) or not isinstance(size, int):
        raise TypeError(f"the object's event_{name}_offset and _size globals are not integers")
    return slice(offset, offset + size)


def event_decoder(obj: aperf.BPFObject) -> Callable[[bytes], Any]:
    """``struct event`` decoded from ``obj``'s BTF, ``comm`` and ``filename`` escaped.

    The two strings are cut from the sample's raw bytes, where the object's
    ``event_*_offset``/``event_*_size`` globals say (bpf/bootstrap_legacy.bpf.c).
    """
    decode = aperf.decoders.from_btf(obj, "event")
    comm, filename = _field(obj, "comm"), _field(obj, "filename")

    def decode_event(data: bytes) -> Any:
        value = decode(data)  # checks the size first
        return value._replace(comm=escape(data[comm]), filename=escape(data[filename]))

    decode_event.size = decode.size  # type: ignore[attr-defined]  # readers refuse shorter
    return decode_event


def event_kind(value: Any) -> str:
    return "EXIT" if value.exit_event else "EXEC"


def table_line(value: Any, now: datetime.datetime) -> str:
    """One line of the table, formatted as libbpf-bootstrap's printf does."""
    if value.exit_event:
        detail = f"[{value.exit_code}]"
        if value.duration_ns:
            detail += f" ({value.duration_ns // 1_000_000}ms)"
    else:
        detail = value.filename
    return LINE % (
        now.strftime("%H:%M:%S"), event_kind(value), value.comm, value.pid, value.ppid, detail
    )


def json_record(sample: aperf.Sample, now: datetime.datetime) -> dict[str, Any]:
    """The fields of ``struct event`` that apply to its kind, plus when it was read and where.

    An exec has a ``filename`` and no exit code; an exit has ``exit_code`` and
    ``duration_ns`` (``null`` when its exec was not seen) and no filename.
    """
    value = sample.value
    record: dict[str, Any] = {
        "time": now.isoformat(timespec="microseconds"),
        "event": event_kind(value),
        "cpu": sample.cpu,
        "pid": value.pid,
        "ppid": value.ppid,
        "comm": value.comm,
    }
    if value.exit_event:
        record["exit_code"] = value.exit_code
        record["duration_ns"] = value.duration_ns or None
    else:
        record["filename"] = value.filename
    record["exit_event"] = value.exit_event
    record["timestamp_ns"] = value.timestamp_ns  # the kernel's CLOCK_BOOTTIME at the event
    return record

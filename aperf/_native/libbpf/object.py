"""BPF objects (libbpf-rs: ``object.rs``): opening an ELF file, walking its maps and
programs, and the strings C hands over or is handed (names, paths)."""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..._errors import ArgumentError
from . import binding as c


def cstr(raw: bytes | None) -> str:
    # Names come from the ELF file; a hostile one must not make open() fail untyped.
    return raw.decode(errors="replace") if raw else ""


def c_path(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], argument: str) -> bytes:
    """``path`` as the bytes C sees. A NUL byte is refused: C would silently cut the path there."""
    try:
        raw = os.fsencode(path)
    except TypeError:
        raise TypeError(
            f"{argument} must be a path (str, bytes or os.PathLike), not {type(path).__name__}"
        ) from None
    if b"\0" in raw:
        raise ArgumentError(
            argument, f"{argument} {os.fsdecode(raw)!r} contains a NUL byte (C would cut it there)"
        )
    return raw


def open_object(path: bytes) -> int:
    return int(c.bpf_object__open_file(path, None))


def iter_maps(obj: int) -> Iterator[int]:
    cur = c.bpf_object__next_map(obj, None)
    while cur:
        yield int(cur)
        cur = c.bpf_object__next_map(obj, cur)


def iter_programs(obj: int) -> Iterator[int]:
    cur = c.bpf_object__next_program(obj, None)
    while cur:
        yield int(cur)
        cur = c.bpf_object__next_program(obj, cur)

"""Decoders from ctypes structures and struct formats, and what every decoder is.

Pure Python: BTF decoders are compiled in ``_btf.py``. Every decoder is a
callable ``bytes -> value`` that reads the type's own size from the start of
the sample (the kernel pads samples, see docs/decoding.md)
and raises ``ValueError`` when the sample is shorter than the type. Decoded
records are named tuples: immutable, attribute access, a readable repr, built
at C speed, equal to plain tuples, and ``_asdict()`` for JSON.
"""

from __future__ import annotations

import struct
from collections import namedtuple
from collections.abc import Callable
from typing import Any

Decoder = Callable[[bytes], Any]


def c_string(raw: bytes) -> str:
    """A C ``char[N]``: cut at the first NUL, invalid UTF-8 replaced (never raises)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class SizedDecoder:
    """A decoder of fixed-size records: ``size`` bytes unpacked by ``fmt``, then built."""

    def __init__(
        self,
        name: str,
        fmt: struct.Struct,
        build: Callable[[tuple[Any, ...]], Any] | None,
        build_many: Callable[[list[bytes]], list[Any]] | None = None,
    ) -> None:
        self.name = name
        self.size = fmt.size
        self.struct = fmt
        self.build = build
        self._build_many = build_many
        unpack_from = fmt.unpack_from
        size = fmt.size
        if build is None:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return unpack_from(data)
        else:

            def decode(data: bytes) -> Any:
                if len(data) < size:
                    raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
                return build(unpack_from(data))

        self._decode = decode

    def decode_many(self, payloads: list[bytes]) -> list[Any]:
        """Decode payloads already known to be long enough, at C speed where possible."""
        if self._build_many is not None:
            return self._build_many(payloads)
        unpacked = map(self.struct.unpack_from, payloads)
        return list(unpacked if self.build is None else map(self.build, unpacked))

    def __call__(self, data: bytes) -> Any:
        return self._decode(data)

    def __repr__(self) -> str:
        return f"<aperf decoder {self.name} ({self.size} bytes)>"


# --- struct formats -----------------------------------------------------------------


def from_struct(fmt: struct.Struct | str, names: str | list[str] | None = None) -> SizedDecoder:
    """Decode with a ``struct`` format; with ``names``, into a named tuple ``Record``."""
    packed = fmt if isinstance(fmt, struct.Struct) else struct.Struct(fmt)
    if names is None:
        return SizedDecoder(f"struct {packed.format!r}", packed, None)
    record = namedtuple("Record", names, rename=True)  # type: ignore[misc]
    return SizedDecoder(f"struct {packed.format!r}", packed, record._make)


# --- ctypes structures (duck-typed: ctypes itself stays in aperf._libbpf) ---------------


def is_ctypes_structure(spec: object) -> bool:
    return (
        isinstance(spec, type)
        and hasattr(spec, "_fields_")
        and hasattr(spec, "from_buffer_copy")
    )


def from_ctypes(cls: type) -> Decoder:
    """Decode into a named tuple with the fields of a ``ctypes.Structure`` subclass.

    ``char`` arrays become ``str`` (cut at NUL), other arrays tuples, nested
    structures named tuples: the same values a BTF decoder gives for the C type.
    """
    size = memoryview(cls()).nbytes
    name = cls.__name__

    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            return c_string(value)
        if is_ctypes_structure(type(value)):
            return record_of(value)
        if hasattr(value, "_length_") and hasattr(value, "_type_"):
            return tuple(convert(v) for v in value)
        return value

    records: dict[type, Any] = {}

    def record_of(instance: Any) -> Any:
        kind = type(instance)
        record: Any = records.get(kind)
        names = [f[0] for f in kind._fields_]
        if record is None:
            record = records[kind] = namedtuple(kind.__name__, names, rename=True)
        return record._make(convert(getattr(instance, n)) for n in names)

    def decode(data: bytes) -> Any:
        if len(data) < size:
            raise ValueError(f"{name} needs {size} bytes, the sample has {len(data)}")
        return record_of(cls.from_buffer_copy(data[:size]))  # type: ignore[attr-defined]

    return decode

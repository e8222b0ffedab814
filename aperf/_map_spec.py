"""What every map-backed ring source does first: turn what the user passed (an
``aperf.Map``, a map fd, a pinned path) into an fd of its own, and check the
kernel's facts about it. (The claim that keeps a second reader off a map is
``_perf_source.MapBackedSource``'s.)
"""

from __future__ import annotations

import os

from . import _libbpf as lb
from ._errors import ClosedResourceError, LibbpfError, MapTypeError
from ._map_types import map_type_name
from ._object import Map

MapSource = Map | int | str | os.PathLike[str]
"""What ``PerfStream``/``PerfBuffer`` accept besides a ring source: a map, its fd, a pinned path."""

BPF_MAP_TYPE_PERF_EVENT_ARRAY = 4
BPF_MAP_TYPE_RINGBUF = 27
READABLE_TYPES = "BPF_MAP_TYPE_PERF_EVENT_ARRAY (4) and BPF_MAP_TYPE_RINGBUF (27)"


def check_map_source(source: object) -> MapSource:
    if isinstance(source, bool) or not isinstance(source, Map | int | str | os.PathLike):
        raise TypeError(
            "source must be an aperf.Map, a map fd (int), a pinned map path or a ring "
            f"source, not {type(source).__name__}"
        )
    return source


def source_name(source: MapSource) -> str:
    if isinstance(source, Map):
        return source.name
    return f"fd {source}" if isinstance(source, int) else os.fspath(source)


def open_map_fd(source: MapSource) -> int:
    """An fd of our own for the map (the caller closes it)."""
    if isinstance(source, Map):
        if source.closed:
            raise ClosedResourceError(f"map {source.name!r} belongs to a closed BPFObject")
        return os.dup(source.fd)
    if isinstance(source, int):
        try:
            return os.dup(source)
        except OSError as exc:
            raise ClosedResourceError(f"map fd {source} is not open ({exc.strerror})") from None
    path = os.fspath(source)
    try:
        return lb.pinned_object_fd(path, argument="source")
    except LibbpfError as exc:
        exc.detail = f"opening pinned map {path!r}"
        raise


def map_facts(fd: int, name: str) -> lb.MapInfo:
    """The kernel's facts about the map behind ``fd``; MapTypeError if it is no BPF map."""
    try:
        os.fstat(fd)
    except OSError:
        raise ClosedResourceError(f"{name}: fd {fd} is not open") from None
    kind = lb.object_kind(fd)
    if kind != "map":
        what = f"a BPF {kind}" if kind else "not a BPF object"
        raise MapTypeError(f"{name} is not a BPF map ({what}); aperf reads {READABLE_TYPES} maps")
    return lb.map_info(fd)


def map_type_of(source: MapSource) -> int | None:
    """The map's type, or None when it cannot be told now (the source's open says why)."""
    if isinstance(source, Map):
        return source.type
    try:
        fd = open_map_fd(source)
    except (OSError, ClosedResourceError):
        return None
    try:
        return map_facts(fd, source_name(source)).type
    except (OSError, MapTypeError, ClosedResourceError):
        return None
    finally:
        os.close(fd)


def require_type(facts: lb.MapInfo, name: str, wanted: int, what: str) -> None:
    if facts.type != wanted:
        raise MapTypeError(
            f"map {name} is a {map_type_name(facts.type)} (type {facts.type}), not {what} "
            f"({map_type_name(wanted)}); aperf reads {READABLE_TYPES} maps"
        )

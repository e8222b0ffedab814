"""What the kernel says of the BPF object behind an fd: its kind, its id, a map's facts
(libbpf-rs: ``query.rs``)."""

from __future__ import annotations

import ctypes
import errno
import os

from ..._errors import ClosedResourceError, LibbpfError
from ..prototypes import MapInfo, read_map_info
from . import binding as c

_ANON_INODE_KINDS = {
    "anon_inode:bpf-map": "map", "anon_inode:bpf-prog": "prog", "anon_inode:bpf_link": "link",
}


def object_kind(fd: int) -> str:
    """The kind of BPF object behind ``fd``: ``map``, ``prog``, ``link``, or "" if none."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")  # cheaper than reading fdinfo
    except FileNotFoundError:
        raise ClosedResourceError(f"fd {fd} is not open") from None
    return _ANON_INODE_KINDS.get(target, "")


class _bpf_info_head(ctypes.Structure):
    # What bpf_map_info, bpf_prog_info and bpf_link_info all start with.
    _fields_ = (("type", ctypes.c_uint32), ("id", ctypes.c_uint32))


def object_id(fd: int) -> tuple[str, int]:
    """("map" | "prog" | "link", kernel id) of the BPF object behind ``fd``."""
    kind = object_kind(fd)
    if not kind:
        raise LibbpfError(errno.EINVAL, "bpf_obj_get_info_by_fd", f"fd {fd} is no BPF object")
    head = _bpf_info_head()
    size = ctypes.c_uint32(ctypes.sizeof(head))
    c.bpf_obj_get_info_by_fd(fd, ctypes.byref(head), ctypes.byref(size))
    return kind, int(head.id)


class _bpf_map_info(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
    )


def map_info(fd: int) -> MapInfo:
    """What the kernel says of the BPF map behind ``fd`` (EINVAL if it is not a map)."""
    # bpf_obj_get_info_by_fd() fills a program's or link's info just as well,
    # which this struct would misread as a map's.
    if object_kind(fd) != "map":
        raise LibbpfError(errno.EINVAL, "bpf_obj_get_info_by_fd", f"fd {fd} is not a BPF map")
    return read_map_info(fd, _bpf_map_info(), c.bpf_obj_get_info_by_fd)

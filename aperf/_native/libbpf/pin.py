"""Pinning: BPF objects at paths in the BPF filesystem, and why a path will not do."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..._errors import LibbpfError, PinnedPathError
from ..libc.functions import libc_function
from . import binding as c
from .object import c_path
from .query import object_id

BPF_FS_MAGIC = 0xCAFE4A11


def _on_bpffs(path: bytes) -> bool | None:
    """Whether ``path`` lies on a BPF filesystem (None: it cannot be looked up)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on x86-64, f_type first
    if libc_function("statfs", ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(path, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == BPF_FS_MAGIC


_NOT_BPFFS = (
    "is not on a BPF filesystem: pinned BPF objects live in a bpffs mount "
    "(mount -t bpf bpf /sys/fs/bpf)"
)


@contextmanager
def _explained_by_path(path: bytes, why: Callable[[bytes, int], str | None]) -> Iterator[None]:
    """Re-raise a libbpf failure as PinnedPathError when ``why`` finds the path at fault."""
    try:
        yield
    except LibbpfError as exc:
        err = exc.errno or 0
        reason = why(path, err)
        if reason is None:
            raise
        raise PinnedPathError(os.fsdecode(path), reason, err, exc.function) from None


def _why_not_pinned(path: bytes, err: int) -> str | None:
    """Why bpf_obj_get() refused ``path``, when the path itself says (None: errno says it)."""
    if not os.path.lexists(path):
        return None
    on_bpffs = _on_bpffs(path)
    if on_bpffs is False:
        return _NOT_BPFFS
    if os.path.isdir(path):
        return "is a directory, not a pinned BPF object"
    if on_bpffs and (os.geteuid() == 0 or err not in (errno.EPERM, errno.EACCES)):
        return "is not a pinned BPF map, program or link"
    return None  # not root and refused: a privilege problem after all


def pinned_object_fd(
    path: str | bytes | os.PathLike[str] | os.PathLike[bytes], argument: str = "path"
) -> int:
    """A new fd of the BPF object pinned at ``path`` (the caller closes it).

    ``ArgumentError`` for a NUL byte in ``path``; ``PinnedPathError``
    when ``path`` exists but holds no pinned object (not bpffs, a directory).
    """
    raw = c_path(path, argument)
    with _explained_by_path(raw, _why_not_pinned):
        fd = int(c.bpf_obj_get(raw))
    return fd


def _why_not_pinnable(path: bytes, err: int) -> str | None:
    """Why bpf_obj_pin() refused ``path``, when the path itself says (None: errno says it)."""
    if err == errno.EEXIST:
        return "already exists (unpin it first, or choose another path)"
    parent = os.path.dirname(path) or b"."
    if not os.path.isdir(parent):
        return "is in a directory that does not exist (create it in bpffs first)"
    if _on_bpffs(parent) is False:
        return _NOT_BPFFS
    return None


def pin_object(fd: int, path: bytes) -> None:
    """Pin the BPF object behind ``fd`` at ``path`` (checked by ``c_path()``).

    Through ``bpf_obj_pin`` rather than ``bpf_map__pin``: libbpf keeps the path
    of a failed pin in the map, which fails every later pin elsewhere and makes
    ``bpf_object__load`` pin (or reuse a stale map) there.
    """
    with _explained_by_path(path, _why_not_pinnable):
        c.bpf_obj_pin(fd, path)


def unpin_object(fd: int, path: bytes, what: str) -> None:
    """Remove the pin at ``path`` if it is the object behind ``fd`` (never another one's pin)."""
    pinned = pinned_object_fd(path)
    try:
        if object_id(pinned) != object_id(fd):
            raise PinnedPathError(
                os.fsdecode(path), f"holds another BPF object than {what}; left in place",
                errno.EINVAL, "bpf_obj_get",
            )
    finally:
        os.close(pinned)
    os.unlink(path)

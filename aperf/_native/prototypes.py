"""C prototypes declared once, bound on first call, for every library aperf loads.

A ``Prototype`` names a C function, its ctypes ``restype``/``argtypes``
and an ``errcheck``; it looks the function up in its library only when first
called, so importing aperf loads no library at all (libbpf on Linux,
``ebpfapi.dll`` on Windows). Each binding (``libbpf/``, ``ebpfapi/``) gives
its own library loader, "function missing" error and typed error to one
``Declarations``, whose factories (``int_fn``, ``ptr_fn``, ``plain_fn``) follow
libbpf's calling conventions.

Both bindings also read a map's facts the same way (``MapInfo``,
``read_map_info``), each with its own ``bpf_map_info`` layout.

A Python callback called by C cannot raise through C: it parks its exception
here (per thread) and the errcheck of the C call that invoked it re-raises it.
"""

from __future__ import annotations

import ctypes
import errno
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ErrCheck = Callable[[Any, Any, tuple[Any, ...]], Any]
ErrorFor = Callable[[int, str], Exception]
"""The typed error for a (positive) errno and the C function's name."""


class _CallbackErrors(threading.local):
    def __init__(self) -> None:
        self.pending: BaseException | None = None


callback_errors = _CallbackErrors()


def park_callback_error(exc: BaseException) -> None:
    """Keep the first exception a Python callback raised while C held the stack."""
    if callback_errors.pending is None:
        callback_errors.pending = exc


def raise_parked() -> None:
    """Re-raise the exception a callback parked during the C call that just returned."""
    exc = callback_errors.pending
    if exc is not None:
        callback_errors.pending = None
        raise exc


class Prototype:
    """A C function of ``library()``, declared now and bound lazily on first call."""

    def __init__(
        self,
        library: Callable[[], Any],
        missing: Callable[[str], Exception],
        name: str,
        restype: Any,
        argtypes: Sequence[Any],
        errcheck: ErrCheck,
    ) -> None:
        self.name = name
        self._library = library
        self._missing = missing
        self._restype = restype
        self._argtypes = list(argtypes)
        self._errcheck = errcheck
        self._fn: Any = None

    def __call__(self, *args: Any) -> Any:
        fn = self._fn
        if fn is None:
            fn = self._bind()
        return fn(*args)

    def _bind(self) -> Any:
        try:
            fn = getattr(self._library(), self.name)
        except AttributeError:
            raise self._missing(self.name) from None
        fn.restype = self._restype
        fn.argtypes = self._argtypes
        fn.errcheck = self._errcheck
        self._fn = fn
        return fn


# --- the errchecks of the libbpf calling conventions (libbpf, and ebpfapi's libbpf API) ---


def check_negative(error_for: ErrorFor) -> ErrCheck:
    """For functions returning ``int``: negative is ``-errno``."""

    def check(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
        raise_parked()
        if result < 0:
            raise error_for(-result, func.__name__)
        return result

    return check


def check_null(error_for: ErrorFor) -> ErrCheck:
    """For functions returning a pointer: NULL is a failure, with ``errno`` set."""

    def check(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
        raise_parked()
        if not result:
            raise error_for(ctypes.get_errno() or errno.EINVAL, func.__name__)
        return result

    return check


def check_nothing(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    """No error convention (getters, iterators, void): only re-raise callback errors."""
    raise_parked()
    return result


class Declarations:
    """The prototype factories of one library that follows libbpf's calling conventions:
    its loader, its "function missing" error and its typed error, given once."""

    def __init__(
        self, library: Callable[[], Any], missing: Callable[[str], Exception],
        error_for: ErrorFor,
    ) -> None:
        self._library = library
        self._missing = missing
        self._check_negative = check_negative(error_for)
        self._check_null = check_null(error_for)

    def declare(
        self, name: str, restype: Any, argtypes: Sequence[Any], errcheck: ErrCheck
    ) -> Prototype:
        """A function declared now, bound on first call (importing aperf loads nothing)."""
        return Prototype(self._library, self._missing, name, restype, argtypes, errcheck)

    def int_fn(self, name: str, *argtypes: Any) -> Prototype:
        """A function returning ``int``: negative is ``-errno``."""
        return self.declare(name, ctypes.c_int, argtypes, self._check_negative)

    def ptr_fn(self, name: str, *argtypes: Any) -> Prototype:
        """A function returning a pointer: NULL means failure, with ``errno`` set."""
        return self.declare(name, ctypes.c_void_p, argtypes, self._check_null)

    def plain_fn(self, name: str, restype: Any, *argtypes: Any) -> Prototype:
        """A function with no error convention (a getter, an iterator, or void)."""
        return self.declare(name, restype, argtypes, check_nothing)


# --- map facts: one shape for libbpf's and eBPF for Windows' bpf_map_info ---


@dataclass(frozen=True)
class MapInfo:
    """The kernel's facts about a BPF map (``bpf_map_info``), as both bindings read them."""

    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def read_map_info(fd: int, info: Any, get_info: Any) -> MapInfo:
    """``get_info`` (a ``bpf_obj_get_info_by_fd``) into ``info`` (its ``bpf_map_info``)."""
    size = ctypes.c_uint32(ctypes.sizeof(info))
    get_info(fd, ctypes.byref(info), ctypes.byref(size))
    return MapInfo(
        type=info.type,
        id=info.id,
        key_size=info.key_size,
        value_size=info.value_size,
        max_entries=info.max_entries,
        flags=info.map_flags,
        name=info.name.decode(errors="replace"),
    )

"""Loading eBPF for Windows (``ebpfapi.dll``) and ``kernel32``, and declaring, once,
every C function aperf calls in them.

As in ``libbpf/binding.py``: each prototype is made by a factory that sets
``argtypes``, ``restype`` and an ``errcheck``; the errcheck turns the function's
failure convention into a typed error carrying errno (or the Windows error
code) and the function's name, and re-raises what a Python callback raised
while C was running. Nothing is loaded at import: only a first call loads a
library, so importing aperf on Linux never looks for the DLL.

The declarations were written from microsoft/ebpf-for-windows at commit
0be2d1c3f36cf85146faa21df3550b6a92712545 (2026-08-22), the newest stored; the
perf buffer ones come from PR #4966 (merged as 6926e944907d, 2026-02-27):

- ``include/bpf/libbpf.h`` (unchanged since 6926e944): ``perf_buffer_sample_fn``,
  ``perf_buffer_lost_fn``, ``perf_buffer__new``, ``perf_buffer__consume_buffer``,
  ``perf_buffer__buffer_cnt``, ``perf_buffer__free``
- ``include/ebpf_api.h``: ``ebpf_handle_t`` (intptr_t), ``fd_t`` (int32_t),
  ``ebpf_perf_buffer_get_wait_handle``, ``ebpf_close_fd``, ``ebpf_duplicate_fd``,
  ``ebpf_map_set_wait_handle``
- ``include/bpf/bpf.h``: ``bpf_obj_get``, ``bpf_obj_get_info_by_fd``
- ``include/ebpf_structs.h``: ``struct bpf_map_info`` (Windows layout),
  ``BPF_MAP_TYPE_PERF_EVENT_ARRAY = 14``
- ``include/ebpf_result.h``: ``ebpf_result_t`` codes
- ``ebpfapi/Source.def``: every name below is exported

Tests load stand-ins through ``APERF_EBPFAPI`` and ``APERF_KERNEL32`` (paths of
shared libraries exporting the same names; see ``tests/windows/``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..._errors import (
    LibbpfError,
    LibbpfUnavailableError,
    MissingPrivilegesError,
    Win32Error,
)
from ..prototypes import Declarations, ErrCheck, Prototype, raise_parked

EBPFAPI_ENV = "APERF_EBPFAPI"
"""Path of the ``ebpfapi`` library to load instead of the installed ``ebpfapi.dll``."""
KERNEL32_ENV = "APERF_KERNEL32"
"""Path of a library standing in for ``kernel32`` (tests on Linux only)."""

INSTALL_HINT = (
    "aperf on Windows needs eBPF for Windows (ebpfapi.dll, with the synchronous perf buffer "
    "API of ebpf-for-windows PR #4966): install its MSI, or point APERF_EBPFAPI at ebpfapi.dll"
)

BPF_MAP_TYPE_PERF_EVENT_ARRAY = 14  # ebpf_structs.h; Linux's is 4
EBPF_HANDLE_INVALID = -1  # ebpf_core_structs.h: (ebpf_handle_t)-1
BPF_OBJ_NAME_LEN = 64  # ebpf_structs.h (Linux: 16)

# ebpf_result.h codes, and the errno ebpf_result_to_errno() gives them (api_common.hpp).
_RESULT_ERRNO = {
    4: _errno.EBADF,  # EBPF_INVALID_FD
    5: _errno.EINVAL,  # EBPF_INVALID_OBJECT
    6: _errno.EINVAL,  # EBPF_INVALID_ARGUMENT
    7: _errno.ENOENT,  # EBPF_OBJECT_NOT_FOUND
    8: _errno.EEXIST,  # EBPF_OBJECT_ALREADY_EXISTS
    9: _errno.ENOENT,  # EBPF_FILE_NOT_FOUND
    12: _errno.ENOMEM,  # EBPF_NO_MEMORY
    20: _errno.EACCES,  # EBPF_ACCESS_DENIED
}

# kernel32 constants (winbase.h / winerror.h)
INFINITE = 0xFFFFFFFF
WAIT_OBJECT_0 = 0x0
WAIT_ABANDONED_0 = 0x80
WAIT_TIMEOUT = 0x102
WAIT_FAILED = 0xFFFFFFFF
MAXIMUM_WAIT_OBJECTS = 64


# --- loading ----------------------------------------------------------------------


def _default_ebpfapi() -> str:
    if sys.platform != "win32":
        raise LibbpfUnavailableError(
            f"eBPF for Windows exists on Windows only; here aperf reads perf event arrays "
            f"through libbpf (set {EBPFAPI_ENV} to load a stand-in for tests)"
        )
    # Python 3.8+ does not search PATH for a bare DLL name; find_library does.
    found = ctypes.util.find_library("ebpfapi")
    if found:
        return found
    program_files = os.environ.get("PROGRAMFILES", r"C:\Program Files")
    return os.path.join(program_files, "ebpf-for-windows", "ebpfapi.dll")


def _load_ebpfapi() -> ctypes.CDLL:
    path = os.environ.get(EBPFAPI_ENV) or _default_ebpfapi()
    try:
        return ctypes.CDLL(path, use_errno=True)
    except OSError as exc:
        raise LibbpfUnavailableError(f"cannot load {path!r} ({exc}); {INSTALL_HINT}") from None


def _load_kernel32() -> ctypes.CDLL:
    path = os.environ.get(KERNEL32_ENV)
    if path:
        return ctypes.CDLL(path, use_errno=True)
    if sys.platform != "win32":
        raise LibbpfUnavailableError(
            f"kernel32 exists on Windows only (set {KERNEL32_ENV} to load a stand-in for tests)"
        )
    return ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined,unused-ignore]


class _Lazy:
    """A library loaded on first use, once."""

    def __init__(self, load: Callable[[], ctypes.CDLL]) -> None:
        self._load = load
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()

    def __call__(self) -> ctypes.CDLL:
        if self._lib is None:
            with self._lock:
                if self._lib is None:
                    self._lib = self._load()
        return self._lib


ebpfapi = _Lazy(_load_ebpfapi)
kernel32 = _Lazy(_load_kernel32)


def last_error() -> int:
    """``GetLastError()`` of the last kernel32 call on this thread.

    ctypes saves it right after the call on Windows (``use_last_error``); a
    stand-in library for tests reports it through errno instead.
    """
    if os.environ.get(KERNEL32_ENV) or sys.platform != "win32":
        return ctypes.get_errno()
    return ctypes.get_last_error()  # type: ignore[attr-defined,no-any-return,unused-ignore]


# --- errors -----------------------------------------------------------------------


def error_for(err: int, function: str, detail: str = "") -> LibbpfError:
    """The typed error for an ebpfapi failure with this (positive) errno."""
    if err in (_errno.EPERM, _errno.EACCES):
        return MissingPrivilegesError(err, function, detail)
    return LibbpfError(err, function, detail)




def _check_result(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    raise_parked()
    if result != 0:
        err = _RESULT_ERRNO.get(result, _errno.EIO)
        raise error_for(err, func.__name__, f"ebpf_result_t {result}")
    return result


def _check_bool(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    if not result:
        raise Win32Error(last_error(), func.__name__)
    return result


def _check_handle(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    if not result:
        raise Win32Error(last_error(), func.__name__)
    return int(result)


def _check_wait(result: Any, func: Any, args: tuple[Any, ...]) -> Any:
    if result == WAIT_FAILED:
        raise Win32Error(last_error(), func.__name__)
    return result


def _ebpfapi_missing(name: str) -> Exception:
    return LibbpfUnavailableError(
        f"the loaded ebpfapi has no {name}() (it predates the synchronous perf buffer API "
        f"of ebpf-for-windows PR #4966); {INSTALL_HINT}"
    )


def _kernel32_missing(name: str) -> Exception:
    return LibbpfUnavailableError(f"the loaded kernel32 has no {name}()")


# ptr_fn's errno is the CRT's: ebpfapi.dll and Python must share the UCRT for it to arrive.
_ebpfapi = Declarations(ebpfapi, _ebpfapi_missing, error_for)
int_fn, ptr_fn, plain_fn = _ebpfapi.int_fn, _ebpfapi.ptr_fn, _ebpfapi.plain_fn


def _win(name: str, restype: Any, argtypes: Sequence[Any], errcheck: ErrCheck) -> Prototype:
    return Prototype(kernel32, _kernel32_missing, name, restype, argtypes, errcheck)


def result_fn(name: str, *argtypes: Any) -> Prototype:
    """An ebpfapi function returning ``ebpf_result_t``: nonzero is a failure."""
    return _ebpfapi.declare(name, ctypes.c_int, argtypes, _check_result)


# --- ebpfapi.dll: the synchronous perf buffer (PR #4966) ---------------------------------

fd_t = ctypes.c_int32
ebpf_handle_t = ctypes.c_ssize_t  # intptr_t

# typedef void (*perf_buffer_sample_fn)(void* ctx, int cpu, void* data, __u32 size);
PERF_SAMPLE_FN = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32
)
# typedef void (*perf_buffer_lost_fn)(void* ctx, int cpu, __u64 cnt);
PERF_LOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64)

# struct perf_buffer* perf_buffer__new(int map_fd, size_t page_cnt, perf_buffer_sample_fn,
#     perf_buffer_lost_fn, void* ctx, const struct perf_buffer_opts* opts);
perf_buffer__new = ptr_fn(
    "perf_buffer__new",
    ctypes.c_int,
    ctypes.c_size_t,
    PERF_SAMPLE_FN,
    PERF_LOST_FN,
    ctypes.c_void_p,
    ctypes.c_void_p,
)
# int perf_buffer__consume_buffer(struct perf_buffer* pb, size_t buf_idx);
perf_buffer__consume_buffer = int_fn(
    "perf_buffer__consume_buffer", ctypes.c_void_p, ctypes.c_size_t
)
# size_t perf_buffer__buffer_cnt(const struct perf_buffer* pb);
perf_buffer__buffer_cnt = plain_fn("perf_buffer__buffer_cnt", ctypes.c_size_t, ctypes.c_void_p)
# void perf_buffer__free(struct perf_buffer* pb);
perf_buffer__free = plain_fn("perf_buffer__free", None, ctypes.c_void_p)
# ebpf_handle_t ebpf_perf_buffer_get_wait_handle(const struct perf_buffer* pb);
ebpf_perf_buffer_get_wait_handle = plain_fn(
    "ebpf_perf_buffer_get_wait_handle", ebpf_handle_t, ctypes.c_void_p
)

# --- ebpfapi.dll: the synchronous ring buffer (mapped memory, one wait handle) ------------

BPF_MAP_TYPE_RINGBUF = 13  # ebpf_structs.h; Linux's is 27

# typedef int (*ring_buffer_sample_fn)(void* ctx, void* data, size_t size);
RING_SAMPLE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

# struct ring_buffer* ring_buffer__new(int map_fd, ring_buffer_sample_fn sample_cb, void* ctx,
#     const struct ring_buffer_opts* opts);  (synchronous unless opts ask for callbacks)
ring_buffer__new = ptr_fn(
    "ring_buffer__new", ctypes.c_int, RING_SAMPLE_FN, ctypes.c_void_p, ctypes.c_void_p
)
# void ring_buffer__free(struct ring_buffer* rb);
ring_buffer__free = plain_fn("ring_buffer__free", None, ctypes.c_void_p)
# ebpf_result_t ebpf_ring_buffer_get_buffer(struct ring_buffer* rb, uint32_t index,
#     ebpf_ring_buffer_consumer_page_t** consumer_page,
#     const ebpf_ring_buffer_producer_page_t** producer_page, const uint8_t** data,
#     uint64_t* data_size);
ebpf_ring_buffer_get_buffer = result_fn(
    "ebpf_ring_buffer_get_buffer",
    ctypes.c_void_p,
    ctypes.c_uint32,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_uint64),
)
# ebpf_handle_t ebpf_ring_buffer_get_wait_handle(struct ring_buffer* rb);
ebpf_ring_buffer_get_wait_handle = plain_fn(
    "ebpf_ring_buffer_get_wait_handle", ebpf_handle_t, ctypes.c_void_p
)

# --- ebpfapi.dll: maps and fds ---------------------------------------------------------

# int bpf_obj_get(const char* pathname);
bpf_obj_get = int_fn("bpf_obj_get", ctypes.c_char_p)
# int bpf_obj_get_info_by_fd(int bpf_fd, void* info, __u32* info_len);
bpf_obj_get_info_by_fd = int_fn(
    "bpf_obj_get_info_by_fd", ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)
)
# ebpf_result_t ebpf_duplicate_fd(fd_t fd, fd_t* dup);
ebpf_duplicate_fd = result_fn("ebpf_duplicate_fd", fd_t, ctypes.POINTER(fd_t))
# ebpf_result_t ebpf_close_fd(fd_t fd);
ebpf_close_fd = result_fn("ebpf_close_fd", fd_t)
# ebpf_result_t ebpf_map_set_wait_handle(fd_t map_fd, uint64_t index, ebpf_handle_t handle);
ebpf_map_set_wait_handle = result_fn(
    "ebpf_map_set_wait_handle", fd_t, ctypes.c_uint64, ebpf_handle_t
)


class bpf_map_info(ctypes.Structure):
    """``struct bpf_map_info`` as eBPF for Windows lays it out (ebpf_structs.h)."""

    _fields_ = (
        ("id", ctypes.c_uint32),
        ("type", ctypes.c_uint32),  # ebpf_map_type_t
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("name", ctypes.c_char * BPF_OBJ_NAME_LEN),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_id", ctypes.c_uint32),
        ("pinned_path_count", ctypes.c_uint32),
    )


# --- kernel32: events and waits ----------------------------------------------------------

HANDLE = ctypes.c_void_p

# HANDLE CreateEventW(LPSECURITY_ATTRIBUTES, BOOL bManualReset, BOOL bInitialState, LPCWSTR);
CreateEventW = _win(
    "CreateEventW", HANDLE, (ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p),
    _check_handle,
)
# BOOL SetEvent(HANDLE); BOOL ResetEvent(HANDLE); BOOL CloseHandle(HANDLE);
SetEvent = _win("SetEvent", ctypes.c_int, (HANDLE,), _check_bool)
ResetEvent = _win("ResetEvent", ctypes.c_int, (HANDLE,), _check_bool)
CloseHandle = _win("CloseHandle", ctypes.c_int, (HANDLE,), _check_bool)
# DWORD WaitForSingleObject(HANDLE, DWORD dwMilliseconds);
WaitForSingleObject = _win(
    "WaitForSingleObject", ctypes.c_uint32, (HANDLE, ctypes.c_uint32), _check_wait
)
# DWORD WaitForMultipleObjects(DWORD nCount, const HANDLE*, BOOL bWaitAll, DWORD dwMilliseconds);
WaitForMultipleObjects = _win(
    "WaitForMultipleObjects",
    ctypes.c_uint32,
    (ctypes.c_uint32, ctypes.POINTER(HANDLE), ctypes.c_int, ctypes.c_uint32),
    _check_wait,
)

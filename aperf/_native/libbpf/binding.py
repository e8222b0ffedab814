"""Loading libbpf and declaring, once, every C function aperf calls.

Every prototype is made by a small factory that sets ``argtypes``, a ctypes
``restype`` and an ``errcheck``; the errcheck turns a NULL or negative return
into a ``LibbpfError`` carrying errno and the function's name, and
re-raises any exception that a Python callback raised while C was running
(the prototype and the parking are shared with ``ebpfapi``, in ``prototypes``).
Nothing outside this subpackage touches ctypes prototypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
import sys
import threading

from ..._errors import LibbpfError, LibbpfUnavailableError, MissingPrivilegesError
from ..prototypes import Declarations
from ..prototypes import park_callback_error as park_callback_error  # for the callbacks

LIBBPF_ENV = "APERF_LIBBPF"
"""Environment variable naming the libbpf shared library to load instead of ``libbpf.so.1``."""

MIN_VERSION = (1, 0)
INSTALL_HINT = (
    "aperf needs libbpf >= 1.0: install it with 'apt-get install libbpf1' "
    "(Debian 12 / Ubuntu 22.10 and later), or point APERF_LIBBPF at a libbpf.so.1"
)

_PERMISSION_ERRNOS = {_errno.EPERM, _errno.EACCES}


LIBBPF_ERRNO_BASE = 4000  # libbpf's own error codes (LIBBPF_ERRNO__FORMAT, ...) start here


def error_for(err: int, function: str, detail: str = "") -> LibbpfError:
    """The typed error for a libbpf failure with this (positive) errno."""
    if err in _PERMISSION_ERRNOS:
        return MissingPrivilegesError(err, function, detail)
    message = None
    if LIBBPF_ERRNO_BASE <= err < LIBBPF_ERRNO_BASE + 100:
        buf = ctypes.create_string_buffer(256)
        if libbpf_strerror(err, buf, len(buf)) == 0:
            message = buf.value.decode(errors="replace")
    return LibbpfError(err, function, detail, message)


def _load_library() -> ctypes.CDLL:
    if sys.platform == "win32" and not os.environ.get(LIBBPF_ENV):
        # eBPF for Windows has its own loader (ebpfapi.dll, _native/ebpfapi); never libbpf.so.1.
        raise LibbpfUnavailableError(
            "aperf.BPFObject needs libbpf and runs on Linux only; on Windows load the program "
            "with eBPF for Windows and pass the perf event array's fd or pinned path to "
            "aperf.PerfStream/PerfBuffer (see docs/windows.md)"
        )
    path = os.environ.get(LIBBPF_ENV) or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(path, use_errno=True)
    except OSError as exc:
        raise LibbpfUnavailableError(f"cannot load {path!r} ({exc}); {INSTALL_HINT}") from None
    # Checked on the raw library here, before the prototypes below can bind to it.
    try:
        get_major = lib.libbpf_major_version
        get_minor = lib.libbpf_minor_version
    except AttributeError:
        raise LibbpfUnavailableError(
            f"{path!r} is not libbpf 1.x (it has no libbpf_major_version); {INSTALL_HINT}"
        ) from None
    get_major.restype = ctypes.c_uint32
    get_major.argtypes = []
    get_minor.restype = ctypes.c_uint32
    get_minor.argtypes = []
    version = (int(get_major()), int(get_minor()))
    if version < MIN_VERSION:
        raise LibbpfUnavailableError(
            f"{path!r} is libbpf {version[0]}.{version[1]}, too old; {INSTALL_HINT}"
        )
    return lib


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The loaded libbpf, loaded and version-checked on first use."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                _lib = _load_library()
    return _lib


# --- prototype factories ------------------------------------------------------

def _missing(name: str) -> Exception:
    return LibbpfUnavailableError(f"the loaded libbpf has no {name}(); {INSTALL_HINT}")


_libbpf = Declarations(library, _missing, error_for)
int_fn, ptr_fn, plain_fn = _libbpf.int_fn, _libbpf.ptr_fn, _libbpf.plain_fn


def version() -> tuple[int, int]:
    """libbpf's (major, minor) version."""
    return (int(libbpf_major_version()), int(libbpf_minor_version()))


def version_string() -> str:
    raw = libbpf_version_string()
    major, minor = version()
    return raw.decode() if raw else f"v{major}.{minor}"


c_size_t_p = ctypes.POINTER(ctypes.c_size_t)
c_uint32_p = ctypes.POINTER(ctypes.c_uint32)

# --- library ------------------------------------------------------------------
libbpf_major_version = plain_fn("libbpf_major_version", ctypes.c_uint32)
libbpf_minor_version = plain_fn("libbpf_minor_version", ctypes.c_uint32)
libbpf_version_string = plain_fn("libbpf_version_string", ctypes.c_char_p)
libbpf_num_possible_cpus = int_fn("libbpf_num_possible_cpus")
PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
libbpf_set_print = plain_fn("libbpf_set_print", ctypes.c_void_p, PRINT_FN)
libbpf_strerror = plain_fn(
    "libbpf_strerror", ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t
)

# --- objects --------------------------------------------------------------------
bpf_object__open_file = ptr_fn("bpf_object__open_file", ctypes.c_char_p, ctypes.c_void_p)
bpf_object__load = int_fn("bpf_object__load", ctypes.c_void_p)
bpf_object__close = plain_fn("bpf_object__close", None, ctypes.c_void_p)
bpf_object__name = plain_fn("bpf_object__name", ctypes.c_char_p, ctypes.c_void_p)
bpf_object__next_map = plain_fn(
    "bpf_object__next_map", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
bpf_object__next_program = plain_fn(
    "bpf_object__next_program", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
)
bpf_object__btf = plain_fn("bpf_object__btf", ctypes.c_void_p, ctypes.c_void_p)

# --- maps -------------------------------------------------------------------------
bpf_map__name = plain_fn("bpf_map__name", ctypes.c_char_p, ctypes.c_void_p)
bpf_map__fd = plain_fn("bpf_map__fd", ctypes.c_int, ctypes.c_void_p)
bpf_map__type = plain_fn("bpf_map__type", ctypes.c_int, ctypes.c_void_p)
bpf_map__max_entries = plain_fn("bpf_map__max_entries", ctypes.c_uint32, ctypes.c_void_p)
bpf_map__key_size = plain_fn("bpf_map__key_size", ctypes.c_uint32, ctypes.c_void_p)
bpf_map__value_size = plain_fn("bpf_map__value_size", ctypes.c_uint32, ctypes.c_void_p)
bpf_map__set_max_entries = int_fn("bpf_map__set_max_entries", ctypes.c_void_p, ctypes.c_uint32)
bpf_map__set_type = int_fn("bpf_map__set_type", ctypes.c_void_p, ctypes.c_int)
bpf_map__set_key_size = int_fn("bpf_map__set_key_size", ctypes.c_void_p, ctypes.c_uint32)
bpf_map__set_value_size = int_fn("bpf_map__set_value_size", ctypes.c_void_p, ctypes.c_uint32)
bpf_map__inner_map = plain_fn("bpf_map__inner_map", ctypes.c_void_p, ctypes.c_void_p)
bpf_map_create = int_fn(
    "bpf_map_create", ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32,
    ctypes.c_uint32, ctypes.c_void_p,
)
bpf_map_get_fd_by_id = int_fn("bpf_map_get_fd_by_id", ctypes.c_uint32)
# 1 supported, 0 not, negative an error; the second argument is reserved (NULL).
libbpf_probe_bpf_map_type = int_fn("libbpf_probe_bpf_map_type", ctypes.c_int, ctypes.c_void_p)
bpf_map__initial_value = plain_fn(
    "bpf_map__initial_value", ctypes.c_void_p, ctypes.c_void_p, c_size_t_p
)
bpf_map__set_initial_value = int_fn(
    "bpf_map__set_initial_value", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)
bpf_map_update_elem = int_fn(
    "bpf_map_update_elem", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64
)
bpf_map_delete_elem = int_fn("bpf_map_delete_elem", ctypes.c_int, ctypes.c_void_p)
bpf_map_lookup_elem = int_fn(
    "bpf_map_lookup_elem", ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p
)
bpf_map_delete_elem = int_fn("bpf_map_delete_elem", ctypes.c_int, ctypes.c_void_p)
bpf_obj_get = int_fn("bpf_obj_get", ctypes.c_char_p)
bpf_obj_pin = int_fn("bpf_obj_pin", ctypes.c_int, ctypes.c_char_p)
bpf_obj_get_info_by_fd = int_fn(
    "bpf_obj_get_info_by_fd", ctypes.c_int, ctypes.c_void_p, c_uint32_p
)

# --- programs and links -------------------------------------------------------------
bpf_program__name = plain_fn("bpf_program__name", ctypes.c_char_p, ctypes.c_void_p)
bpf_program__section_name = plain_fn(
    "bpf_program__section_name", ctypes.c_char_p, ctypes.c_void_p
)
bpf_program__fd = plain_fn("bpf_program__fd", ctypes.c_int, ctypes.c_void_p)
bpf_program__type = plain_fn("bpf_program__type", ctypes.c_int, ctypes.c_void_p)
bpf_program__attach = ptr_fn("bpf_program__attach", ctypes.c_void_p)
bpf_link__destroy = int_fn("bpf_link__destroy", ctypes.c_void_p)
bpf_prog_test_run_opts = int_fn("bpf_prog_test_run_opts", ctypes.c_int, ctypes.c_void_p)

# --- BTF ------------------------------------------------------------------------------
btf__find_by_name_kind = int_fn(
    "btf__find_by_name_kind", ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32
)
btf__type_by_id = ptr_fn("btf__type_by_id", ctypes.c_void_p, ctypes.c_uint32)
btf__type_cnt = plain_fn("btf__type_cnt", ctypes.c_uint32, ctypes.c_void_p)
btf__name_by_offset = plain_fn(
    "btf__name_by_offset", ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint32
)
btf__resolve_size = plain_fn("btf__resolve_size", ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32)

# --- perf buffers ---------------------------------------------------------------------
PERF_EVENT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
perf_buffer__new_raw = ptr_fn(
    "perf_buffer__new_raw",
    ctypes.c_int,
    ctypes.c_size_t,
    ctypes.c_void_p,
    PERF_EVENT_FN,
    ctypes.c_void_p,
    ctypes.c_void_p,
)
perf_buffer__free = plain_fn("perf_buffer__free", None, ctypes.c_void_p)
perf_buffer__buffer_cnt = plain_fn("perf_buffer__buffer_cnt", ctypes.c_size_t, ctypes.c_void_p)
perf_buffer__buffer_fd = int_fn("perf_buffer__buffer_fd", ctypes.c_void_p, ctypes.c_size_t)
perf_buffer__consume_buffer = int_fn(
    "perf_buffer__consume_buffer", ctypes.c_void_p, ctypes.c_size_t
)
perf_buffer__buffer = int_fn(
    "perf_buffer__buffer",
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_void_p),
    c_size_t_p,
)

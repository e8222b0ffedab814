"""libbpf's log, routed through aperf (libbpf-rs: ``print.rs``), and its version."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

from ..libc.functions import libc_function
from . import binding as c

VERBOSE_ENV = "APERF_LIBBPF_VERBOSE"
LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2


class _LogState(threading.local):
    def __init__(self) -> None:
        self.capture: list[str] | None = None


_log_state = _LogState()
_verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
_print_installed = False
_print_lock = threading.Lock()


def _format(fmt: bytes, args: int | None) -> str:
    buf = ctypes.create_string_buffer(4096)
    vsnprintf = libc_function(
        "vsnprintf", ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
        ctypes.c_void_p,
    )
    vsnprintf(buf, len(buf), fmt, args)
    return buf.value.decode("utf-8", "replace")


def _print_message(level: int, fmt: bytes, args: int | None) -> int:
    try:
        if level == LIBBPF_DEBUG and not _verbose and _log_state.capture is None:
            return 0
        text = _format(fmt, args)
        if _log_state.capture is not None:
            _log_state.capture.append(text)
        if _verbose or (level == LIBBPF_WARN and _log_state.capture is None):
            # libbpf's own warnings go to stderr as libbpf itself would print them,
            # unless a caller is capturing them to put into an exception.
            sys.stderr.write(text)
    except BaseException as exc:  # parked, re-raised by the C call's errcheck
        c.park_callback_error(exc)
    return 0


_print_callback = c.PRINT_FN(_print_message)


def install_print() -> None:
    """Route libbpf's log through aperf (once per process)."""
    global _print_installed
    if _print_installed:
        return
    with _print_lock:
        if not _print_installed:
            c.libbpf_set_print(_print_callback)
            _print_installed = True


def set_libbpf_verbose(verbose: bool = True) -> None:
    """Print all of libbpf's output, debug included, to stderr (or set APERF_LIBBPF_VERBOSE=1)."""
    global _verbose
    _verbose = verbose
    install_print()


def libbpf_version() -> tuple[int, int]:
    """The (major, minor) version of the libbpf aperf loaded (>= 1.0)."""
    return c.version()


class capture_log:
    """Collect libbpf's messages (all levels) emitted by this thread inside the block."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __enter__(self) -> capture_log:
        install_print()
        self._outer = _log_state.capture
        _log_state.capture = self.lines
        return self

    def __exit__(self, *exc: object) -> None:
        _log_state.capture = self._outer
        if self._outer is not None:
            self._outer.extend(self.lines)

    @property
    def text(self) -> str:
        return "".join(self.lines)

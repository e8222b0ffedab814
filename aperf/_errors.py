"""The exceptions aperf raises: one flat vocabulary, re-exported from ``aperf``.

Errors from libbpf carry the errno, its message and the name of the C function
that failed; they are translated once, at the binding boundary.
"""

from __future__ import annotations

import errno as _errno
import os
import re
from typing import Any


class AperfError(Exception):
    """Base class of every error aperf raises on purpose."""


# --- libbpf and the kernel -------------------------------------------------


class LibbpfUnavailableError(AperfError, ImportError):
    """libbpf could not be loaded, or is too old. The message says what to install."""


class LibbpfError(AperfError, OSError):
    """A libbpf call failed. ``errno``, ``strerror`` and ``function`` say how."""

    function: str

    def __init__(
        self, err: int, function: str, detail: str = "", message: str | None = None
    ) -> None:
        if message is None:
            message = os.strerror(err) if err else "unknown error"
        super().__init__(err, message)
        self.function = function
        self.detail = detail  # one line: what aperf was doing, libbpf's last word
        self.log = ""  # everything libbpf printed during the failed call

    def __str__(self) -> str:
        return f"{self._failure()}: {self.detail}" if self.detail else self._failure()

    def _failure(self) -> str:
        name = _errno.errorcode.get(self.errno or 0, str(self.errno))
        return f"{self.function}() failed: [{name}] {self.strerror}"


class MissingPrivilegesError(LibbpfError, PermissionError):
    """The kernel refused for lack of privileges (run as root, or with CAP_BPF and CAP_PERFMON)."""

    def __str__(self) -> str:
        return super().__str__() + " (BPF needs root, or CAP_BPF + CAP_PERFMON)"


class Win32Error(AperfError, OSError):
    """A Windows API call (``kernel32``: events and waits) failed.

    ``winerror`` is ``GetLastError()``'s code, ``function`` the API's name.
    """

    function: str

    def __init__(self, winerror: int, function: str, detail: str = "") -> None:
        message = f"{function}() failed with Windows error {winerror}"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.winerror = winerror
        self.function = function


# --- BPF objects -------------------------------------------------------------


class ObjectError(AperfError):
    """Base class of errors about a BPF object file and what it holds."""


class ObjectFileError(ObjectError, LibbpfError):
    """The file is missing, unreadable, or not an ELF BPF object."""

    def __init__(
        self, path: str, err: int, function: str, reason: str, message: str | None = None
    ) -> None:
        LibbpfError.__init__(self, err, function, reason, message)
        self.path = path

    def __str__(self) -> str:
        return f"cannot open BPF object {self.path!r}: {self.detail} ({self._failure()})"


class UnknownNameError(ObjectError, KeyError):
    """No map, program or global of that name exists; the message lists those that do.

    A :class:`KeyError` (hence a :class:`LookupError`), so that ``obj.maps`` and
    ``obj.programs`` follow the Mapping protocol: ``in`` and ``.get()`` see a miss.
    """

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(f"no {kind} named {name!r}; known: {', '.join(sorted(known)) or 'none'}")
        self.kind = kind
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError would show the message in quotes


class ArgumentError(AperfError, ValueError):
    """An argument aperf cannot hand to the kernel; ``argument`` names it.

    E.g. a map key or value of the wrong size, unknown update flags, a path with
    a NUL byte. Arguments of the wrong type raise :class:`TypeError` instead.
    """

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


class GlobalValueError(ObjectError, ValueError):
    """A value does not fit the ``const volatile`` global it is meant for."""


class ObjectStateError(ObjectError):
    """The operation is not allowed in the object's current state (e.g. set_global after load)."""


class PinnedPathError(LibbpfError):
    """A path in bpffs cannot hold or give a pinned BPF object.

    It is not on a BPF filesystem (``mount -t bpf bpf /sys/fs/bpf``), is a
    directory, holds no BPF object, holds another object than expected, or is
    already taken. ``path`` and ``reason`` say which; ``errno`` is the kernel's.
    """

    def __init__(self, path: str, reason: str, err: int, function: str) -> None:
        super().__init__(err, function)
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        context = f"{self.detail}: " if self.detail else ""
        return f"{context}{self.path!r} {self.reason} ({self._failure()})"


class VerifierError(ObjectError, LibbpfError):
    """The kernel's verifier rejected a program.

    ``program`` names it; ``log`` holds libbpf's and the verifier's output.
    """

    def __init__(self, path: str, err: int, log: str) -> None:
        LibbpfError.__init__(self, err, "bpf_object__load")
        self.path = path
        self.log = log
        found = re.search(r"prog '([^']+)': (?:BPF program load failed|failed to load)", log)
        self.program = found.group(1) if found else None

    def __str__(self) -> str:
        tail = "\n".join(self.log.strip().splitlines()[-12:])
        which = f"program {self.program!r}" if self.program else "a program"
        return (
            f"the kernel's verifier rejected {which} of {self.path!r} "
            f"({self._failure()}); last lines of the log:\n{tail}\n"
            "(the full log is in .log; set APERF_LIBBPF_VERBOSE=1 to see all of libbpf's output)"
        )


# --- perf rings and streams --------------------------------------------------


class MapTypeError(AperfError, TypeError):
    """The map is not a BPF_MAP_TYPE_PERF_EVENT_ARRAY."""


class RingSizeError(AperfError, ValueError):
    """The per-CPU ring size is invalid (page count not a power of two, zero, too large)."""


class ClosedResourceError(AperfError):
    """The stream, buffer or object was closed."""


class BusyResourceError(AperfError):
    """Another task is already using this resource (e.g. iterating the same stream)."""


class BrokenRingError(AperfError):
    """A ring held a corrupt record header; that ring was stopped."""

    def __init__(self, cpu: int, reason: str) -> None:
        super().__init__(f"perf ring of CPU {cpu} is corrupt and was stopped: {reason}")
        self.cpu = cpu
        self.partial: list[Any] = []  # the intact records before the corrupt one


class DecodeError(AperfError, ValueError):
    """A decoder did not fit a sample. ``cpu`` and ``data`` identify the sample."""

    def __init__(self, cpu: int, data: bytes, reason: str) -> None:
        super().__init__(f"cannot decode a {len(data)}-byte sample from CPU {cpu}: {reason}")
        self.cpu = cpu
        self.data = data
        self.reason = reason

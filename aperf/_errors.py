"""The exceptions aperf raises: one flat vocabulary, re-exported from ``aperf``.

Errors from libbpf carry the errno, its message and the name of the C function
that failed; they are translated once, at the binding boundary.
"""

from __future__ import annotations

import difflib
import errno as _errno
import os
import re
from typing import Any

import anyio

from ._privileges import effective_capabilities, privileges_hint


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
    """The kernel refused for lack of privileges; the message says what this process lacks.

    Loading BPF programs needs root, or CAP_BPF and CAP_PERFMON. Attaching a
    tracepoint also reads its id from tracefs (``/sys/kernel/tracing``, mode 0700
    on most systems), which takes root or CAP_DAC_READ_SEARCH. ``capabilities``
    holds the effective capability mask of the process when the call failed
    (None where ``/proc`` cannot tell).
    """

    def __init__(
        self, err: int, function: str, detail: str = "", message: str | None = None
    ) -> None:
        super().__init__(err, function, detail, message)
        self.capabilities = effective_capabilities()

    def __str__(self) -> str:
        return f"{super().__str__()} ({self.hint})"

    @property
    def hint(self) -> str:
        """What this process lacks, as far as aperf can tell (the end of the message)."""
        return privileges_hint(self.capabilities, f"{self.detail}\n{self.log}")


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
    """No map, program, global or struct of that name exists. With a close match the
    message says it and stops ("no map named 'evnets'; did you mean 'events'?"); without
    one it lists the names that exist (the first ``SHOWN``, sorted, and how many more:
    an object's BTF can hold hundreds of kernel structs), then any advice (for a struct:
    how one gets into the object's BTF).

    A ``KeyError`` (hence a ``LookupError``), so that ``obj.maps`` and
    ``obj.programs`` follow the Mapping protocol: ``in`` and ``.get()`` see a miss.
    ``suggestions`` holds the close matches, best first; ``known`` every name.
    """

    SHOWN = 20

    def __init__(self, kind: str, name: str, known: list[str], hint: str = "") -> None:
        self.suggestions = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        message = f"no {kind} named {name!r}; "
        if self.suggestions:
            message += f"did you mean {' or '.join(map(repr, self.suggestions))}?"
            hint = ""  # the likely fix is said: the rest would bury it
        else:
            names = sorted(known)
            more = len(names) - self.SHOWN
            message += f"known: {', '.join(names[:self.SHOWN]) or 'none'}"
            message += f" and {more} more" if more > 0 else ""
        super().__init__(f"{message}. {hint}" if hint else message)
        self.kind = kind
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return str(self.args[0])  # KeyError would show the message in quotes


class ArgumentError(AperfError, ValueError):
    """An argument aperf cannot hand to the kernel; ``argument`` names it.

    E.g. a map key or value of the wrong size, unknown update flags, a path with
    a NUL byte. Arguments of the wrong type raise ``TypeError`` instead.
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


def _ring_name(cpu: int, map: str | None = None) -> str:
    ring = "ring buffer" if cpu < 0 else f"perf ring of CPU {cpu}"
    return ring if map is None else f"{ring} of map {map!r}"



class MapTypeError(AperfError, TypeError):
    """The map is neither a BPF_MAP_TYPE_PERF_EVENT_ARRAY nor a BPF_MAP_TYPE_RINGBUF."""


class RingSizeError(AperfError, ValueError):
    """The per-CPU ring size is invalid (page count not a power of two, zero, too large)."""


class UnsupportedError(AperfError, TypeError):
    """The source cannot do what was asked: e.g. ``pause()`` on a BPF ring buffer,
    which has no per-CPU slots to empty, or ``cpus=`` for a source without CPU rings."""


class ClosedResourceError(AperfError, anyio.ClosedResourceError):
    """The stream, buffer or object was closed.

    Also an ``anyio.ClosedResourceError``: code written for anyio's resources catches it.
    """


class BusyResourceError(AperfError, anyio.BusyResourceError):
    """Another task is already using this resource (e.g. iterating the same stream).

    Also an ``anyio.BusyResourceError`` (whose message this class writes itself).
    """

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)  # anyio's __init__ would wrap it in its own sentence


class TakenOverError(AperfError, anyio.BrokenResourceError):
    """Another aperf reader took the map over (``take_over=True``): this stream ends.

    It comes through the stream in order, after every event this reader had
    taken out of its rings, and ends it. ``pid`` is the taker's process id
    (the kernel's word; 0 if it is in another pid namespace), ``map_id`` the
    map's kernel id. Also an ``anyio.BrokenResourceError``: the stream was made
    unusable by an external cause.
    """

    def __init__(self, name: str, map_id: int, pid: int) -> None:
        who = f"pid {pid}" if pid > 0 else "a process in another pid namespace"
        super().__init__(
            f"map {name} (id {map_id}) was taken over by {who} (take_over=True): this "
            "reader's stream ends here, after every event it had"
        )
        self.name = name
        self.map_id = map_id
        self.pid = pid


class BrokenRingError(AperfError):
    """A ring held a corrupt record header; that ring was stopped."""

    def __init__(self, cpu: int, reason: str, *, map: str | None = None) -> None:
        super().__init__(f"{_ring_name(cpu, map)} is corrupt and was stopped: {reason}")
        self.cpu = cpu
        self.map = map  # the map's name, in a stream of several maps
        self.partial: list[Any] = []  # the intact records before the corrupt one


class DecodeError(AperfError, ValueError):
    """A decoder did not fit a sample. ``cpu`` and ``data`` identify the sample."""

    def __init__(self, cpu: int, data: bytes, reason: str, *, map: str | None = None) -> None:
        super().__init__(
            f"cannot decode a {len(data)}-byte sample from the {_ring_name(cpu, map)}: {reason}"
        )
        self.cpu = cpu
        self.map = map  # the map's name, in a stream of several maps
        self.data = data
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles (a BadSample's error, sent to another process) with its map.
        return (_decode_error, (self.cpu, self.data, self.reason, self.map))


def _decode_error(cpu: int, data: bytes, reason: str, map: str | None) -> DecodeError:
    return DecodeError(cpu, data, reason, map=map)


class RingFullError(AperfError, TimeoutError):
    """A user ring buffer had no room for a message (at once, or within the timeout).

    Nothing of the message was written. A ``TimeoutError``: ``except TimeoutError``
    catches a timed-out [`UserRingBuffer.send`][aperf.UserRingBuffer.send].
    """


# --- optional extras, recordings -------------------------------------------


class MissingExtraError(AperfError, ImportError):
    """What was asked for needs an optional extra that is not installed: ``extra`` names
    it (``pip install 'aperf-bpf[EXTRA]'``), ``package`` the package it brings."""

    def __init__(self, what: str, *, extra: str, package: str) -> None:
        super().__init__(f"{what} needs {package}: pip install 'aperf-bpf[{extra}]'",
                         name=package)
        self.extra = extra
        self.package = package


class RecordingError(AperfError, OSError):
    """A recording could not be written (or read): ``path`` is the file, ``errno`` and
    ``strerror`` say why (``ENOSPC``: the disk is full; ``EACCES``: permission). What
    it held is counted, never dropped silently (docs/recording.md)."""

    def __init__(self, err: int, strerror: str, path: str, detail: str = "") -> None:
        super().__init__(err, strerror, path)
        self.detail = detail

    def __str__(self) -> str:
        text = f"cannot write the recording file {self.filename}: {self.strerror}"
        return f"{text} ({self.detail})" if self.detail else text


class RecordingFormatError(AperfError, ValueError):
    """A file in a recording's directory is not an aperf recording, or is damaged (a
    recording is untrusted input: it never crashes a reader). ``path`` names it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class DecoderMismatchError(AperfError, TypeError):
    """A recording replayed into a stream whose decoder is not the one it was recorded
    with: ``recorded`` and ``given`` name both."""

    def __init__(self, recorded: str, given: str, detail: str = "") -> None:
        super().__init__(
            f"this recording was made with decoder {recorded}, and the stream decodes with "
            f"{given}: their layouts differ{f' ({detail})' if detail else ''}; replay it with "
            "the recording's own decoder (aperf.replay(...).decoder) or the same struct"
        )
        self.recorded = recorded
        self.given = given

"""libbpf's version and log switch, as public functions."""

from __future__ import annotations

from . import _libbpf as lb


def libbpf_version() -> tuple[int, int]:
    """The (major, minor) version of the libbpf aperf loaded (>= 1.0)."""
    return lb.version()


def set_libbpf_verbose(verbose: bool = True) -> None:
    """Print all of libbpf's output, debug included, to stderr (or set APERF_LIBBPF_VERBOSE=1)."""
    lb.set_verbose(verbose)

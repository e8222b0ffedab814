"""The libbpf binding: loading, version checks, errno-carrying errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aperf
from aperf._native import libbpf as lb


def test_reports_libbpf_version() -> None:
    major, minor = aperf.libbpf_version()
    assert (major, minor) >= (1, 0)
    assert lb.version_string().startswith(f"v{major}.{minor}")


def _version_in_subprocess(library: str) -> subprocess.CompletedProcess[str]:
    code = "import aperf; print(aperf.libbpf_version())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={"APERF_LIBBPF": library, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_library_says_what_to_install() -> None:
    result = _version_in_subprocess("/nonexistent/libbpf.so.1")
    assert result.returncode != 0
    assert "LibbpfUnavailableError" in result.stderr
    assert "/nonexistent/libbpf.so.1" in result.stderr
    assert "apt-get install libbpf1" in result.stderr


def test_library_without_version_functions_is_refused() -> None:
    result = _version_in_subprocess("libc.so.6")
    assert result.returncode != 0
    assert "not libbpf 1.x" in result.stderr
    assert "apt-get install libbpf1" in result.stderr


def test_too_old_library_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "oldbpf.c"
    source.write_text(
        textwrap.dedent(
            """
            unsigned libbpf_major_version(void) { return 0; }
            unsigned libbpf_minor_version(void) { return 8; }
            """
        )
    )
    library = tmp_path / "libbpf.so.0"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    result = _version_in_subprocess(str(library))
    assert result.returncode != 0
    assert "is libbpf 0.8, too old" in result.stderr
    assert "apt-get install libbpf1" in result.stderr


def test_failed_call_raises_errno_and_function_name(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.bpf.o"
    bogus.write_bytes(b"\x7fELF not really")
    with pytest.raises(aperf.ObjectFileError) as info:
        aperf.BPFObject(bogus)
    err = info.value
    assert isinstance(err, aperf.LibbpfError)
    assert isinstance(err, OSError)
    assert err.errno is not None and err.errno > 0
    assert err.function == "bpf_object__open_file"
    assert "bpf_object__open_file" in str(err)


def test_errcheck_maps_permission_errnos_to_missing_privileges() -> None:
    import errno

    err = lb.error_for(errno.EPERM, "bpf_object__load")
    assert isinstance(err, aperf.MissingPrivilegesError)
    assert isinstance(err, PermissionError)
    assert "CAP_BPF" in str(err)
    assert isinstance(lb.error_for(errno.EINVAL, "x"), aperf.LibbpfError)
    assert not isinstance(lb.error_for(errno.EINVAL, "x"), PermissionError)

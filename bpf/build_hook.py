"""Compile the BPF objects the aperf package ships, while setuptools builds a wheel.

pyproject.toml names these classes under ``[tool.setuptools.cmdclass]``. A wheel
is built from sources (``python -m build`` builds the sdist, then the wheel from
it), so its objects always match ``bpf/*.bpf.c``: nothing prebuilt can drift.
The compile rules live in ``bpf/Makefile`` alone; this hook runs
``make -C bpf shipped`` with the wheel's ``aperf/_objects`` as destination.

Editable installs (``pip install -e .``) compile nothing: a checkout gets its
objects from ``make -C bpf`` (``scripts/setup.sh`` runs it), as before.

It also builds aperf's optional compiled fast path (``aperf/_native/_speedups.c``,
declared in pyproject.toml as an optional extension on the limited API): ``BuildExt``
skips it when ``APERF_NO_EXTENSIONS=1`` is set, and setuptools skips it when the
compiler fails (``optional``). ``BdistWheel`` then tags the wheel by what it holds:
with the compiled module, ``cp311-abi3-<platform>`` (every CPython from 3.11; auditwheel
repair makes the platform ``manylinux_2_17``); without it, ``py3-none-any``: Python and
BPF bytecode, which the kernel verifies and compiles itself, and no machine code.
docs/install.md says why that tag is honest for these objects, and
tests/packaging/test_packaging.py checks both wheels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import machinery
from pathlib import Path

from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError

BPF_DIR = Path(__file__).resolve().parent
KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
# Debian's names: the error says what to install, not only what is missing.
PACKAGES = {"clang": "clang", "llvm-strip": "llvm", "make": "make", "bpftool": "bpftool"}


def missing_tools() -> list[str]:
    """What the compile needs and this machine lacks, one phrase each."""
    missing = []
    # CLANG and LLVM_STRIP, like the Makefile's variables, may name other commands.
    for tool, command in (
        ("clang", os.environ.get("CLANG", "clang")),
        ("llvm-strip", os.environ.get("LLVM_STRIP", "llvm-strip")),
        ("make", "make"),
    ):
        if shutil.which(command) is None:
            missing.append(f"{command} (Debian package {PACKAGES[tool]})")
    if not (BPF_DIR / "vmlinux.h").exists():
        # vmlinux.h is generated from the running kernel's BTF by bpftool.
        bpftool = os.environ.get("BPFTOOL") or shutil.which("bpftool")
        if bpftool is None and not Path("/usr/sbin/bpftool").exists():
            missing.append(f"bpftool (Debian package {PACKAGES['bpftool']})")
        if not KERNEL_BTF.exists():
            missing.append(f"{KERNEL_BTF} (a kernel with BTF), or a bpf/vmlinux.h")
    return missing


def compile_objects(destination: Path) -> None:
    """Build the shipped objects into ``destination``; a clear error if the tools are missing."""
    missing = missing_tools()
    if missing:
        raise ExecError(
            "building aperf's wheel compiles its BPF objects (bpf/*.bpf.c) and needs: "
            + "; ".join(missing)
            + ". On Debian: apt-get install clang llvm libbpf-dev bpftool make"
        )
    destination.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["make", "-s", "-C", str(BPF_DIR), "shipped", f"DESTDIR_OBJ={destination}"],
        check=False,
    )
    if result.returncode != 0:
        raise ExecError(f"compiling the BPF objects failed: make exited with {result.returncode}")


class BuildPy(build_py):
    """build_py, plus the BPF objects compiled into the build's ``aperf/_objects``."""

    def run(self) -> None:
        super().run()
        # On Windows the objects (Linux BPF programs: the testing Producer, the tracer)
        # mean nothing and the tools are absent: the wheel there ships none.
        if not self.editable_mode and sys.platform != "win32":
            compile_objects(Path(self.build_lib).resolve() / "aperf" / "_objects")


LIMITED_API = "cp311"  # _speedups.c's Py_LIMITED_API: the buffer protocol is 3.11's
EXTENSION_SUFFIXES = tuple(machinery.EXTENSION_SUFFIXES)  # what a compiled module ends with


def extensions_off() -> bool:
    """``APERF_NO_EXTENSIONS`` asks for the pure package (as aperf reads it at run time)."""
    value = os.environ.get("APERF_NO_EXTENSIONS", "").strip().lower()
    return value not in ("", "0", "false", "no")


class BuildExt(build_ext):
    """build_ext, skipped under ``APERF_NO_EXTENSIONS=1`` (a failed compile is skipped by
    setuptools itself: the extension is ``optional``)."""

    def run(self) -> None:
        if extensions_off():
            print("aperf: APERF_NO_EXTENSIONS is set: building the pure package")
            return
        super().run()


class BdistWheel(bdist_wheel):
    """bdist_wheel, tagged by what the build holds: the abi3 tag with the compiled fast
    path, ``py3-none-any`` without it (APERF_NO_EXTENSIONS=1, or no compiler)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if extensions_off():
            self._pure()
        elif not self.root_is_pure and not self.py_limited_api:
            self.py_limited_api = LIMITED_API

    def _pure(self) -> None:
        """A wheel of Python and BPF bytecode: installed as purelib, tagged py3-none-any."""
        self.distribution.ext_modules = []  # install then lays it out as purelib too
        self.root_is_pure = True
        self.py_limited_api = False

    def run(self) -> None:
        if not self.root_is_pure and not self.skip_build:
            self.run_command("build")  # bdist_wheel's own run of it is then a no-op
            native = Path(self.get_finalized_command("build").build_lib) / "aperf" / "_native"
            if not [p for p in native.glob("_speedups*") if p.name.endswith(EXTENSION_SUFFIXES)]:
                print("aperf: the fast path was not compiled: building the pure package")
                self._pure()
        super().run()

"""Compile the BPF objects the aperf package ships, while setuptools builds a wheel.

pyproject.toml names these classes under ``[tool.setuptools.cmdclass]``. A wheel
is built from sources (``python -m build`` builds the sdist, then the wheel from
it), so its objects always match ``bpf/*.bpf.c``: nothing prebuilt can drift.
The compile rules live in ``bpf/Makefile`` alone; this hook runs
``make -C bpf shipped`` with the wheel's ``aperf/_objects`` as destination.

Editable installs (``pip install -e .``) compile nothing: a checkout gets its
objects from ``make -C bpf`` (``scripts/setup.sh`` runs it), as before.

The wheel is pure (``py3-none-any``, setuptools' own tag for a distribution
without extension modules): it holds Python and BPF bytecode, which the kernel
verifies and compiles itself, and no machine code. docs/install.md says why
that tag is honest for these objects, and tests/packaging/test_packaging.py checks it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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

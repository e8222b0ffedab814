"""Pages whose promise takes more than running their blocks: checked here in depth.

- docs/own-program.md: its Python block, saved as the page says, prints the
  exec of a process of ours (pid and name), as root and as the dedicated user
  ``aperf`` holding only the capabilities of docs/privileges.md (its ``useradd``
  and ``setpriv`` lines), and stops cleanly on Ctrl-C.
- docs/privileges.md: its systemd unit passes ``systemd-analyze verify``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .snippets import REPO, Block, blocks_in, shell_commands

PAGES = REPO / "docs"


def page_blocks(page: str, lang: str) -> list[Block]:
    path = PAGES / page
    return [b for b in blocks_in(path.read_text(), f"docs/{page}") if b.lang == lang]


def own_program() -> str:
    """The Python block of own-program.md's steps 3 and 4 (the one reading minimal.bpf.o):
    the whole user side of the program."""
    (block,) = [b for b in page_blocks("own-program.md", "python") if "minimal.bpf.o" in b.code]
    return block.code


def setpriv_prefix() -> list[str]:
    """privileges.md's setpriv line, without the command it runs."""
    for block in page_blocks("privileges.md", "sh"):
        for command in shell_commands(block.code):
            words = command.split()
            if words[0] == "setpriv" and words[-1].endswith("aperf-trace"):
                return words[:-1]
    raise AssertionError("privileges.md has no setpriv line that runs aperf-trace")


def make_the_user() -> None:
    """Run privileges.md's line that makes its dedicated user (if it is not there yet)."""
    for block in page_blocks("privileges.md", "sh"):
        for command in shell_commands(block.code):
            if "useradd" in command:
                subprocess.run(["bash", "-euo", "pipefail", "-c", command], check=True,
                               timeout=60)
                return
    raise AssertionError("privileges.md has no line that makes its user")


def a_process_named(directory: Path) -> Path:
    """A copy of ``true`` with a name of our own (a comm nobody else has)."""
    name = f"aperf-own{os.getpid() % 100000}"[:15]
    path = directory / name
    shutil.copy(shutil.which("true") or "/bin/true", path)
    path.chmod(0o755)
    return path


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory that ``nobody`` can read too (pytest's tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="aperf-own-program-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("who", ["root", "aperf-with-the-capabilities"])
def test_own_program_prints_our_exec(tracefs: None, shared_dir: Path, who: str) -> None:
    script = shared_dir / "hello.py"  # saved as the page says, run from the checkout
    script.write_text(own_program())
    if who != "root":
        make_the_user()
    prefix = setpriv_prefix() if who != "root" else []
    process = a_process_named(shared_dir)
    out, err = shared_dir / "out", shared_dir / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            [*prefix, sys.executable, str(script)], cwd=REPO, stdout=stdout, stderr=stderr,
            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
    try:
        deadline = time.monotonic() + 30
        while True:  # the first execs may come before the program is attached
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, out.read_text()[-2000:]
            child = subprocess.Popen([process])
            child.wait()
            time.sleep(0.1)
            # The decoded pid is the pid of the process that exec'd, its comm the new name.
            if f"exec_event(pid={child.pid}, comm='{process.name}')\n" in out.read_text():
                break
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 0, err.read_text()
    assert "Traceback" not in err.read_text(), err.read_text()


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    (block,) = page_blocks("privileges.md", "ini")
    exec_start = re.search(r"^ExecStart=(\S+)", block.code, re.MULTILINE)
    assert exec_start is not None
    # The page installs aperf in /opt/aperf; here the same tool is the checkout's.
    unit = block.code.replace(exec_start.group(1), str(Path(sys.executable).parent / "aperf-trace"))
    path = tmp_path / "aperf-trace.service"
    path.write_text(unit)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout + proc.stderr == "", proc.stdout + proc.stderr  # no unknown key or value

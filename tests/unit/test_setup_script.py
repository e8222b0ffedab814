"""``./scripts/tracer.sh`` on a fresh checkout says what it is doing while
``scripts/setup.sh`` installs, before the minute of quiet pip, and says nothing of it
once everything is in place. Run on a copy of the scripts, with stand-ins for every
command that would change the machine (apt, pip, mount, make): nothing is installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

from ..helpers import REPO

# The stand-in interpreter: the base python3 makes the venv, whose python records what
# it is asked to run (pip, the tracer) in calls.log.
FAKE_PYTHON = """#!/bin/sh
echo "$0 $*" >> "$CALLS"
case "$1 $2" in
  "-m venv") mkdir -p "$3/bin" && cp "$0" "$3/bin/python" ;;
  "-VV ") echo "Python 3.11.7 (stand-in)" ;;
  "-m examples.bootstrap_legacy") echo "TIME     EVENT COMM" ;;
esac
exit 0
"""
STUBS = {
    "dpkg-query": 'echo "install ok installed"',
    "mountpoint": "exit 0",
    "mount": "exit 0",
    "make": "exit 0",
    "id": "echo 0",
    "apt-get": 'echo "apt-get must not run here" >&2; exit 1',
}


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_the_first_run_says_what_takes_a_minute_and_later_runs_do_not(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "tracer.sh"):
        shutil.copy(REPO / "scripts" / name, checkout / "scripts" / name)
    # What the install stamp hashes besides the scripts (setup.sh: the editable install
    # compiles the fast path, so its source and the build hook are inputs too).
    for name in ("pyproject.toml", "bpf/build_hook.py", "aperf/_native/_speedups.c"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, checkout / name)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        executable(stubs / name, f"#!/bin/sh\n{body}\n")
    executable(stubs / "python3", FAKE_PYTHON)
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "CALLS": str(calls)}
    env.pop("APERF_SETUP_FORCE", None)

    def tracer() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "scripts/tracer.sh"], cwd=checkout, env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    first = tracer()
    assert first.returncode == 0, first.stderr
    said = first.stderr.splitlines()
    assert "aperf setup: making .venv, this checkout's own Python environment" in said
    installing = [line for line in said if "installing aperf and its Python packages" in line]
    assert installing == [
        "aperf setup: installing aperf and its Python packages into .venv with pip "
        "(quietly: about a minute on the first run, seconds later)"
    ]
    assert "pip install" in calls.read_text() and first.stdout == "TIME     EVENT COMM\n"

    again = tracer()  # everything in place: straight to the tracer, nothing said
    assert again.returncode == 0 and again.stderr == "" and again.stdout == first.stdout
    assert calls.read_text().count("pip install") == 1

"""Every command and snippet of README.md, docs/ and the API's docstrings runs as written.

The blocks and the directives that say how to run them are described in
tests/docs/snippets.py. A block that is not run says why, in the page itself.
Blocks marked ``needs root`` or ``needs the toolchain`` are kernel-tier tests.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .snippets import (
    DIRECTIVES,
    REPO,
    RUNNABLE,
    SHELL,
    Block,
    all_blocks,
    excerpt_mismatch,
    shell_commands,
)

BLOCKS = all_blocks()
DEFAULT_TIMEOUT = 60.0
FIRST_LINE_TIMEOUT = 30.0  # a "runs until Ctrl-C" command must print within this


def _params(blocks: list[Block]) -> list[object]:
    return [
        pytest.param(b, id=b.where, marks=[pytest.mark.kernel] if b.kernel_tier else [])
        for b in blocks
    ]


def snippet_env() -> dict[str, str]:
    """The environment of a reader's shell: without this test's virtual environment."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and p != venv_bin
    )
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env["PYTHONUNBUFFERED"] = "1"  # stdout is a file here: flush each line, as at a terminal
    return env


def command(block: Block, code: str, tmp_path: Path) -> list[str]:
    if block.lang == "python":
        script = tmp_path / "snippet.py"
        script.write_text(code)
        return [sys.executable, str(script)]
    return ["bash", "-euo", "pipefail", "-c", code]


def workdir(block: Block, tmp_path: Path) -> Path:
    copied = block.directives.get("in a scratch copy of")
    if copied is None:
        return REPO
    scratch = tmp_path / "scratch"
    shutil.copytree(
        REPO / copied, scratch / copied, ignore=shutil.ignore_patterns("*.o", "__pycache__")
    )
    return scratch


def check_output(block: Block, output: str) -> None:
    assert "Traceback (most recent call last)" not in output, output
    assert "DeprecationWarning" not in output, output  # docs teach the current API
    expected = block.directives.get("expect")
    if expected is not None:
        assert re.search(expected, output, re.MULTILINE), f"no match for {expected!r} in:\n{output}"


def run_to_completion(block: Block, tmp_path: Path) -> None:
    timeout = float(block.directives.get("timeout") or DEFAULT_TIMEOUT)
    proc = subprocess.run(
        command(block, block.code, tmp_path), cwd=workdir(block, tmp_path), env=snippet_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout  # stderr too, interleaved as on a terminal
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{output}"
    check_output(block, output)


def run_until_stopped(block: Block, code: str, sig: int, tmp_path: Path) -> None:
    """Start ``code``, wait for its first line of output, then send ``sig`` as a terminal does."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            command(block, code, tmp_path), cwd=workdir(block, tmp_path), env=snippet_env(),
            stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + FIRST_LINE_TIMEOUT
        while "\n" not in out.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, f"nothing printed:\n{err.read_text()}"
            subprocess.run(["sleep", "0.01"], check=True)  # an exec and an exit to trace
            time.sleep(0.1)
        assert proc.poll() is None, f"it ended by itself:\n{out.read_text()}{err.read_text()}"
        time.sleep(0.2)
        os.killpg(proc.pid, sig)  # Ctrl-C signals the whole foreground group
        rc = proc.wait(timeout=float(block.directives.get("timeout") or 10))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = out.read_text() + err.read_text()
    assert rc == 0, f"exit status {rc} after {signal.Signals(sig).name}:\n{output}"
    check_output(block, output)


RUN = [b for b in BLOCKS if b.runnable]
STOPS = {"runs until Ctrl-C": signal.SIGINT, "runs until SIGTERM": signal.SIGTERM}


@pytest.mark.parametrize("block", _params(RUN))
def test_block_runs_as_written(
    block: Block, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if "needs root" in block.directives:
        request.getfixturevalue("tracefs")  # root, BPF, and tracefs mounted
    elif block.kernel_tier:
        request.getfixturevalue("kernel")  # the tier where scripts/setup.sh built everything
    stops = [sig for key, sig in STOPS.items() if key in block.directives]
    if not stops:
        run_to_completion(block, tmp_path)
    for sig in stops:
        for code in [block.code] if block.lang == "python" else shell_commands(block.code):
            run_until_stopped(block, code, sig, tmp_path)


EXCERPTS = [b for b in BLOCKS if "excerpt of" in b.directives]


@pytest.mark.parametrize("block", _params(EXCERPTS))
def test_excerpt_matches_its_source(block: Block) -> None:
    source = REPO / block.directives["excerpt of"]
    assert source.is_file(), f"{block.where}: no file {source}"
    missing = excerpt_mismatch(block.code, source.read_text())
    assert missing is None, f"{block.where}: not in {source.name} (in this order): {missing!r}"


def test_directives_are_known_and_skips_say_why() -> None:
    for block in BLOCKS:
        unknown = set(block.directives) - DIRECTIVES
        assert not unknown, f"{block.where}: unknown directive(s) {sorted(unknown)}"
        if "not run" in block.directives:
            assert block.directives["not run"], f"{block.where}: 'not run' needs a reason"
        if block.directives and block.lang not in RUNNABLE:
            assert set(block.directives) <= {"excerpt of", "not run"}, (
                f"{block.where}: a {block.lang or 'plain'} block is not run"
            )
        if block.lang in SHELL:
            assert block.directives, (
                f"{block.where}: a shell block says how to run it: '<!-- run -->' (or another "
                "directive, tests/docs/snippets.py) if it is safe to run as written, else "
                "'<!-- not run: REASON -->'"
            )


def test_the_runner_finds_the_blocks() -> None:
    # A parser that found nothing would make every test above pass vacuously.
    pages = {b.where.rsplit(":", 1)[0] for b in BLOCKS}
    assert {"README.md", "docs/rings.md", "docs/testing.md"} <= pages
    assert len(RUN) >= 15 and len(EXCERPTS) >= 5
    assert any("(docstring)" in b.where for b in RUN)


def test_every_page_gets_into_the_site_nav() -> None:
    # A page that mkdocs.yml's nav does not name (one merged from another branch)
    # goes under "More" (scripts/mkdocs_hooks.py) instead of being left unreachable.
    from mkdocs.config import load_config
    from mkdocs.structure.files import get_files

    import scripts.mkdocs_hooks as hooks

    config = load_config(str(REPO / "mkdocs.yml"))
    files = get_files(config)
    pages = {f.src_uri for f in files.documentation_pages()}
    config.nav = [entry for entry in config.nav if entry != {"Home": "index.md"}]  # as if new
    hooks.on_files(files, config)
    assert pages and pages <= hooks._named(config.nav), sorted(pages - hooks._named(config.nav))
    assert config.nav[-1] == {"More": ["index.md"]}

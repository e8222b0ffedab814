"""bench/run.py's quick answers, as any user: no traceback where there is nothing to report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/run.py", *args], cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )


def test_report_only_without_results_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "results.json"  # a fresh checkout has no bench/results.json
    proc = run_bench("--report-only", "--no-doc", "--results", str(missing))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        f"no results to report: {missing} does not exist yet; a run writes it "
        "(.venv/bin/python bench/run.py, as root)\n"
    )


def test_report_only_with_unreadable_results_says_so_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "results.json"
    broken.write_text("{not json")
    proc = run_bench("--report-only", "--no-doc", "--results", str(broken))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"cannot read the results in {broken}: ")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_the_report_states_promises_not_issue_numbers() -> None:
    # docs/benchmarks.md is product documentation: the harness names what aperf promises,
    # not the project's issues that asked for it.
    code = (
        "import sys; sys.path.insert(0, 'bench'); import report\n"
        "machine = dict(uname='u', cpu_model='c', nproc=2, python='3', uvloop='u', "
        "libbpf=[1, 1], bcc=None, gcc='g', aperf_default_pages=128)\n"
        "print(report.generated([], machine, [], 'skipped', 'run', True, False))\n"
    )
    text = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=60).stdout
    assert "### Promises" in text and "#### Streams keep up with the kernel's rings" in text
    assert "Issue " not in text and "issue " not in text
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert all(line in page for line in text.splitlines() if line.startswith("#### "))

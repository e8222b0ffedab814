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

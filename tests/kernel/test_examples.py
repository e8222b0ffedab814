"""The trio and ring buffer examples run as their docstrings say (kernel tier).

Each exits 0 only when every sample the BPF side produced was delivered or
counted as lost, and prints the counts, checked here too.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ..helpers import REPO

COUNTS = re.compile(r"(\d+) samples, (\d+) lost, (\d+) produced")


@pytest.mark.kernel
@pytest.mark.parametrize(
    "args",
    [
        ["examples.trio_stream", "--count", "20000"],
        ["examples.trio_stream", "--count", "20000", "--ringbuf"],
        ["examples.ringbuf_stream", "--count", "20000"],
        # a 64 KiB ring buffer on trio through anyio: it drops, and says how many
        ["examples.ringbuf_stream", "--count", "20000", "--backend", "trio", "--ring-kib", "64"],
    ],
    ids=["trio", "trio-ringbuf", "ringbuf-asyncio", "ringbuf-trio-small"],
)
def test_example_accounts_for_every_sample(kernel: None, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    found = COUNTS.search(done.stdout)
    assert found, done.stdout
    samples, lost, produced = map(int, found.groups())
    assert samples + lost == produced == 20000
    assert samples > 0
    assert done.stderr == ""

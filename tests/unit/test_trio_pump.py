"""The trio binding's system task yields after every round of work (issue 28): a drain
timer whose deadline stays in the past (as an ordered stream's did while its consumer
waited) must not keep the other tasks from running. Run in a child process with a
timeout: a task that never yields freezes trio, and would hang the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import trio
    from aperf._waiting.trio import TrioBinding

    async def main():
        binding = TrioBinding("fd")
        ticks = 0

        def tick():
            nonlocal ticks
            ticks += 1
            binding.schedule(binding.time() - 1.0, tick)  # due again at once, for ever

        binding.schedule(binding.time(), tick)
        with trio.fail_after(10):
            for _ in range(3):
                # Another task gets its turn only if the pump gave the scheduler one.
                await trio.lowlevel.checkpoint()
        binding.stop()
        print("ticks", ticks)

    trio.run(main)
    """)


def test_a_timer_always_due_still_lets_other_tasks_run() -> None:
    pytest.importorskip("trio")
    try:
        done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                              timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the trio run froze: the pump ran its timer without yielding")
    assert done.returncode == 0, done.stderr
    word, ticks = done.stdout.split()
    assert word == "ticks" and int(ticks) >= 1  # the pump ran, and so did the others

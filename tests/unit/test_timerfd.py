"""The asyncio binding's drain timer on a timerfd (issue 23): it fires once per arming, a
re-arm replaces the last, None disarms, and stop() closes the fd; uvloop keeps call_at."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from aperf._waiting.asyncio import AsyncioBinding

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="timerfd is Linux's")


@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_the_timerfd_fires_once_per_arming_and_is_closed_by_stop(use_uvloop: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        binding = AsyncioBinding(loop, "fd")
        fired: list[str] = []
        done = loop.create_future()

        def second() -> None:
            fired.append("second")
            done.set_result(None)

        binding.schedule(loop.time() + 0.001, lambda: fired.append("first"))
        binding.schedule(loop.time() + 0.002, second)  # replaces the first
        await asyncio.wait_for(done, 5)
        assert fired == ["second"]
        if use_uvloop:  # its timers are not rounded up: call_at
            assert binding._timerfd is None
            binding.stop()
            return
        binding.schedule(loop.time(), lambda: fired.append("disarmed"))
        binding.schedule(None, lambda: fired.append("none"))
        await asyncio.sleep(0.01)
        assert fired == ["second"]
        timerfd = binding._timerfd
        assert timerfd is not None
        fd = timerfd.fd
        binding.stop()
        with pytest.raises(OSError):
            os.fstat(fd)
        # After stop, a late schedule falls back to call_at and holds no fd.
        binding.schedule(loop.time(), lambda: fired.append("after stop"))
        await asyncio.sleep(0.01)
        assert binding._timerfd is None and fired[-1] == "after stop"
        binding.stop()

    if use_uvloop:
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())

"""A source that ends for good (a map taken over by another process): the reader
delivers what the rings hold, then the error, on every loop, without the kernel."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import anyio
import pytest

import aperf
from aperf._rings.seam import SourceEnded
from aperf.testing import FakeRingSource

from ..helpers import past_the_first_look


class EndingSource(FakeRingSource):
    """A fake source with a notice handle (an eventfd): once signalled, it ends."""

    def __init__(self, *, drain: bool = True) -> None:
        super().__init__(cpus=[0, 1])
        self.notice = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.drain = drain
        self.acknowledged = 0

    @property
    def notices(self) -> list[int]:
        return [self.notice]

    def acknowledge(self, handle: int) -> None:
        if handle != self.notice:
            super().acknowledge(handle)
            return
        self.acknowledged += 1
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.notice)
        raise SourceEnded(aperf.TakenOverError("fake", 7, 1234), drain=self.drain)

    def close_notice(self) -> None:
        os.close(self.notice)


@pytest.mark.anyio
@pytest.mark.parametrize("drain", [True, False])
async def test_the_error_comes_after_every_event_the_rings_held(drain: bool) -> None:
    source = EndingSource(drain=drain)
    got: list[Any] = []
    try:
        # Every 1000th sample wakes the reader and the drain timer looks once a minute:
        # the 30 below wait in the rings.
        wakeup = aperf.Wakeup.every(1000, max_latency=60)
        async with aperf.PerfStream(source, wakeup=wakeup) as stream:
            await past_the_first_look(stream, source)
            for i in range(30):
                assert source.write(i % 2, i.to_bytes(4, "little"))
            os.eventfd_write(source.notice, 1)
            with pytest.raises(aperf.TakenOverError, match="taken over by pid 1234"):
                with anyio.fail_after(10):
                    async for event in stream:
                        got.append(event)
            assert stream.statistics().pending == 0
    finally:
        source.close_notice()
    if drain:
        assert sorted(int.from_bytes(e.data[:4], "little") for e in got) == list(range(30))
    else:
        assert got == []  # the rings are no longer ours: nothing is taken from them
    assert source.acknowledged >= 1


def test_poll_raises_it_after_the_callbacks_had_every_event() -> None:
    source = EndingSource()
    got: list[Any] = []
    try:
        with aperf.PerfBuffer(source, on_sample=got.append,
                              wakeup=aperf.Wakeup.every(1000, max_latency=60)) as pb:
            for i in range(30):
                assert source.write(0, i.to_bytes(4, "little"))
            os.eventfd_write(source.notice, 1)
            with pytest.raises(aperf.TakenOverError):
                for _ in range(10):
                    pb.poll(1000)
    finally:
        source.close_notice()
    assert [int.from_bytes(e.data[:4], "little") for e in got] == list(range(30))

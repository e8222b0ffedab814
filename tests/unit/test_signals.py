"""``aperf.closing_on_signals`` in this process, on every loop (asyncio, uvloop, trio), with
no ring: what it closes, which signal it records, what it puts back, what it refuses.
tests/kernel/test_signals.py sends the real SIGINT/SIGTERM to a program reading a kernel ring."""

from __future__ import annotations

import os
import signal
import threading

import anyio
import pytest

import aperf

pytestmark = pytest.mark.anyio


class Closable:
    def __init__(self, fails: bool = False) -> None:
        self.closes = 0
        self.fails = fails

    def close(self) -> None:
        self.closes += 1
        if self.fails:
            raise OSError("this close fails")


async def until_closed(thing: Closable) -> None:
    with anyio.fail_after(10):
        while not thing.closes:
            await anyio.sleep(0.001)


async def test_the_signal_closes_each_resource_once_and_is_recorded() -> None:
    first, second, late = Closable(), Closable(), Closable()
    called: list[str] = []
    before = signal.getsignal(signal.SIGUSR1)
    async with aperf.closing_on_signals(
        first, lambda: called.append("called"), second, signals=[signal.SIGUSR1]
    ) as stop:
        assert stop.signal is None
        os.kill(os.getpid(), signal.SIGUSR1)
        await until_closed(first)
        stop.add(late)  # after the signal: closed at once
        assert (first.closes, second.closes, late.closes, called) == (1, 1, 1, ["called"])
        assert stop.signal is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


async def test_leaving_puts_back_the_loops_own_ctrl_c_handling() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with aperf.closing_on_signals(Closable()) as stop:  # a plain with works too
        assert stop.signals == (signal.SIGINT, signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is not before[signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def test_a_close_that_fails_is_raised_when_leaving() -> None:
    failing = Closable(fails=True)
    with pytest.raises(OSError, match="this close fails"):
        async with aperf.closing_on_signals(failing, signals=[signal.SIGUSR2]):
            os.kill(os.getpid(), signal.SIGUSR2)
            await until_closed(failing)


async def test_outside_the_main_thread_it_says_why() -> None:
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            with aperf.closing_on_signals(Closable()):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert isinstance(errors[0], RuntimeError)
    assert "main thread" in str(errors[0])


@pytest.mark.parametrize(
    ("signals", "message"),
    [
        ([signal.SIGKILL], "SIGKILL cannot be caught"),
        ([], "signals is empty"),
        (["SIGINT"], "signals must be signal numbers, not 'SIGINT'"),
        ([10_000], "10000 is not a signal"),
    ],
)
def test_signals_that_cannot_close_anything_are_refused(
    signals: list[object], message: str
) -> None:
    with pytest.raises(aperf.ArgumentError, match=message) as caught:
        aperf.closing_on_signals(Closable(), signals=signals)  # type: ignore[arg-type]
    assert caught.value.argument == "signals"


def test_without_a_loop_it_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="needs a running event loop"), (
        aperf.closing_on_signals(Closable())
    ):
        pass

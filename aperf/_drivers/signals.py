"""Close streams on SIGINT and SIGTERM, on whichever loop runs: asyncio, uvloop, trio, anyio.

``loop.add_signal_handler`` exists on asyncio's loops only: under ``trio.run`` it
is not there at all. Each loop has its own safe way in from a signal, and this
module picks it by ``sniffio``:

- asyncio and uvloop (and anyio on asyncio): ``loop.add_signal_handler``, which
  runs the handler as a loop callback; where the loop has none (Windows),
  ``signal.signal`` with ``loop.call_soon_threadsafe``.
- trio (and anyio on trio): ``signal.signal`` with ``TrioToken.run_sync_soon``,
  the one trio call that is safe from a signal handler.

Either way the closes run on the loop, between two callbacks: nothing is
interrupted in the middle of a line and no task is cancelled.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from types import FrameType, TracebackType
from typing import Any, Protocol

if sys.version_info >= (3, 11):
    from typing import Self
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Self

import sniffio

from .._errors import ArgumentError

DEFAULT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}

_LOOP_TRAMPOLINES = ("asyncio.unix_events", "uvloop.loop")
_PythonHandler = Callable[[int, FrameType | None], Any] | int | None


class SupportsClose(Protocol):
    """Anything with a ``close()`` that takes no argument (a `PerfStream`, ...)."""

    def close(self) -> None: ...


Closable = SupportsClose | Callable[[], object]
"""What a signal closes: an object with ``close()``, or a function to call."""


class SignalCloser:
    """While entered, each of its signals closes every resource given or added.

    Made by [`closing_on_signals()`][aperf.closing_on_signals]; use it as ``with``
    or ``async with`` inside a running asyncio, uvloop, trio or anyio loop, in the
    main thread (the only thread signals reach).
    """

    def __init__(self, resources: Iterable[Closable], signals: Iterable[int]) -> None:
        self.signals: tuple[signal.Signals, ...] = _checked(signals)
        self.signal: signal.Signals | None = None
        """The first signal that came (None until one did)."""
        self._resources = list(resources)
        self._failures: list[BaseException] = []
        self._previous: dict[signal.Signals, _PythonHandler] = {}
        self._restore: Callable[[], None] | None = None

    def add(self, resource: Closable) -> None:
        """Close ``resource`` too at the signal (call it, if it is a function); at once
        if the signal came already.

        For what is made after the handlers are in place (a stream opened after a
        BPF object loaded under them).
        """
        self._resources.append(resource)
        if self.signal is not None:
            self._close(resource)

    # --- entering and leaving --------------------------------------------------------

    def __enter__(self) -> Self:
        if self._restore is not None:
            raise RuntimeError("closing_on_signals() is already entered")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "closing_on_signals() must be entered in the main thread: "
                "Python delivers signals there only"
            )
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            raise RuntimeError(
                "closing_on_signals() needs a running event loop (asyncio, uvloop, trio or "
                "anyio); without one, catch KeyboardInterrupt (docs/ctrl-c.md)"
            ) from None
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
        if library == "trio":
            self._restore = self._install_trio()
        elif library == "asyncio":
            self._restore = self._install_asyncio()
        else:
            raise RuntimeError(f"closing_on_signals() does not know the {library!r} loop")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()
        if self._failures and exc is None:
            raise self._failures[0]  # a close that failed in the handler, not lost

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(kind, exc, tb)

    # --- per loop -----------------------------------------------------------------------

    def _install_asyncio(self) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        try:
            for sig in self.signals:
                loop.add_signal_handler(sig, self._on_signal, sig)
        except NotImplementedError:  # Windows' loops: no add_signal_handler
            return self._install_python(loop.call_soon_threadsafe)

        def restore() -> None:
            for sig in self.signals:
                loop.remove_signal_handler(sig)
            self._put_back_previous()

        return restore

    def _install_trio(self) -> Callable[[], None]:
        import trio

        return self._install_python(trio.lowlevel.current_trio_token().run_sync_soon)

    def _install_python(self, schedule: Callable[..., object]) -> Callable[[], None]:
        """``signal.signal``; the handler only hands the work to the loop (``schedule``)."""

        def handler(number: int, frame: FrameType | None) -> None:
            schedule(self._on_signal, signal.Signals(number))

        for sig in self.signals:
            signal.signal(sig, handler)
        return self._put_back_previous

    def _put_back_previous(self) -> None:
        for sig, previous in self._previous.items():
            # A loop's own handler (another add_signal_handler) is only the loop's
            # trampoline: put back alone it would swallow the signal.
            if previous is None or getattr(previous, "__module__", "") in _LOOP_TRAMPOLINES:
                continue
            if signal.getsignal(sig) is not previous:
                signal.signal(sig, previous)
        self._previous.clear()

    # --- on the loop, at a signal ---------------------------------------------------------

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.signal is None:
            self.signal = sig
        for resource in self._resources:
            self._close(resource)

    def _close(self, resource: Closable) -> None:
        close = resource.close if hasattr(resource, "close") else resource
        try:
            close()
        except Exception as exc:  # raised where it is seen: out of the with block
            self._failures.append(exc)


def closing_on_signals(
    *resources: Closable, signals: Iterable[int] = DEFAULT_SIGNALS
) -> SignalCloser:
    """Close ``resources`` when one of ``signals`` (default SIGINT and SIGTERM) comes,
    on any loop: asyncio, uvloop, trio, and anyio on either backend.

    <!-- runs until Ctrl-C; runs until SIGTERM; expect: ^stopped by SIG(INT|TERM)$ -->
    ```python
    import anyio

    import aperf
    from aperf.testing import FakeRingSource


    async def main() -> None:
        src = FakeRingSource(cpus=[0], ring_bytes=4096)  # rings in memory: no root
        async with aperf.PerfStream(src) as stream, aperf.closing_on_signals(stream) as stop:
            src.write(0, b"hello")
            async for event in stream:  # ends on Ctrl-C or SIGTERM, after what was read
                print(event.data[:5], flush=True)
        print("stopped by", stop.signal.name if stop.signal else "the end of the stream")


    anyio.run(main)  # or asyncio.run(main()), trio.run(main), uvloop.run(main())
    ```

    Closing a stream ends an ``async for`` over it (and ``await stream.run()``)
    once the events it had read are handed out. The closes run on the loop,
    between two callbacks, so nothing is interrupted mid-line and no task is
    cancelled; a close that raises makes leaving the block raise it.

    Args:
        *resources: what to close: anything with a ``close()`` method (a
            [`PerfStream`][aperf.PerfStream], a `PerfBuffer`, ...), or a function
            to call instead (``event.set``, ``task.cancel``, ``scope.cancel``).
            [`SignalCloser.add()`][aperf.SignalCloser.add] adds more later, e.g. a
            stream opened after the handlers went in.
        signals: the signals that close them (not SIGKILL or SIGSTOP, which
            cannot be caught).

    Returns:
        A [`SignalCloser`][aperf.SignalCloser], for ``with`` or ``async with``,
        entered in the main thread inside a running loop. Leaving it puts back
        the Python signal handlers that were there before (e.g. asyncio.run's
        or trio's own Ctrl-C handling). Its ``signal`` attribute says which
        signal came, if one did.

    Raises:
        ArgumentError: a signal that cannot be caught, or not a signal at all.
        RuntimeError: entered without a running loop, or outside the main thread.
    """
    return SignalCloser(resources, signals)


def _checked(signals: Iterable[int]) -> tuple[signal.Signals, ...]:
    checked: list[signal.Signals] = []
    for sig in signals:
        if isinstance(sig, bool) or not isinstance(sig, int):
            raise ArgumentError("signals", f"signals must be signal numbers, not {sig!r}")
        try:
            number = signal.Signals(sig)
        except ValueError:
            raise ArgumentError("signals", f"{sig} is not a signal on this system") from None
        if number in _UNCATCHABLE:
            raise ArgumentError("signals", f"{number.name} cannot be caught")
        if number not in checked:
            checked.append(number)
    if not checked:
        raise ArgumentError("signals", "signals is empty: no signal would close anything")
    return tuple(checked)

"""Waiting, in one place: the only code that chooses how a driver waits.

- ``base``: the protocols (``LoopBinding`` for ``PerfStream``, ``HandleWaiter``
  for ``PerfBuffer``) and the handle vocabulary (``HandleKind``, ``OnHandle``);
- ``asyncio``: asyncio and uvloop (and Windows wait handles on them);
- ``trio``: trio, and anyio on trio (imported only under trio: trio is optional);
- ``epoll``: the sync driver's wait on fds;
- ``win32``: Windows wait handles without a loop (``Win32Waiter``) and the waiter
  threads; ``trio_win32``: those handles under trio (both imported only for a
  "win32" handle kind).

Another loop or another kind of handle plugs in here, in ``current_binding()``
or ``handle_waiter()``.
"""

from __future__ import annotations

# Not ``import asyncio``: importing the submodule .asyncio rebinds that name here.
from asyncio import get_running_loop
from collections.abc import Iterable

import sniffio

from .._errors import AperfError
from .asyncio import AsyncioBinding, ProactorHandleBinding, ThreadedHandleBinding
from .base import HandleKind, HandleWaiter, LoopBinding
from .epoll import EpollWaiter


def current_binding(kind: HandleKind) -> LoopBinding:
    """The binding for the running event loop (called inside the loop)."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        raise AperfError(
            "PerfStream needs a running event loop (asyncio, uvloop or trio, directly or "
            "through anyio); for no event loop use aperf.PerfBuffer"
        ) from None
    if library == "trio":
        from .trio import TrioBinding  # trio is an optional dependency

        return TrioBinding(kind)
    if library != "asyncio":
        raise AperfError(f"PerfStream runs on asyncio, uvloop or trio, not on {library}")
    loop = get_running_loop()
    if kind == "win32":
        proactor = getattr(loop, "_proactor", None)
        if proactor is not None and hasattr(proactor, "wait_for_handle"):
            return ProactorHandleBinding(loop, kind, proactor)
        return ThreadedHandleBinding(loop, kind)
    return AsyncioBinding(loop, kind)


def handle_waiter(kind: HandleKind, handles: Iterable[int]) -> HandleWaiter:
    """What ``PerfBuffer`` waits with on these handles, without an event loop."""
    if kind == "win32":
        from .win32 import Win32Waiter

        return Win32Waiter(handles)
    return EpollWaiter(handles)

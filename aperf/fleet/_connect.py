"""Connecting to NATS and checking the JetStream stream, with one typed error per mistake.

nats-py either retries a failed first connection for ever (``max_reconnect_attempts=-1``)
or gives up on later outages too. aperf wants both: reconnect for ever once
connected, yet fail fast and clearly when the first connection cannot be made.
So the first connection runs with unlimited attempts under a deadline, and an
authorization violation (which no retry cures) ends it at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, StorageType, StreamConfig, StreamInfo

from .._log import log
from ._args import url_problem
from ._errors import FleetConfigError

Servers = str | Sequence[str]
Callback = Callable[[], Awaitable[None]]

DEFAULT_JETSTREAM = "APERF"
DEFAULT_PREFIX = "aperf"
RECONNECT_WAIT = 0.25  # seconds between reconnection attempts: a restart is seen within this


def server_list(servers: object) -> list[str]:
    if isinstance(servers, str):
        servers = [servers]
    if (
        not isinstance(servers, Sequence)
        or not servers
        or not all(isinstance(s, str) and s for s in servers)
    ):
        raise TypeError(f"servers must be a NATS URL or a list of them, not {servers!r}")
    for url in servers:
        problem = url_problem(url)
        if problem:
            shown = _without_password(url)
            raise FleetConfigError("servers", f"{shown!r} is not a NATS URL: {problem}")
    return list(servers)


async def connect(
    servers: Servers,
    *,
    timeout: float,
    name: str,
    on_error: Callable[[Exception], None] | None = None,
    disconnected: Callback | None = None,
    reconnected: Callback | None = None,
    options: Mapping[str, Any] | None = None,
) -> Client:
    """A connected client that reconnects for ever, or FleetConfigError within ``timeout``."""
    urls = server_list(servers)
    if timeout <= 0:
        raise ValueError(f"connect_timeout must be positive seconds, not {timeout!r}")
    errors: list[Exception] = []
    refused = asyncio.Event()

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)
        del errors[:-3]
        if isinstance(exc, nats.errors.AuthorizationError) or "Authorization Violation" in str(
            exc
        ):
            refused.set()
        if on_error is not None:
            on_error(exc)

    client = Client()
    settings: dict[str, Any] = {
        "name": name,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT,
        "connect_timeout": min(timeout, 2.0),
        "error_cb": error_cb,
    }
    if disconnected is not None:
        settings["disconnected_cb"] = disconnected
    if reconnected is not None:
        settings["reconnected_cb"] = reconnected
    settings.update(options or {})
    attempt = asyncio.ensure_future(client.connect(urls, **settings))
    gave_up = asyncio.ensure_future(refused.wait())
    try:
        await asyncio.wait({attempt, gave_up}, timeout=timeout, return_when="FIRST_COMPLETED")
    finally:
        gave_up.cancel()
    if attempt.done() and attempt.exception() is None and client.is_connected:
        log.debug("connected to NATS", servers=urls, url=str(client.connected_url))
        return client
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    await client.close()
    shown = ", ".join(_without_password(u) for u in urls)
    if refused.is_set():
        raise FleetConfigError(
            "servers", f"the NATS server at {shown} refused the credentials "
            "(Authorization Violation): check the user and password or token"
        )
    last = errors[-1] if errors else (attempt.exception() if attempt.done() else None)
    why = f": {type(last).__name__}: {last}" if last is not None else ""
    raise FleetConfigError(
        "servers", f"no NATS server answered at {shown} within {timeout:g} s{why}"
    )


def _without_password(url: str) -> str:
    scheme, sep, rest = url.rpartition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return f"{scheme}{sep}{rest}"


_NO_JETSTREAM = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    nats.js.errors.ServiceUnavailableError,
)


def _no_jetstream(exc: Exception) -> FleetConfigError:
    return FleetConfigError(
        "servers", f"the NATS server has no JetStream ({exc}); start nats-server with -js"
    )


async def stream_info(js: JetStreamContext, jetstream: str) -> StreamInfo:
    """The stream's info, or FleetConfigError if JetStream is off or the stream is missing."""
    try:
        return await js.stream_info(jetstream)
    except nats.js.errors.NotFoundError:
        raise FleetConfigError(
            "jetstream", f"the JetStream stream {jetstream!r} does not exist; create it "
            "(aperf.fleet.create_stream, or python -m aperf.fleet create-stream)"
        ) from None
    except _NO_JETSTREAM as exc:
        raise _no_jetstream(exc) from None


async def check_stream(js: JetStreamContext, jetstream: str, subject: str) -> StreamInfo:
    """The info of stream ``jetstream``; FleetConfigError unless JetStream is on and that
    stream takes ``subject``."""
    try:
        found: str | None = await js.find_stream_name_by_subject(subject)
    except nats.js.errors.NotFoundError:
        found = None
    except _NO_JETSTREAM as exc:
        raise _no_jetstream(exc) from None
    info = await stream_info(js, jetstream)
    if found == jetstream:
        return info
    subjects = ", ".join(info.config.subjects or []) or "none"
    raise FleetConfigError(
        "jetstream", f"the JetStream stream {jetstream!r} does not take subject {subject!r} "
        f"(its subjects: {subjects}"
        + (f"; stream {found!r} takes it" if found else "") + ")"
    )


async def create_stream(
    servers: Servers,
    *,
    jetstream: str = DEFAULT_JETSTREAM,
    subject_prefix: str = DEFAULT_PREFIX,
    max_bytes: int | None = 1 << 30,
    max_age: float | None = None,
    max_msgs: int | None = None,
    discard: str = "old",
    memory: bool = False,
    connect_timeout: float = 5.0,
    connect_options: Mapping[str, Any] | None = None,
) -> None:
    """Create (or update) the JetStream stream that takes ``<subject_prefix>.>``.

    Its limits bound what the fleet keeps: with ``discard="old"`` the oldest
    messages go when a limit is hit (readers then see a [`Gap`][aperf.fleet.Gap]), with
    ``discard="new"`` publishing stops instead (sinks stop taking from their
    streams, and the kernels count the drops). File storage unless ``memory``.
    """
    if discard not in ("old", "new"):
        raise ValueError(f"discard must be 'old' or 'new', not {discard!r}")
    client = await connect(
        servers, timeout=connect_timeout, name="aperf-create-stream", options=connect_options
    )
    try:
        config = StreamConfig(
            name=jetstream,
            subjects=[f"{subject_prefix}.>"],
            max_bytes=max_bytes if max_bytes is not None else -1,
            max_age=max_age,
            max_msgs=max_msgs if max_msgs is not None else -1,
            discard=DiscardPolicy.OLD if discard == "old" else DiscardPolicy.NEW,
            storage=StorageType.MEMORY if memory else StorageType.FILE,
            duplicate_window=120.0,
        )
        js = client.jetstream()
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)  # exists already: apply these limits
        except _NO_JETSTREAM as exc:
            raise _no_jetstream(exc) from None
    finally:
        await client.close()

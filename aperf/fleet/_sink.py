"""The sink: forward a perf stream into JetStream, without blocking the kernel side
more than a bounded window allows and without losing anything silently.

Flow control is a window of published-but-unacknowledged messages. When it is
full (JetStream slow), or the connection is down, ``JetStreamSink.send()``
waits, so ``JetStreamSink.forward()`` stops taking from the stream: aperf's
bounded queue fills, the stream stops reading the rings, the kernel counts what
it drops, and those ``Lost`` notices are forwarded, in order, once the window
opens again. Memory is bounded by the window whatever the outage; nothing is
buffered beyond it.

Every message carries a ``Nats-Msg-Id`` (host, stream, run id, first sequence
number, and the message's tag: a keyed hash no one else can compute before the
sink publishes), so a retry of a message JetStream did store is de-duplicated,
and no third party can claim a message's id first to make JetStream drop it. A message
is retried when its acknowledgement has not come within ``ack_timeout`` (doubling
up to 8x), when JetStream answers with a temporary error, and, all of them in
order, after every reconnection. A message is given up only when JetStream
rejects it for good or the sink is closed before it was acknowledged; either is
counted in ``statistics().dropped`` with its reason, and readers see it as a Gap.

Those rules are ``_window.py``'s, sans I/O; this module is their I/O: it connects,
publishes what the window puts in flight, hands it the acknowledgements and the
connection's ups and downs, and wakes whoever waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import types
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from .._log import log
from ._args import check_int, check_name, check_seconds
from ._clock import BOOT_OFFSET_HEADER, boot_offset_ns
from ._connect import (
    DEFAULT_JETSTREAM,
    DEFAULT_PREFIX,
    NatsOptions,
    Path,
    Refusals,
    Servers,
    auth,
    check_stream,
    connect,
    resolve_options,
)
from ._errors import FleetAuthError, FleetClosedError, FleetConfigError
from ._events import SinkStatistics
from ._signing import SIGNATURE_HEADER, KeyPath, load_signing_key, sign
from ._window import Ack, Pending, Window
from ._wire import MIN_MESSAGE_BYTES, Framer, subject_token

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DEFAULT_BATCH = 256
DEFAULT_WINDOW = 32
DEFAULT_MESSAGE_BYTES = 1 << 20


class BatchSource(Protocol):
    """What ``JetStreamSink.forward()`` reads: a [`PerfStream`][aperf.PerfStream], or alike."""

    def batches(self, max_items: int = ...) -> AsyncIterator[list[Any]]: ...


class JetStreamSink:
    """Forward aperf events to JetStream subject ``<subject_prefix>.<host>.<name>``.

    <!-- not run: a fragment, against a server at nats://nats:4222 (tests/fleet/test_fleet.py) -->
    ```python
    async with JetStreamSink("nats://nats:4222", name="exec") as sink:
        async with aperf.PerfStream(m) as stream:   # decoder=None: raw bytes travel
            await sink.forward(stream)              # until the stream closes
    ```

    ``batch`` is the most samples per message, ``window`` the most messages
    published and not yet acknowledged, ``max_message_bytes`` the most bytes per
    message (capped by the server's max_payload). ``servers`` is a NATS URL (it
    may hold ``user:password@``) or a list of them (the nodes of a cluster);
    ``connect_options`` go to ``nats.connect`` as they are. ``servers`` may instead be a
    [`NatsOptions`][aperf.fleet.NatsOptions], which holds the URLs and every connection
    keyword below (credentials, TLS, ``allow_insecure``, the two timeouts,
    ``connect_options``) in one value that a reader and ``create_stream()`` take too;
    those keywords are then not given here.

    Who the sink is to the server: ``user`` and ``password``, or ``token``, or
    ``creds`` (a ``.creds`` file: a user JWT and its nkey seed, as ``nsc`` makes
    them). ``tls_ca`` is the CA file that signed the server's certificate (TLS;
    ``tls://`` URLs use the system's CAs without it), ``tls_cert`` and ``tls_key``
    the client certificate for servers that verify clients. Asking for TLS in any
    way (those, or a ``tls://`` URL) requires it: a server that offers none is
    refused with [`FleetInsecureError`][aperf.fleet.FleetInsecureError] before
    anything is sent; ``tls_handshake_first`` starts TLS before the server's INFO
    (servers configured with ``handshake_first``, nats-server 2.10.4 on). Without
    TLS a password or token goes only to a server on this host (loopback, with a
    [`FleetInsecureWarning`][aperf.fleet.FleetInsecureWarning]), elsewhere only
    with ``allow_insecure=True`` (docs/fleet.md: what is promised). Its replies come on
    inboxes under ``_INBOX.aperf.<host>``: a host's user needs permission to
    publish on ``<subject_prefix>.<host>.>`` and a few JetStream API subjects and to
    subscribe there, no more (docs/fleet.md gives a server configuration). A
    publish the server refuses (the user may not publish as this host) raises
    [`FleetAuthError`][aperf.fleet.FleetAuthError] from the next ``send()`` or
    ``flush()``, and what was in flight is counted as dropped.

    ``open()`` waits up to ``connect_timeout`` seconds for a server, then up to
    ``ready_timeout`` for JetStream to serve (a cluster without quorum, or electing
    a leader, does not), and raises
    [`FleetUnavailableError`][aperf.fleet.FleetUnavailableError] if it does not.
    """

    def __init__(
        self,
        servers: Servers | NatsOptions,
        *,
        host: str | None = None,
        name: str = "perf",
        jetstream: str = DEFAULT_JETSTREAM,
        subject_prefix: str = DEFAULT_PREFIX,
        batch: int = DEFAULT_BATCH,
        window: int = DEFAULT_WINDOW,
        max_message_bytes: int = DEFAULT_MESSAGE_BYTES,
        ack_timeout: float = 2.0,
        connect_timeout: float = 5.0,
        connect_options: Mapping[str, Any] | None = None,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        creds: Path | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        ready_timeout: float = 10.0,
        tls_handshake_first: bool = False,
        allow_insecure: bool = False,
        signing_key: Ed25519PrivateKey | KeyPath | None = None,
    ) -> None:
        self._nats = resolve_options(
            servers, connect_options=connect_options, user=user, password=password,
            token=token, creds=creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_handshake_first=tls_handshake_first, allow_insecure=allow_insecure,
            connect_timeout=connect_timeout, ready_timeout=ready_timeout,
        )
        self._host = host if host is not None else socket.gethostname()
        check_name("host", self._host)
        check_name("name", name)
        check_name("jetstream", jetstream)
        check_name("subject_prefix", subject_prefix)
        self._name = name
        self._jetstream = jetstream
        self._batch = check_int("batch", batch, 1, 65535)
        window = check_int("window", window, 1, 1 << 16)
        # At least one 64 KiB sample (the most a perf record holds) and its header.
        self._max_bytes = check_int(
            "max_message_bytes", max_message_bytes, MIN_MESSAGE_BYTES, 64 << 20
        )
        ack_timeout = check_seconds("ack_timeout", ack_timeout)
        self._signing_key = None if signing_key is None else load_signing_key(signing_key)
        self._refusals = Refusals()
        tokens = f"{subject_token(self._host)}.{subject_token(name)}"
        self._subject = f"{subject_prefix}.{tokens}"
        self._inbox_prefix = f"_INBOX.aperf.{subject_token(self._host)}"
        self._epoch = int.from_bytes(os.urandom(8), "little")
        self._id_prefix = f"{tokens}.{self._epoch:016x}."
        # What is in flight, numbered, published again and settled: decided there (sans
        # I/O), published here.
        self._window = Window(window, ack_timeout)
        self._nc: Client | None = None
        self._inbox = ""
        self._headers: dict[str, str] = {}  # sent with every message (_clock.py)
        self._supervisor: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # an ack, a drop, a (re)connection, a failure
        self._wake = asyncio.Event()  # the supervisor has something to look at
        self._failure: BaseException | None = None
        self._closing = False
        self._closed = False
        self._closed_event = asyncio.Event()

    # --- opening and closing -----------------------------------------------------------

    async def open(self) -> None:
        """Connect, check that the JetStream stream takes this sink's subject, start."""
        if self._closed:
            raise FleetClosedError("this JetStreamSink was closed; make a new one")
        if self._nc is not None:
            return
        nc = await connect(
            self._nats.servers,
            timeout=self._nats.connect_timeout,
            name=f"aperf-sink {self._host}/{self._name}",
            on_error=self._on_error,
            disconnected=self._on_disconnected,
            reconnected=self._on_reconnected,
            options=self._nats.connect_options,
            auth=auth(self._nats),
            refusals=self._refusals,
            inbox_prefix=self._inbox_prefix,
        )
        try:
            info = await check_stream(
                nc, nc.jetstream(), self._jetstream, self._subject,
                timeout=self._nats.ready_timeout, refusals=self._refusals,
            )
            if nc.max_payload < MIN_MESSAGE_BYTES:
                raise FleetConfigError(
                    "servers", f"the server's max_payload ({nc.max_payload} bytes) is below "
                    f"the {MIN_MESSAGE_BYTES} bytes a 64 KiB sample needs"
                )
            # Messages as large as the stream takes (headers and subject count toward
            # its max_msg_size; 512 bytes is room for ours). A sample too large even
            # alone is still sent, refused, and counted as dropped.
            limit = info.config.max_msg_size or -1
            max_bytes = min(self._max_bytes, nc.max_payload)
            if limit > 0:
                max_bytes = min(max_bytes, max(limit - 512, 1024))
            self._inbox = nc.new_inbox() + "."
            offset = boot_offset_ns()  # so that readers can time this host's events
            self._headers = {} if offset is None else {BOOT_OFFSET_HEADER: str(offset)}
            await nc.subscribe(self._inbox + "*", cb=self._on_ack)
        except BaseException:
            await nc.close()
            raise
        self._window.opened(Framer(
            self._host, self._name, self._epoch, max_events=self._batch, max_bytes=max_bytes
        ))
        self._nc = nc
        self._supervisor = asyncio.ensure_future(self._supervise())
        log.info(
            "fleet sink opened", subject=self._subject, jetstream=self._jetstream,
            epoch=f"{self._epoch:016x}", window=self._window.size, batch=self._batch,
        )

    async def __aenter__(self) -> JetStreamSink:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self, timeout: float = 5.0) -> None:
        """Wait up to ``timeout`` seconds for the acknowledgements still due, give up the
        rest (counted as dropped), publish the end-of-stream message, disconnect.

        Callable from another task: a ``send()`` waiting for room raises
        [`FleetClosedError`][aperf.fleet.FleetClosedError] at once.
        """
        if self._closing:  # closed, or being closed by another task: wait for it
            await self._closed_event.wait()
            return
        self._closing = True  # no new messages: send() raises from now on
        self._changed.set()
        nc = self._nc
        try:
            if nc is not None and self._failure is None:
                with contextlib.suppress(asyncio.TimeoutError, FleetClosedError):
                    await asyncio.wait_for(self.flush(), timeout)
            self._window.give_up_all("unacknowledged when the sink closed")
            self._changed.set()  # a flush() in another task: nothing is in flight now
            refused = isinstance(self._failure, FleetAuthError)  # the end would be refused too
            framer = self._window.framer
            if nc is not None and framer is not None and nc.is_connected and not refused:
                await self._publish_bridges(nc)
                await self._publish_end(nc, framer, timeout)
        finally:
            self._closed = True
            self._closed_event.set()
            self._changed.set()
            if self._supervisor is not None:
                # Python 3.11's wait_for can swallow a cancel that meets a wakeup: the
                # supervisor also stops when it sees the sink closed, which the wake makes it see.
                self._wake.set()
                self._supervisor.cancel()
                await asyncio.gather(self._supervisor, return_exceptions=True)
            if nc is not None:
                await nc.close()
        log.info("fleet sink closed", subject=self._subject, **_summary(self.statistics()))

    async def _publish_end(self, nc: Client, framer: Framer, timeout: float) -> None:
        msg_id = f"{self._id_prefix}end.{framer.tag(framer.next_seq).hex()}"
        payload = framer.end()
        try:
            await nc.request(
                self._subject, payload, timeout=min(timeout, self._window.ack_timeout),
                headers=self._signed({"Nats-Msg-Id": msg_id}, payload),
            )
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            # Readers then lack only the final watermark: holes at the very end of
            # this stream stay open instead of being reported as Gaps.
            log.warning("fleet sink: end-of-stream message not stored", error=str(exc))

    # --- forwarding ----------------------------------------------------------------------

    async def forward(self, stream: BatchSource) -> None:
        """Forward every event of an open [`aperf.PerfStream`][aperf.PerfStream] until it closes.

        Open the stream with ``decoder=None``: the raw bytes are what travels, and a
        reader decodes them. Backpressure reaches the stream: this stops taking from
        it while the window is full or the server is away.
        """
        async for batch in stream.batches(self._batch):
            await self.send(batch)

    async def send(self, events: Sequence[Any]) -> None:
        """Frame ``events`` (Sample, Lost, BadSample, in stream order) and publish them,
        waiting while the window is full or the connection is down."""
        self._require_open()
        window = self._window
        outs = window.frame(events)
        sent = 0
        try:
            for out in outs:
                await self._room()
                headers = {"Nats-Msg-Id": f"{self._id_prefix}{out.first}.{out.tag.hex()}",
                           **self._headers}
                pending = window.put(out, self._signed(headers, out.payload))
                if len(window.inflight) == 1:
                    self._wake.set()  # the supervisor sleeps without a deadline when idle
                sent += 1
                await self._publish(pending)
        finally:
            window.abandon(outs[sent:])  # framed, never published: counted, and a Gap

    async def flush(self) -> None:
        """Wait until every published message is acknowledged (or given up)."""
        while True:
            self._changed.clear()
            self._raise_failure()
            if not self._window.inflight:
                return
            if self._closed:
                raise FleetClosedError("the sink was closed with messages unacknowledged")
            await self._changed.wait()

    def _signed(self, headers: dict[str, str], payload: bytes) -> dict[str, str]:
        """``headers``, with the message's signature if the sink has a key."""
        if self._signing_key is not None:
            headers[SIGNATURE_HEADER] = sign(
                self._signing_key, self._subject, headers.get(BOOT_OFFSET_HEADER), payload
            )
        return headers

    def _require_open(self) -> None:
        self._raise_failure()
        if self._closing:
            raise FleetClosedError("this JetStreamSink is closed")
        if self._window.framer is None:
            raise FleetClosedError("open the JetStreamSink first (async with, or await open())")

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _room(self) -> None:
        while True:
            self._changed.clear()
            self._raise_failure()
            if self._closing:
                raise FleetClosedError("the sink was closed")
            if self._window.room():
                return
            await self._changed.wait()

    async def _publish(self, pending: Pending) -> None:
        nc = self._nc
        assert nc is not None
        self._window.attempt(pending, asyncio.get_running_loop().time())
        out = pending.out
        try:
            await nc.publish(
                self._subject, out.payload, reply=f"{self._inbox}{out.first}",
                headers=pending.headers,
            )
        except (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError):
            pass  # down: all of the window is published again once reconnected
        except nats.errors.ConnectionClosedError:
            self._fail(FleetClosedError("the NATS connection was closed"))

    # --- acknowledgements, retries, reconnections ------------------------------------------

    async def _on_ack(self, msg: Msg) -> None:
        # A nats-py callback: an exception here would only reach error_cb, so any
        # failure is kept and raised by the next send() or flush() instead.
        try:
            self._handle_ack(msg)
        except Exception as exc:  # pragma: no cover - a bug; surfaced, never dropped
            self._fail(exc)

    def _handle_ack(self, msg: Msg) -> None:
        try:
            first = int(msg.subject[len(self._inbox) :])
        except ValueError:
            return
        status = msg.headers.get("Status") if msg.headers else None
        now = asyncio.get_running_loop().time()
        done = self._window.acknowledged(first, status, msg.data, now)
        if done is Ack.STORED or done is Ack.DROPPED:
            self._changed.set()  # room in the window; flush() may be done
        if done is Ack.RETRY or done is Ack.DROPPED:
            self._wake.set()  # a sooner deadline, or a stand-in to publish

    async def _publish_bridges(self, nc: Client) -> None:
        """Publish the stand-ins of the messages given up (best effort: without them,
        readers see the hole as a Gap once a checked watermark passes it)."""
        bridges = self._window.bridges
        while bridges:
            out, payload = bridges[0]
            msg_id = f"{self._id_prefix}{out.first}.{out.tag.hex()}.dropped"
            try:
                await nc.publish(self._subject, payload,
                                 headers=self._signed({"Nats-Msg-Id": msg_id}, payload))
            except nats.errors.Error:
                return  # away: tried again once reconnected (or given up at close)
            del bridges[0]

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._changed.set()

    def _on_error(self, exc: Exception) -> None:
        log.debug("fleet sink: NATS error", subject=self._subject, error=str(exc))
        refused = self._refusals.note(exc)
        if refused is None or self._window.framer is None:
            return  # not a refusal, or one while opening: open() raises it
        # The server dropped what it refused (no acknowledgement will come), and will
        # refuse every message on this subject: fail now, count what was in flight.
        self._fail(FleetAuthError(
            "host", f"the NATS server refused: {refused}; this user may not publish as "
            f"host {self._host!r} (subject {self._subject!r}), or lacks a permission "
            "docs/fleet.md lists"
        ))
        if self._window.give_up_all(f"refused by the NATS server: {refused}"):
            self._wake.set()  # their stand-ins, once the server takes them (it will not)

    async def _on_disconnected(self) -> None:
        if self._window.disconnected():
            log.info("fleet sink: disconnected from NATS", subject=self._subject)
        self._changed.set()

    async def _on_reconnected(self) -> None:
        log.info("fleet sink: reconnected to NATS", subject=self._subject)
        self._window.reconnected()  # everything in flight is published again, in order
        self._wake.set()
        self._changed.set()

    async def _supervise(self) -> None:
        """Re-publish messages whose acknowledgement is overdue, and all after a reconnect."""
        try:
            await self._resend_forever()
        except Exception as exc:  # pragma: no cover - a bug; surfaced by send(), not lost
            self._fail(exc)

    async def _resend_forever(self) -> None:
        loop = asyncio.get_running_loop()
        window = self._window
        while not self._closed:
            self._wake.clear()
            if window.connected and window.bridges and self._nc is not None:
                await self._publish_bridges(self._nc)
            if window.connected and window.inflight:
                now = loop.time()
                for pending in list(window.inflight.values()):
                    if not window.connected:
                        break
                    if window.retry(pending, now):
                        await self._publish(pending)
            deadline = window.next_deadline()
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    # --- introspection -----------------------------------------------------------------

    def statistics(self) -> SinkStatistics:
        """Messages published, acknowledged, retried; samples; drops with their reasons."""
        nc, window = self._nc, self._window
        return SinkStatistics(
            **dataclasses.asdict(window.counts),
            dropped=types.MappingProxyType(dict(window.dropped)),
            in_flight=len(window.inflight),
            in_flight_bytes=window.inflight_bytes,
            connected=window.connected and not self._closed,
            reconnects=nc.stats["reconnects"] if nc is not None else 0,
        )

    @property
    def subject(self) -> str:
        """The NATS subject the sink publishes to: ``<subject_prefix>.<host>.<name>``."""
        return self._subject

    @property
    def host(self) -> str:
        """The host name the messages carry (``host=``, else the machine's name)."""
        return self._host

    @property
    def epoch(self) -> int:
        """Random per sink: with the host and stream name, it tells this run's messages apart."""
        return self._epoch


def _summary(stats: SinkStatistics) -> dict[str, Any]:
    return {
        "published": stats.published,
        "acknowledged": stats.acknowledged,
        "retried": stats.retried,
        "dropped": dict(stats.dropped),
    }

"""The fleet reader: one async stream of every host's events, from a durable JetStream consumer.

The driver of ``_intake.py``: it pulls messages in fetches, hands them to the intake
one at a time, hands out the events the intake builds, and acknowledges a message
once its last event has been handed out and the consumer came back for the next
one (or closed the reader): what a reader stops in the middle of is redelivered to
the next reader of the durable consumer.

Its memory is bounded whatever the messages claim: a fetch asks for fewer messages
while they are large (``max_fetch_bytes``), the next fetch waits until the last one
is handed out, and events are built a chunk at a time (``_intake.py``). Iterating
is cancellation-safe: the fetch runs in a task of the reader's own and what it
brings is kept on the reader, and the iterator is aperf's streams' own class
(``aperf/_drivers/items.py``), which keeps nothing across an await, so a cancelled or
timed-out ``anext()`` loses nothing and the same iterator goes on.

A ``Gap`` is said only for what is really gone: before holes are settled, the
reader asks the consumer whether every message it delivered and not yet had
acknowledged is in this reader's hands (``num_ack_pending``); a message delivered
and lost on the way (the reader's server died) is redelivered after ``ack_wait``
and may still fill the hole.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .._drivers.items import Items, batches
from .._log import log
from ._args import check_int, check_name, check_seconds
from ._connect import (
    DEFAULT_JETSTREAM,
    DEFAULT_PREFIX,
    NatsOptions,
    Path,
    Refusals,
    Servers,
    auth,
    connect,
    ready,
    resolve_options,
    stream_info,
)
from ._errors import FleetClosedError, FleetConfigError
from ._events import FleetEvent, ReaderStatistics
from ._intake import Decoder, DecoderChoice, Delivery, Intake
from ._signing import load_host_keys

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["Decoder", "DecoderChoice", "FleetReader"]

_RETRY_PAUSE = 0.2  # seconds between fetches while the server is away
_SETTLE_EVERY = 1.0  # seconds between two questions to the consumer about holes
DEFAULT_FETCH_BYTES = 8 << 20
T = TypeVar("T")


def _nothing(_: Any) -> None:
    pass


class FleetReader:
    """Every host's events from JetStream stream ``jetstream``, as one async iterator.

    <!-- not run: a fragment, against a server at nats://nats:4222 (tests/fleet/test_fleet.py) -->
    ```python
    decoder = aperf.decoders.from_btf(aperf.BPFObject("tracer.bpf.o"), "event")
    async with FleetReader("nats://nats:4222", durable="viewer", decoder=decoder) as r:
        async for host, stream, event in r:
            ...
    ```

    ``decoder`` decodes the samples of every stream, or maps stream names to
    decoders (a missing name: raw bytes, ``value`` None); samples shorter than a
    decoder's ``size`` (the ``aperf.decoders`` have one) are refused with one
    [`Malformed`][aperf.fleet.Malformed] notice per message, counted in
    ``statistics().short``. ``durable`` names the consumer (created on first use with
    ``ack_wait`` and ``max_ack_pending``, kept by JetStream across restarts of the
    reader and the server). ``subject`` filters (default ``<subject_prefix>.>``,
    every host and stream); ``batch`` is the most messages per fetch, and
    ``max_fetch_bytes`` about the most bytes of them (fewer messages while they are
    large; at least one).

    A message the reader cannot use or refuses (not aperf's, a payload whose host or
    stream disagrees with its subject, a forgery its sink run's chain of tags shows,
    one not signed by its host's key) is yielded as a
    [`Malformed`][aperf.fleet.Malformed] notice, counted, and acknowledged: it never
    raises out of ``async for`` and never blocks the consumer.

    ``host_keys`` makes the hosts' messages authentic end to end: a mapping of host
    names to Ed25519 public keys (``cryptography``'s ``Ed25519PublicKey``, or their
    32 bytes), or the path of a hosts file (``<host> ssh-ed25519 <base64>`` lines, as
    ``python -m aperf.fleet keygen`` prints them). Then every message must be signed
    with its host's key (``JetStreamSink(signing_key=...)``); anything else is
    refused. Without it, the NATS subject permission is the only authentication
    (docs/fleet.md, "What a reader can trust").

    ``user``, ``password``, ``token``, ``creds``, the ``tls_*`` files,
    ``tls_handshake_first``, ``allow_insecure``, ``connect_timeout`` and
    ``ready_timeout`` are as for
    [`JetStreamSink`][aperf.fleet.JetStreamSink]: ``open()`` waits for a cluster
    electing a leader, up to ``ready_timeout``. ``servers`` may be a
    [`NatsOptions`][aperf.fleet.NatsOptions] holding all of those instead. A reader's
    user needs the JetStream API subjects of its stream and durable, and nothing on
    ``<subject_prefix>.>``
    (docs/fleet.md). A permission the server refuses while reading raises
    [`FleetAuthError`][aperf.fleet.FleetAuthError] out of the iteration.
    """

    def __init__(
        self,
        servers: Servers | NatsOptions,
        *,
        jetstream: str = DEFAULT_JETSTREAM,
        durable: str = "aperf-fleet",
        subject: str | None = None,
        subject_prefix: str = DEFAULT_PREFIX,
        decoder: DecoderChoice = None,
        batch: int = 64,
        fetch_timeout: float = 1.0,
        ack_wait: float = 60.0,
        max_ack_pending: int = 1024,
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
        host_keys: Mapping[str, Ed25519PublicKey | bytes] | Path | None = None,
        max_fetch_bytes: int = DEFAULT_FETCH_BYTES,
    ) -> None:
        self._nats = resolve_options(
            servers, connect_options=connect_options, user=user, password=password,
            token=token, creds=creds, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_handshake_first=tls_handshake_first, allow_insecure=allow_insecure,
            connect_timeout=connect_timeout, ready_timeout=ready_timeout,
        )
        check_name("jetstream", jetstream)
        check_name("durable", durable)
        self._max_ack_pending = check_int("max_ack_pending", max_ack_pending, 1, 1 << 20)
        self._batch = check_int("batch", batch, 1, max_ack_pending)
        self._max_fetch_bytes = check_int("max_fetch_bytes", max_fetch_bytes, 1, 1 << 40)
        self._fetch_timeout = check_seconds("fetch_timeout", fetch_timeout)
        self._ack_wait = check_seconds("ack_wait", ack_wait)
        if decoder is not None and not callable(decoder) and not isinstance(decoder, Mapping):
            raise TypeError(
                f"decoder must be a callable, a mapping of stream names to them, or None, "
                f"not {type(decoder).__name__}"
            )
        self._jetstream = jetstream
        self._durable = durable
        self._subject = subject or f"{subject_prefix}.>"
        keys = None if host_keys is None else load_host_keys(host_keys)
        self._intake = Intake(prefix=subject_prefix, decoder=decoder, host_keys=keys)
        self._refusals = Refusals()
        self._nc: Client | None = None
        self._psub: JetStreamContext.PullSubscription | None = None
        self._fetched: deque[Msg] = deque()  # fetched, not yet given to the intake
        # The reader's own task, one at a time: acknowledgements to send, a fetch, or a
        # question to the consumer about holes. Every wait on the network is in it, so a
        # consumer's cancelled anext() cancels only its wait for the task (nats-py's
        # requests wait with wait_for, which can swallow a cancellation).
        self._task: asyncio.Task[Any] | None = None
        self._task_done: Callable[[Any], None] = _nothing
        self._fetch_n = 1  # messages per fetch: batch, fewer while they are large
        self._unacked = 0  # messages received and not acknowledged
        self._to_ack: deque[Msg] = deque()
        self._asked_at = -1e9  # when the consumer was last asked about holes
        self._closed = False
        self._last_problem = ""

    # --- opening and closing -----------------------------------------------------------

    async def open(self) -> None:
        """Connect, check the stream, create or bind the durable consumer."""
        if self._closed:
            raise FleetClosedError("this FleetReader was closed; make a new one")
        if self._nc is not None:
            return
        options = self._nats
        nc = await connect(
            options.servers, timeout=options.connect_timeout,
            name=f"aperf-reader {self._durable}", on_error=self._on_error,
            options=options.connect_options, auth=auth(options), refusals=self._refusals,
        )
        try:
            js = nc.jetstream()
            await stream_info(
                nc, js, self._jetstream, timeout=self._nats.ready_timeout, refusals=self._refusals
            )
            config = ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=self._ack_wait,
                max_ack_pending=self._max_ack_pending,
            )
            try:
                self._psub = await ready(
                    nc, lambda: js.pull_subscribe(
                        self._subject, durable=self._durable, stream=self._jetstream,
                        config=config,
                    ), timeout=self._nats.ready_timeout, refusals=self._refusals,
                )
            except nats.js.errors.BadRequestError as exc:
                raise FleetConfigError(
                    "subject", f"JetStream refused a consumer on {self._subject!r} in stream "
                    f"{self._jetstream!r}: {exc.description}"
                ) from None
        except BaseException:
            await nc.close()
            raise
        self._nc = nc
        # Until their sizes are seen, as many messages as fit if each were the largest.
        self._fetch_n = max(1, min(self._batch, self._max_fetch_bytes // max(nc.max_payload, 1)))
        log.info(
            "fleet reader opened", jetstream=self._jetstream, durable=self._durable,
            subject=self._subject,
        )

    async def __aenter__(self) -> FleetReader:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Acknowledge what was handed out, and disconnect. Events still held are not
        acknowledged: JetStream redelivers their messages to the next reader, and an
        iterator used after this ends instead of handing them out twice."""
        if self._closed:
            return
        self._closed = True
        nc = self._nc
        if nc is None:
            return
        try:
            # Messages fetched that give no event (an end of stream, a duplicate) are
            # done with too; the first that gives events stops it, unacknowledged.
            self._to_ack.extend(self._intake.released())
            while self._fetched and not self._intake.busy:
                self._accept(self._fetched.popleft())
                self._to_ack.extend(self._intake.released())
            task = self._task
            if task is not None:
                if self._task_done is not _nothing:  # a fetch (what it was bringing is
                    task.cancel()  # redelivered) or a question: only acks are waited for
                await asyncio.wait((task,))
            self._to_ack.extend(self._intake.released())
            await self._send_acks()
        finally:
            if self._task is not None:
                self._task.cancel()
            # An iterator used after this ends: what is still held is the next reader's.
            self._intake.withhold()
            self._fetched.clear()
            await nc.close()
        log.info("fleet reader closed", durable=self._durable,
                 messages=self._intake.counts.messages)

    # --- iterating ---------------------------------------------------------------------

    def __aiter__(self) -> Items[FleetEvent]:
        self._require_open()
        # Events are handed out straight from the intake's front: it holds one message's
        # at most (the next is accepted once it is used up), so the reader's steps, and
        # the acknowledgement of a message, come when the consumer is back after its last.
        intake = self._intake
        return Items(intake.next_event, partial(self._pump, intake.fill), self._ended,
                     self._wait)

    def batches(self, max_items: int = 1024) -> Items[list[FleetEvent]]:
        """Yield lists of up to ``max_items`` events, in order, without a per-item await.

        Acknowledgement works as for ``async for``: a message is acknowledged when the
        batch holding its last event has been handled (the next batch is asked for).
        """
        check_int("max_items", max_items, 1, 1 << 30)
        self._require_open()
        take = partial(self._pump, partial(self._intake.hand, max_items))
        return batches(take, self._ended, self._wait)

    def _require_open(self) -> None:
        if self._psub is None:
            raise FleetClosedError("open the FleetReader first (async with, or await open())")

    def _pump(self, take: Callable[[], T]) -> T:
        """What ``take()`` gives (events, or that there are some), doing the reader's next
        steps without waiting until it gives something: the acknowledgements due, a
        fetched message to the intake, a fetch or a question to start. Something false
        when the iterator must wait for the reader's task (``_wait``), or the reader is
        closed with nothing left (``_ended``). Every wait on the network is in that
        task: a cancelled ``anext()`` leaves it running, and the next call takes what it
        did, so nothing fetched is lost and no cancellation swallowed."""
        intake = self._intake
        while True:
            self._ack_released()
            got = take()
            if got:
                return got
            task = self._task
            if task is not None:
                if not task.done():
                    return got
                self._task, done = None, self._task_done
                # (Its exception, if any, raised here. A fetch's messages that came
                # after aclose() are left to the next reader.)
                if not task.cancelled() and (done is _nothing or not self._closed):
                    done(task.result())
            elif self._closed:  # (what a fetch brought after aclose() is the next reader's)
                return got
            elif self._fetched:
                self._accept(self._fetched.popleft())
            elif intake.unsettled() and self._may_ask():
                self._start(self._ask(), self._asked)
            else:
                self._start(self._fetch_once(self._fetch_n), self._took)

    def _ack_released(self) -> None:
        to_ack = self._to_ack
        to_ack.extend(self._intake.released())  # the consumer came back: done with those
        if to_ack and self._task is None:
            self._start(self._send_acks(), _nothing)  # sent while events are handed out

    def _ended(self) -> bool:
        return self._closed and self._task is None

    async def _wait(self) -> None:
        task = self._task
        if task is not None:
            await asyncio.wait((task,))

    def _start(self, work: Coroutine[Any, Any, Any], done: Callable[[Any], None]) -> None:
        self._task = asyncio.ensure_future(work)
        self._task_done = done

    def _accept(self, msg: Msg) -> None:
        try:
            meta = msg.metadata
            seq, delivered = meta.sequence.stream, meta.num_delivered
        except (nats.errors.Error, ValueError, IndexError, TypeError):  # not from JetStream
            seq, delivered = 0, 1
        self._intake.accept(Delivery(msg.subject, msg.data, msg.headers, seq, delivered, msg))

    async def _send_acks(self) -> None:
        to_ack = self._to_ack
        while to_ack:
            try:
                await to_ack[0].ack()
            except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError,
                    nats.errors.MsgAlreadyAckdError):
                # Not acknowledged: JetStream redelivers it after ack_wait, and this
                # reader (if still running) drops the copy as a duplicate.
                log.debug("fleet reader: ack not sent", durable=self._durable)
            to_ack.popleft()
            self._unacked -= 1

    def _took(self, msgs: list[Msg]) -> None:
        """Keep what a fetch brought; fetch fewer messages next time if they are large."""
        if msgs:
            self._unacked += len(msgs)
            self._fetched.extend(msgs)
            size = sum(len(m.data) for m in msgs) // len(msgs) + 1
            self._fetch_n = max(1, min(self._batch, self._max_fetch_bytes // size))

    async def _fetch_once(self, n: int) -> list[Msg]:
        psub = self._psub
        assert psub is not None
        try:
            return await psub.fetch(n, timeout=self._fetch_timeout)
        except nats.errors.TimeoutError:
            # Nothing new (or the server is away; the client reconnects), unless the
            # server refused the fetch or an acknowledgement: that lasts.
            self._refusals.check("servers")
            return []
        except nats.errors.ConnectionClosedError:
            if self._closed:
                return []
            raise FleetClosedError("the NATS connection of the fleet reader closed") from None
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if self._closed:
                return []
            self._note_problem(exc, "fetch failed, retrying")
            await asyncio.sleep(_RETRY_PAUSE)
            return []

    def _may_ask(self) -> bool:
        """At most one question to the consumer about holes a ``_SETTLE_EVERY``."""
        now = asyncio.get_running_loop().time()
        if now - self._asked_at < _SETTLE_EVERY:
            return False
        self._asked_at = now
        return True

    async def _ask(self) -> tuple[int, int | None] | None:
        """How many messages the consumer delivered and has not had acknowledged, and the
        stream's first sequence if the intake needs it; None if it did not answer."""
        nc = self._nc
        assert nc is not None
        js = nc.jetstream()
        try:
            await nc.flush(timeout=max(1, int(self._fetch_timeout)))  # the acks first
            info = await js.consumer_info(self._jetstream, self._durable)
            first_seq = None
            if self._intake.wants_stream_state():
                first_seq = (await js.stream_info(self._jetstream)).state.first_seq
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            self._note_problem(exc, "cannot ask the consumer about holes, retrying")
            return None
        return info.num_ack_pending or 0, first_seq

    def _asked(self, answer: tuple[int, int | None] | None) -> None:
        """Let the intake report its holes if no message the consumer delivered is on its
        way to this reader."""
        if answer is None:
            return
        ack_pending, first_seq = answer
        in_flight = ack_pending - self._unacked  # (no ack or fetch ran meanwhile)
        if in_flight > 0:
            # Delivered and not in this reader's hands: lost on the way (redelivered
            # after ack_wait), in flight, or held by another reader of the durable.
            log.debug("fleet reader: holes wait for messages on their way",
                      durable=self._durable, in_flight=in_flight)
            return
        self._intake.settle(first_seq)

    def _on_error(self, exc: Exception) -> None:
        log.debug("fleet reader: NATS error", durable=self._durable, error=str(exc))

    def _note_problem(self, exc: BaseException, what: str) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if text != self._last_problem:  # once per kind of trouble, not once per retry
            self._last_problem = text
            log.warning(f"fleet reader: {what}", durable=self._durable, error=text)

    # --- introspection -----------------------------------------------------------------

    def boot_offset_ns(self, host: str) -> int | None:
        """``host``'s wall clock minus its kernel's boot-time clock, in ns, as its sinks
        last sent it; None until a message from ``host`` carried one.

        A BPF timestamp from ``bpf_ktime_get_boot_ns()`` (CLOCK_BOOTTIME) plus this
        is the event's wall-clock time, in ns since the epoch: each host boots at its
        own time, so a reader cannot use its own clock for another host's events.
        Exact to the hosts' clock sync; every [`JetStreamSink`][aperf.fleet.JetStreamSink]
        sends it (taken when the sink opens). Only messages the reader accepted set it
        (with ``host_keys``, signed ones): a host can claim any offset for itself, none
        for another.
        """
        return self._intake.boot_offset_ns(host)

    def statistics(self) -> ReaderStatistics:
        """Messages, samples, lost counts, bad samples, gaps, duplicates, and the messages
        malformed, refused or conflicting, seen so far."""
        return ReaderStatistics(**asdict(self._intake.counts))

"""End-to-end tests of the web service that embeds aperf (examples/service/).

The service runs as a subprocess on a free loopback port, with the real tracer
loaded; the tests talk to it over HTTP with httpx and make processes of their
own, recognising their events by pid among whatever else the machine runs.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 15.0
TIMEOUT = 10.0
# A small replay window and socket buffers, so that a client that stops reading
# falls out of the window after a few hundred events, not tens of thousands.
REPLAY = 64
SEND_BUFFER = 4096
BURST = 600  # processes: 1200 events, about 300 KB of SSE
METRIC_LINE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
    r'(?:\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)\})?'
    r' (?P<value>[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|NaN|[-+]Inf))'
)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]

pytestmark = pytest.mark.kernel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> Metrics:
    """Parse the Prometheus text format strictly: every line is a comment or a sample."""
    samples: Metrics = {}
    typed: set[str] = set()
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("#"):
            kind, name, *_ = line[2:].split(" ", 2)
            assert kind in ("HELP", "TYPE"), line
            if kind == "TYPE":
                assert line.split()[-1] in ("counter", "gauge"), line
                typed.add(name)
            continue
        m = METRIC_LINE.fullmatch(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        assert m["name"] in typed, f"{m['name']} has no # TYPE line"
        labels = frozenset(LABEL.findall(m["labels"] or ""))
        samples[m["name"], labels] = float(m["value"])
    return samples


def total(metrics: Metrics, name: str) -> float:
    return sum(v for (n, _), v in metrics.items() if n == name)


def per_label(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    return {dict(labels)[label]: v for (n, labels), v in metrics.items() if n == name}


class Service:
    """``python -m examples.service`` on a free loopback port; its JSON log in a file.

    With ``token``, the service gets ``--token-file`` (mode 0600) and ``http`` sends the
    token. With ``generated_token``, it makes its own in ``runtime`` (RUNTIME_DIRECTORY),
    and ``http`` sends that one once the file is there. Otherwise ``--no-token``.
    ``wrapper`` goes before the command (``prlimit ...``); stderr goes to the log unless
    ``stderr`` says where.
    """

    def __init__(self, log_path: Path, *args: str, token: str | None = None,
                 generated_token: bool = False, wrapper: Sequence[str] = (),
                 stderr: int = subprocess.STDOUT) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.token = token
        self.runtime = log_path.with_name("run")
        self.runtime.mkdir(mode=0o700, exist_ok=True)
        self.token_path = self.runtime / f"token-127.0.0.1-{self.port}"
        self.generated_token = generated_token
        headers = {}
        if token is not None:
            token_file = log_path.with_name("token")
            token_file.write_text(token + "\n")
            token_file.chmod(0o600)
            args = ("--token-file", str(token_file), *args)
            headers["Authorization"] = f"Bearer {token}"
        elif not generated_token:
            args = ("--no-token", *args)
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*wrapper, sys.executable, "-m", "examples.service", "--host", "127.0.0.1",
                 "--port", str(self.port), "--heartbeat", "0.5", *args],
                cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=stderr,
                env={**os.environ, "RUNTIME_DIRECTORY": str(self.runtime)},
            )
        self.http = httpx.Client(base_url=self.base, timeout=TIMEOUT, headers=headers)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def records(self) -> list[dict[str, Any]]:
        """The JSON log, one object per line (anything else fails the test)."""
        return [json.loads(line) for line in self.log.splitlines()]

    def record(self, event: str, logger: str = "examples.service") -> dict[str, Any]:
        """The one log record of ``event``."""
        found = [r for r in self.records() if r["event"] == event and r["logger"] == logger]
        assert len(found) == 1, (event, found)
        return found[0]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the service exited with {self.proc.returncode}:\n{self.log}")
            if self.generated_token and self.token is None and self.token_path.exists():
                # Written before the server starts: there once /health can answer.
                self.token = self.token_path.read_text().strip()
                self.http.headers["Authorization"] = f"Bearer {self.token}"
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"the service was not healthy within {STARTUP_TIMEOUT}s:\n{self.log}")

    def metrics(self) -> Metrics:
        response = self.http.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        return parse_metrics(response.text)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        return rc, time.monotonic() - start

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def service(tracefs: None, tmp_path: Path) -> Iterator[Service]:
    svc = Service(
        tmp_path / "service.log",
        "--replay", str(REPLAY), "--send-buffer", str(SEND_BUFFER),
        "--shutdown-timeout", "2",
    )
    try:
        svc.wait_ready()
        yield svc
    finally:
        svc.close()


@dataclass
class Message:
    event: str  # "message" unless the server named it
    data: str
    id: str | None = None  # the id: field of this message, if it had one

    def json(self) -> Any:
        return json.loads(self.data)


def lines_until_timeout(response: httpx.Response, timeout: float = TIMEOUT) -> Iterator[str]:
    """The lines of an event stream, for ``timeout`` seconds at most.

    httpx's read timeout never fires on an event stream: keep-alives come every 0.5 s.
    """
    deadline = time.monotonic() + timeout
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            pytest.fail(f"the expected message did not come within {timeout}s")
        yield line


def parse_sse(lines: Iterator[str]) -> Iterator[Message]:
    event, id_ = "message", None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield Message(event, "\n".join(data), id_)
            event, data, id_ = "message", [], None
        elif line.startswith(":"):
            continue  # comment: the greeting, keep-alives
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                id_ = value


class FastClient:
    """An /events client reading in a thread as fast as it can (httpx)."""

    def __init__(self, base: str, headers: dict[str, str] | None = None) -> None:
        self.http = httpx.Client(base_url=base, timeout=httpx.Timeout(TIMEOUT), headers=headers)
        self.messages: queue.Queue[Message | None] = queue.Queue()
        self.received: list[Message] = []
        self.connected = threading.Event()
        self.error: BaseException | None = None
        self.status = 0
        self.headers: httpx.Headers | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        assert self.connected.wait(TIMEOUT), "the /events request got no answer"

    def _read(self) -> None:
        try:
            with self.http.stream("GET", "/events") as response:
                self.status, self.headers = response.status_code, response.headers
                self.connected.set()
                for message in parse_sse(response.iter_lines()):
                    self.messages.put(message)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc
        finally:
            self.connected.set()
            self.messages.put(None)  # the server ended the stream

    def read_until(
        self, done: Callable[[Message], bool], timeout: float = TIMEOUT
    ) -> list[Message]:
        """Read until ``done(message)`` is true for a message; everything received so far."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self.messages.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"timed out; last messages: {self.received[-5:]}")
            if message is None:
                pytest.fail(f"the stream ended early ({self.error!r})")
            self.received.append(message)
            if done(message):
                return self.received

    def wait_end(self, timeout: float = TIMEOUT) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the event stream did not end"

    def close(self) -> None:
        self.http.close()


class StalledClient:
    """An /events client (httpx) with a tiny receive buffer that reads nothing until told."""

    def __init__(self, base: str) -> None:
        transport = httpx.HTTPTransport(
            socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
        )
        self.http = httpx.Client(
            base_url=base, transport=transport, timeout=httpx.Timeout(TIMEOUT)
        )
        self._stream = self.http.stream("GET", "/events")
        self.response = self._stream.__enter__()  # headers read, body left in the socket

    def messages(self) -> Iterator[Message]:
        """Start reading; with a normal receive buffer again, so that it goes fast."""
        sock = self.response.extensions["network_stream"].get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        return parse_sse(lines_until_timeout(self.response))

    def close(self) -> None:
        self._stream.__exit__(None, None, None)
        self.http.close()


def event_seq(message: Message) -> int:
    """The sequence number in an event's id (``<run>-<seq>``)."""
    assert message.id is not None
    return int(message.id.rpartition("-")[2])


def read_events(
    base: str, headers: dict[str, str], done: Callable[[list[Message]], bool]
) -> list[Message]:
    """Open /events with ``headers``, read messages until ``done(messages)``, close."""
    messages: list[Message] = []
    with httpx.Client(base_url=base, timeout=TIMEOUT) as http, \
            http.stream("GET", "/events", headers=headers) as response:
        assert response.status_code == 200
        for message in parse_sse(lines_until_timeout(response)):
            messages.append(message)
            if done(messages):
                return messages
    pytest.fail(f"the stream ended early; {len(messages)} messages: {messages[:3]} ... "
                f"{messages[-3:]}")


def spawn_burst(count: int) -> int:
    """A shell that runs /bin/true ``count`` times; its pid (the parent of every true)."""
    sh, true = shutil.which("sh"), shutil.which("true")
    assert sh and true
    loop = f"i=0; while [ $i -lt {count} ]; do {true}; i=$((i+1)); done"
    proc = subprocess.Popen([sh, "-c", loop])
    assert proc.wait(timeout=60) == 0
    return proc.pid


def events_of_children(messages: list[Message], parent: int, kind: str) -> set[int]:
    return {
        m.json()["pid"] for m in messages
        if m.event == "message" and m.json()["ppid"] == parent and m.json()["event"] == kind
    }


# --- tests -----------------------------------------------------------------------------------


def test_health_reports_an_open_stream(service: Service) -> None:
    response = service.http.get("/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["stream_open"] is True
    assert body["lost"] == 0 and body["broken_cpus"] == []


def test_slow_client_does_not_hold_back_the_fast_one(service: Service) -> None:
    stalled = StalledClient(service.base)
    fast = FastClient(service.base)
    try:
        assert fast.status == 200 and fast.headers is not None
        assert fast.headers["content-type"].startswith("text/event-stream")
        # Wait for the server to count both clients before making events.
        deadline = time.monotonic() + TIMEOUT
        while total(service.metrics(), "aperf_sse_clients") < 2:
            assert time.monotonic() < deadline, "the clients were never both connected"
            time.sleep(0.05)

        parent = spawn_burst(BURST)
        exited: set[int] = set()

        def all_exited(message: Message) -> bool:
            if message.event == "message":
                record = message.json()
                if record["ppid"] == parent and record["event"] == "EXIT":
                    exited.add(record["pid"])
            return len(exited) == BURST

        received = fast.read_until(all_exited)
        # Every exec and exit of the burst reached the fast client, nothing missed,
        # although the stalled client fell out of the replay window meanwhile.
        execs = events_of_children(received, parent, "EXEC")
        assert len(execs) == BURST
        assert not [m for m in received if m.event == "missed"]
        for m in received:
            if m.event == "message" and m.json()["ppid"] == parent:
                record = m.json()
                assert record["comm"] == "true"
                if record["event"] == "EXEC":
                    assert record["filename"] == shutil.which("true")
        # Consecutive ids: the fast client got every event published since it came.
        seqs = [event_seq(m) for m in received if m.id is not None]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))

        metrics = service.metrics()
        assert total(metrics, "aperf_sse_max_lag") > REPLAY  # the stalled client
        assert total(metrics, "aperf_lost_total") == 0

        # Once the stalled client reads again, it is told how many events it missed,
        # and the count is the one /metrics gives for all clients together.
        notice = None
        for message in stalled.messages():
            if message.event == "missed":
                notice = message.json()
                break
        assert notice is not None and notice["reason"] == "slow" and notice["missed"] > 0
        missed = per_label(service.metrics(), "aperf_sse_missed_total", "reason")
        assert missed == {"slow": notice["missed"], "reconnect": 0, "shutdown": 0}
    finally:
        stalled.close()
        fast.close()


def test_metrics_parse_and_grow(service: Service) -> None:
    before = service.metrics()
    # prometheus_client's standard collectors: process and GC metrics for free.
    for name in ("process_resident_memory_bytes", "process_open_fds",
                 "python_gc_collections_total"):
        assert total(before, name) > 0, name
    cpus = {str(c) for c in range(os.cpu_count() or 1)}
    for name in ("aperf_samples_total", "aperf_lost_total", "aperf_bytes_total",
                 "aperf_wakeups_total", "aperf_decode_errors_total"):
        assert set(per_label(before, name, "cpu")) <= cpus
        assert per_label(before, name, "cpu"), f"no per-CPU {name}"
    # Drops by cause, per CPU: both reasons always there (they add up to all drops).
    reasons = {(dict(k)["cpu"], dict(k)["reason"]) for n, k in before if n == "aperf_lost_total"}
    assert reasons == {(cpu, r) for cpu, _ in reasons for r in ("queue", "ring")}
    for name in ("aperf_ring_backlog_bytes", "aperf_ring_high_water_ratio"):
        values = per_label(before, name, "cpu")
        assert values and set(values) <= cpus, name
    assert all(0 <= v <= 1 for v in per_label(before, "aperf_ring_high_water_ratio",
                                               "cpu").values())
    assert total(before, "aperf_stream_open") == 1
    assert ("aperf_sse_clients", frozenset()) in before

    spawn_burst(20)
    deadline = time.monotonic() + TIMEOUT
    while True:
        after = service.metrics()
        if total(after, "aperf_samples_total") >= total(before, "aperf_samples_total") + 40:
            break
        assert time.monotonic() < deadline, "the sample counters did not grow"
        time.sleep(0.1)
    for name in ("aperf_bytes_total", "aperf_wakeups_total",
                 "aperf_sse_events_published_total"):
        assert total(after, name) > total(before, name), name
    for (name, labels), value in before.items():
        if name.endswith("_total") and (name, labels) in after:
            assert after[name, labels] >= value, (name, labels)
    # No label that grows with the clients: every label name is one of a known few.
    label_names = {k for (name, labels) in after for k, _ in labels if name.startswith("aperf_")}
    assert label_names == {"cpu", "reason"}

    # A scraper that asks for OpenMetrics gets it.
    response = service.http.get(
        "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert "aperf_samples_total{cpu=" in response.text


def test_kernel_losses_reach_metrics_and_clients(tracefs: None, tmp_path: Path) -> None:
    sh, true, taskset = shutil.which("sh"), shutil.which("true"), shutil.which("taskset")
    if taskset is None:
        pytest.skip("taskset is not installed")
    assert sh and true
    cpus = sorted(os.sched_getaffinity(0))
    svc = Service(tmp_path / "service.log", "--pages", "1")  # about 22 events per CPU ring
    try:
        svc.wait_ready()
        fast = FastClient(svc.base)
        try:
            # A stopped service cannot drain its rings: the kernel drops and counts.
            svc.proc.send_signal(signal.SIGSTOP)
            try:
                for cpu in cpus:
                    burst = [taskset, "-c", str(cpu), sh, "-c",
                             f"for i in $(seq 100); do {true}; done"]
                    subprocess.run(burst, check=True, timeout=60)
            finally:
                svc.proc.send_signal(signal.SIGCONT)
            # The count comes with the next event that fits in that CPU's ring.
            deadline = time.monotonic() + TIMEOUT
            while total(svc.metrics(), "aperf_lost_total") == 0:
                assert time.monotonic() < deadline, "no loss was counted"
                for cpu in cpus:
                    subprocess.run([taskset, "-c", str(cpu), true], check=True)
                time.sleep(0.1)
            # The service's queue was not full: the rings overflowed, all drops are "ring".
            by_reason: dict[str, float] = {}
            for (name, labels), value in svc.metrics().items():
                if name == "aperf_lost_total":
                    reason = dict(labels)["reason"]
                    by_reason[reason] = by_reason.get(reason, 0) + value
            assert by_reason["queue"] == 0 and by_reason["ring"] > 0
            notices = fast.read_until(lambda m: m.event == "lost")
            lost = notices[-1].json()
            assert lost["count"] > 0 and lost["cpu"] in cpus
            assert svc.http.get("/health").json()["lost"] > 0
        finally:
            fast.close()
    finally:
        svc.close()


def test_sigterm_ends_streams_and_exits_cleanly(service: Service) -> None:
    fast = FastClient(service.base)
    stalled = StalledClient(service.base)
    try:
        spawn_burst(BURST)  # leaves the stalled client with a full socket and queue
        rc, elapsed = service.stop(signal.SIGTERM)
        fast.wait_end()  # the server ended the stream: a clean end, no error
        assert fast.error is None
    finally:
        stalled.close()
        fast.close()
    assert rc == 0, service.log
    # Streams end at once; a stalled client gets --shutdown-timeout (2 s) at most.
    assert elapsed < 6.0
    records = [json.loads(line) for line in service.log.splitlines()]  # JSON logs only
    events = [r["event"] for r in records]
    assert "perf stream closed" in events  # aperf freed the rings
    assert "tracer stopped" in events
    assert events[-1].startswith("Finished server process")
    # The stalled client was cut off at the shutdown timeout, and said so in one
    # warning. (uvicorn adds its own error lines about that connection.)
    assert "client cut off at shutdown: it stopped reading" in events
    assert "Traceback" not in service.log
    assert not [r for r in records if "exception" in r], records
    # What it had yet to take is counted, as missed at shutdown.
    cut_off = service.record("client cut off at shutdown: it stopped reading")
    stopped = service.record("tracer stopped")
    assert cut_off["missed_at_shutdown"] > 0
    assert stopped["missed"]["shutdown"] == cut_off["missed_at_shutdown"]


def test_logs_the_address_it_listens_on(service: Service) -> None:
    listening = service.record("listening")
    assert listening["url"] == f"http://127.0.0.1:{service.port}/"
    assert listening["level"] == "info"
    # Said once the server accepts connections: after the tracer started.
    events = [r["event"] for r in service.records()]
    assert events.index("listening") > events.index("tracer running")


def test_sigterm_publishes_everything_read(tracefs: None, tmp_path: Path) -> None:
    """Events read from the rings at shutdown are published, and reach a reading client.

    A shell makes processes without pause while the service gets SIGTERM: events are in
    the rings and in aperf's queue when it stops. Afterwards, exactly: every sample aperf
    read became an event (or a counted bad sample), every event and lost notice was
    published, and the client that kept reading got every one of them, up to the last.
    """
    sh, true = shutil.which("sh"), shutil.which("true")
    assert sh and true
    # A window no client that reads can fall out of, whatever the machine's load.
    svc = Service(tmp_path / "service.log", "--pages", "1024", "--replay", "65536")
    busy = None
    try:
        svc.wait_ready()
        fast = FastClient(svc.base)
        try:
            busy = subprocess.Popen([sh, "-c", f"while :; do {true}; done"])
            fast.read_until(lambda m: m.event == "message" and m.json()["ppid"] == busy.pid)
            rc, _ = svc.stop(signal.SIGTERM)
            fast.wait_end()
            assert fast.error is None
            while (m := fast.messages.get_nowait()) is not None:
                fast.received.append(m)
        finally:
            fast.close()
            if busy is not None:
                busy.kill()
                busy.wait()
    finally:
        svc.close()
    assert rc == 0, svc.log
    read = svc.record("perf stream closed", logger="aperf")  # aperf's own count
    stopped = svc.record("tracer stopped")
    # Rings of 4 MiB per CPU: one shell's processes never fill them, so every event
    # published is a sample read (no lost notices among them).
    assert read["lost"] == 0
    assert stopped["published"] == read["samples"] - read["decode_errors"]
    # The service's own accounting says the same. (aperf logs "undelivered": what it read
    # at the close and had not handed out yet; the pump publishes those after it.)
    assert stopped["samples"] == read["samples"]
    assert read["samples"] == stopped["events"] + stopped["bad_samples"]
    assert stopped["events"] + stopped["lost_notices"] == stopped["published"]
    assert stopped["unpublished"] == 0
    assert stopped["missed"] == {"slow": 0, "reconnect": 0, "shutdown": 0}
    # The client got every event published after it came, up to the very last one.
    seqs = [event_seq(m) for m in fast.received if m.id is not None]
    assert seqs == list(range(seqs[0], stopped["published"] + 1))
    assert not [m for m in fast.received if m.event == "missed"]


def published(service: Service) -> int:
    return int(service.http.get("/health").json()["published"])


def wait_published(service: Service, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while published(service) < count:
        assert time.monotonic() < deadline, f"fewer than {count} events were published"
        time.sleep(0.05)


# Room for what the machine's other processes do while the test's client is away.
RECONNECT_REPLAY = 512


@pytest.fixture
def roomy_service(tracefs: None, tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "service.log", "--replay", str(RECONNECT_REPLAY))
    try:
        svc.wait_ready()
        yield svc
    finally:
        svc.close()


def test_reconnect_gets_what_it_missed_or_a_notice(roomy_service: Service) -> None:
    service = roomy_service
    # A client sees the exit of a process of ours, and goes away.
    fast = FastClient(service.base)
    try:
        proc = subprocess.Popen([shutil.which("sh") or "sh", "-c", "exit 3"])
        assert proc.wait(timeout=TIMEOUT) == 3
        received = fast.read_until(
            lambda m: m.event == "message" and m.json()["pid"] == proc.pid
            and m.json()["event"] == "EXIT"
        )
    finally:
        fast.close()
    last = received[-1]
    assert last.id is not None

    # While it is away, 10 processes run: 20 events, far fewer than the window holds.
    burst = spawn_burst(10)
    wait_published(service, event_seq(last) + 20)

    def burst_exited(messages: list[Message]) -> bool:
        return len(events_of_children(messages, burst, "EXIT")) == 10

    # Back with Last-Event-ID: everything after that event, in order, nothing missed.
    again = read_events(service.base, {"Last-Event-ID": last.id}, burst_exited)
    assert not [m for m in again if m.event == "missed"]
    seqs = [event_seq(m) for m in again if m.id is not None]
    assert seqs == list(range(event_seq(last) + 1, event_seq(last) + 1 + len(seqs)))
    assert len(events_of_children(again, burst, "EXEC")) == 10
    assert total(service.metrics(), "aperf_sse_replayed_total") >= 20

    # Away again while 300 processes run: 600 events, more than the window holds.
    last = [m for m in again if m.id is not None][-1]
    assert last.id is not None
    spawn_burst(300)
    wait_published(service, event_seq(last) + 600)
    newest = published(service)
    back = read_events(service.base, {"Last-Event-ID": last.id},
                       lambda ms: any(m.id and event_seq(m) >= newest for m in ms))
    notice, first = back[0], back[1]
    assert notice.event == "missed" and notice.id is None
    # Exactly the events between the one it had and the oldest one still kept.
    assert notice.json() == {"missed": event_seq(first) - event_seq(last) - 1,
                             "reason": "reconnect"}
    assert notice.json()["missed"] > 0
    assert newest - event_seq(first) < RECONNECT_REPLAY  # the window, all of it
    seqs = [event_seq(m) for m in back[1:] if m.id is not None]
    assert seqs == list(range(event_seq(first), event_seq(first) + len(seqs)))
    missed = per_label(service.metrics(), "aperf_sse_missed_total", "reason")
    assert missed["reconnect"] == notice.json()["missed"]

    # An id of an earlier run of the service: how many were missed is unknown.
    run = last.id.rpartition("-")[0]
    other = read_events(service.base, {"Last-Event-ID": f"{run}0-1"}, lambda ms: True)
    assert other[0].event == "missed"
    assert other[0].json() == {"missed": None, "reason": "restart"}
    # Ids it never handed out are refused, saying which header is wrong.
    for bad in ("nonsense", f"{run}-{newest + 1000}"):
        response = service.http.get("/events", headers={"Last-Event-ID": bad})
        assert response.status_code == 400
        assert "Last-Event-ID" in response.json()["error"]


def test_history_gives_a_new_client_the_last_events_then_ready(roomy_service: Service) -> None:
    service = roomy_service
    spawn_burst(10)  # 22 events at least
    wait_published(service, 20)
    newest = published(service)
    # A page asks for the last events; `ready` (no id) says it has everything up to where
    # it came, and counts it among the clients.
    with httpx.Client(base_url=service.base, timeout=TIMEOUT) as http, \
            http.stream("GET", "/events?history=20") as response:
        assert response.status_code == 200
        messages: list[Message] = []
        for message in parse_sse(lines_until_timeout(response)):
            messages.append(message)
            if message.event == "ready":
                break
    *history, ready = messages
    assert ready.id is None and ready.json() == {"clients": 1}
    seqs = [event_seq(m) for m in history]
    assert len(seqs) == 20 and seqs == list(range(seqs[0], seqs[0] + 20))
    assert seqs[-1] >= newest  # up to the newest event when it came
    assert all(m.event in ("message", "lost") for m in history)
    for bad in ("-1", "x", "", "1e3", "٣", "9" * 5000, "0x10"):
        response = service.http.get("/events", params={"history": bad})
        assert response.status_code == 400, bad
        assert "history=" in response.json()["error"]
        assert len(response.text) < 200


def test_events_carry_the_kernel_time(service: Service) -> None:
    fast = FastClient(service.base)
    try:
        # A stopped service reads nothing: the events wait in the rings. Their times
        # must be when they happened, not when the service read them.
        service.proc.send_signal(signal.SIGSTOP)
        try:
            before = time.time()
            proc = subprocess.Popen([shutil.which("sh") or "sh", "-c", "exit 4"])
            assert proc.wait(timeout=TIMEOUT) == 4
            after = time.time()
            time.sleep(0.5)
            resumed = time.time()
        finally:
            service.proc.send_signal(signal.SIGCONT)
        received = fast.read_until(
            lambda m: m.event == "message" and m.json()["pid"] == proc.pid
            and m.json()["event"] == "EXIT"
        )
    finally:
        fast.close()
    mine = [m.json() for m in received if m.event == "message" and m.json()["pid"] == proc.pid]
    exec_, exit_ = (next(r for r in mine if r["event"] == kind) for kind in ("EXEC", "EXIT"))
    exec_time, exit_time = (
        datetime.datetime.fromisoformat(r["time"]).timestamp() for r in (exec_, exit_)
    )
    slack = 0.005  # the offset between the clocks is taken once, to the microsecond
    assert before - slack <= exec_time <= exit_time <= after + slack
    assert exit_time < resumed - 0.4  # read half a second later, timed when it happened
    # Both come from the BPF event's own nanoseconds, converted with one offset.
    between = (exit_["timestamp_ns"] - exec_["timestamp_ns"]) / 1e9
    assert abs((exit_time - exec_time) - between) < 2e-6


def run_service(*args: str) -> subprocess.CompletedProcess[str]:
    """The service run to its end (a failure), its token (if it makes one) kept to itself."""
    with tempfile.TemporaryDirectory() as runtime:
        return subprocess.run(
            [sys.executable, "-m", "examples.service", "--host", "127.0.0.1", *args],
            cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
            env={**os.environ, "RUNTIME_DIRECTORY": runtime},
        )


def assert_one_line_failure(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("service: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (("--port", "99999"), "argument --port: 99999 is not a TCP port (1 to 65535)"),
    (("--heartbeat", "0"), "argument --heartbeat: 0 is not a positive number of seconds"),
    (("--replay", "1"), "argument --replay: 1 is not a number of events, 2 or more"),
    (("--port", "http"), "argument --port: invalid port value: 'http'"),
])
def test_bad_options_fail_in_one_line(args: tuple[str, ...], expected: str) -> None:
    assert_one_line_failure(run_service(*args), expected)


def test_missing_object_fails_in_one_line(kernel: None, tmp_path: Path) -> None:
    missing = tmp_path / "nothing.bpf.o"
    result = run_service("--port", str(free_port()), "--object", str(missing))
    assert_one_line_failure(result, f"BPF object {missing} does not exist")


def test_bad_object_fails_in_one_line(tracefs: None, tmp_path: Path) -> None:
    bad = tmp_path / "bad.bpf.o"
    bad.write_text("not an ELF file\n")
    result = run_service("--port", str(free_port()), "--object", str(bad))
    assert_one_line_failure(result, f"cannot open BPF object {bad}: not a loadable ELF")


def test_taken_port_fails_in_one_line(kernel: None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_service("--port", str(port))
    assert_one_line_failure(result, f"cannot listen on 127.0.0.1:{port}: Address already in use")


# What docs/service.md calls an event id: <run>-<seq>, run letters and digits, seq from 1.
ID_GRAMMAR = re.compile(r"[0-9A-Za-z]{1,32}-[1-9][0-9]*", re.ASCII)
# Header values as bytes on the wire (latin-1 text: any byte but controls).
HEADER_TEXT = st.text(st.characters(codec="latin-1", exclude_categories=("Cc",)), max_size=30)


def event_id_status(service: Service, last_event_id: str | bytes) -> tuple[int, Any]:
    """The status of /events with this Last-Event-ID, and the JSON error if it is one."""
    with service.http.stream("GET", "/events", headers={"Last-Event-ID": last_event_id}) as r:
        if r.status_code == 200:
            return 200, None
        r.read()
        json_body = r.headers.get("content-type", "").startswith("application/json")
        return r.status_code, r.json() if json_body else r.text


def test_malformed_last_event_ids_get_400(roomy_service: Service) -> None:
    service = roomy_service
    fast = FastClient(service.base)
    try:
        subprocess.run([shutil.which("true") or "true"], check=True)
        first = fast.read_until(lambda m: m.id is not None)[-1]
    finally:
        fast.close()
    assert first.id is not None
    run, newest = first.id.rpartition("-")[0], published(service)
    malformed = [
        f"{run}-", f"{run}-" + "7" * 5000, f"{run}-" + "9" * 20, f"{run}-\u00b2",
        f"{run}-1\u00b2", f"{run}--1", f"{run}-+1", f"{run}-0", f"{run}-01", f"{run}-1.0",
        f"{run}-1e3", f"{run}-0x1", f"{run}-1_0", "-1", "-", "--", run,
        f"{run}-1-", f"{run}-1-1", f"{run} -1", f"{run}- 1", f"{run}-1 x", "x" * 40 + "-1",
        f"{run}\u00e9-1", "\u00ff", f"{run}-\u00bd",
    ]
    for bad in malformed:  # as latin-1 bytes: the server sees these very characters
        status, body = event_id_status(service, bad.encode("latin-1"))
        assert status == 400, (bad[:50], status)
        assert "Last-Event-ID" in body["error"]
    # The same ids sent as UTF-8, and a Unicode digit no latin-1 byte can say.
    for bad in (f"{run}-\u00b2", f"{run}-\uff13", f"{run}-\u0661"):
        status, _ = event_id_status(service, bad.encode())
        assert status == 400, bad

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.one_of(
        HEADER_TEXT,
        HEADER_TEXT.map(lambda text: f"{run}-{text}"),
        st.integers(-(10**40), 10**40).map(lambda n: f"{run}-{n}"),
        st.integers(1, 6000).map(lambda digits: f"{run}-" + "1" * digits),
    ))
    def never_500(last_event_id: str) -> None:
        value = last_event_id.strip(" \t")  # HTTP has no spaces around a header value
        status, body = event_id_status(service, value.encode("latin-1"))
        if ID_GRAMMAR.fullmatch(value) is None:
            assert status == 400, (value[:50], status)
            assert "Last-Event-ID" in body["error"]
        elif value.rpartition("-")[0] != run:
            assert status == 200  # an id of another run: a "restart" notice, then events
        else:
            digits = value.rpartition("-")[2]
            seq = int(digits) if len(digits) < 19 else 10**19  # (int() refuses 4301 digits)
            # Published before the test began; never (the machine makes events meanwhile,
            # but not a million); or maybe published since: 200 or 400, never 500.
            expected = {200} if seq <= newest else {400} if seq > newest + 10**6 else {200, 400}
            assert status in expected, (value[:50], status)

    never_500()
    assert "Traceback" not in service.log
    assert not [r for r in service.records() if "exception" in r]

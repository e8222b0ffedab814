"""NATS credentials never go where they should not (issue 29, part 2).

Asking for TLS in any way (a ``tls://`` URL, a CA, a client certificate, TLS first)
means TLS or nothing: a server, or a man in the middle, that answers
``"tls_required": false`` gets nothing. Without TLS a password or token goes in clear
only to a peer on this host (with a warning), elsewhere only with ``allow_insecure``.

Shown against a real nats-server (one that lets clients choose, ``allow_non_tls``, and
one without TLS) and against a fake server that offers no TLS and keeps every byte a
client sends it: the tests assert what reached it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import ssl
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import aperf
import aperf.fleet as fleet  # its new names are read in the tests, so they run on old code
from aperf.fleet import FleetConfigError, FleetReader, JetStreamSink, create_stream
from aperf.fleet.testing import NatsServer, free_port

from ..helpers import REPO, asyncio_only
from .test_fleet import running_server
from .test_fleet_security import make_certificates

SECRET = "pa55-w0rd-never-in-clear"


class FakeNats:
    """Not a NATS server: on ``host`` it sends an INFO (``tls_required`` false unless
    ``info`` says otherwise; TLS first when given ``tls``), answers PING with PONG, and
    keeps every byte a client sends in ``received``; to a TLS handshake it answers as
    nats-server does to what it cannot parse."""

    def __init__(
        self, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None, **info: Any
    ) -> None:
        self.host = host
        self.info = {
            "server_id": "FAKE", "version": "2.9.10", "proto": 1, "headers": True,
            "max_payload": 1 << 20, "auth_required": True, "tls_required": False, **info,
        }
        self.received = bytearray()
        self.accepted = 0
        self.ended = 0
        self._tls = tls
        self._changed = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> FakeNats:
        self._server = await asyncio.start_server(self._serve, self.host, 0, ssl=self._tls)
        self.port: int = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop listening and close every connection (a server gone)."""
        self._server.close()
        for writer in self._writers:
            writer.close()
        await asyncio.gather(*self._tasks)  # each sees its connection end
        await self._server.wait_closed()

    def url(self, scheme: str = "nats", auth: str = "") -> str:
        return f"{scheme}://{auth}{self.host}:{self.port}"

    async def wait_ended(self, count: int) -> None:
        """Until ``count`` connections have ended (the client hung up, or was refused)."""
        while self.ended < count:
            self._changed.clear()
            await self._changed.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.append(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            writer.write(b"INFO " + json.dumps(self.info).encode() + b"\r\n")
            await writer.drain()
            pending = b""
            while data := await reader.read(65536):
                self.received += data
                if data[:1] == b"\x16":  # a TLS record: nats-server's answer to a protocol
                    writer.write(b"-ERR 'Unknown Protocol Operation'\r\n")  # it cannot parse
                    break
                *lines, pending = (pending + data).split(b"\r\n")
                for _ in range(lines.count(b"PING")):
                    writer.write(b"PONG\r\n")
                await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
            await writer.wait_closed()
            self.ended += 1
            self._changed.set()


def outward_address() -> str:
    """An IPv4 address of this machine that is not loopback: a server there is, to the
    client's check, not on this host (the connection stays on this machine)."""
    shown = subprocess.run(
        ["ip", "-j", "-4", "addr", "show"], capture_output=True, text=True, check=True
    ).stdout
    for link in json.loads(shown):
        for address in link.get("addr_info", []):
            if not ipaddress.ip_address(address["local"]).is_loopback:
                return str(address["local"])
    pytest.fail("this machine has no IPv4 address but loopback's (ip -4 addr)", pytrace=False)


def login(**more: Any) -> dict[str, Any]:
    return {"user": "web-1", "password": SECRET, "connect_timeout": 5, **more}


async def open_error(thing: JetStreamSink | FleetReader) -> FleetConfigError:
    """The error ``thing.open()`` raises (it must raise one, well within the timeout)."""
    with pytest.raises(FleetConfigError) as info:
        await asyncio.wait_for(thing.open(), 20)
    await thing.aclose()
    return info.value


# --- a fake server that offers no TLS -----------------------------------------------------


@pytest.mark.anyio
@asyncio_only
async def test_tls_asked_for_is_tls_or_nothing(tmp_path: Path) -> None:
    """A server, or someone in between, that says ``"tls_required": false`` to a client
    that asked for TLS gets nothing: before, nats-py sent it the password in clear."""
    ca = make_certificates(tmp_path / "tls").ca
    asks = {
        "a tls:// URL": ("tls", {}),
        "tls_ca": ("nats", {"tls_ca": ca}),
        "both": ("tls", {"tls_ca": ca}),
    }
    for what, (scheme, tls) in asks.items():
        for make in (JetStreamSink, FleetReader):
            async with FakeNats() as fake:
                error = await open_error(make(fake.url(scheme), **login(**tls)))
                assert bytes(fake.received) == b"", (what, make, bytes(fake.received))
                assert isinstance(error, fleet.FleetInsecureError), (what, error)
                assert error.argument == "servers" and "offers none" in str(error)
        async with FakeNats() as fake:
            with pytest.raises(FleetConfigError) as info:
                await create_stream(fake.url(scheme), **login(**tls))
            assert bytes(fake.received) == b""
            assert isinstance(info.value, fleet.FleetInsecureError)
    # In the URL, or a token: the same.
    async with FakeNats() as fake:
        error = await open_error(JetStreamSink(fake.url("tls", f"web-1:{SECRET}@")))
        assert bytes(fake.received) == b"" and isinstance(error, fleet.FleetInsecureError)
    async with FakeNats() as fake:
        error = await open_error(FleetReader(fake.url("tls"), token=SECRET))
        assert bytes(fake.received) == b"" and isinstance(error, fleet.FleetInsecureError)

    # One that says TLS is available, and then does not speak it: the client starts
    # TLS (nats-py would not have: it upgrades only when the server requires it), the
    # handshake fails, nothing else is sent.
    async with FakeNats(tls_available=True) as fake:
        error = await open_error(JetStreamSink(fake.url(), **login(tls_ca=ca)))
        assert SECRET.encode() not in fake.received and b"CONNECT" not in fake.received
        assert error.argument == "tls_ca" and "TLS with the NATS server" in str(error)
    # TLS first (for servers configured with handshake_first) to a server without TLS.
    async with FakeNats() as fake:
        error = await open_error(
            JetStreamSink(fake.url(), **login(tls_ca=ca, tls_handshake_first=True))
        )
        assert SECRET.encode() not in fake.received and b"CONNECT" not in fake.received
        assert error.argument == "tls_ca"


@pytest.mark.anyio
@asyncio_only
async def test_tls_first_sends_nothing_before_the_handshake(tmp_path: Path) -> None:
    """``tls_handshake_first``: TLS before the INFO (nats-server 2.9 cannot do it; a
    fake that does stands in). The CONNECT arrives, over TLS."""
    made = make_certificates(tmp_path / "tls")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    etc = made.ca.parent
    server_tls.load_cert_chain(etc / "server-cert.pem", etc / "server-key.pem")
    async with FakeNats(tls=server_tls) as fake:
        error = await open_error(
            JetStreamSink(fake.url(), **login(tls_ca=made.ca, tls_handshake_first=True))
        )
        assert "no JetStream" in str(error)  # it connected, and found no JetStream
        connect = json.loads(bytes(fake.received).split(b"\r\n")[0].partition(b" ")[2])
        assert connect["pass"] == SECRET  # decrypted by the fake: it came over TLS


@pytest.mark.anyio
@asyncio_only
async def test_a_password_in_clear_goes_only_to_this_host() -> None:
    host = outward_address()
    # Not on this host, no TLS: refused before the CONNECT, for every kind of secret.
    secrets = {
        "password": ({"user": "web-1", "password": SECRET}, ""),
        "token": ({"token": SECRET}, ""),
        "URL": ({}, f"web-1:{SECRET}@"),
    }
    for what, (given, auth) in secrets.items():
        for make in (JetStreamSink, FleetReader):
            async with FakeNats(host) as fake:
                error = await open_error(make(fake.url(auth=auth), connect_timeout=5, **given))
                assert bytes(fake.received) == b"", (what, bytes(fake.received))
                assert isinstance(error, fleet.FleetInsecureError), (what, error)
                assert error.argument == "allow_insecure" and "not on this host" in str(error)
                assert SECRET not in str(error)
    async with FakeNats(host) as fake:
        with pytest.raises(FleetConfigError) as info:
            await create_stream(fake.url(), **login())
        assert bytes(fake.received) == b""
        assert isinstance(info.value, fleet.FleetInsecureError)

    # Said to be meant: it goes, and nothing warns (warnings are errors in this suite).
    async with FakeNats(host) as fake:
        error = await open_error(JetStreamSink(fake.url(), **login(allow_insecure=True)))
        assert "no JetStream" in str(error)
        assert SECRET.encode() in fake.received

    # On this host: it goes, with a warning naming the server, once per server.
    async with FakeNats() as fake:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")  # Python's own: once per message and place
            for make in (JetStreamSink, FleetReader, JetStreamSink):
                error = await open_error(make(fake.url(), **login()))
                assert "no JetStream" in str(error)
        assert SECRET.encode() in fake.received
        said = [str(w.message) for w in seen if w.category is fleet.FleetInsecureWarning]
        assert said == [
            f"the NATS password went in clear (no TLS) to {fake.url()}, on this host: a "
            "local user who holds that port first would get it; use TLS or a creds file, "
            "or allow_insecure=True (--nats-insecure) to say this is meant"
        ], [str(w.message) for w in seen]
        # A creds file (nkey challenge-response) sends no secret: no warning.


@pytest.mark.anyio
@asyncio_only
async def test_a_server_a_cluster_adds_is_held_to_the_same_rules(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server's INFO may add servers to the client's pool (``connect_urls``): after a
    reconnection the password would go there; not in clear to another host. The
    client keeps trying (as for a server that is down) and says so once."""
    from aperf.fleet._connect import connect, credentials

    elsewhere = FakeNats(outward_address())
    async with elsewhere, FakeNats(connect_urls=[f"{elsewhere.host}:{elsewhere.port}"]) as here:
        with pytest.warns(fleet.FleetInsecureWarning, match="in clear"):
            nc = await connect(
                here.url(), timeout=5, name="t", auth=credentials(user="web-1", password=SECRET),
            )
        try:
            assert SECRET.encode() in here.received
            await here.stop()  # the client tries the other one now
            await elsewhere.wait_ended(3)  # refused thrice: the second one's error said
        finally:
            await nc.close()
    assert elsewhere.accepted >= 3 and bytes(elsewhere.received) == b""
    said = [r.getMessage() for r in caplog.records if "reconnection was refused" in r.getMessage()]
    assert len(said) == 1 and "not on this host" in said[0], said


# --- a real nats-server ----------------------------------------------------------------------


def connections(monitor: int) -> list[dict[str, Any]]:
    """The server's client connections, from its monitoring port (``/connz``)."""
    url = f"http://127.0.0.1:{monitor}/connz?auth=true"
    with urllib.request.urlopen(url, timeout=5) as reply:
        found: list[dict[str, Any]] = json.load(reply)["connections"] or []
        return found


@pytest.fixture
def either_server(tmp_path: Path) -> Iterator[tuple[NatsServer, Path, int]]:
    """nats-server with TLS that also takes plain clients (``allow_non_tls``: its INFO
    says ``"tls_available": true``, not ``tls_required``), one user with a password;
    its CA and monitoring port."""
    made = make_certificates(tmp_path / "etc")
    etc = made.ca.parent
    monitor = free_port()
    config = f"""
jetstream {{ store_dir: "{tmp_path / 'store'}" }}
tls {{ cert_file: "{etc / 'server-cert.pem'}", key_file: "{etc / 'server-key.pem'}" }}
allow_non_tls: true
authorization {{ users: [ {{user: web-1, password: "{SECRET}"}} ] }}
"""
    with running_server(tmp_path / "nats", config=config, arguments=["-m", str(monitor)]) as s:
        yield s, made.ca, monitor


@pytest.mark.anyio
@asyncio_only
async def test_a_real_server_that_lets_clients_choose_gets_tls(
    either_server: tuple[NatsServer, Path, int],
) -> None:
    server, ca, monitor = either_server
    await create_stream(server.url, **login(tls_ca=ca))
    async with (
        JetStreamSink(server.url, host="web-1", name="perf", **login(tls_ca=ca)),
        FleetReader(server.url, durable="d", **login(tls_ca=ca)),
    ):
        seen = {c.get("name"): c for c in connections(monitor)}
        for name in ("aperf-sink web-1/perf", "aperf-reader d"):
            assert seen[name].get("authorized_user") == "web-1", seen
            assert seen[name].get("tls_version"), f"{name} sent the password in clear: {seen}"
    # Without a TLS option the same server is used in clear, on loopback, with a warning.
    with pytest.warns(fleet.FleetInsecureWarning, match=r"password went in clear"):
        await create_stream(server.url, **login())


@pytest.mark.anyio
@asyncio_only
async def test_a_real_server_without_tls_is_refused_when_tls_is_asked_for(
    tmp_path: Path,
) -> None:
    ca = make_certificates(tmp_path / "etc").ca
    with running_server(tmp_path / "nats", user="web-1", password=SECRET) as server:
        plain = f"127.0.0.1:{server.port}"
        for url, tls in ((f"tls://{plain}", {}), (f"nats://{plain}", {"tls_ca": ca})):
            for make in (JetStreamSink, FleetReader):
                error = await open_error(make(url, **login(**tls)))
                assert isinstance(error, fleet.FleetInsecureError), (url, error)
                assert error.argument == "servers"


# --- the commands ------------------------------------------------------------------------------


async def run_command(*args: str) -> tuple[int, str]:
    """Run ``python -m ARGS`` while this loop serves the fakes: (status, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *args, cwd=REPO, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@pytest.mark.anyio
@asyncio_only
async def test_commands_refuse_in_one_line_with_their_cannot_run_status(tmp_path: Path) -> None:
    ca = make_certificates(tmp_path / "etc").ca
    secret = tmp_path / "password"
    secret.write_text(SECRET + "\n")
    creds = ["--nats-user", "web-1", "--nats-password-file", str(secret)]
    commands = {  # the command, and what it calls itself
        ("aperf", "trace"): "aperf-trace",
        ("aperf.fleet", "create-stream"): "aperf.fleet",
        ("examples.fleet_view",): "fleet_view",
    }
    status = 1  # every command's "cannot run" (a refused command line is 2, a bad option)
    host = outward_address()
    for command, prog in commands.items():
        cases = {  # what is said, the option named, the status
            "TLS asked": ("127.0.0.1", "nats", ["--nats-ca", str(ca)], "offers none",
                          "(check --nats)", 1),
            "not this host": (host, "nats", [], "not on this host",
                              "allow it with allow_insecure=True (--nats-insecure)", 2),
        }
        for what, (address, scheme, more, said, option, code_) in cases.items():
            async with FakeNats(address) as fake:
                code, err = await run_command(*command, "--nats", fake.url(scheme), *creds, *more)
            assert bytes(fake.received) == b"", (command, what, bytes(fake.received))
            lines = err.strip().splitlines()
            assert code == code_ and len(lines) == 1 and said in lines[0], (command, err)
            assert lines[0].endswith(option) and "(check servers=)" not in lines[0], lines[0]
            assert SECRET not in err
        # --nats-insecure: sent, and then no JetStream.
        async with FakeNats(host) as fake:
            code, err = await run_command(
                *command, "--nats", fake.url(), *creds, "--nats-insecure"
            )
        assert SECRET.encode() in fake.received
        assert code == status and "no JetStream" in err and "warning" not in err, (command, err)
        # To this host: sent, with a warning in one line.
        async with FakeNats() as fake:
            code, err = await run_command(*command, "--nats", fake.url(), *creds)
        assert SECRET.encode() in fake.received
        warning, error = err.strip().splitlines()
        assert warning.startswith(f"{prog}: warning: the NATS password went in clear"), err
        assert code == status and "no JetStream" in error, (command, err)


def test_the_ca_option_says_what_it_is() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "aperf.fleet", "create-stream", "--help"], cwd=REPO,
        capture_output=True, text=True, check=True,
    ).stdout
    text = " ".join(shown.split())
    assert re.search(r"--nats-ca PATH TLS: the CA certificate that signed the server's "
                     r"certificate \(a tls:// URL without it trusts the system's CAs\); "
                     r"given, TLS is required", text), text
    assert "--nats-insecure" in text and "--nats-tls-first" in text


@pytest.mark.anyio
@asyncio_only
async def test_one_nats_options_value_serves_the_sink_the_reader_and_create_stream(
    either_server: tuple[NatsServer, Path, int],
) -> None:
    """The URLs, the user, the TLS CA and the timeouts given once, as ``NatsOptions``,
    instead of the same keywords three times: each connects over TLS as that user, and a
    sample goes through."""
    server, ca, monitor = either_server
    options = fleet.NatsOptions(server.url, **login(tls_ca=ca))
    await create_stream(options)
    async with (
        JetStreamSink(options, host="web-1", name="perf") as sink,
        FleetReader(options, durable="d") as reader,
    ):
        seen = {c.get("name"): c for c in connections(monitor)}
        for name in ("aperf-sink web-1/perf", "aperf-reader d"):
            assert seen[name].get("authorized_user") == "web-1", seen
            assert seen[name].get("tls_version"), f"{name} sent the password in clear: {seen}"
        await sink.send([aperf.Sample(0, b"one sample")])
        host, stream, event = await asyncio.wait_for(anext(aiter(reader)), 30)
    assert (host, stream, event) == ("web-1", "perf", aperf.Sample(0, b"one sample", None))
    # The same value, and a keyword beside it: which would win? Said, naming it.
    with pytest.raises(TypeError, match=r"^user= goes in the NatsOptions"):
        FleetReader(options, user="web-2")

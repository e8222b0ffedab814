"""aperf.fleet against a nats-server with users, permissions and TLS, as docs/fleet.md
configures it: the configuration is read from the page, the certificates are made here.

What the server must refuse (a host publishing as another, a reader publishing, a
wrong password, a certificate that does not verify) is refused, reported as one
typed error (one line, exit status 2 from the commands), and nothing reaches the
stream as another host.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from aperf.fleet import (
    FleetAuthError,
    FleetConfigError,
    FleetInsecureWarning,
    FleetReader,
    JetStreamSink,
    create_stream,
)
from aperf.fleet._wire import Framer
from aperf.fleet.testing import NatsServer

from ..docs.snippets import blocks_in
from ..helpers import REPO, asyncio_only
from ..kernel.test_tracer import HEADER as TRACER_HEADER
from ..kernel.test_tracer import parse_row
from .test_fleet import SEQ_TS, Fleet, Lines, read_fleet, running_server, seq_sample, until

PASSWORDS = {
    "web-1": "w1-secret", "web-2": "w2-secret", "fleet-reader": "r-secret",
    "fleet-admin": "a-secret",
}
ETC = "/etc/nats/"  # where docs/fleet.md's configuration has its files
STORE = "/var/lib/nats"  # and its JetStream store


# --- certificates and the server of docs/fleet.md ------------------------------------------


@dataclass
class Tls:
    ca: Path  # the CA clients trust
    other_ca: Path  # a CA that signed nothing of this server's


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make_ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common)).issuer_name(_name(common))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ), critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def make_certificates(directory: Path) -> Tls:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost, in the
    files docs/fleet.md's configuration names (under ``directory`` for /etc/nats/)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = make_ca("aperf test CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _pem(directory / "server-cert.pem", cert.public_bytes(pem))
    _pem(directory / "server-key.pem", key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))
    _, other = make_ca("a CA nobody uses")
    return Tls(
        ca=_pem(directory / "ca.pem", ca.public_bytes(pem)),
        other_ca=_pem(directory / "other-ca.pem", other.public_bytes(pem)),
    )


def docs_config() -> str:
    """The server configuration docs/fleet.md gives (its ``conf`` block with users)."""
    page = REPO / "docs" / "fleet.md"
    found = [
        b.code for b in blocks_in(page.read_text(), "docs/fleet.md")
        if b.lang == "conf" and "authorization" in b.code
    ]
    assert len(found) == 1, "docs/fleet.md must hold one server configuration with users"
    return found[0]


@dataclass
class Secure:
    server: NatsServer
    tls: Tls
    dir: Path

    @property
    def url(self) -> str:
        return self.server.url

    def login(self, user: str, **more: Any) -> dict[str, Any]:
        """The keywords a sink, reader or create_stream takes to be ``user``, over TLS."""
        return {"user": user, "password": PASSWORDS[user], "tls_ca": self.tls.ca, **more}

    def password_file(self, user: str, password: str | None = None) -> Path:
        path = self.dir / f"{user}.password"
        path.write_text((password or PASSWORDS[user]) + "\n")
        return path


@contextlib.contextmanager
def secure_server(
    directory: Path, monkeypatch: pytest.MonkeyPatch, config: str | None = None
) -> Iterator[Secure]:
    """nats-server running docs/fleet.md's configuration, its files under ``directory``."""
    etc = directory / "etc"
    tls = make_certificates(etc)
    store = directory / "store"
    text = (config or docs_config()).replace(ETC, f"{etc}/").replace(STORE, str(store))
    assert ETC not in text and STORE not in text and "server-cert.pem" in text
    for user, password in PASSWORDS.items():  # the config reads them from the environment
        monkeypatch.setenv(user.upper().replace("-", "_") + "_PASSWORD", password)
    with running_server(directory / "nats", config=text) as server:
        yield Secure(server, tls, directory)


@pytest.fixture
def secure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Secure]:
    with secure_server(tmp_path, monkeypatch) as server:
        yield server


async def stored_subjects(secure: Secure) -> dict[str, int]:
    """Messages per subject in stream APERF, as the admin sees it."""
    nc = await nats.connect(
        secure.url, user="fleet-admin", password=PASSWORDS["fleet-admin"],
        tls=_context(secure.tls.ca),
    )
    try:
        info = await nc.jetstream().stream_info("APERF", subjects_filter=">")
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


def _context(ca: Path) -> Any:
    import ssl

    return ssl.create_default_context(cafile=str(ca))


# --- the library ---------------------------------------------------------------------------


@pytest.mark.anyio
@asyncio_only
async def test_hosts_publish_only_as_themselves_over_tls(secure: Secure) -> None:
    await create_stream(secure.url, **secure.login("fleet-admin"))
    web1 = secure.login("web-1")
    async with JetStreamSink(secure.url, host="web-1", name="perf", **web1) as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])
        await sink.flush()
    assert sink.statistics().samples_acknowledged == 10

    # web-1 as web-2: the server refuses the replies' inboxes, _INBOX.aperf.web-2.
    with pytest.raises(FleetAuthError, match=r"(?i)permissions violation for subscription"):
        await asyncio.wait_for(
            JetStreamSink(secure.url, host="web-2", **secure.login("web-1")).open(), 10
        )
    # With web-1's inboxes it opens; the server refuses what it publishes as web-2,
    # the sink says so and counts it.
    impostor = JetStreamSink(
        secure.url, host="web-2", name="perf", ack_timeout=30, **secure.login("web-1"),
        connect_options={"inbox_prefix": "_INBOX.aperf.web-1"},
    )
    async with impostor:
        await impostor.send([seq_sample(0, i) for i in range(7)])
        with pytest.raises(FleetAuthError, match=r"(?i)permissions violation for publish to "
                           r"\"aperf\.web-2\.perf\"") as refused:
            await asyncio.wait_for(impostor.flush(), 20)  # well before the ack timeout
        assert refused.value.argument == "host"
        with pytest.raises(FleetAuthError):
            await impostor.send([seq_sample(0, 7)])
    stats = impostor.statistics()
    [(reason, count)] = stats.dropped.items()
    assert count == 7 and reason.lower().startswith(
        "refused by the nats server: permissions violation for publish"
    )
    assert stats.samples_acknowledged == 0

    # A reader's user may consume and nothing else: it cannot publish as a host either.
    problems: list[Exception] = []

    async def error_cb(exc: Exception) -> None:
        problems.append(exc)

    nc = await nats.connect(
        secure.url, user="fleet-reader", password=PASSWORDS["fleet-reader"],
        tls=_context(secure.tls.ca), error_cb=error_cb,
    )
    try:
        await nc.publish("aperf.web-1.perf", b"forged")
        await nc.flush()
        # The server's refusal comes back on its own, to error_cb: wait for it.
        await until(lambda: any("permissions violation for publish" in str(p).lower()
                                for p in problems), "the server's refusal")
    finally:
        await nc.close()

    # Only web-1's own messages were stored (its samples and its end-of-stream).
    assert await stored_subjects(secure) == {"aperf.web-1.perf": 2}
    fleet = Fleet()
    async with FleetReader(
        secure.url, durable="dash", decoder=SEQ_TS, **secure.login("fleet-reader")
    ) as reader:
        await read_fleet(reader, fleet, lambda: fleet.accounted("web-1") >= 10)
    assert fleet.seqs == {"web-1": list(range(10))}
    assert fleet.gaps == []


@pytest.mark.anyio
@asyncio_only
async def test_refused_credentials_and_certificates_are_one_typed_error(secure: Secure) -> None:
    await create_stream(secure.url, **secure.login("fleet-admin"))
    wrong = {"user": "web-1", "password": "not-it", "tls_ca": secure.tls.ca}
    for thing in (JetStreamSink(secure.url, host="web-1", **wrong),
                  FleetReader(secure.url, **wrong)):
        with pytest.raises(FleetAuthError, match="refused the credentials") as info:
            await asyncio.wait_for(thing.open(), 10)  # at once, not after retries
        assert info.value.argument == "password" and "not-it" not in str(info.value)
    with pytest.raises(FleetAuthError) as info:  # a FleetConfigError too, for old callers
        await create_stream(secure.url, **wrong)
    assert isinstance(info.value, FleetConfigError)

    # The server's certificate does not verify against another CA, nor the system's.
    for ca in (secure.tls.other_ca, None):
        login = secure.login("web-1", tls_ca=ca) if ca else {
            "user": "web-1", "password": PASSWORDS["web-1"]
        }
        with pytest.raises(FleetAuthError, match="does not verify") as info:
            await asyncio.wait_for(JetStreamSink(secure.url, host="web-1", **login).open(), 10)
        assert info.value.argument == "tls_ca"

    # A reader whose user lacks a JetStream API permission: refused, said at open().
    sink_user = secure.login("web-1")
    with pytest.raises(FleetAuthError, match=r"(?i)permissions violation"):
        await asyncio.wait_for(FleetReader(secure.url, **sink_user).open(), 10)

    # Mistakes in the options themselves, before any connection.
    with pytest.raises(FleetConfigError, match="cannot read") as bad:
        JetStreamSink(secure.url, tls_ca=secure.dir / "missing.pem")
    assert bad.value.argument == "tls_ca"
    with pytest.raises(FleetConfigError) as bad:
        FleetReader(secure.url, creds=secure.dir / "missing.creds")
    assert bad.value.argument == "creds"
    with pytest.raises(ValueError, match="one of"):
        JetStreamSink(secure.url, user="a", password="b", token="c")
    with pytest.raises(ValueError, match="password needs user"):
        FleetReader(secure.url, password="b")


@pytest.mark.anyio
@asyncio_only
async def test_a_token_server(tmp_path: Path) -> None:
    with running_server(tmp_path / "nats", arguments=["--auth", "s3cret-token"]) as server:
        with pytest.warns(FleetInsecureWarning, match="token went in clear"):  # loopback
            await create_stream(server.url, token="s3cret-token")
        clear = {"token": "s3cret-token", "allow_insecure": True}  # meant: no warning
        async with JetStreamSink(server.url, host="h", **clear) as sink:
            await sink.send([seq_sample(0, 0)])
            await sink.flush()
        fleet = Fleet()
        async with FleetReader(server.url, decoder=SEQ_TS, **clear) as reader:
            await read_fleet(reader, fleet, lambda: fleet.accounted("h") >= 1)
        assert fleet.seqs == {"h": [0]}
        with pytest.raises(FleetAuthError) as info:
            await JetStreamSink(server.url, token="wrong").open()
        assert info.value.argument == "token"


@pytest.mark.anyio
@asyncio_only
@pytest.mark.filterwarnings("ignore::aperf.fleet.FleetInsecureWarning")  # a password, loopback
async def test_the_reader_refuses_a_forged_host_when_the_server_lets_it_through(
    tmp_path: Path,
) -> None:
    """A misconfigured server (one user, allowed everything) lets mallory publish a
    message claiming to be web-1's on aperf.mallory.perf: the reader must not hand
    it out as web-1's, and counts it."""
    with running_server(tmp_path / "nats", user="mallory", password="m") as server:
        await create_stream(server.url)
        forged = Framer("web-1", "perf", 12345, max_events=100, max_bytes=100_000)
        nc = await nats.connect(server.url)
        try:
            for out in forged.frame([seq_sample(0, 1000 + i) for i in range(5)], 0):
                await nc.jetstream().publish("aperf.mallory.perf", out.payload)
        finally:
            await nc.close()
        async with JetStreamSink(server.url, host="web-1", name="perf") as sink:
            await sink.send([seq_sample(0, i) for i in range(5)])
        fleet = Fleet()
        async with FleetReader(server.url, durable="d", decoder=SEQ_TS) as reader:
            await read_fleet(reader, fleet, lambda: fleet.accounted("web-1") >= 5)
            stats = reader.statistics()
    assert fleet.seqs == {"web-1": list(range(5))}, "forged events were handed out as web-1's"
    assert stats.malformed + getattr(stats, "refused", 0) >= 1  # counted, not silent


# --- the commands --------------------------------------------------------------------------


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_commands_take_credentials_and_say_a_refusal_in_one_line(
    tracefs: None, secure: Secure
) -> None:
    ca = str(secure.tls.ca)
    admin = ["--nats-user", "fleet-admin", "--nats-password-file",
             str(secure.password_file("fleet-admin")), "--nats-ca", ca]
    made = run_cli("aperf.fleet", "create-stream", "--nats", secure.url, *admin)
    assert made.returncode == 0, made.stderr
    assert "1 replica(s)" in made.stderr

    wrong = ["--nats-user", "web-1", "--nats-password-file",
             str(secure.password_file("wrong", "not-it")), "--nats-ca", ca]
    for command in (
        ("aperf", "trace", "--nats", secure.url, "--host", "web-1", *wrong),
        ("examples.fleet_view", "--nats", secure.url, *wrong),
        ("aperf.fleet", "create-stream", "--nats", secure.url, *wrong),
    ):
        result = run_cli(*command)
        assert result.returncode == 2, (command, result.stderr)
        line = one_line(result)
        assert "refused the credentials" in line and "not-it" not in line
        assert line.endswith("(check --nats-user and --nats-password-file)"), line
    # No credentials at all: the line names the options that give them, not servers=.
    for command in (
        ("aperf", "trace", "--nats", secure.url, "--host", "web-1", "--nats-ca", ca),
        ("examples.fleet_view", "--nats", secure.url, "--nats-ca", ca),
        ("aperf.fleet", "create-stream", "--nats", secure.url, "--nats-ca", ca),
    ):
        result = run_cli(*command)
        assert result.returncode == 2, (command, result.stderr)
        line = one_line(result)
        assert "refused the credentials" in line and "servers=" not in line, line
        assert line.endswith("(credentials go in --nats-user and --nats-password-file, "
                             "--nats-token-file, or --nats-creds)"), line
    bad_file = run_cli("aperf.fleet", "create-stream", "--nats", secure.url,
                       "--nats-password-file", str(secure.dir / "missing"))
    assert bad_file.returncode == 2 and "cannot read" in bad_file.stderr

    # The right ones: a tracer as web-1 and the viewer as the reader, over TLS.
    web1 = ["--nats-user", "web-1", "--nats-password-file",
            str(secure.password_file("web-1")), "--nats-ca", ca]
    reader = ["--nats-user", "fleet-reader", "--nats-password-file",
              str(secure.password_file("fleet-reader")), "--nats-ca", ca]
    header = "HOST             " + TRACER_HEADER
    with (
        Lines("examples.fleet_view", "--nats", secure.url, *reader) as viewer,
        Lines("aperf", "trace", "--nats", secure.url, "--host", "web-1", *web1) as tracer,
    ):
        tracer.read_until(lambda seen: TRACER_HEADER in seen)
        viewer.read_until(lambda seen: header in seen)
        probe = subprocess.Popen(["/bin/true"])
        probe.wait()

        def seen_it(_: list[str]) -> bool:
            rows = viewer.seen[viewer.seen.index(header) + 1 :]
            return any(
                line[:16].rstrip() == "web-1" and parse_row(line[17:]).pid == probe.pid
                for line in rows
            )

        viewer.read_until(seen_it)
        assert tracer.stop(2) == 0 and viewer.stop(15) == 0

    # web-1 publishing as web-2: refused, one line, status 2.
    impostor = run_cli("aperf", "trace", "--nats", secure.url, "--host", "web-2", *web1)
    assert impostor.returncode == 2
    assert "permissions violation" in one_line(impostor).lower()
    assert set(asyncio.run(stored_subjects(secure))) == {"aperf.web-1.bootstrap_legacy"}


def test_the_docs_configuration_is_the_one_tested() -> None:
    text = docs_config()
    # Each host may publish on its own subjects only; the reader on none of aperf.>.
    for host in ("web-1", "web-2"):
        user = re.search(r"\{user: " + host + r",.*?\}\}", text, re.S)
        assert user is not None
        assert re.findall(r'"aperf\.[^"]*"', user.group()) == [f'"aperf.{host}.>"']
    reader = re.search(r"\{user: fleet-reader,.*?\}\}", text, re.S)
    assert reader is not None and '"aperf.' not in reader.group()
    assert os.path.basename(ETC.rstrip("/")) == "nats"  # the paths the fixture replaces

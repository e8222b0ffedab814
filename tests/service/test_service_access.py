"""Who may talk to the service (examples/service/access.py), on the real service process.

A page of another site must not read the events through DNS rebinding (the Host check); only
a holder of the token (``--token-file``, or one the service makes when none is given) reads
anything but the page's static files, and serving everyone takes ``--no-token``; the token
stays out of logs, cookies and Referer headers; a browser's session id is short-lived, and a
copy of it used by someone else ends the session. Other users are real processes of
``nobody`` (through ``setpriv``).
"""

from __future__ import annotations

import os
import pty
import queue
import re
import secrets
import select
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from examples.service.access import COOKIE

from .test_service import REPO, TIMEOUT, Service, free_port, run_service

pytestmark = pytest.mark.kernel

DATA_ROUTES = ("/", "/events", "/health", "/metrics")


def as_nobody(code: str, *args: str) -> subprocess.Popen[str]:
    """Python ``code`` in a process of ``nobody`` (another local user, no capability)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to run a process as another user")
    return subprocess.Popen(
        [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
         "--bounding-set=-all", sys.executable, "-c", textwrap.dedent(code), *args],
        cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def next_line(proc: subprocess.Popen[str], timeout: float = TIMEOUT) -> str:
    """The next line ``proc`` prints, waited for at most ``timeout`` seconds."""
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()),  # type: ignore[union-attr]
                     daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process printed no line within {timeout}s: {out!r} {err!r}")


def status(http: httpx.Client, path: str, **headers: str) -> int:
    """The status of GET ``path`` (an event stream is closed once its headers are in)."""
    with http.stream("GET", path, headers=headers) as response:
        return response.status_code


@pytest.fixture
def guarded(tracefs: None, tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "service.log", "--allowed-host", "dash.example",
                  token=secrets.token_urlsafe(32))
    try:
        svc.wait_ready()
        yield svc
    finally:
        svc.close()


def test_foreign_host_headers_are_refused(tracefs: None, tmp_path: Path) -> None:
    svc = Service(tmp_path / "service.log")
    try:
        svc.wait_ready()
        for path in DATA_ROUTES:
            # What a rebinding page's requests carry: its own name.
            assert status(svc.http, path, host=f"evil.example:{svc.port}") == 400, path
            assert status(svc.http, path, host="evil.example") == 400, path
            assert status(svc.http, path, host=f"localhost:{svc.port}") == 200, path
            assert status(svc.http, path, host=f"127.0.0.1:{svc.port}") == 200, path
        assert status(svc.http, "/static/page.js", host="127.0.0.1.evil.example") == 400
    finally:
        svc.close()


def test_token_is_asked_on_every_route_but_static(guarded: Service) -> None:
    svc, token = guarded, guarded.token
    assert token is not None
    with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as anonymous:
        for path in DATA_ROUTES:
            assert status(anonymous, path) == 401, path
            assert status(anonymous, path, authorization="Bearer " + token[:-1]) == 401, path
            assert status(anonymous, path, authorization="Bearer " + token + "x") == 401, path
            assert status(anonymous, path, authorization="Basic " + token) == 401, path
            assert status(anonymous, path, authorization="Bearer " + token) == 200, path
            # The token is no session id: a cookie never holds it.
            assert status(anonymous, path, cookie=f"{COOKIE}={token}") == 401, path
        refused = anonymous.get("/events")
        assert refused.headers["www-authenticate"] == "Bearer"
        assert "token" in refused.json()["error"]
        # The page's script and stylesheet hold no data: served to anyone.
        assert status(anonymous, "/static/page.js") == 200
        assert status(anonymous, "/static/page.css") == 200
        # A wrong ?token= sets nothing; the right one sets the cookie once and sends the
        # browser back to / without the token in its address bar.
        wrong = anonymous.get("/", params={"token": "x" + token})
        assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
        once = anonymous.get("/", params={"token": token})
        assert once.status_code == 303 and once.headers["location"] == "/"
        assert once.headers["cache-control"] == "no-store"
        cookie = once.headers["set-cookie"]
        attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attributes
        assert not any(a.startswith(("max-age", "expires")) for a in attributes)
        assert "secure" not in attributes  # plain HTTP here; --secure-cookie behind TLS
        session = anonymous.cookies[COOKIE]
        assert len(session) >= 40 and token not in session and session not in token
        assert status(anonymous, "/health") == 200  # the cookie, from now on
        # With a session already, the token still leaves the address bar at once.
        again = anonymous.get("/", params={"token": token})
        assert again.status_code == 303 and anonymous.cookies[COOKIE] != session
    # The token does not lift the Host check; --allowed-host adds a name.
    assert status(svc.http, "/health", host="evil.example") == 400
    assert status(svc.http, "/health", host="dash.example") == 200
    assert status(svc.http, "/health", host=f"DASH.example:{svc.port}") == 200


def test_non_loopback_without_token_options_is_not_refused(kernel: None, tmp_path: Path) -> None:
    # Refused with status 2 before tokens were made by default; now served with one made at
    # start-up, like loopback (test_a_token_is_made_when_none_is_given). The runs stop at
    # the next check (no object here), so that nothing listens on this machine's
    # interfaces during the test.
    missing = tmp_path / "missing.bpf.o"
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(32))
    token_file.chmod(0o600)
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        for extra in ((), ("--no-token",), ("--token-file", str(token_file))):
            result = run_service("--host", host, "--port", str(free_port()),
                                 "--object", str(missing), *extra)
            assert result.returncode == 1, (host, extra, result.stderr)
            assert result.stderr == f"service: BPF object {missing} does not exist; build " \
                "it with: make -C bpf\n"


@pytest.mark.parametrize(("content", "expected"), [
    (None, "cannot read token file"),
    ("short\n", "must hold one token of at least 16 characters"),
    ("a token with spaces in it\n", "must hold one token"),
    ("caf\u00e9" * 8, "must hold one token"),
])
def test_bad_token_file_fails_in_one_line(
    kernel: None, tmp_path: Path, content: str | None, expected: str
) -> None:
    token_file = tmp_path / "token"
    if content is not None:
        token_file.write_text(content)
        token_file.chmod(0o600)
    result = run_service("--port", str(free_port()), "--token-file", str(token_file))
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("service: ") and expected in line, line


@pytest.mark.parametrize("bad", ["*", "evil example", "*evil.example", "a..b", "-x.example"])
def test_bad_allowed_host_fails_in_one_line(bad: str) -> None:
    result = run_service("--allowed-host", bad)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("service: argument --allowed-host: ")
    # The same for --host, which is served as a Host too.
    result = subprocess.run([sys.executable, "-m", "examples.service", "--host", bad], cwd=REPO,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("service: argument --host: ")


def test_help_and_docs_say_who_can_see_what() -> None:
    result = subprocess.run([sys.executable, "-m", "examples.service", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True)
    text = " ".join(result.stdout.split())
    docs = " ".join((REPO / "docs" / "service.md").read_text().split())
    for said in (text, docs):
        assert "who can see what" in said.lower()
        for what in ("name", "the file it ran", "exit code", "--token-file", "--no-token",
                     "--allowed-host", "DNS rebinding", "/?token="):
            assert what in said, what


def test_access_log_keeps_query_strings_out(guarded: Service) -> None:
    svc, token = guarded, guarded.token
    assert token is not None
    with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as anonymous:
        assert anonymous.get("/", params={"token": "wrong-" + token}).status_code == 401
        assert anonymous.get("/", params={"token": token}).status_code == 303
        assert anonymous.get("/health", params={"token": token, "x": "qs-secret"}).status_code \
            == 200  # the cookie
        assert status(anonymous, "/events?qs-secret") == 200
    svc.stop()
    # Each request is logged (after wait_ready's), without its query string.
    access = [r["event"] for r in svc.records() if r["logger"] == "uvicorn.access"][-4:]
    assert [line.partition(" - ")[2] for line in access] == [
        '"GET / HTTP/1.1" 401', '"GET / HTTP/1.1" 303', '"GET /health HTTP/1.1" 200',
        '"GET /events HTTP/1.1" 200'], access
    assert token not in svc.log and "qs-secret" not in svc.log


def test_token_file_open_to_group_or_others_is_refused(kernel: None, tmp_path: Path) -> None:
    missing = tmp_path / "missing.bpf.o"
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    for mode in (0o644, 0o640, 0o604, 0o620, 0o602, 0o610):
        token_file.chmod(mode)
        result = run_service("--port", str(free_port()), "--token-file", str(token_file),
                             "--object", str(missing))
        assert result.returncode == 1, result.stderr
        assert result.stderr == f"service: token file {token_file} is open to group or " \
            f"others (mode {mode:04o}): anyone who reads it reads every event; chmod 600 " \
            f"{token_file}\n"
    for mode in (0o600, 0o400):  # private: taken (the run stops at the next check)
        token_file.chmod(mode)
        result = run_service("--port", str(free_port()), "--token-file", str(token_file),
                             "--object", str(missing))
        assert result.returncode == 1 and "does not exist" in result.stderr, result.stderr


def test_a_token_is_made_when_none_is_given(tracefs: None, tmp_path: Path) -> None:
    # As a user starts it on a terminal: stderr on a pseudo-terminal, the log in a file.
    terminal, stderr = pty.openpty()
    svc = Service(tmp_path / "service.log", generated_token=True, stderr=stderr)
    os.close(stderr)
    try:
        svc.wait_ready()
        token = svc.token
        assert token is not None and len(token) >= 40

        # The file: 0600 in a directory of root's only.
        info = svc.token_path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        assert stat.S_IMODE(svc.runtime.stat().st_mode) == 0o700
        # The terminal shows the URL with the token, once; the log says where it is, only.
        shown = b""
        url = f"http://127.0.0.1:{svc.port}/?token={token}"
        deadline = time.monotonic() + TIMEOUT
        while url.encode() not in shown and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.5)[0]:
                shown += os.read(terminal, 4096)
        assert shown.count(url.encode()) == 1, shown
        assert svc.record("token made")["token_file"] == str(svc.token_path)
        assert token not in svc.log

        # Nobody without the token; another user can neither read the file nor the events.
        with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as anonymous:
            for path in DATA_ROUTES:
                assert status(anonymous, path) == 401, path
        other = as_nobody("""
            import http.client, sys
            try:
                open(sys.argv[2]).read()
            except PermissionError:
                print("no token")
            conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
            conn.request("GET", "/events")
            print(conn.getresponse().status)
        """, str(svc.port), str(svc.token_path))
        assert next_line(other).strip() == "no token"
        assert next_line(other).strip() == "401"
        other.communicate()
        assert status(svc.http, "/events") == 200  # the token, as a bearer

        # The token dies with the service.
        assert svc.stop()[0] == 0
        assert not svc.token_path.exists()
    finally:
        os.close(terminal)
        svc.close()


def test_no_token_is_said_in_the_log(tracefs: None, tmp_path: Path) -> None:
    svc = Service(tmp_path / "service.log")  # --no-token
    try:
        svc.wait_ready()
        with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as anonymous:
            assert status(anonymous, "/events") == 200
        warning = svc.record("serving without a token: whoever reaches the port reads every "
                             "event")
        assert warning["level"] == "warning" and warning["port"] == svc.port
        assert not svc.token_path.exists()
    finally:
        svc.close()


def session_cookie(response: httpx.Response) -> str | None:
    """The session id a response hands out, if it does."""
    match = re.match(rf"{COOKIE}=([^;]*);", response.headers.get("set-cookie", ""))
    return match[1] if match else None


def health_with_session(http: httpx.Client, session: str) -> int:
    """The status of /health with only this session id as the cookie."""
    http.cookies.clear()
    return http.get("/health", headers={"cookie": f"{COOKIE}={session}"}).status_code


def test_session_ids_are_short_lived_and_a_copied_one_ends_the_session(
    tracefs: None, tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(32)
    # Ids replaced after 2 s, dead after 4 s unused: the test polls every 0.1 s, and would
    # have to stall for 2 s to see its own id die.
    svc = Service(tmp_path / "service.log", "--session-rotate", "2", token=token)
    try:
        svc.wait_ready()
        with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as user, \
                httpx.Client(base_url=svc.base, timeout=TIMEOUT) as thief:
            first = session_cookie(user.get("/", params={"token": token}))
            assert first is not None and token not in first
            assert user.get("/health").status_code == 200
            copied = first  # what another program took from the browser

            # The user's id is replaced once it is two seconds old, at its next use.
            deadline = time.monotonic() + TIMEOUT
            while (renewed := session_cookie(user.get("/health"))) is None:
                assert time.monotonic() < deadline, "the session id was never replaced"
                time.sleep(0.1)
            assert renewed != first and user.cookies[COOKIE] == renewed
            assert user.get("/health").status_code == 200

            # The copy works for the grace (two seconds here) at most; used after it, it
            # ends the session for both holders.
            deadline = time.monotonic() + TIMEOUT
            while health_with_session(thief, copied) == 200:
                assert time.monotonic() < deadline, "the copied session id was never refused"
                time.sleep(0.1)
            assert user.get("/health").status_code == 401
            assert svc.record("browser session ended: a replaced session id was used again, "
                              "so two parties held it (a copy of the cookie)")["level"] == \
                "warning"
            # Made-up ids, and the token as an id, never open anything; the token opens a
            # new session.
            for made_up in (secrets.token_urlsafe(32), token, renewed, ""):
                assert health_with_session(thief, made_up) == 401
            user.cookies.clear()
            assert user.get("/", params={"token": token}).status_code == 303
            assert user.get("/health").status_code == 200
    finally:
        svc.close()


def test_every_response_says_no_referrer_and_the_cookie_can_be_secure(
    tracefs: None, tmp_path: Path
) -> None:
    token = secrets.token_urlsafe(32)
    svc = Service(tmp_path / "service.log", "--secure-cookie", token=token)
    try:
        svc.wait_ready()
        with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as anonymous:
            responses = [
                anonymous.get("/", params={"token": token}),
                anonymous.get("/health", headers={"authorization": "Bearer " + token}),
                anonymous.get("/health"),
                anonymous.get("/health", headers={"host": "evil.example"}),
                anonymous.get("/nothing", headers={"authorization": "Bearer " + token}),
                anonymous.get("/static/page.js"),
            ]
            assert [r.status_code for r in responses] == [303, 200, 401, 400, 404, 200]
            for response in responses:
                assert response.headers["referrer-policy"] == "no-referrer", response
            attributes = {a.strip().lower() for a in responses[0].headers["set-cookie"].split(";")}
            assert "secure" in attributes  # and so httpx, on plain HTTP, does not send it
            assert status(anonymous, "/health") == 401
    finally:
        svc.close()

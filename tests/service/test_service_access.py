"""Who may talk to the service (examples/service/access.py), on the real service process.

A page of another site must not read the events through DNS rebinding (the Host check); with
``--token-file`` only a holder of the token reads anything but the page's static files; a
non-loopback address is not served without a token unless asked for explicitly.
"""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .test_service import REPO, TIMEOUT, Service, free_port, run_service

pytestmark = pytest.mark.kernel

DATA_ROUTES = ("/", "/events", "/health", "/metrics")


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
            assert status(anonymous, path, cookie=f"aperf_service_token={token}") == 200, path
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
        cookie = once.headers["set-cookie"]
        assert cookie.startswith(f"aperf_service_token={token};")
        attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attributes
        assert anonymous.cookies["aperf_service_token"] == token
        assert status(anonymous, "/health") == 200  # the cookie, from now on
    # The token does not lift the Host check; --allowed-host adds a name.
    assert status(svc.http, "/health", host="evil.example") == 400
    assert status(svc.http, "/health", host="dash.example") == 200
    assert status(svc.http, "/health", host=f"DASH.example:{svc.port}") == 200


def test_non_loopback_without_token_refuses_to_start(kernel: None, tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::", "192.0.2.1"):
        result = run_service("--host", host, "--port", str(free_port()))
        assert result.returncode == 2, (host, result.stderr)
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"service: --host {host} is not a loopback address")
        assert "--token-file" in line and "--no-token" in line
    # Told explicitly, or given a token, it goes on (to the next check: no object here,
    # so that nothing listens on this machine's interfaces during the test).
    missing = tmp_path / "missing.bpf.o"
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(32))
    for extra in (("--no-token",), ("--token-file", str(token_file))):
        result = run_service("--host", "0.0.0.0", "--port", str(free_port()),
                             "--object", str(missing), *extra)
        assert result.returncode == 1, result.stderr
        assert result.stderr == f"service: BPF object {missing} does not exist; build it with: " \
            "make -C bpf\n"
    # localhost and ::1 are loopback: no token needed.
    result = run_service("--host", "localhost", "--port", str(free_port()),
                         "--object", str(missing))
    assert result.returncode == 1 and "does not exist" in result.stderr


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

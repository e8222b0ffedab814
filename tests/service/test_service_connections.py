"""What connections cost the service, on the real process (examples/service/connections.py).

Another local user (a real process of ``nobody``) opens idle connections by the thousand;
the service holds at most ``--max-connections`` of them, closes those that send no request
head in time, keeps file descriptors in reserve for its rings, and root's ``/health`` is
still answered. Event streams beyond ``--max-clients`` get 503. The service runs with the
soft ``RLIMIT_NOFILE`` of a systemd unit (1024).
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from examples.service.connections import MAX_CONNECTIONS, RING_RESERVE_FDS

from .test_service import (
    REPO,
    TIMEOUT,
    FastClient,
    Service,
    assert_one_line_failure,
    free_port,
    per_label,
    run_service,
    total,
)
from .test_service_access import as_nobody, next_line

pytestmark = pytest.mark.kernel

SYSTEMD_SOFT_NOFILE = 1024  # LimitNOFILE's default soft limit for a service
IDLE = 1100  # what exhausted the service before the guard: its 1024 fds

# Opens argv[2] connections to port argv[1], sends nothing, says how many it opened, and
# holds them until killed.
HOARDER = """
    import resource, signal, socket, sys
    port, count = int(sys.argv[1]), int(sys.argv[2])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(60)
        s.connect(("127.0.0.1", port))
        held.append(s)
    print(len(held), flush=True)
    signal.pause()
"""


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def soft_nofile(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no open files limit")


def systemd_limits() -> list[str]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return ["prlimit", f"--nofile={SYSTEMD_SOFT_NOFILE}:{hard}", "--"]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_another_users_idle_connections_leave_health_answered(
    tracefs: None, tmp_path: Path, loop: str
) -> None:
    svc = Service(tmp_path / "service.log", "--loop", loop, wrapper=systemd_limits())
    hoarder = None
    try:
        svc.wait_ready()
        assert soft_nofile(svc.proc.pid) == SYSTEMD_SOFT_NOFILE  # it needs no more
        # The service's open fds, looked at all along (the most seen is a lower bound of
        # its peak; connections.py bounds the peak itself).
        peak, attacked = [open_fds(svc.proc.pid)], threading.Event()

        def watch() -> None:
            while not attacked.is_set():
                peak[0] = max(peak[0], open_fds(svc.proc.pid))
                time.sleep(0.001)  # a sample a millisecond

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        hoarder = as_nobody(HOARDER, str(svc.port), str(IDLE))
        # Every connect() got through: the service accepts at once, and pushes out the
        # oldest idle connections to stay at its limit.
        try:
            assert next_line(hoarder, 6 * TIMEOUT).strip() == str(IDLE)
        finally:
            attacked.set()
            watcher.join()
        fds_under_attack = peak[0]
        for _ in range(5):  # each on a new connection, as a health check does
            with httpx.Client(base_url=svc.base, timeout=TIMEOUT) as root:
                assert root.get("/health").status_code == 200
        metrics = svc.metrics()
        held = total(metrics, "aperf_http_connections")
        assert held <= MAX_CONNECTIONS
        assert total(metrics, "aperf_http_connections_limit") == MAX_CONNECTIONS
        dropped = per_label(metrics, "aperf_http_connections_dropped_total", "reason")
        # Pushed out, or timed out if the other user's connects took long (SYN retries).
        assert dropped["pushed_out"] + dropped["header_timeout"] >= IDLE - MAX_CONNECTIONS
        # What the rings may still open: the reserve, whatever the other user does.
        headroom = SYSTEMD_SOFT_NOFILE - max(fds_under_attack, open_fds(svc.proc.pid))
        assert headroom >= RING_RESERVE_FDS, (fds_under_attack, headroom)
        print(f"\n{loop}: {IDLE} idle connections of nobody: the service holds {held:.0f} "
              f"(limit {MAX_CONNECTIONS}), at most {fds_under_attack} fds seen open, "
              f"{headroom} free of {SYSTEMD_SOFT_NOFILE}; dropped {dropped}")
    finally:
        if hoarder is not None:
            hoarder.kill()
            hoarder.communicate()
        svc.close()


def closed_by_server(sock: socket.socket) -> bool:
    """Wait (at most TIMEOUT) for the server to close ``sock``: EOF or a reset."""
    sock.settimeout(TIMEOUT)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_a_request_head_must_come_in_time(tracefs: None, tmp_path: Path) -> None:
    svc = Service(tmp_path / "service.log", "--header-timeout", "1")
    try:
        svc.wait_ready()
        address = ("127.0.0.1", svc.port)
        head = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{svc.port}\r\n"
        with socket.create_connection(address) as silent, \
                socket.create_connection(address) as partial, \
                socket.create_connection(address) as kept_alive:
            partial.sendall(head.encode())  # and never the blank line
            kept_alive.sendall((head + "\r\n").encode())
            assert kept_alive.recv(4096).startswith(b"HTTP/1.1 200 OK")  # in one piece
            kept_alive.sendall(head.encode())  # the next request, never finished
            assert closed_by_server(silent), "a connection that sent nothing stayed open"
            assert closed_by_server(partial), "a connection that sent half a head stayed open"
            assert closed_by_server(kept_alive), "a kept-alive connection stayed open"
        dropped = svc.metrics()["aperf_http_connections_dropped_total",
                                frozenset({("reason", "header_timeout")})]
        # The three (uvicorn's keep-alive timeout, 5 s, never fires first: the next head had
        # begun), and maybe the test's own kept-alive connection of wait_ready().
        assert dropped >= 3
    finally:
        svc.close()


def test_the_oldest_idle_connection_makes_room(tracefs: None, tmp_path: Path) -> None:
    svc = Service(tmp_path / "service.log", "--max-connections", "4", "--max-clients", "1")
    try:
        svc.wait_ready()
        svc.http.close()  # its kept-alive connection would be one of the four
        address = ("127.0.0.1", svc.port)
        idle = [socket.create_connection(address) for _ in range(4)]
        try:
            # Each accepted in turn: the service has seen the four once a fifth, which
            # asks at once, is answered.
            with httpx.Client(base_url=svc.base, timeout=TIMEOUT,
                              limits=httpx.Limits(max_keepalive_connections=0)) as client:
                assert client.get("/health").status_code == 200
            assert closed_by_server(idle[0]), "the oldest idle connection stayed open"
            for sock in idle[1:]:
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)  # open, nothing to read
        finally:
            for sock in idle:
                sock.close()
    finally:
        svc.close()


def test_event_streams_beyond_max_clients_get_503(tracefs: None, tmp_path: Path) -> None:
    svc = Service(tmp_path / "service.log", "--max-clients", "2")
    clients: list[FastClient] = []
    try:
        svc.wait_ready()
        clients += [FastClient(svc.base), FastClient(svc.base)]
        assert [c.status for c in clients] == [200, 200]
        with svc.http.stream("GET", "/events") as refused:
            assert refused.status_code == 503 and refused.headers["retry-after"] == "10"
            assert "too many event streams (2)" in refused.read().decode()
        assert svc.http.get("/health").status_code == 200  # the other routes are served
        # A stream that ends makes room for another.
        clients.pop().close()
        deadline = time.monotonic() + TIMEOUT
        refusals = 1
        while (again := FastClient(svc.base)).status == 503:
            again.close()
            refusals += 1
            assert time.monotonic() < deadline, "the closed stream never made room"
            time.sleep(0.1)
        clients.append(again)
        assert total(svc.metrics(), "aperf_sse_refused_total") == refusals
    finally:
        for client in clients:
            client.close()
        svc.close()


def test_max_clients_must_leave_connections_for_the_rest() -> None:
    assert_one_line_failure(
        run_service("--max-clients", "8", "--max-connections", "8"),
        "--max-clients 8 must be less than --max-connections 8")


def test_file_descriptors_are_reserved_or_the_start_fails(tracefs: None, tmp_path: Path) -> None:
    # A soft limit too low for the defaults is raised, up to the hard limit.
    svc = Service(tmp_path / "service.log", wrapper=["prlimit", "--nofile=512:4096", "--"])
    try:
        svc.wait_ready()
        raised = soft_nofile(svc.proc.pid)
        assert raised > 512
        assert raised - open_fds(svc.proc.pid) >= MAX_CONNECTIONS + RING_RESERVE_FDS
    finally:
        svc.close()
    # A hard limit too low: said in one line, before anything is opened.
    low = subprocess.run(
        ["prlimit", "--nofile=512:512", "--", sys.executable, "-m", "examples.service",
         "--port", str(free_port()), "--max-connections", "300", "--max-clients", "8"],
        cwd=REPO, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert low.returncode == 1, low.stderr
    (line,) = low.stderr.splitlines()
    assert line.startswith("service: --max-connections 300 needs ") and \
        "file descriptors, but RLIMIT_NOFILE allows 512: lower --max-connections" in line, line

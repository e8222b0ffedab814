"""A real ``nats-server -js`` on loopback, for tests and benchmarks of fleet code.

```python
with NatsServer(tmp_path) as server:      # JetStream store in tmp_path
    await aperf.fleet.create_stream(server.url)
    server.kill(); server.start()         # a crash and a restart, same port and store
```

[`NatsCluster`][aperf.fleet.testing.NatsCluster] runs three (or more) of them as one
JetStream cluster, for replicated streams.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["NatsCluster", "NatsServer", "free_port", "nats_server_path"]

_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_READY = "Server is ready"


def nats_server_path() -> str | None:
    """Where ``nats-server`` is (PATH, then Debian's /usr/sbin), or None."""
    found = shutil.which("nats-server")
    if found:
        return found
    debian = "/usr/sbin/nats-server"
    return debian if os.access(debian, os.X_OK) else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NatsServer:
    """One nats-server process on 127.0.0.1, JetStream (unless ``jetstream=False``)
    storing in ``directory``; optionally with a user and password.

    The first start picks a free port (unless ``port`` is given); later starts reuse
    it, so clients reconnect. ``config`` is the text of a server configuration file
    (users, permissions, TLS: see docs/fleet.md), written into ``directory`` and
    passed with ``-c``; the command line's address, port and log override what it
    says about them, and its ``jetstream`` block names the store directory.
    ``arguments`` are more command-line options.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        jetstream: bool = True,
        user: str | None = None,
        password: str | None = None,
        executable: str | None = None,
        port: int | None = None,
        config: str | None = None,
        arguments: Sequence[str] = (),
    ) -> None:
        exe = executable or nats_server_path()
        if exe is None:
            raise FileNotFoundError(
                "nats-server is not installed (Debian: apt-get install nats-server)"
            )
        self._exe = exe
        self._dir = Path(directory)
        self._jetstream = jetstream
        self._user = user
        self._password = password
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0
        self._config = config
        self._arguments = list(arguments)
        self.port: int | None = port

    @property
    def url(self) -> str:
        """The server's ``nats://`` URL on 127.0.0.1, with the user and password if set."""
        if self.port is None:
            raise RuntimeError("the server has not been started")
        auth = f"{self._user}:{self._password}@" if self._user is not None else ""
        return f"nats://{auth}127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server process's pid (while it runs)."""
        if self._proc is None:
            raise RuntimeError("the server is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process is running."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start (or start again, on the same port and store) and wait until it is ready."""
        if self.running:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        log = self._dir / f"nats-server.{self._starts}.log"
        args = [self._exe, "-a", "127.0.0.1", "-p", str(self.port or -1), "-l", str(log)]
        if self._jetstream:
            args += ["-js"]
            if self._config is None:  # else its jetstream block says where (nats-server
                args += ["-sd", str(self._dir / "jetstream")]  # refuses both)
        if self._user is not None:
            args += ["--user", self._user, "--pass", self._password or ""]
        if self._config is not None:
            config = self._dir / "nats-server.conf"
            config.write_text(self._config)
            args += ["-c", str(config)]
        args += self._arguments
        errors = self._dir / f"nats-server.{self._starts}.stderr"
        with errors.open("wb") as stderr:  # what it says before its log is open
            self._proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr
            )
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            found = _LISTENING.search(text)
            if found and _READY in text and self._accepts(int(found.group(1))):
                self.port = int(found.group(1))
                return
            if self._proc.poll() is not None:
                text += errors.read_text(errors="replace")
                raise RuntimeError(f"nats-server exited with {self._proc.returncode}:\n{text}")
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"nats-server not ready within {timeout} s:\n{text}")
            time.sleep(0.02)

    @staticmethod
    def _accepts(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed, no goodbye to the clients."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown."""
        self._end(signal.SIGTERM)

    def _end(self, sig: int) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class NatsCluster:
    """``size`` nats-servers on loopback routed into one JetStream cluster (named
    ``name``; servers ``n1``, ``n2``, ...), each with its own ports and store under
    ``directory``.

    <!-- not run: a fragment of a test (tmp_path, awaits); tests/fleet/test_fleet_cluster.py -->
    ```python
    with NatsCluster(tmp_path) as cluster:          # 3 nodes, JetStream ready
        await aperf.fleet.create_stream(cluster.urls, replicas=3)
        cluster.node("n2").kill(); cluster.node("n2").start()
    ```

    A node killed and started again keeps its ports and store, so it rejoins.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        size: int = 3,
        name: str = "aperf",
        executable: str | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size!r}")
        base = Path(directory)
        routes = [free_port() for _ in range(size)]
        self._monitors = [free_port() for _ in range(size)]
        self.names = [f"n{i + 1}" for i in range(size)]
        self.servers: list[NatsServer] = []
        for i, node in enumerate(self.names):
            others = ",".join(
                f"nats://127.0.0.1:{p}" for j, p in enumerate(routes) if j != i
            )
            self.servers.append(NatsServer(
                base / node, executable=executable, port=free_port(), arguments=[
                    "--server_name", node, "--cluster_name", name,
                    "--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", others,
                    "-m", str(self._monitors[i]),
                ],
            ))

    @property
    def urls(self) -> list[str]:
        """Every node's client URL (give them all to a client: it fails over)."""
        return [server.url for server in self.servers]

    def node(self, name: str) -> NatsServer:
        """The server named ``name`` (``"n1"``, ...; as in a stream's cluster leader)."""
        return self.servers[self.names.index(name)]

    def start(self, timeout: float = 30.0) -> None:
        """Start every node that is not running and wait until JetStream is healthy."""
        for server in self.servers:
            server.start()
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until every running node says JetStream is healthy (``/healthz``: a
        meta leader is known and its streams are current)."""
        deadline = time.monotonic() + timeout
        for server, port in zip(self.servers, self._monitors, strict=True):
            while server.running and not _healthy(port):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the NATS cluster was not healthy within {timeout} s")
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL every node."""
        for server in self.servers:
            server.kill()

    def __enter__(self) -> NatsCluster:
        try:
            self.start()
        except BaseException:
            self.kill()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False

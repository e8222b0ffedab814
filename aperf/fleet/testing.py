"""A real ``nats-server -js`` on loopback, for tests and benchmarks of fleet code.

```python
with NatsServer(tmp_path) as server:      # JetStream store in tmp_path
    await aperf.fleet.create_stream(server.url)
    server.kill(); server.start()         # a crash and a restart, same port and store
```
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["NatsServer", "nats_server_path"]

_LISTENING = re.compile(r"Listening for client connections on [^\s]*:(\d+)")
_READY = "Server is ready"


def nats_server_path() -> str | None:
    """Where ``nats-server`` is (PATH, then Debian's /usr/sbin), or None."""
    found = shutil.which("nats-server")
    if found:
        return found
    debian = "/usr/sbin/nats-server"
    return debian if os.access(debian, os.X_OK) else None


class NatsServer:
    """One nats-server process on 127.0.0.1, JetStream (unless ``jetstream=False``)
    storing in ``directory``; optionally with a user and password.

    The first start picks a free port; later starts reuse it, so clients reconnect.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        jetstream: bool = True,
        user: str | None = None,
        password: str | None = None,
        executable: str | None = None,
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
        self.port: int | None = None

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
            args += ["-js", "-sd", str(self._dir / "jetstream")]
        if self._user is not None:
            args += ["--user", self._user, "--pass", self._password or ""]
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            found = _LISTENING.search(text)
            if found and _READY in text and self._accepts(int(found.group(1))):
                self.port = int(found.group(1))
                return
            if self._proc.poll() is not None:
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

"""A picture of the Grafana dashboard's panels from a real run of the service: not Grafana's.

Grafana is neither a Debian package nor a PyPI one, so nothing here can render the dashboard
with Grafana. This draws what it would chart instead, from real data, in two steps:

``record`` (as root: it loads the tracer) starts the service on the real kernel with a
token, and Debian's Prometheus (``apt-get install --no-install-recommends prometheus``, or
``--prometheus PATH``) scraping it every second with that token, as docs/service.md's scrape
job does. For RUN_SECONDS it runs the workload of WORKLOAD (processes, a burst the kernel
loses, a stalled client, a reconnection, idle connections, refused streams). Then it asks
Prometheus for every query of grafana-dashboard.json over the run, with ``$instance`` and
``$__rate_interval`` replaced as Grafana replaces them, and writes Prometheus' answers to a
JSON file.

``draw`` lays each panel out where the dashboard puts it (``gridPos``), with its title,
unit and legends, and plots those answers with matplotlib: lines for time series, the last
value over a sparkline for stats. A footer in the picture says what it is.

    python -m examples.service.dashboard_picture record examples/service/dashboard-run.json
    python -m examples.service.dashboard_picture draw examples/service/dashboard-run.json \\
        docs/service-dashboard.png
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DASHBOARD = HERE / "grafana-dashboard.json"
RUN_SECONDS = 150
SCRAPE_SECONDS = 1
STEP_SECONDS = 2
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 * scrape interval), with
# $__interval the step of the query.
RATE_INTERVAL = f"{max(STEP_SECONDS + SCRAPE_SECONDS, 4 * SCRAPE_SECONDS)}s"
# The service as the run has it: small rings (losses), a small window and socket buffer (a
# stalled client falls out), a short head deadline and few streams (dropped and refused).
SERVICE_OPTIONS = ("--pages", "4", "--replay", "1024", "--send-buffer", "4096",
                   "--header-timeout", "5", "--max-clients", "3", "--heartbeat", "1")
# (second of the run, what happens): the picture's footer and docs/service.md say this.
WORKLOAD = (
    (0, "a client reads /events for the whole run"),
    (10, "20 processes a second start (until 140 s)"),
    (40, "the service is stopped (SIGSTOP) while 300 processes run on each CPU: the kernel "
         "loses what its 4-page rings cannot hold"),
    (60, "a client connects to /events and reads nothing (4 KiB receive buffer)"),
    (85, "3 connections send nothing (closed after --header-timeout 5)"),
    (100, "a client reconnects with the Last-Event-ID of 200 events before"),
    (110, "2 more event streams ask while 3 are open (--max-clients 3): one is refused"),
    (120, "the stalled client reads again (it missed what left the window)"),
)


def fail(message: str) -> int:
    print(f"dashboard_picture: {message}", file=sys.stderr)
    return 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_targets(dashboard: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(panel, target) of every query of the dashboard, in its order."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def grafana_query(expr: str, instance: str) -> str:
    """``expr`` with Grafana's variables replaced as Grafana would for this one instance."""
    # A regex-escaped value inside a PromQL string: a backslash is written twice there.
    escaped = re.escape(instance).replace("\\", "\\\\")
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$instance", escaped)


# --- record --------------------------------------------------------------------------------


class Run:
    """The service, Prometheus and the workload's clients, for one recording."""

    def __init__(self, prometheus: str, work: Path) -> None:
        self.work = work
        self.port, self.prometheus_port = free_port(), free_port()
        self.instance = f"127.0.0.1:{self.port}"
        self.token = secrets.token_urlsafe(32)
        token_file = work / "token"
        token_file.write_text(self.token + "\n")
        token_file.chmod(0o600)
        self.processes: list[subprocess.Popen[bytes]] = []
        self.service = self._start(
            [sys.executable, "-m", "examples.service", "--host", "127.0.0.1", "--port",
             str(self.port), "--token-file", str(token_file), *SERVICE_OPTIONS],
            work / "service.log", cwd=REPO)
        config = work / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s"},
            "scrape_configs": [{
                "job_name": "aperf-service",
                "authorization": {"credentials_file": str(token_file)},
                "static_configs": [{"targets": [self.instance]}],
            }],
        }))
        self.prometheus = self._start(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.prometheus_port}", "--log.level=warn"],
            work / "prometheus.log", cwd=work)
        self.stop = threading.Event()
        self.ids: deque[str] = deque(maxlen=200)  # the reader's last event ids

    def _start(self, command: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cwd)
        self.processes.append(proc)
        return proc

    def close(self) -> None:
        self.stop.set()
        for proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def prometheus_api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.prometheus_port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus: {body}")
        return body["data"]

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in (("the service", self.service), ("Prometheus", self.prometheus)):
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} "
                                       f"(logs in {self.work})")
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                if ready():
                    return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {timeout} s (logs in {self.work})")

    def scraped(self) -> bool:
        up = self.prometheus_api("/api/v1/query", query='up{job="aperf-service"}')["result"]
        return bool(up) and up[0]["value"][1] == "1"

    def stream(self, headers: str = "", rcvbuf: int = 0) -> socket.socket:
        """A connection that asked for /events (its answer is left unread)."""
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect(("127.0.0.1", self.port))
        sock.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                     f"{self.token}\r\n{headers}\r\n".encode())
        return sock

    def read_events(self) -> None:
        """The reader: every event of the run; it keeps the last ids."""
        with self.stream() as sock, sock.makefile("rb") as lines:
            sock.settimeout(5)
            while not self.stop.is_set():
                line = lines.readline()
                if not line:
                    return
                if line.startswith(b"id: "):
                    self.ids.append(line[4:].strip().decode())

    def processes_per_second(self, rate: float, until: float) -> None:
        true = shutil.which("true") or "true"
        while time.monotonic() < until and not self.stop.is_set():
            subprocess.run([true], check=True)
            time.sleep(1 / rate)

    def lose_events(self) -> None:
        sh, taskset = shutil.which("sh") or "sh", shutil.which("taskset") or "taskset"
        true = shutil.which("true") or "/bin/true"  # a program: the shell's own true is no exec
        self.service.send_signal(signal.SIGSTOP)
        try:
            for cpu in sorted(os.sched_getaffinity(0)):
                subprocess.run([taskset, "-c", str(cpu), sh, "-c",
                                f"i=0; while [ $i -lt 300 ]; do {true}; i=$((i+1)); done"],
                               check=True)
        finally:
            self.service.send_signal(signal.SIGCONT)


def status_of(sock: socket.socket) -> int:
    """The status code of the answer on ``sock``."""
    sock.settimeout(10)
    head = sock.recv(64)
    return int(head.split(b" ")[1])


def record(out: Path, prometheus: str) -> int:
    if os.geteuid() != 0:
        return fail("record loads the tracer: run it as root")
    found = shutil.which(prometheus)
    if found is None:
        return fail(f"no Prometheus at {prometheus!r}: apt-get install --no-install-recommends "
                    "prometheus, or give --prometheus PATH")
    version = subprocess.run([found, "--version"], capture_output=True, text=True,
                             check=True).stdout.split("\n")[0]
    dashboard = json.loads(DASHBOARD.read_text())
    with tempfile.TemporaryDirectory(prefix="aperf-dashboard-") as tmp:
        run = Run(found, Path(tmp))
        try:
            run.wait_until("scrape of the service", run.scraped)
            start = time.time()
            t0 = time.monotonic()

            def at(second: float) -> None:
                time.sleep(max(0.0, t0 + second - time.monotonic()))

            def steady_load() -> None:
                at(10)
                run.processes_per_second(20, t0 + 140)

            threads = [threading.Thread(target=run.read_events, daemon=True),
                       threading.Thread(target=steady_load, daemon=True)]
            for thread in threads:
                thread.start()
            at(40)
            run.lose_events()
            at(60)
            stalled = run.stream(rcvbuf=4096)
            at(85)
            idle = [socket.create_connection(("127.0.0.1", run.port)) for _ in range(3)]
            at(100)
            with run.stream(f"Last-Event-ID: {run.ids[0]}\r\n") as again:
                assert status_of(again) == 200
            at(110)
            more = [run.stream() for _ in range(2)]
            statuses = sorted(status_of(s) for s in more)
            assert statuses == [200, 503], statuses
            at(120)
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            stalled.settimeout(10)
            seen = b""
            while b"event: missed" not in seen:
                seen = seen[-64:] + stalled.recv(1 << 16)
            at(RUN_SECONDS)
            end = start + RUN_SECONDS
            for sock in [stalled, *idle, *more]:
                sock.close()
            results: dict[str, list[dict[str, Any]]] = {}
            for _, target in dashboard_targets(dashboard):
                data = run.prometheus_api(
                    "/api/v1/query_range", query=grafana_query(target["expr"], run.instance),
                    start=f"{start:.3f}", end=f"{end:.3f}", step=str(STEP_SECONDS))
                results[target["expr"]] = [
                    {"metric": series["metric"],
                     "values": [[round(float(t) - start, 3), float(v)]
                                for t, v in series["values"]]}
                    for series in data["result"]]
        finally:
            run.close()
    out.write_text(json.dumps({
        "what": "Prometheus' answers to every query of grafana-dashboard.json over a run of "
                "the service; dashboard_picture.py draws them",
        "prometheus": version, "instance": run.instance, "seconds": RUN_SECONDS,
        "step_seconds": STEP_SECONDS, "scrape_seconds": SCRAPE_SECONDS,
        "rate_interval": RATE_INTERVAL, "service_options": list(SERVICE_OPTIONS),
        "workload": [list(w) for w in WORKLOAD], "results": results,
    }, indent=0) + "\n")
    print(f"wrote {out}")
    return 0


# --- draw ----------------------------------------------------------------------------------

IEC = ("B", "KiB", "MiB", "GiB", "TiB")
SI = ("", "k", "M", "G", "T")


def format_value(value: float, unit: str | None) -> str:
    """``value`` as Grafana's unit of the same name shows it (the units the dashboard uses)."""
    if math.isnan(value):
        return "no data"
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit in ("bytes", "Bps"):
        exponent = 0 if abs(value) < 1024 else min(len(IEC) - 1, int(math.log(abs(value), 1024)))
        text = f"{value / 1024 ** exponent:.3g} {IEC[exponent]}"
        return text + ("/s" if unit == "Bps" else "")
    exponent = 0 if abs(value) < 1000 else min(len(SI) - 1, int(math.log10(abs(value)) // 3))
    text = f"{value / 1000 ** exponent:.3g}{SI[exponent]}"
    return text + (" ops/s" if unit == "ops" else "")


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


# Inches: a column of Grafana's 24, a row of its grid, and the room around each plot.
COLUMN, ROW = 0.6, 0.33
HEADER, FOOTER = 0.5, 0.75
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM, GAP = 0.75, 0.15, 0.32, 0.28, 0.06


def draw(data_file: Path, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    data = json.loads(data_file.read_text())
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width, height = 24 * COLUMN, HEADER + rows * ROW + FOOTER
    fig = plt.figure(figsize=(width, height), dpi=80)
    fig.text(0.1 / width, 1 - 0.1 / height, dashboard["title"], ha="left", va="top",
             fontsize=15, fontweight="bold")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def rect(x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        """Inches from the top left of the grid, as a figure fraction (left, bottom, w, h)."""
        return x / width, 1 - (HEADER + y + h) / height, w / width, h / height

    for panel in panels:
        pos = panel["gridPos"]
        x, y = pos["x"] * COLUMN + GAP, pos["y"] * ROW + GAP
        w, h = pos["w"] * COLUMN - 2 * GAP, pos["h"] * ROW - 2 * GAP
        fig.add_artist(Rectangle(rect(x, y, w, h)[:2], w / width, h / height,
                                 transform=fig.transFigure, fill=False, ec="#d0d0d0", lw=1))
        left, _, _, _ = rect(x + 0.08, y, 0, 0)
        fig.text(left, 1 - (HEADER + y + 0.06) / height, panel["title"], ha="left", va="top",
                 fontsize=9.5, fontweight="bold")
        stat = panel["type"] == "stat"
        pad_left = 0.12 if stat else PAD_LEFT
        ax = fig.add_axes(rect(x + pad_left, y + PAD_TOP, w - pad_left - PAD_RIGHT,
                               h - PAD_TOP - (0.08 if stat else PAD_BOTTOM)))
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        ax.tick_params(labelsize=7.5)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        lines: list[tuple[str, list[float], list[float]]] = []
        for target in panel["targets"]:
            for series in data["results"][target["expr"]]:
                xs = [t for t, _ in series["values"]]
                ys = [v for _, v in series["values"]]
                lines.append((legend(target.get("legendFormat", ""), series["metric"]), xs, ys))
        ax.set_xlim(0, data["seconds"])
        if stat:  # Grafana's default: the last value, over a sparkline of the series
            last = lines[0][2][-1] if lines and lines[0][2] else math.nan
            if lines:
                ax.fill_between(lines[0][1], lines[0][2], color=colors[0], alpha=0.12, lw=0)
                ax.set_ylim(0, max(max(lines[0][2]), 1e-9) * 1.6)
            ax.text(0.5, 0.45, format_value(last, unit), transform=ax.transAxes, ha="center",
                    va="center", fontsize=20, fontweight="bold", color="#1f4e79")
            ax.set_axis_off()
            continue
        for index, (label, xs, ys) in enumerate(lines):
            ax.plot(xs, ys, lw=1.3, color=colors[index % len(colors)], label=label)
        peak = max((max(ys) for _, _, ys in lines if ys), default=0.0)
        ax.set_ylim(0, peak * 1.3 if peak > 0 else 1)  # room for the legend above the lines
        ax.yaxis.set_major_locator(MaxNLocator(4))
        ax.yaxis.set_major_formatter(FuncFormatter(
            lambda v, _, unit=unit: "0" if v == 0 else format_value(v, unit)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f} s"))
        ax.grid(True, color="#e8e8e8", lw=0.8)
        if lines:
            ax.legend(loc="upper left", fontsize=7, frameon=False, ncol=min(4, len(lines)),
                      borderaxespad=0.1, handlelength=1.2)
    footer = (
        "Not a Grafana screenshot. The panels of examples/service/grafana-dashboard.json "
        "(layout, titles, units, legends); each query evaluated by "
        f"{data['prometheus']} scraping the service every {data['scrape_seconds']} s for a "
        f"{data['seconds']} s run on the real kernel (step {data['step_seconds']} s, "
        f"$__rate_interval {data['rate_interval']}); drawn by "
        "examples/service/dashboard_picture.py with matplotlib. Times: seconds of the run. "
        "Workload, beside whatever else the machine ran: "
        + "; ".join(f"{t} s: {what}" for t, what in data["workload"]) + "."
    )
    fig.text(0.1 / width, 0.08 / height, textwrap.fill(footer, 235), fontsize=7.5,
             color="#444", va="bottom", ha="left")
    fig.savefig(out, dpi=80, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.service.dashboard_picture",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run the service under Prometheus; keep its answers")
    rec.add_argument("data", type=Path, help="the JSON file to write")
    rec.add_argument("--prometheus", default="prometheus", help="the Prometheus binary")
    drawing = commands.add_parser("draw", help="draw the panels from a recording")
    drawing.add_argument("data", type=Path, help="a JSON file that record wrote")
    drawing.add_argument("png", type=Path, help="the picture to write")
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.data, args.prometheus)
    return draw(args.data, args.png)


if __name__ == "__main__":
    sys.exit(main())

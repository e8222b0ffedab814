"""The service's live page, in a real browser: Debian's headless Chromium, driven by Selenium.

The service runs against the real kernel, with a token that the browser gets the way a user
would (``/?token=``, once); the tests exec programs of their own, and make the kernel lose
events, then check that the page shows both: the rows of the exec and exit, lost counters that
agree with the service's, numbers right under their headings, and a chart with the events per
second of each CPU and the losses. Set APERF_SERVICE_SCREENSHOT=docs/service-page.png to keep
the chart test's screenshot (docs/service.md shows it).

Nothing assumes the rest of the machine quiet: other users' processes fill the table and the
small rings too (and so lose events) at any time. The probe's rows are caught as the page
inserts them, the page's lost count is compared with the lost notices of the same stretch of
the stream (read by the test too), and the page's copy of /health's count with what /health
said just before and after.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException, WebDriverException
from selenium.webdriver.chrome.service import Service as DriverService
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from examples.service.access import COOKIE

from ..helpers import REQUIRE_BPF
from .test_service import TIMEOUT, FastClient, Message, Service, event_seq
from .test_service_access import as_nobody, next_line

CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; never a downloaded browser
CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver, the same version
PROBE = "aperf-page-test"  # a copy of sh under this name: its comm and file name are ours
MAX_ROWS = 500  # rows the page keeps (MAX_ROWS in page.js)

pytestmark = pytest.mark.kernel


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        why = f"{' and '.join(missing)} missing: apt-get install chromium chromium-driver"
        if REQUIRE_BPF:
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,860",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    # With the driver's path given, Selenium runs it and never looks for another one.
    service = DriverService(CHROMEDRIVER, log_output=str(tmp_path / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: webdriver.Chrome, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def wait_for(driver: webdriver.Chrome, what: str, condition: Callable[[], Any]) -> Any:
    try:
        return WebDriverWait(driver, TIMEOUT, ignored_exceptions=(WebDriverException,)).until(
            lambda _: condition()
        )
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        pytest.fail(f"the page never showed {what}; it shows:\n{body[:2000]}")


def row_cells(driver: webdriver.Chrome, pid: int, event: str) -> list[str] | None:
    rows = driver.find_elements(By.CSS_SELECTOR, f'tr[data-pid="{pid}"][data-event="{event}"]')
    return [td.text for td in rows[0].find_elements(By.TAG_NAME, "td")] if rows else None


def open_page(browser: webdriver.Chrome, svc: Service) -> None:
    """Open the page as its user does: ``/?token=`` once, then the cookie."""
    assert svc.token is not None
    browser.get(f"{svc.base}/?token={svc.token}")
    wait_for(browser, "a live event stream", lambda: text(browser, "status") == "live")
    assert browser.current_url == svc.base + "/"  # the token left the address bar
    assert browser.title == "aperf: exec/exit events"
    # Everything the page loads comes from the service itself: no CDN, no build step.
    for element in browser.find_elements(By.CSS_SELECTOR, "script[src], link[href]"):
        url = element.get_attribute("src") or element.get_attribute("href")
        assert url is not None and url.startswith(svc.base + "/static/"), url


def page_service(tmp_path: Path) -> Service:
    # Rings of about 90 events: a burst of 200 overflows them. The rest of the machine may
    # overflow them too (other users' bursts): the tests count on nothing being quiet. A
    # replay window the page cannot fall out of, however many events the machine makes.
    svc = Service(tmp_path / "service.log", "--pages", "4", "--replay", "65536",
                  token=secrets.token_urlsafe(24))
    svc.wait_ready()
    return svc


def make_probe(tmp_path: Path) -> Path:
    """A copy of ``sh`` named PROBE: its rows are the test's own."""
    sh = shutil.which("sh")
    assert sh
    probe = tmp_path / PROBE
    shutil.copy(sh, probe)
    return probe


def lose_events(svc: Service) -> None:
    """Make the kernel lose events on every CPU: bursts while the service is stopped."""
    sh, true, taskset = shutil.which("sh"), shutil.which("true"), shutil.which("taskset")
    assert sh and true and taskset
    svc.proc.send_signal(signal.SIGSTOP)
    try:
        for cpu in sorted(os.sched_getaffinity(0)):
            subprocess.run([taskset, "-c", str(cpu), sh, "-c",
                            f"for i in $(seq 100); do {true}; done"], check=True, timeout=60)
    finally:
        svc.proc.send_signal(signal.SIGCONT)


def flush_losses() -> None:
    """The kernel says a ring's loss with its next event: one event on every CPU."""
    taskset, true = shutil.which("taskset"), shutil.which("true")
    assert taskset and true
    for cpu in sorted(os.sched_getaffinity(0)):
        subprocess.run([taskset, "-c", str(cpu), true], check=True)


# Records each row of a probe (a process of ours, named PROBE) as the page inserts it,
# with the page's count of lost events at that moment: the table keeps 500 rows, and a busy
# machine can push a row out before the test looks.
WATCH_PROBE_ROWS = """
const name = arguments[0];
window.probeRows = [];
new MutationObserver((mutations) => {
  for (const mutation of mutations) {
    for (const row of mutation.addedNodes) {
      if (row.cells && row.cells.length > 2 && row.cells[2].textContent === name) {
        window.probeRows.push({
          pid: Number(row.dataset.pid), event: row.dataset.event,
          cells: [...row.cells].map((td) => td.textContent),
          lost: Number(document.getElementById("count-lost").textContent),
        });
      }
    }
  }
}).observe(document.getElementById("events"), { childList: true });
"""


def probe_rows(driver: webdriver.Chrome, pid: int) -> dict[str, dict[str, Any]]:
    rows = driver.execute_script("return window.probeRows;")
    return {row["event"]: row for row in rows if row["pid"] == pid}


def run_probe(driver: webdriver.Chrome, probe: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """Run the probe (it exits with 7) until the page shows its exec and exit rows.

    The kernel may lose its events in rings that the rest of the machine filled: then the
    page's lost count moves (a loss is said with the ring's next event, which
    flush_losses() makes on every CPU), and the probe runs again.
    """
    for _ in range(10):
        before = text(driver, "count-lost")
        proc = subprocess.Popen([str(probe), "-c", "exit 7"])
        assert proc.wait(timeout=TIMEOUT) == 7

        def shown_or_lost(pid: int = proc.pid, before: str = before) -> bool:
            flush_losses()
            return len(probe_rows(driver, pid)) == 2 or text(driver, "count-lost") != before

        wait_for(driver, f"the rows of pid {proc.pid} or a loss", shown_or_lost)
        rows = probe_rows(driver, proc.pid)
        if len(rows) == 2:
            return proc.pid, rows
    pytest.fail("the kernel lost the probe's events ten times in a row")


def wait_lost_total_shown(driver: webdriver.Chrome, svc: Service) -> None:
    """The page shows the service's lost count, read from /health (which only grows)."""
    before = svc.http.get("/health").json()["lost"]
    (shown,) = wait_for(driver, f"at least {before} lost in the kernel", lambda: (
        (n := text(driver, "lost-total")).isdigit() and int(n) >= before and [int(n)]))
    assert shown <= svc.http.get("/health").json()["lost"]


def test_live_page_shows_events_and_lost_counters(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    probe = make_probe(tmp_path)
    svc = page_service(tmp_path)
    reference = None
    try:
        open_page(browser, svc)
        browser.execute_script(WATCH_PROBE_ROWS, PROBE)
        # The same event stream, read by the test: what the page should have counted.
        reference = FastClient(svc.base, headers={"Authorization": f"Bearer {svc.token}"})

        # A process of ours: its exec and its exit appear as rows, newest first.
        pid, rows = run_probe(browser, probe)
        exec_row, exit_row = rows["EXEC"]["cells"], rows["EXIT"]["cells"]
        # time, event, comm, pid, ppid, file name / exit code, ran, cpu
        assert exec_row[1:6] == ["EXEC", PROBE, str(pid), str(os.getpid()), str(probe)]
        assert exit_row[1:6] == ["EXIT", PROBE, str(pid), str(os.getpid()), "[7]"]
        assert exit_row[6].endswith(" ms")
        assert exec_row[0] <= exit_row[0]  # HH:MM:SS.mmm, the kernel's times
        assert int(text(browser, "count-events")) >= 2
        wait_for(browser, "the service's counters",
                 lambda: text(browser, "samples").isdigit() and int(text(browser, "samples")) >= 2)
        wait_lost_total_shown(browser, svc)

        # The kernel loses events while the service is stopped; the page must say so,
        # from the event stream (lost notices) and from /health.
        lost_before = rows["EXIT"]["lost"]
        lose_events(svc)
        wait_for(browser, "the kernel's losses", lambda: (
            flush_losses() or int(text(browser, "count-lost")) > lost_before))
        second, rows_after = run_probe(browser, probe)
        wait_lost_total_shown(browser, svc)
        assert "CPU" in text(browser, "lost-by-cpu")

        # Between the two probes' exits, the page counted exactly the lost notices of the
        # stream, whatever else the machine did meanwhile.
        def exit_of(pid: int) -> Callable[[Message], bool]:
            return lambda m: m.event == "message" and m.json()["pid"] == pid and \
                m.json()["event"] == "EXIT"

        messages = reference.read_until(exit_of(second))
        first_exit = next(i for i, m in enumerate(messages) if exit_of(pid)(m))
        between = messages[first_exit + 1:-1]
        assert not [m for m in between if m.event == "missed"]
        notices = sum(m.json()["count"] for m in between if m.event == "lost")
        assert notices > 0
        assert rows_after["EXIT"]["lost"] - lost_before == notices
        assert text(browser, "count-missed") == "0"  # the page kept up
    finally:
        browser.save_screenshot(str(tmp_path / "service-page.png"))
        if reference is not None:
            reference.close()
        svc.close()


# Text boxes of the heading and of every cell, column by column (the cells' own boxes are
# as wide as the column whatever the alignment: what lines up or not is their text).
TEXT_BOXES = """
const box = (el) => {
  if (!el.textContent) return null;
  const range = document.createRange();
  range.selectNodeContents(el);
  const r = range.getBoundingClientRect();
  return [r.left, r.right];
};
const table = document.getElementById("event-table");
return {
  heads: [...table.tHead.rows[0].cells].map(box),
  rows: [...table.tBodies[0].rows].slice(0, 100).map((row) => [...row.cells].map(box)),
  counters: [...document.querySelectorAll(".counters dl > div")].map(
    (d) => [box(d.querySelector("dt")), box(d.querySelector("dd"))]),
};
"""
NUMERIC_COLUMNS = {3, 4, 6, 7}  # pid, ppid, ran, cpu: right-aligned under their heading

# Each series of the chart: its name, the values it shows, and the points drawn for them.
CHART = """
const polylines = [...document.querySelectorAll("#chart polyline")];
return polylines.map((p) => ({
  name: p.dataset.series,
  values: p.dataset.values.split(" ").map(Number),
  ys: [...p.points].map((point) => point.y),
}));
"""
CHART_BOTTOM = 150  # y of 0 in the SVG's viewBox (PLOT.bottom in page.js)
# In one turn of the page's loop (no event can come in between): the chart drawn now, the
# count of the second under way (drawn once it is over), the page's totals, and its age.
CHART_NOW = """
drawChart();
return {
  current: Object.fromEntries([...series].map(([name, values]) => [name, values.at(-1)])),
  lost: counts.lost, missed: counts.missed, age_ms: performance.now(),
};
"""


def charted_losses_agree(driver: webdriver.Chrome) -> int:
    """Check that the chart's lost and missed lines hold every notice the page got; the lost.

    The chart covers a minute: for a page older than that, what it shows is at most what
    the page got.
    """
    now = driver.execute_script(CHART_NOW)
    drawn = chart(driver)  # drawn by CHART_NOW's drawChart(); redrawn only in a later turn
    for name in ("lost", "missed"):
        charted = sum(drawn[name]) + now["current"][name]
        if now["age_ms"] < 59_000:
            assert charted == now[name], (name, drawn[name], now)
        else:
            assert charted <= now[name], (name, drawn[name], now)
    return int(now["lost"])


def chart(driver: webdriver.Chrome) -> dict[str, list[float]]:
    """The chart's series by name, after checking that the points drawn are the values."""
    drawn = driver.execute_script(CHART)
    for series in drawn:
        assert len(series["ys"]) == len(series["values"]) == 60, series["name"]
        for value, y in zip(series["values"], series["ys"], strict=True):
            # 0 on the axis, anything more above it (the higher, the more).
            assert (y == CHART_BOTTOM) if value == 0 else (y < CHART_BOTTOM), series
    return {series["name"]: series["values"] for series in drawn}


def test_page_aligns_numbers_and_charts_events_and_losses(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    svc = page_service(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))
    try:
        open_page(browser, svc)
        # Nothing the page uses comes from elsewhere (the chart is the page's own SVG).
        resources = browser.execute_script(
            "return performance.getEntriesByType('resource').map((r) => r.name)")
        assert resources and all(url.startswith(svc.base + "/") for url in resources), resources
        assert not browser.find_elements(By.CSS_SELECTOR, "img, iframe, object, embed")

        # Events on every CPU: the rows fill, each CPU's line rises above 0.
        flush_losses()
        names = wait_for(browser, "a line per CPU with events", lambda: (
            (c := chart(browser)) and all(sum(c.get(f"cpu {cpu}", [0])) > 0 for cpu in cpus)
            and c))
        assert set(names) == {f"cpu {cpu}" for cpu in cpus} | {"lost", "missed"}
        lost_before = charted_losses_agree(browser)  # what the rest of the machine lost

        # The kernel loses events: the "lost" line rises by the page's lost count.
        lose_events(svc)
        wait_for(browser, "the kernel's losses", lambda: (
            flush_losses() or int(text(browser, "count-lost")) > lost_before))
        charted_losses_agree(browser)
        assert text(browser, "count-missed") == "0"  # the page kept up

        boxes = browser.execute_script(TEXT_BOXES)
        heads, rows = boxes["heads"], boxes["rows"]
        assert len(rows) >= 10 and all(heads)
        for column, head in enumerate(heads):
            edge = 1 if column in NUMERIC_COLUMNS else 0  # right edges, or left edges
            for row in rows:
                if row[column] is not None:
                    assert abs(row[column][edge] - head[edge]) < 1, (column, head, row)
        for label, number in boxes["counters"]:
            assert abs(label[0] - number[0]) < 1, (label, number)
    finally:
        screenshot = tmp_path / "service-page.png"
        browser.save_screenshot(str(screenshot))
        keep = os.environ.get("APERF_SERVICE_SCREENSHOT")
        if keep:
            shutil.copy(screenshot, keep)
        svc.close()


# Another user's web server on another port of 127.0.0.1 (a real process of nobody): it
# prints the port, then the Cookie and Referer headers of the first request, then replays
# the session cookie it got to the service (port argv[1]), following the ids the service
# hands out as a browser would, until refused.
COOKIE_THIEF = """
    import http.client, http.server, json, re, sys, time
    service = int(sys.argv[1])
    name = sys.argv[2]
    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.update(cookie=self.headers.get("Cookie"), referer=self.headers.get("Referer"))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.handle_request()
    print(json.dumps(seen), flush=True)
    session = re.search(name + "=([^;]*)", seen["cookie"] or "")
    session = session[1] if session else ""
    for _ in range(600):
        conn = http.client.HTTPConnection("127.0.0.1", service, timeout=10)
        conn.request("GET", "/health", headers={"Cookie": name + "=" + session})
        response = conn.getresponse()
        renewed = re.match(name + "=([^;]*)", response.getheader("Set-Cookie") or "")
        session = renewed[1] if renewed else session
        conn.close()
        if response.status != 200:
            print(response.status, flush=True)
            break
        time.sleep(0.2)
"""


def test_a_cookie_another_users_server_collects_is_no_token_and_soon_worthless(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    svc = Service(tmp_path / "service.log", "--session-rotate", "3",
                  token=secrets.token_urlsafe(24))
    svc.wait_ready()
    thief = as_nobody(COOKIE_THIEF, str(svc.port), COOKIE)
    try:
        open_page(browser, svc)
        first = browser.get_cookie(COOKIE)
        assert first is not None and first["httpOnly"] and first["sameSite"] == "Strict"
        # The page follows the new ids the service hands out (its /health requests get them).
        wait_for(browser, "a new session id", lambda: (
            (now := browser.get_cookie(COOKIE)) is not None and now["value"] != first["value"]
            and text(browser, "status") == "live"))

        # The page makes the browser ask the other server for an image: a browser sends
        # 127.0.0.1's cookies to every port of it, Strict ones too (same site).
        port = int(next_line(thief))
        browser.execute_script("new Image().src = arguments[0];", f"http://127.0.0.1:{port}/")
        seen = json.loads(next_line(thief))
        assert seen["referer"] is None  # Referrer-Policy: no-referrer
        assert seen["cookie"] is not None and seen["cookie"].startswith(f"{COOKIE}=")
        assert svc.token is not None and svc.token not in seen["cookie"]  # never the token

        # Its replays are refused soon: at the latest when the page's next request after
        # the grace shows two holders of the session, which then ends for both.
        assert next_line(thief, 4 * TIMEOUT).strip() == "401"
        wait_for(browser, "the page signed out",
                 lambda: text(browser, "status").startswith("signed out"))
        # The token opens a new session.
        open_page(browser, svc)
    finally:
        thief.kill()
        thief.communicate()
        svc.close()


# Installed before the page's own script runs (CDP's addScriptToEvaluateOnNewDocument):
# every state of the page that could be painted, from the first node the parser inserts.
# A MutationObserver's callback runs after every task that changed the DOM, before the
# browser can paint, so no state goes unseen. Rows of the probe are kept as they come.
RECORD_FIRST_STATES = """
window.pageStates = [];
window.probeRows = [];
const probeName = %s;
const text = (id) => {
  const element = document.getElementById(id);
  return element && !element.hidden ? element.textContent : null;
};
const record = (mutations) => {
  for (const mutation of mutations || []) {
    for (const row of mutation.addedNodes) {
      if (row.cells && row.cells.length > 2 && row.cells[2].textContent === probeName) {
        window.probeRows.push({ pid: Number(row.dataset.pid), event: row.dataset.event });
      }
    }
  }
  const body = document.getElementById("events");
  const state = {
    status: text("status"), clients: text("clients"), events: text("count-events"),
    rows: body ? body.rows.length : null, table_says: text("table-state"),
  };
  const last = window.pageStates.at(-1);
  if (!last || JSON.stringify(last) !== JSON.stringify(state)) window.pageStates.push(state);
};
new MutationObserver(record).observe(document, {
  childList: true, subtree: true, characterData: true, attributes: true,
});
record();
"""


def test_first_paint_shows_the_replay_and_counts_the_page_itself(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    probe = make_probe(tmp_path)
    svc = page_service(tmp_path)
    try:
        # Events in the replay window before the page opens: the probe's exec and exit,
        # whose sequence numbers a reader of the stream sees.
        reference = FastClient(svc.base, headers={"Authorization": f"Bearer {svc.token}"})
        try:
            proc = subprocess.Popen([str(probe), "-c", "exit 7"])
            assert proc.wait(timeout=TIMEOUT) == 7
            messages = reference.read_until(lambda m: m.event == "message" and m.json()[
                "pid"] == proc.pid and m.json()["event"] == "EXIT")
        finally:
            reference.close()
        probe_exec = next(m for m in messages if m.event == "message"
                          and m.json()["pid"] == proc.pid and m.json()["event"] == "EXEC")
        # The page will be the only event stream: the reader has gone.
        wait_for(browser, "no event stream left", lambda: svc.http.get(
            "/health").json()["clients"] == 0)

        browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                                {"source": RECORD_FIRST_STATES % json.dumps(PROBE)})
        open_page(browser, svc)
        newest_then = svc.http.get("/health").json()["published"]
        wait_for(browser, "the service's counters", lambda: text(browser, "samples").isdigit())
        states = browser.execute_script("return window.pageStates;")
        assert states and states[0]["status"] is None  # recorded from before the header

        # Never "clients 0" while the page is connected (it is itself a client), and a
        # number once it is live; before that, no number at all.
        shown = [s for s in states if s["clients"] is not None]
        assert shown and all(s["clients"] != "0" for s in shown), states
        live = [s for s in states if s["status"] == "live"]
        assert live and all(s["clients"].isdigit() and int(s["clients"]) >= 1
                            for s in live), states
        # Never an empty table that does not say it is still connecting: the replay
        # holds events (the probe's at least).
        for state in states:
            if state["rows"] == 0:
                assert state["table_says"] is not None and \
                    state["table_says"].startswith("connecting"), (state, states)
        # The page's first live state shows the recent events (from the replay), among
        # them the probe's when fewer than a table's worth came after it.
        assert live[0]["rows"] > 0, states
        if newest_then - event_seq(probe_exec) < MAX_ROWS:
            rows = {(r["pid"], r["event"]) for r in
                    browser.execute_script("return window.probeRows;")}
            assert {(proc.pid, "EXEC"), (proc.pid, "EXIT")} <= rows, rows
    finally:
        browser.save_screenshot(str(tmp_path / "service-page.png"))
        svc.close()

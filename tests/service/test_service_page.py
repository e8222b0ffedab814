"""The service's live page, in a real browser: Debian's headless Chromium, driven by Selenium.

The service runs against the real kernel, with a token that the browser gets the way a user
would (``/?token=``, once); the tests exec programs of their own, and make the kernel lose
events, then check that the page shows both: the rows of the exec and exit, lost counters that
agree with the service's, numbers right under their headings, and a chart with the events per
second of each CPU and the losses. Set APERF_SERVICE_SCREENSHOT=docs/service-page.png to keep
the chart test's screenshot (docs/service.md shows it).
"""

from __future__ import annotations

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

from ..helpers import REQUIRE_BPF
from .test_service import TIMEOUT, Service

CHROMIUM = "/usr/bin/chromium"  # Debian's chromium; never a downloaded browser
CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver, the same version
PROBE = "aperf-page-test"  # a copy of sh under this name: its comm and file name are ours

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
    # Rings of about 90 events: a burst of 200 overflows them, the machine's own
    # processes do not (the lost counters must start at 0).
    svc = Service(tmp_path / "service.log", "--pages", "4", token=secrets.token_urlsafe(24))
    svc.wait_ready()
    return svc


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


def test_live_page_shows_events_and_lost_counters(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    sh = shutil.which("sh")
    assert sh
    svc = page_service(tmp_path)
    try:
        open_page(browser, svc)

        # A process of ours: its exec and its exit appear as rows, newest first.
        probe = tmp_path / PROBE
        shutil.copy(sh, probe)
        proc = subprocess.Popen([str(probe), "-c", "exit 7"])
        assert proc.wait(timeout=TIMEOUT) == 7
        exit_row = wait_for(browser, f"the exit of pid {proc.pid}",
                            lambda: row_cells(browser, proc.pid, "EXIT"))
        exec_row = row_cells(browser, proc.pid, "EXEC")
        assert exec_row is not None
        # time, event, comm, pid, ppid, file name / exit code, ran, cpu
        assert exec_row[1:6] == ["EXEC", PROBE, str(proc.pid), str(os.getpid()), str(probe)]
        assert exit_row[1:6] == ["EXIT", PROBE, str(proc.pid), str(os.getpid()), "[7]"]
        assert exit_row[6].endswith(" ms")
        assert exec_row[0] <= exit_row[0]  # HH:MM:SS.mmm, the kernel's times
        assert int(text(browser, "count-events")) >= 2
        wait_for(browser, "the service's counters",
                 lambda: text(browser, "samples").isdigit() and int(text(browser, "samples")) >= 2)
        assert text(browser, "lost-total") == "0"

        # The kernel loses events while the service is stopped; the page must say so,
        # from the event stream (lost notices) and from /health, and both must agree.
        lose_events(svc)

        def losses_shown() -> bool:
            flush_losses()
            lost = svc.http.get("/health").json()["lost"]
            return lost > 0 and text(browser, "lost-total") == text(browser, "count-lost") == str(
                lost)

        wait_for(browser, "the kernel's losses", losses_shown)
        assert "CPU" in text(browser, "lost-by-cpu")
        assert text(browser, "count-missed") == "0"  # the page kept up
    finally:
        browser.save_screenshot(str(tmp_path / "service-page.png"))
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
        assert sum(names["lost"]) == sum(names["missed"]) == 0

        # The kernel loses events: the "lost" line rises by the page's lost count.
        lose_events(svc)

        def lost_charted() -> bool:
            flush_losses()
            lost = text(browser, "count-lost")
            return lost != "0" and sum(chart(browser)["lost"]) == int(lost)

        wait_for(browser, "the losses on the chart", lost_charted)

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

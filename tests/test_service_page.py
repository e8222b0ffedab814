"""The service's live page, in a real browser: Debian's headless Chromium, driven by Selenium.

The service runs against the real kernel; the test execs a program of its own, and makes the
kernel lose events, then checks that the page shows both: the rows of its exec and exit, and
lost counters that agree with the service's. Set APERF_SERVICE_SCREENSHOT=docs/service-page.png
to keep the screenshot (docs/service.md shows it).
"""

from __future__ import annotations

import os
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

from .conftest import REQUIRE_BPF
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


def test_live_page_shows_events_and_lost_counters(
    tracefs: None, tmp_path: Path, browser: webdriver.Chrome
) -> None:
    sh, true, taskset = shutil.which("sh"), shutil.which("true"), shutil.which("taskset")
    assert sh and true and taskset
    # Rings of about 90 events: a burst of 200 overflows them, the machine's own
    # processes do not (the lost counters must start at 0).
    svc = Service(tmp_path / "service.log", "--pages", "4")
    try:
        svc.wait_ready()
        browser.get(svc.base + "/")
        wait_for(browser, "a live event stream", lambda: text(browser, "status") == "live")
        assert browser.title == "aperf: exec/exit events"
        # Everything the page loads comes from the service itself: no CDN, no build step.
        for element in browser.find_elements(By.CSS_SELECTOR, "script[src], link[href]"):
            url = element.get_attribute("src") or element.get_attribute("href")
            assert url is not None and url.startswith(svc.base + "/static/"), url

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
        svc.proc.send_signal(signal.SIGSTOP)
        try:
            for cpu in sorted(os.sched_getaffinity(0)):
                subprocess.run([taskset, "-c", str(cpu), sh, "-c",
                                f"for i in $(seq 100); do {true}; done"], check=True, timeout=60)
        finally:
            svc.proc.send_signal(signal.SIGCONT)

        def losses_shown() -> bool:
            for cpu in sorted(os.sched_getaffinity(0)):  # the count comes with the next event
                subprocess.run([taskset, "-c", str(cpu), true], check=True)
            lost = svc.http.get("/health").json()["lost"]
            return lost > 0 and text(browser, "lost-total") == text(browser, "count-lost") == str(
                lost)

        wait_for(browser, "the kernel's losses", losses_shown)
        assert "CPU" in text(browser, "lost-by-cpu")
        assert text(browser, "count-missed") == "0"  # the page kept up
    finally:
        screenshot = tmp_path / "service-page.png"
        browser.save_screenshot(str(screenshot))
        keep = os.environ.get("APERF_SERVICE_SCREENSHOT")
        if keep:
            shutil.copy(screenshot, keep)
        svc.close()

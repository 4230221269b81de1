"""Drive the ``ekit ui`` dashboard in a real headless Chromium from the tests.

The browser is the distribution's package (Debian's ``chromium`` and
``chromium-driver``, which ``.ci/run`` installs when they are missing),
driven through selenium with the driver found on ``PATH``: nothing is
downloaded at test time.

Tests skip when no Chromium is installed, except under CI (``CI`` set to
anything but ``0``/``false``, or ``EKIT_REQUIRE_BROWSER=1``, which ``.ci/run``
sets): there a missing browser is a failure, so the browser tests cannot
quietly stop running.

Helpers:

- :func:`chrome` starts a headless browser (1280x800, console logged);
  :func:`severe_console_errors` reads what the page logged at SEVERE.
- :class:`UiServer` starts ``ekit ui ...`` as a real subprocess and reads the
  URL it prints as its first line of stdout.
- :func:`wait_until` waits on a condition in the page (never a fixed sleep).
"""

from __future__ import annotations

import os
import queue as _queue
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def browser_required() -> bool:
    """True under CI, where a missing browser must fail the browser tests."""
    return _truthy(os.environ.get("CI")) or _truthy(os.environ.get("EKIT_REQUIRE_BROWSER"))


def chromium_paths() -> tuple[str, str] | None:
    """The Chromium binary and its chromedriver, or None when either is missing."""
    binary = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        return None
    return binary, driver


def require_browser() -> tuple[str, str]:
    """The browser's paths; skip the test without one, or fail under CI."""
    paths = chromium_paths()
    if paths is None:
        message = "no chromium + chromedriver on PATH (apt-get install chromium chromium-driver)"
        if browser_required():
            pytest.fail(f"{message}: CI must run the browser tests")
        pytest.skip(message)
    try:
        import selenium  # noqa: F401
    except ImportError:
        if browser_required():
            pytest.fail("selenium is not installed (pip install -e '.[test]')")
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    return paths


@contextmanager
def chrome(width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A headless Chromium (selenium WebDriver), its viewport ``width`` x ``height``, logging the console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = require_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        # The page's viewport itself (the window's size includes its frame).
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        yield driver
    finally:
        driver.quit()


def severe_console_errors(driver: Any) -> list[dict[str, Any]]:
    """The console entries logged at SEVERE since the last call (errors, failed loads)."""
    return [entry for entry in driver.get_log("browser") if entry.get("level") == "SEVERE"]


def wait_until(driver: Any, condition: Callable[[Any], T], timeout: float = 20.0, message: str = "") -> T:
    """Wait until ``condition(driver)`` is truthy and return it (selenium's WebDriverWait).

    An element the condition found may be replaced before it reads it (a
    live update puts a new part of the page in place): that try counts as
    false, and the condition is asked again.
    """
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,))
    return wait.until(condition, message)


class UiServer:
    """``ekit ui ARGS`` in a subprocess; ``url`` is the first line it prints.

    Use as a context manager: the server is terminated (then killed) on exit,
    and its stderr is kept in ``stderr`` for failure messages.
    """

    def __init__(self, args: Sequence[str], *, cwd: Path | None = None, timeout: float = 20.0) -> None:
        self.args = list(args)
        self.cwd = cwd
        self.timeout = timeout
        self.url = ""
        self.stderr = ""
        self._proc: subprocess.Popen[str] | None = None
        self._lines: _queue.Queue[str | None] = _queue.Queue()
        self._err: list[str] = []
        self._err_thread: threading.Thread | None = None

    def __enter__(self) -> UiServer:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), str(self.cwd) if self.cwd else "", env.get("PYTHONPATH", "")) if p
        )
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "ekit_runtime", "ui", *self.args],
            cwd=self.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._pump, args=(self._proc.stdout, self._lines), daemon=True).start()
        self._err_thread = threading.Thread(target=self._drain_err, daemon=True)
        self._err_thread.start()
        try:
            first = self._lines.get(timeout=self.timeout)
        except _queue.Empty:
            first = None
        if not first or not first.strip().startswith("http"):
            self.__exit__(None, None, None)
            raise AssertionError(
                f"ekit ui {' '.join(self.args)} printed no URL first (got {first!r}); stderr:\n{self.stderr}"
            )
        self.url = first.strip().rstrip("/")
        return self

    @staticmethod
    def _pump(stream: Any, lines: _queue.Queue[str | None]) -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    def _drain_err(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for line in self._proc.stderr:
            self._err.append(line)

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._err_thread is not None:
            self._err_thread.join(5)
        self.stderr = "".join(self._err)


def run_url(server: UiServer, run_id: str) -> str:
    return f"{server.url}/run/{urllib.parse.quote(run_id, safe='')}"


def wait_for(condition: Any, what: str, timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds (polling the queue, never a blind sleep)."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        tick.wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_status(queue: Any, run_id: str, status: str) -> None:
    wait_for(lambda: queue.status(run_id).status == status, f"run {run_id!r} to be {status!r}")

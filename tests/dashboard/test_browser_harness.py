"""The browser harness (tests/support/browser.py) sees what it must, so the dashboard tests can trust it.

- a script error in a page is caught as a SEVERE console entry;
- without a browser, the browser tests skip on a developer's machine but fail
  under CI (``CI`` or ``EKIT_REQUIRE_BROWSER`` set), so CI cannot stop running them.
"""

from __future__ import annotations

import pytest

from tests.support import browser


@pytest.mark.timeout(60)
def test_a_script_error_in_the_page_is_a_severe_console_entry() -> None:
    with browser.chrome() as driver:
        driver.get("data:text/html,<p>fine</p>")
        assert browser.severe_console_errors(driver) == []
        driver.get("data:text/html,<script>undefinedFunction()</script>")
        errors = browser.severe_console_errors(driver)
        assert errors and "undefinedFunction" in errors[0]["message"]


@pytest.mark.parametrize(
    ("env", "outcome"),
    [
        ({}, pytest.skip.Exception),
        ({"CI": "false"}, pytest.skip.Exception),
        ({"CI": "true"}, pytest.fail.Exception),
        ({"EKIT_REQUIRE_BROWSER": "1"}, pytest.fail.Exception),
    ],
)
def test_a_missing_browser_skips_only_outside_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, env: dict[str, str], outcome: type[BaseException]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("EKIT_REQUIRE_BROWSER", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(outcome):
        browser.require_browser()

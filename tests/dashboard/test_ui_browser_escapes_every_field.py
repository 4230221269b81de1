"""In a real browser, markup in any user-controlled field stays text: in the pages and in every live update.

The promise (docs/dashboard.md, "Actions and their safety"), checked where it
matters, in headless Chromium: runs whose every field carries a payload that
breaks out of elements and quoted attributes (tests/support/ui_hostile.py) are shown,
and neither the page as served nor the page after its live updates replaced
every part of it holds an element or a handler the payload made; no dialog
opens; the payload is there as text; the replaced forms carry the page's
token again (the JSON never holds it). The same fields over HTTP, parsed:
tests/dashboard/test_ui_escapes_every_field.py.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_runtime.queue import SqliteQueue
from tests.support.browser import UiServer, chrome, require_browser, severe_console_errors, wait_until
from tests.support.ui_hostile import PAGE_SVGS, PAYLOAD, populate

pytestmark = pytest.mark.timeout(120)

INJECTED = "var PAGE_SVGS = " + json.dumps(PAGE_SVGS) + ";" + """
var bad = [];
document.querySelectorAll('img, iframe, object, embed, script:not([src]), svg'
                          + PAGE_SVGS.map(function (id) { return ':not(#' + id + ')'; }).join(''))
  .forEach(function (e) { bad.push(e.outerHTML.slice(0, 120)); });
document.querySelectorAll('*').forEach(function (e) {
  Array.from(e.attributes).forEach(function (a) {
    if (a.name.indexOf('on') === 0) { bad.push(e.tagName + ' ' + a.name); }
  });
});
return bad;
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UiServer, dict[str, str], Any]]:
    require_browser()
    db = tmp_path_factory.mktemp("hostile") / "runs.db"
    queue = SqliteQueue(str(db))
    ids = populate(queue)
    with UiServer(["--queue", str(db), "--allow-actions", "--port", "0"]) as server, chrome() as driver:
        yield server, ids, driver
    queue.close()


TOKENS = ("return Array.from(document.querySelectorAll('input[name=token]'))"
          ".map(function (f) { return f.value; });")


def assert_inert(driver: Any, where: str, shown: str = PAYLOAD) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    assert driver.execute_script(INJECTED) == [], where
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018
    assert shown in driver.execute_script("return document.body.textContent"), where


def every_part_replaced(driver: Any) -> bool:
    return bool(driver.execute_script(
        "var parts = document.querySelectorAll('#run > div.part');"
        "return parts.length > 0 && Array.from(parts)"
        ".every(function (p) { return p.dataset.version !== 'stale'; });"
    ))


@pytest.mark.parametrize("role", ["waiting", "answered", "failed", "denied", "running"])
def test_a_run_page_and_its_live_updates_create_no_element_from_a_field(
    served: tuple[UiServer, dict[str, str], Any], role: str
) -> None:
    server, ids, driver = served
    driver.get(f"{server.url}/run/{urllib.parse.quote(ids[role], safe='')}")
    assert_inert(driver, f"the page of {role}")
    tokens = driver.execute_script(TOKENS)
    assert tokens and all(tokens), role  # every run here offers an action
    # Mark every part out of date: the next poll puts each one in place from the JSON.
    driver.execute_script("document.querySelectorAll('#run > div.part')"
                          ".forEach(function (p) { p.dataset.version = 'stale'; });")
    wait_until(driver, every_part_replaced, 20, f"the page of {role} never replaced its parts")
    assert_inert(driver, f"the page of {role}, every part replaced by a live update")
    assert driver.execute_script(TOKENS) == tokens, role
    assert not severe_console_errors(driver)


def test_the_runs_page_and_its_live_updates_create_no_element_from_a_field(
    served: tuple[UiServer, dict[str, str], Any]
) -> None:
    server, ids, driver = served
    for query in ("", "?workflow=" + urllib.parse.quote(PAYLOAD)):
        driver.get(f"{server.url}/{query}")
        assert_inert(driver, "the runs page " + query)
        driver.execute_script("delete document.body.dataset.refreshed;"
                              "document.querySelector('#runs tbody').innerHTML = '';")
        wait_until(driver, lambda d: d.execute_script("return document.body.dataset.refreshed"), 20)
        assert_inert(driver, "the runs page, its rows replaced by a live update " + query)
        shown = driver.execute_script("return document.querySelectorAll('#runs tr[data-run-id]').length")
        assert shown == (len(ids) if not query else 2)
    assert not severe_console_errors(driver)


def test_a_missing_run_named_by_markup_is_a_page_of_text(
    served: tuple[UiServer, dict[str, str], Any]
) -> None:
    server, _, driver = served
    driver.get(f"{server.url}/run/{urllib.parse.quote(PAYLOAD + ' nope', safe='')}")
    assert driver.find_element("css selector", "h2.error-code").text == "404"
    assert_inert(driver, "the 404 page", "no run '<script>alert(1)</script>\"><img src=x onerror=alert(2)>")
    severe_console_errors(driver)  # the 404 itself is logged: nothing else may be

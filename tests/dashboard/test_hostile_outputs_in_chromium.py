"""In real Chromium, markup in outputs, answers, questions and failures stays text, as served and live.

The promise (docs/dashboard.md, "Actions and their safety"): outputs (a
step's, an item's, a typed one, a huge one, one whose keys are markup), the
answers people gave and who gave them, the prompts of the runs waiting first
on the runs page, and failures' messages are escaped: neither the pages as
served nor the pages after a live update replaced every part of them hold an
element or a handler the payload made, no dialog opens, the payload is there
as text, and the forms a live update put in place carry the page's token
again. A store file whose outputs hold lone surrogates (JSON can spell them,
no page can encode them) shows them as ``\\udcxx``. Skipped with no Chromium
except under CI (tests/support/browser.py).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from ekit_core import WorkflowCheckpoint
from ekit_runtime.queue import RunQueue, SqliteQueue
from tests.support.browser import UiServer, chrome, require_browser, severe_console_errors, wait_until
from tests.support.ui_hostile import PAYLOAD

pytestmark = pytest.mark.timeout(120)

INJECTED = """
var bad = [];
document.querySelectorAll('img, iframe, object, embed, script:not([src]), '
                          + 'svg:not(#graph):not(#fleet-chart):not(#usage-chart)')
  .forEach(function (e) { bad.push(e.outerHTML.slice(0, 120)); });
document.querySelectorAll('*').forEach(function (e) {
  Array.from(e.attributes).forEach(function (a) {
    if (a.name.indexOf('on') === 0) { bad.push(e.tagName + ' ' + a.name); }
  });
});
return bad;
"""
TOKENS = ("return Array.from(document.querySelectorAll('input[name=token]'))"
          ".map(function (f) { return f.value; });")
HUGE = (PAYLOAD + " ") * 400  # past the 20,000 characters a page holds of an output
GRAPH = {"plan": [], "work": ["plan"], PAYLOAD: ["work"], "boom": []}


def _checkpoint(asked: dict[str, Any], outputs: dict[str, Any] | None = None) -> WorkflowCheckpoint:
    shapes = {"work": {"map_over": "plan"}} if outputs is None else {}
    return WorkflowCheckpoint.from_dict({
        "format_version": 3, "step_index": 5,
        "outputs": outputs if outputs is not None else {
            "plan": {PAYLOAD: 1, "'quoted'": 2}, f"work[{PAYLOAD}]": PAYLOAD, "work[']": HUGE,
            "work": {PAYLOAD: PAYLOAD, "'": HUGE},
            PAYLOAD: {"$ekit": "type", "type": PAYLOAD, "value": {PAYLOAD: PAYLOAD}}},
        "cost": {"input_tokens": 7, "output_tokens": 3, "llm_calls": 1}, "context": {},
        "step_usage": {PAYLOAD: {"input_tokens": 7, "output_tokens": 3, "llm_calls": 1}},
        "failures": {"boom": {"error_type": PAYLOAD, "message": PAYLOAD * 20, "attempts": 2}},
        "graph": GRAPH, "shapes": shapes, "asked": asked})


def _save(queue: RunQueue, run_id: str, cp: WorkflowCheckpoint, park: bool) -> None:
    queue.submit(run_id + " wf", {}, run_id=run_id)
    lease = queue.claim("w", {run_id + " wf": None}, 600)
    assert lease is not None
    queue.save(lease, cp, 600)
    if park:
        queue.park(lease, PAYLOAD)
    else:
        queue.finish(lease, "failed", PAYLOAD)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[UiServer, UiServer, Any]]:
    require_browser()
    tmp = tmp_path_factory.mktemp("hostile-outputs")
    queue = SqliteQueue(str(tmp / "runs.db"))
    answered = {"plan": [{"kind": "value", "prompt": PAYLOAD,
                          "answer": {"by": PAYLOAD, "at": PAYLOAD, "value": {PAYLOAD: [PAYLOAD]}}}]}
    _save(queue, PAYLOAD + " answered", _checkpoint(answered), park=False)
    asking = {PAYLOAD: [{"kind": "value", "prompt": PAYLOAD, "details": {PAYLOAD: PAYLOAD}}],
              "boom": [{"kind": "approval", "prompt": PAYLOAD}]}
    _save(queue, PAYLOAD + " waiting", _checkpoint(asking), park=True)
    queue.close()
    file = tmp / "run.json"
    outputs = {"plan": "\udc80" + PAYLOAD, "work": ["\ud800 " + PAYLOAD] * 50}
    file.write_text(json.dumps(_checkpoint({}, outputs).to_dict()))  # (ensure_ascii: escapes in the file)
    with UiServer(["--queue", str(tmp / "runs.db"), "--allow-actions", "--port", "0"]) as server, \
            UiServer([str(file), "--port", "0"]) as from_file, chrome() as driver:
        yield server, from_file, driver


def _inert(driver: Any, where: str, shown: str = PAYLOAD) -> None:
    from selenium.common.exceptions import NoAlertPresentException

    assert driver.execute_script(INJECTED) == [], where
    with pytest.raises(NoAlertPresentException):
        driver.switch_to.alert.text  # noqa: B018
    assert shown in driver.execute_script("return document.body.textContent"), where


def _every_part_replaced(driver: Any) -> bool:
    return bool(driver.execute_script(
        "var parts = document.querySelectorAll('div.part');"
        "return parts.length > 0 && Array.from(parts)"
        ".every(function (p) { return p.dataset.version !== 'stale'; });"
    ))


def _replace_every_part(driver: Any, where: str) -> None:
    driver.execute_script("document.querySelectorAll('div.part')"
                          ".forEach(function (p) { p.dataset.version = 'stale'; });")
    wait_until(driver, _every_part_replaced, 20, f"{where}: a part was never replaced")


@pytest.mark.parametrize("role", ["answered", "waiting"])
def test_a_run_page_shows_hostile_outputs_and_answers_as_text(
    served: tuple[UiServer, UiServer, Any], role: str
) -> None:
    server, _, driver = served
    driver.get(f"{server.url}/run/{urllib.parse.quote(PAYLOAD + ' ' + role, safe='')}")
    _inert(driver, role)
    text = driver.execute_script("return document.getElementById('outputs').textContent")
    assert json.dumps(PAYLOAD) in text and "all of it (" in text
    if role == "answered":
        answers = driver.execute_script("return document.getElementById('answers').textContent")
        assert json.dumps({PAYLOAD: [PAYLOAD]}, indent=2, ensure_ascii=False) in answers  # (all of it)
    # The whole of the huge item, served as text: the browser shows it, runs nothing.
    link = driver.execute_script(
        "return Array.from(document.querySelectorAll('#outputs a')).map(function (a) { return a.href; })")
    assert link
    _replace_every_part(driver, role)
    _inert(driver, f"{role}, every part replaced by a live update")
    driver.get(link[0])
    assert driver.execute_script(INJECTED) == []
    assert json.loads(driver.execute_script("return document.body.textContent")) == HUGE
    assert not severe_console_errors(driver)


def test_the_runs_page_shows_a_hostile_question_first_as_text_with_its_forms(
    served: tuple[UiServer, UiServer, Any]
) -> None:
    server, _, driver = served
    driver.get(server.url + "/")
    _inert(driver, "the runs page")
    waiting = driver.execute_script("return document.getElementById('waiting').textContent")
    assert PAYLOAD in waiting and json.dumps({PAYLOAD: PAYLOAD}, indent=2) in waiting
    tokens = driver.execute_script(TOKENS)
    assert len(tokens) == 3 and all(tokens)  # an answer, an approval and a denial
    _replace_every_part(driver, "the runs page")
    _inert(driver, "the runs page, every part replaced by a live update")
    assert driver.execute_script(TOKENS) == tokens
    assert not severe_console_errors(driver)


def test_lone_surrogates_of_a_store_file_show_as_their_escapes(
    served: tuple[UiServer, UiServer, Any]
) -> None:
    _, from_file, driver = served
    driver.get(f"{from_file.url}/run/run.json")
    _inert(driver, "a store file's run", "\\udc80<script>alert(1)</script>")
    assert "\\ud800 " in driver.execute_script("return document.getElementById('outputs').textContent")
    _replace_every_part(driver, "a store file's run")
    _inert(driver, "a store file's run, every part replaced", "\\udc80<script>alert(1)</script>")
    assert not severe_console_errors(driver)

"""The dashboard shows every user-controlled field as text, never as markup, on every page and update.

The promise (docs/dashboard.md, "Actions and their safety"): whatever comes
from a run (run ids, the workflow's name, step names, a mapped step's item
keys, worker names, questions and their details, answers and who gave them,
reasons, errors, the context) is HTML-escaped, quotes too, in the pages, in
the SVG, in the error pages and in every piece of HTML the live updates put
in place (``/api/runs``, ``/api/run/<id>``). A payload that breaks out of an
element and out of either kind of quoted attribute (tests/support/ui_hostile.py) is
put in every such field; the HTML is parsed, and must hold no element or
handler the payload made, while the payload is shown, as text, where each
field belongs. The same pages in a real browser: tests/dashboard/test_ui_browser_escapes_every_field.py.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator

import pytest

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import Dashboard, QueueSource
from tests.support.dashboard_http import fetch, serving, token_and_cookie
from tests.support.ui_hostile import ITEM, PAYLOAD, populate, unsafe_markup

Q = urllib.parse.quote


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Dashboard, dict[str, str]]]:
    queue = SqliteQueue(str(tmp_path_factory.mktemp("hostile") / "q.db"))
    ids = populate(queue)
    with serving(QueueSource(queue, PAYLOAD), allow_actions=True) as server:
        yield server, ids
    queue.close()


def shown_safely(html: str, where: str) -> str:
    """``html``'s text, once it is known to hold no markup the payload made."""
    unsafe, text = unsafe_markup(html)
    assert not unsafe, f"{where}: {unsafe}"
    return text


def run_path(run_id: str) -> str:
    return "/run/" + Q(run_id, safe="")


# Where each run shows its payload-bearing fields, as text a person reads.
SHOWN = {
    "waiting": [f"run {PAYLOAD} waiting", PAYLOAD + " asks", f"asks (value): {PAYLOAD}",
                f"slowest {ITEM}:"],
    "answered": [f"slowest {ITEM}:", PAYLOAD + " mapped"],
    "failed": [f"{PAYLOAD}: {PAYLOAD}", PAYLOAD + " boom"],
    "denied": [f"was denied approval: {PAYLOAD}"],
    "running": [f"{ITEM}: attempt 1 on worker {PAYLOAD}, for", f"reason{PAYLOAD}", f"owner{PAYLOAD}"],
}


@pytest.mark.parametrize("role", sorted(SHOWN))
def test_a_run_page_and_its_live_update_show_every_field_as_text(
    hostile: tuple[Dashboard, dict[str, str]], role: str
) -> None:
    server, ids = hostile
    page = fetch(server, run_path(ids[role]))
    assert page.status == 200
    text = shown_safely(page.body, f"the page of {role}")
    for expected in SHOWN[role]:
        assert expected in text.replace("\n", ""), (role, expected)
    data = fetch(server, "/api" + run_path(ids[role])).json()
    pieces = {"steps_tbody": data["steps_tbody"], "in_flight_html": data["in_flight_html"],
              **{f"parts[{key}]": html for key, html in data["parts"].items()}}
    live = "".join(shown_safely(html, f"/api/run of {role}: {key}") for key, html in pieces.items())
    for expected in SHOWN[role]:
        assert expected in live.replace("\n", ""), (role, expected)


def test_the_runs_pages_and_their_live_updates_show_every_field_as_text(
    hostile: tuple[Dashboard, dict[str, str]]
) -> None:
    server, ids = hostile
    for query in ("", "?status=failed", "?status=running", "?workflow=" + Q(PAYLOAD)):
        page = fetch(server, "/" + query)
        assert page.status == 200, query
        text = shown_safely(page.body, "/" + query)
        data = fetch(server, "/api/runs" + query).json()
        live = shown_safely(data["tbody"], "/api/runs" + query) + shown_safely(data["nav"], query)
        for shown in (text, live):
            assert PAYLOAD in shown, query
    everything = shown_safely(fetch(server, "/").body, "/")
    for run_id in ids.values():
        assert run_id in everything
    assert f"{PAYLOAD} (lease" in everything.replace("\n", "")  # the running run's owner, the worker


def test_error_pages_show_what_was_asked_as_text(hostile: tuple[Dashboard, dict[str, str]]) -> None:
    server, ids = hostile
    token, cookie = token_and_cookie(server, run_path(ids["running"]))
    answers = [
        fetch(server, run_path(PAYLOAD + " nope")),  # 404, names the run
        fetch(server, "/api" + run_path(PAYLOAD + " nope")),
        fetch(server, "/?workflow=" + Q(PAYLOAD + "\x00")),  # 400
        fetch(server, run_path(ids["running"]) + "/retry", {"token": token}, {"Cookie": cookie}),  # 409
        fetch(server, run_path(ids["waiting"]) + "/answer",
              {"token": token, "step": PAYLOAD, "value": PAYLOAD}, {"Cookie": cookie}),
    ]
    assert [a.status for a in answers] == [404, 404, 400, 409, 409]
    for answer in answers:
        if answer.headers["Content-Type"] == "application/json":
            # Never HTML: a browser told nosniff renders it as nothing but JSON.
            assert answer.headers["X-Content-Type-Options"] == "nosniff"
            assert answer.json()["error"] == f"no run {PAYLOAD + ' nope'!r}"
        else:
            shown_safely(answer.body, f"the {answer.status} page")
    assert PAYLOAD in shown_safely(answers[0].body, "404")

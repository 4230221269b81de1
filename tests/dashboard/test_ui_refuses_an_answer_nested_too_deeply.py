"""An answer posted on the dashboard that is JSON nested too deeply to read is a 400, not a 500.

``json.loads`` raises ``RecursionError`` (not a ``ValueError``) past
Python's recursion limit: the answer form turned 5,000 ``[`` (well
within its 64 KiB) into "internal error: RecursionError". It is the
poster's input to fix, and nothing is written.
"""

from __future__ import annotations

from typing import Any

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import fetch, in_every_status, serving, token_and_cookie


def test_an_answer_nested_too_deeply_is_a_400_and_nothing_is_written(tmp_path: Any, capsys: Any) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    in_every_status(queue)
    try:
        before = queue.checkpoint("r-waiting")
        with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
            token, cookie = token_and_cookie(server, "/run/r-waiting")
            for value in ("[" * 5_000 + "]" * 5_000, "[" * 5_000, '{"a":' * 2_000 + "1" + "}" * 2_000):
                got = fetch(server, "/run/r-waiting/answer", {"token": token, "step": "b", "value": value},
                            {"Cookie": cookie})
                assert got.status == 400, got.body[-300:]
                assert "nested" in got.body
        assert queue.checkpoint("r-waiting") == before
        assert queue.status("r-waiting").status == "waiting"
        assert "RecursionError" not in capsys.readouterr().err
    finally:
        queue.close()

"""A page number the dashboard cannot take is a 400 whatever its length, never a 500.

``?page=`` followed by more than 4,300 digits made ``int()`` raise (Python's
limit on digits turned to an int) before the length was checked: an
"internal error" page, and a line on stderr, where docs/dashboard.md
promises a 400 for any page number that is not a whole number from 1.
"""

from __future__ import annotations

from typing import Any

import pytest

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import fetch, serving


@pytest.mark.parametrize("page", ["9" * 5000, "0" * 5000, "1" * 10, "0", "-1", "1.5", "%D9%A1"])
def test_a_page_number_the_dashboard_cannot_take_is_a_400(page: str, tmp_path: Any, capsys: Any) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    try:
        with serving(QueueSource(queue, "q.db")) as server:
            for path in ("/", "/api/runs"):
                got = fetch(server, f"{path}?page={page}")
                assert got.status == 400, (path, len(page))
                assert len(got.body) < 2000, (path, len(page))  # the number is cut short in the message
        assert "internal error" not in capsys.readouterr().err
    finally:
        queue.close()

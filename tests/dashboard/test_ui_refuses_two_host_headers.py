"""A request with two ``Host`` headers is refused (400), whichever comes first.

The dashboard read the first ``Host`` only: a request naming 127.0.0.1 and
then another site was served, page, token cookie and all. RFC 9112 (3.2)
says a server must answer such a request with 400: a proxy in front (the
docs suggest one) may route it by the other header.
"""

from __future__ import annotations

import socket
from typing import Any

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import QueueSource
from tests.support.dashboard_http import in_every_status, serving


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def test_two_host_headers_are_a_400_that_sets_no_cookie(tmp_path: Any) -> None:
    queue = SqliteQueue(str(tmp_path / "q.db"))
    in_every_status(queue)
    try:
        with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
            port = server.server_address[1]
            own, other = f"127.0.0.1:{port}".encode(), f"evil.example:{port}".encode()
            for first, second in ((own, other), (other, own), (own, own)):
                got = _raw(port, b"GET /run/r-queued HTTP/1.1\r\nHost: " + first + b"\r\nHost: " + second
                           + b"\r\nConnection: close\r\n\r\n")
                head = got.split(b"\r\n\r\n", 1)[0]
                assert head.split(b"\r\n")[0].split()[1] == b"400", (first, second)
                assert b"Set-Cookie" not in head and b"r-queued" not in got
            got = _raw(port, b"GET /run/r-queued HTTP/1.1\r\nHost: " + own + b"\r\nConnection: close\r\n\r\n")
            assert got.split(b"\r\n")[0].split()[1] == b"200"
    finally:
        queue.close()

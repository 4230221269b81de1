"""Bound to a non-loopback address (``--host 0.0.0.0``), the dashboard still refuses a rebound name.

A server listening on every address listens on 127.0.0.1 too: a page the
user's browser opens at ``http://evil.example:PORT/``, its name then
re-pointed at 127.0.0.1 (DNS rebinding), reached it with ``Host:
evil.example:PORT``, which any-address serving let in; the matching
``Origin`` passed too, so the page read the token and posted a cancel.
Whatever the bound address, a ``Host`` must be a literal IP address (which
no one can re-point) or ``localhost``, at the server's port: the address
``ekit ui`` prints is one.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import Dashboard, QueueSource, Source, make_server
from tests.support.dashboard_http import fetch, in_every_status, token_and_cookie


@contextmanager
def _serving_on(source: Source, host: str) -> Iterator[Dashboard]:
    server = make_server(source, host, allow_actions=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


@pytest.fixture
def queue(tmp_path: object) -> Iterator[SqliteQueue]:
    q = SqliteQueue(f"{tmp_path}/q.db")
    in_every_status(q)
    yield q
    q.close()


def _port(server: Dashboard) -> int:
    port = urllib.parse.urlsplit(server.url).port
    assert port is not None
    return port


def test_a_rebound_name_reads_nothing_and_posts_nothing_on_every_address(queue: SqliteQueue) -> None:
    with _serving_on(QueueSource(queue, "q.db"), "0.0.0.0") as server:
        port = _port(server)
        token, cookie = token_and_cookie(server, "/run/r-queued")
        for host in (f"evil.example:{port}", f"127.attacker.example:{port}", f"localhost.:{port}",
                     f"0x7f.0.0.1:{port}", f"2130706433:{port}", f"user@10.0.0.1:{port}", ""):
            got = fetch(server, "/run/r-queued", headers={"Host": host})
            assert got.status == 403, host
            assert token not in got.body and "Set-Cookie" not in got.headers, host
            got = fetch(server, "/run/r-queued/cancel", {"token": token},
                        {"Host": host, "Cookie": cookie, "Origin": f"http://{host}"})
            assert got.status == 403, host
        assert queue.status("r-queued").status == "queued"


def test_a_literal_address_or_localhost_at_the_port_is_served_on_every_address(queue: SqliteQueue) -> None:
    with _serving_on(QueueSource(queue, "q.db"), "0.0.0.0") as server:
        port = _port(server)
        for host in (f"127.0.0.1:{port}", f"0.0.0.0:{port}", f"10.1.2.3:{port}", f"192.168.0.7:{port}",
                     f"localhost:{port}", f"[::1]:{port}", f"[fe80::1]:{port}", f"[2001:db8::7]:{port}"):
            assert server.host_allowed(host), host
            got = fetch(server, "/run/r-queued", headers={"Host": host})
            assert got.status == 200, host
        for host in (f"10.1.2.3:{port + 1}", f"[::1]:{port}0", "10.1.2.3", f"010.1.2.3:{port}",
                     f"[::1:{port}", f"[not-an-address]:{port}", f"10.1.2.3.:{port}"):
            assert not server.host_allowed(host), host

"""The dashboard answers only its own address: no DNS rebinding, no foreign Origin, no stray cookie.

The promise (docs/dashboard.md, "Actions and their safety"): listening on a
loopback address, ``ekit ui`` serves a request only when its ``Host`` is a
literal loopback address (an IPv4 address in 127.0.0.0/8, ``[::1]``) or
``localhost``, at the server's own port; a name that merely begins like one
(``127.attacker.example``) is a rebound site and reads nothing, takes no
token and acts on nothing. An action's ``Origin``, when sent, must be this
server's own: scheme, host and port. The token's cookie is set only with a
page served (200), never with a refusal or an error.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_runtime.queue import SqliteQueue
from ekit_runtime.ui import Dashboard, QueueSource, Source, make_server
from tests.support.dashboard_http import fetch, in_every_status, serving, token_and_cookie


@pytest.fixture
def queue(tmp_path: object) -> SqliteQueue:
    q = SqliteQueue(f"{tmp_path}/q.db")
    in_every_status(q)
    return q


def _port(server: Dashboard) -> int:
    port = urllib.parse.urlsplit(server.url).port
    assert port is not None
    return port


def _hostile_hosts(port: int) -> list[str]:
    """Names a rebound (or forged) request could carry: none is this server's own address."""
    return [
        f"127.attacker.example:{port}",
        f"127.0.0.1.attacker.example:{port}",
        f"127.0.0.1.nip.io:{port}",
        f"localhost.attacker.example:{port}",
        f"127.evil:{port}",
        f"127.1:{port}",  # not a dotted quad: a browser would have sent 127.0.0.1
        f"0x7f.0.0.1:{port}",
        f"0177.0.0.1:{port}",
        f"127.0.0.256:{port}",
        f"[::ffff:127.0.0.1]:{port}",
        f"[::1].attacker.example:{port}",
        f"::1:{port}",  # an IPv6 literal without brackets is no Host
        f"127.0.0.1:{port + 1}",  # another port of the same address
        f"127.0.0.1:{port}0",
        f"127.0.0.1:+{port}",
        f"127.0.0.1:{port}:{port}",
        f"user@127.0.0.1:{port}",
        "127.0.0.1",  # no port: port 80, not this server's
        "localhost",
        "",
    ]


def test_a_host_that_only_begins_like_a_loopback_address_reads_nothing(queue: SqliteQueue) -> None:
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, _ = token_and_cookie(server, "/run/r-queued")
        for host in _hostile_hosts(_port(server)):
            for path in ("/", "/run/r-queued", "/api/runs", "/api/run/r-queued", "/static/app.js"):
                got = fetch(server, path, headers={"Host": host})
                assert got.status == 403, (host, path, got.status)
                assert token not in got.body, (host, path)
                assert "Set-Cookie" not in got.headers, (host, path)
                assert "r-queued" not in got.body, (host, path)


def test_a_rebound_site_cannot_post_an_action(queue: SqliteQueue) -> None:
    """The attack as reported: read a page through a rebound name, then post its token and cookie."""
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, cookie = token_and_cookie(server, "/run/r-queued")
        for host in _hostile_hosts(_port(server)):
            got = fetch(server, "/run/r-queued/cancel", {"token": token},
                        {"Host": host, "Cookie": cookie, "Origin": f"http://{host}"})
            assert got.status == 403, host
            got = fetch(server, "/run/r-queued/cancel", {"token": token}, {"Host": host, "Cookie": cookie})
            assert got.status == 403, host
        assert queue.status("r-queued").status == "queued"


def test_every_literal_loopback_name_at_the_servers_port_is_served(queue: SqliteQueue) -> None:
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        port = _port(server)
        for host in (f"127.0.0.1:{port}", f"127.1.2.3:{port}", f"127.255.255.254:{port}",
                     f"localhost:{port}", f"LocalHost:{port}", f"[::1]:{port}"):
            got = fetch(server, "/run/r-queued", headers={"Host": host})
            assert got.status == 200, host
            assert "Set-Cookie" in got.headers, host


def test_an_origin_other_than_the_servers_own_is_refused(queue: SqliteQueue) -> None:
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        port = _port(server)
        host = f"127.0.0.1:{port}"
        token, cookie = token_and_cookie(server, "/run/r-queued")
        for origin in (f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port - 1}", "http://127.0.0.1",
                       f"https://127.0.0.1:{port}", f"ftp://127.0.0.1:{port}", f"http://localhost:{port}",
                       f"http://127.0.0.2:{port}", f"http://127.attacker.example:{port}",
                       f"http://user@127.0.0.1:{port}", f"http://127.0.0.1:{port}/x", f"http://{port}",
                       "null", "", "http://evil.example"):
            got = fetch(server, "/run/r-queued/cancel", {"token": token},
                        {"Host": host, "Cookie": cookie, "Origin": origin})
            assert got.status == 403, origin
        assert queue.status("r-queued").status == "queued"
        got = fetch(server, "/run/r-queued/cancel", {"token": token},
                    {"Host": host, "Cookie": cookie, "Origin": f"http://{host}"})
        assert got.status == 303
        assert queue.status("r-queued").status == "cancelled"


def test_no_answer_but_a_served_page_sets_the_cookie(queue: SqliteQueue) -> None:
    with serving(QueueSource(queue, "q.db"), allow_actions=True) as server:
        token, cookie = token_and_cookie(server, "/run/r-queued")
        answers = [
            fetch(server, "/run/r-queued/cancel", {"token": "wrong"}, {"Cookie": cookie}),  # 403
            fetch(server, "/run/r-queued/cancel", {"token": token}),  # 403: no cookie
            fetch(server, "/nope"),  # 404
            fetch(server, "/run/nope"),  # 404
            fetch(server, "/?page=0"),  # 400
            fetch(server, "/run/r-finished/retry", {"token": token}, {"Cookie": cookie}),  # 409
            fetch(server, "/run/r-queued/cancel", {"token": token}, {"Cookie": cookie}),  # 303
        ]
        assert [a.status for a in answers] == [403, 403, 404, 404, 400, 409, 303]
        for answer in answers:
            assert "Set-Cookie" not in answer.headers, answer.status
            assert token not in answer.body, answer.status


def _own_name(name: str) -> bool:
    """The rule, said another way: ``localhost``, ``[::1]``, or an IPv4 address of 127.0.0.0/8
    written as the address itself prints (a dotted quad, no leading zero)."""
    if name in ("localhost", "[::1]"):
        return True
    try:
        address = ipaddress.IPv4Address(name)
    except ValueError:
        return False
    return str(address) == name and address.is_loopback


NAMES = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"127(\.[0-9a-z-]{0,5}){0,5}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(network="127.0.0.0/8").map(str),
    st.sampled_from(["localhost", "[::1]", "::1", "127.0.0.1", "localhost.", "127.0.0.1.", "[::1]x"]),
)


@pytest.fixture(scope="module")
def bound() -> Iterator[Dashboard]:
    server = make_server(Source())
    yield server
    server.server_close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES, port=st.one_of(st.none(), st.integers(0, 70000)), case=st.booleans())
def test_a_host_is_served_exactly_when_it_is_a_literal_loopback_name_at_the_port(
    bound: Dashboard, name: str, port: int | None, case: bool
) -> None:
    own = _port(bound)
    given_name = name.upper() if case else name
    header = given_name if port is None else f"{given_name}:{port}"
    # Names compare without case, in ASCII only (a Host header is ASCII).
    expected = (given_name.isascii() and _own_name(given_name.lower())
                and (port == own or (port is None and own == 80)))
    assert bound.host_allowed(header) is expected, header
    # An action's Origin passes only as this very scheme, host and port.
    if expected:
        assert bound.origin_allowed(f"http://{header}", header)
        assert not bound.origin_allowed(f"https://{header}", header)
        assert not bound.origin_allowed(f"http://{header}0", header)

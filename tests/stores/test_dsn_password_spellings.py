"""A password is kept out of messages however its parameter's name is spelt.

libpq percent-decodes the keys of a URL's query as well as their values, so
``?pass%77ord=SECRET`` (or ``?%70assword=``) is the connection's password,
exactly as ``?password=`` is; an upper-case ``PASSWORD=`` of a key=value
string is refused by libpq, but is the user's secret all the same. And a
DSN handed over as ``bytes`` is refused without being quoted back.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ekit_runtime.cli import main
from ekit_runtime.redaction import redacted, scrub
from tests.support.queue_backends import fresh_postgres

CORE = "Zq7SECRETx"


@st.composite
def spellings(draw: st.DrawFn) -> str:
    """``password`` or ``sslpassword``, each letter maybe percent-encoded (either case of hex)."""
    name = draw(st.sampled_from(["password", "sslpassword"]))
    out = []
    for char in name:
        how = draw(st.sampled_from(["raw", "{:02X}", "{:02x}"]))  # kept, or either case of hex
        out.append(char if how == "raw" else "%" + how.format(ord(char)))
    return "".join(out)


def _url(key: str, host: str = "127.0.0.1", port: int | str = 1, db: str = "db") -> str:
    return f"postgresql://postgres@{host}:{port}/{db}?sslmode=disable&{key}={CORE}"


@given(key=spellings())
@settings(max_examples=60, deadline=None)
def test_an_encoded_password_key_is_masked(key: str) -> None:
    dsn = _url(key)
    assert CORE not in redacted(dsn)
    assert CORE not in scrub(f'driver says: "{dsn}" and "{CORE}"', dsn)


@pytest.mark.parametrize("key", ["pass%77ord", "%70assword", "%73slpassword", "PASSWORD", "Pass%57ord"])
def test_no_command_shows_an_encoded_password_key(
    key: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    dsn = _url(key)
    for cli in (["audit", dsn], ["graph", "--checkpoint", dsn], ["queue", "--queue", dsn, "list"]):
        caplog.clear()
        main(cli)
        out, err = capsys.readouterr()
        assert CORE not in out + err + caplog.text, (cli, out + err)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, str, str]]:
    with fresh_postgres() as dsn:
        import psycopg

        with psycopg.connect(dsn) as conn:
            info = conn.info
            yield info.host, str(info.port), info.dbname


def test_libpq_takes_an_encoded_key_as_the_password(server: tuple[str, str, str]) -> None:
    """Why the masking matters: the real driver really sends it (trust auth lets it connect)."""
    import psycopg

    host, port, db = server
    with psycopg.connect(_url("pass%77ord", host, port, db)) as conn:
        assert conn.pgconn.password == CORE.encode()


def test_the_real_server_listing_never_shows_an_encoded_password_key(
    server: tuple[str, str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    host, port, db = server
    dsn = _url("%70assword", host, port, db)
    for cli in (["audit", dsn], ["queue", "--queue", dsn, "list"]):
        main(cli)
        out, err = capsys.readouterr()
        assert CORE not in out + err, (cli, out + err)


def test_a_dsn_given_as_bytes_is_refused_without_quoting_it() -> None:
    from ekit_runtime.queue import PostgresQueue
    from ekit_runtime.stores import PostgresStore

    dsn = f"postgresql://u:{CORE}@127.0.0.1:1/db".encode()
    for make in (lambda: PostgresStore(dsn, run_id="r"), lambda: PostgresQueue(dsn)):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="bytes") as caught:
            make()
        assert CORE not in str(caught.value)


@pytest.mark.parametrize(
    "url", [b"postgresql://u:SECRETBYTES@127.0.0.1:1/db", bytearray(b"host=x password=SECRETBYTES")]
)
def test_a_queue_url_that_is_not_a_string_is_refused_without_its_text(url: object) -> None:
    from ekit_runtime.queue import open_queue

    with pytest.raises(ValueError, match="must be a non-empty string") as caught:
        open_queue(url)  # type: ignore[arg-type]
    assert "SECRETBYTES" not in str(caught.value)

"""No password of a database URL or DSN is ever printed, logged or left in an exception's text.

Drivers that cannot parse a URL quote it back (``invalid percent-encoded
token: "pa%zzSECRET"``), and libpq reads a password holding a raw ``/`` or
``@`` as part of a host name, which it then names in its error. Every
command that takes a DSN (``ekit audit``, ``rewind``, ``graph``, ``queue``,
``worker``) is run through the real entry point over generated passwords
(``%``, ``@``, ``:``, ``/``, brackets, quotes, spaces, non-ASCII) and URL
shapes, against an unreachable server and against the real one (trust
authentication: any password connects, so the commands go on to their
success paths and print labels, listings and results, where a password
must not show either). The password's distinctive core must appear in no
stdout, stderr or log line.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ekit_runtime import Step, Workflow
from ekit_runtime.cli import main
from ekit_runtime.redaction import WITHHELD, redacted, scrub
from tests.support.queue_backends import fresh_postgres

ROOT = Path(__file__).resolve().parents[2]
CORE = "Zq7SECRETx"  # not hex, so no "%" before or after it can decode into it
WORKFLOWS = {"flow": Workflow([Step("a", lambda ctx: "A")])}

_special = st.sampled_from([*"%@:/[]'\" \\?#&=+é€\U0001f600", "%41", "%zz", "%"])
_piece = st.lists(_special | st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=4)
passwords = st.builds(lambda a, b: "".join(a) + CORE + "".join(b), _piece, _piece)


def _quoted(password: str) -> str:
    return password.replace("\\", "\\\\").replace("'", "\\'")


SHAPES = {
    "raw-url": lambda pw, host, port, db: f"postgresql://postgres:{pw}@{host}:{port}/{db}",
    "encoded-url": lambda pw, host, port, db:
        f"postgresql://postgres:{quote(pw, safe='')}@{host}:{port}/{db}",
    "query": lambda pw, host, port, db: f"postgres://{host}:{port}/{db}?user=postgres&password={quote(pw)}",
    "raw-query": lambda pw, host, port, db: f"postgresql://{host}:{port}/{db}?password={pw}",
    "broken-ipv6": lambda pw, host, port, db: f"postgresql://postgres:{pw}@[::1/{db}",
    "keyword-quoted": lambda pw, host, port, db:
        f"host={host} port={port} user=postgres dbname={db} password='{_quoted(pw)}'",
    "keyword-raw": lambda pw, host, port, db:
        f"host={host} port={port} user=postgres password={pw} dbname={db}",
}


def _commands(dsn: str) -> list[list[str]]:
    return [
        ["audit", dsn],
        ["audit", dsn, "--run-id", "nope"],
        ["rewind", dsn, "--run-id", "nope", "--step", "a", "--graph-from-checkpoint"],
        ["graph", "--checkpoint", dsn],
        ["queue", "--queue", dsn, "list"],
        ["queue", "--queue", dsn, "submit", "flow", "--run-id", "r1"],
        ["worker", "--queue", dsn, "--workflows", "tests.stores.test_dsn_passwords:WORKFLOWS", "--until-idle",
         "--lease", "5"],
    ]


def _assert_never_shown(
    dsn: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    for cli in _commands(dsn):
        caplog.clear()
        main(cli)
        out, err = capsys.readouterr()
        shown = out + err + caplog.text
        assert CORE not in shown, (cli, shown)


@given(password=passwords, shape=st.sampled_from(sorted(SHAPES)))
@settings(max_examples=150, deadline=None)
def test_redacted_and_scrub_never_keep_the_password(password: str, shape: str) -> None:
    dsn = SHAPES[shape](password, "127.0.0.1", 1, "db")
    assert CORE not in redacted(dsn)
    # What a driver may quote back: the DSN itself, the password as written.
    for said in (f"invalid token: \"{dsn}\"", f"bad: {password}", f"host '{password}'"):
        assert CORE not in scrub(said, dsn)


@pytest.mark.parametrize(
    ("dsn", "withheld"),
    [
        ("postgresql://u:pa%zzSECRET@host/db", False),
        ("postgresql://u:SECRET@[::1/db", False),
        ("postgresql://u:pa/ssSECRET@host/db", True),
        ("postgresql://u:p@ssSECRET@host/db", True),
        ("host=x password='se cretSECRET", True),
        ("host=x password=se cretSECRET", True),
    ],
)
def test_what_the_driver_says_is_scrubbed_or_withheld(dsn: str, withheld: bool) -> None:
    from ekit_runtime.stores.pg import connect, psycopg

    with pytest.raises(psycopg.Error) as caught:
        connect(dsn)
    text = str(caught.value)
    assert "SECRET" not in text and "cret" not in text
    assert (text == WITHHELD) is withheld
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


@pytest.fixture(autouse=True)
def _log_everything(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield


@pytest.mark.timeout(120)
@given(password=passwords, shape=st.sampled_from(sorted(SHAPES)))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_command_shows_the_password_of_an_unreachable_server(
    password: str, shape: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    _assert_never_shown(SHAPES[shape](password, "127.0.0.1", 1, "db"), capsys, caplog)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int, str]]:
    from psycopg.conninfo import conninfo_to_dict

    with fresh_postgres() as url:
        params = conninfo_to_dict(url)
        yield str(params["host"]), int(params["port"]), str(params["dbname"])


@pytest.mark.timeout(180)
@given(password=passwords, shape=st.sampled_from(sorted(SHAPES)))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_command_shows_the_password_on_the_real_server(
    password: str, shape: str, server: tuple[str, int, str],
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
) -> None:
    _assert_never_shown(SHAPES[shape](password, *server), capsys, caplog)


def test_the_real_server_is_reached_through_a_url_with_a_password(
    server: tuple[str, int, str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Trust authentication ignores the password: the commands get past the
    # connection and print their listings, which must name the URL redacted.
    dsn = SHAPES["encoded-url"](f"a/b@{CORE}", *server)
    assert main(["queue", "--queue", dsn, "submit", "flow", "--run-id", "listed"]) == 0
    assert main(["audit", dsn]) == 2
    out, err = capsys.readouterr()
    assert "listed" in out and "postgres:***@" in err and CORE not in out + err + caplog.text


@pytest.mark.parametrize(
    "cli",
    [
        ["audit", "postgresql://u:pa%zzSECRET@127.0.0.1:1/db"],
        ["worker", "--queue", "postgresql://u:SECRET@[::1/db",
         "--workflows", "tests.stores.test_dsn_passwords:WORKFLOWS", "--until-idle"],
        ["queue", "--queue", "postgresql://u:p@ssSECRET@127.0.0.1:1/db", "list"],
    ],
)
def test_a_real_process_prints_one_clean_line_without_the_password(cli: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "ekit_runtime", *cli], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "SECRET" not in done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "internal error" not in done.stderr, done.stderr
    assert done.stderr.startswith("ekit: ")


@pytest.mark.parametrize("dsn", [f"postgresql://u:{CORE}@h/db", f"postgresql://u:a/b{CORE}@h/db",
                                 f"host=h password='{CORE}'"])
def test_log_lines_made_while_a_command_runs_are_scrubbed(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    from ekit_runtime.redaction import Redactor

    before = logging.getLogRecordFactory()
    with Redactor.of(["worker", "--queue", dsn]).scrubbing_logs():
        try:
            raise RuntimeError(f"the driver said: host 'b{CORE}' ({dsn})")
        except RuntimeError:
            logging.getLogger("ekit_runtime.queue.worker").exception("renewal failed for %s", dsn)
    logging.getLogger("after").warning("plain %s", "text")
    assert "renewal failed for" in caplog.text and "plain text" in caplog.text
    assert CORE not in caplog.text
    assert logging.getLogRecordFactory() is before


@pytest.fixture
def no_access_url(server: tuple[str, int, str]) -> Iterator[str]:
    """A URL, with a password, for a role that may not read the queue's tables the database holds."""
    import uuid

    import psycopg

    from ekit_runtime.queue import open_queue

    host, port, db = server
    role = f"ekit_noaccess_{uuid.uuid4().hex[:8]}"
    admin = f"host={host} port={port} user=postgres dbname={db}"
    open_queue(admin).close()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        yield f"postgresql://{role}:{quote(CORE)}@{host}:{port}/{db}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


def test_a_driver_error_is_one_clean_line_naming_the_database(
    no_access_url: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # The server refuses the query itself (psycopg's InsufficientPrivilege),
    # after the connection succeeded: no layer below the command names it.
    for cli in (["queue", "--queue", no_access_url, "list"],
                ["worker", "--queue", no_access_url,
                 "--workflows", "tests.stores.test_dsn_passwords:WORKFLOWS", "--until-idle"],
                ["audit", no_access_url]):
        assert main(cli) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "internal error" not in err, err
        assert "InsufficientPrivilege: permission denied for table ekit_queue_" in err
        assert ":***@" in err and CORE not in out + err + caplog.text


def test_options_written_with_an_equals_sign_and_ssl_passphrases_are_masked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"postgresql://u:{CORE}@127.0.0.1:1/db?sslpassword=K3y{CORE}"
    assert redacted(url) == "postgresql://u:***@127.0.0.1:1/db?sslpassword=***"
    assert redacted(f"host=h sslpassword='{CORE}' password={CORE}") == "host=h sslpassword='***' password=***"
    assert main(["queue", f"--queue={url}", "list"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and CORE not in out + err

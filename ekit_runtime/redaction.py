"""Keeping a database connection string's password out of every message, log line and exception text.

A DSN is a URL (``postgresql://user:PASSWORD@host/db?password=...``) or a
libpq key=value string (``host=h password='PASSWORD'``); ``sslpassword`` is
a secret too. The API:

- :func:`redacted` is the DSN fit for a message: every password shown as ``***``.
- :func:`scrub` takes any other text that may quote the DSN (a driver's error
  message, a log line) and removes the password from it, as written and
  percent-decoded or unescaped; it returns :data:`WITHHELD` instead when it
  cannot make the text safe.
- :class:`Redactor` is the command line's second guard: it holds the
  passwords of every DSN among the arguments, masks them in whatever the
  command prints and in every log record made while the command runs.
- :func:`is_keyword_dsn` tells a key=value string from a file name.

Neither trusts the URL to parse: the password is found by hand, between the
``://``, the first ``:`` after it and the last ``@``, because the drivers
that fail to parse a URL are precisely the ones that quote it back
(``invalid percent-encoded token: "pa%zzSECRET"``). Where the password ends
cannot always be told: a raw ``/``, ``?``, ``#`` or second ``@`` before the
last ``@`` (libpq and urllib then disagree, and libpq may quote a piece of
the password as a host name), a raw ``&`` or ``#`` in a ``?password=`` (the
rest may be a parameter libpq names in its error), an unterminated quote, a
backslash or a key libpq does not know in a key=value string (``password=a
b=c``). Then :func:`scrub` withholds the text altogether rather than risk it.
Every occurrence of every form of a password is masked, so a password as
short as a common word masks that word wherever it appears: safe, if ugly.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

__all__ = [
    "LIBPQ_KEYWORDS", "WITHHELD", "Redactor", "Secrets", "is_keyword_dsn", "redacted", "scrub", "secrets_of",
]

WITHHELD = (
    "<message withheld: it may hold the password, and this connection string does not show "
    "where the password ends; percent-encode '/', '?', '#', '@' and ':' in a URL's password, "
    "quote a key=value password>"
)
"""What :func:`scrub` returns in place of a text it cannot make safe."""

LIBPQ_KEYWORDS = frozenset(
    {
        *("host", "hostaddr", "port", "dbname", "user", "password", "passfile", "require_auth"),
        *("channel_binding", "connect_timeout", "client_encoding", "options", "application_name"),
        *("fallback_application_name", "keepalives", "keepalives_idle", "keepalives_interval"),
        *("keepalives_count", "tcp_user_timeout", "replication", "gssencmode", "sslmode", "requiressl"),
        *("sslnegotiation", "sslcompression", "sslcert", "sslkey", "sslkeylogfile", "sslpassword"),
        *("sslcertmode", "sslrootcert", "sslcrl", "sslcrldir", "sslsni", "requirepeer"),
        *("ssl_min_protocol_version", "ssl_max_protocol_version", "krbsrvname", "gsslib"),
        *("gssdelegation", "service", "target_session_attrs", "load_balance_hosts"),
    }
)
"""libpq's connection keywords (PostgreSQL 17): any other key makes libpq refuse a key=value string."""

_MASK = "***"
# Short pieces of an ambiguous password are not scrubbed from log lines: they
# would mangle every line, and log lines are scrubbed only as a second guard.
_MIN_FRAGMENT = 4
# libpq's two secret parameters: the password, and the SSL client key's passphrase.
_SECRET_KEYS = frozenset({"password", "sslpassword"})
# Every "?key=value" and "&key=value", overlapping (a raw "?" may start another
# key inside a value): libpq percent-decodes a query key, so "pass%77ord" is
# the password too. Keys are compared without case, erring towards masking.
_QUERY_PARAMETER = re.compile(r"(?=[?&]([^&#=]*)=([^&#]*))")
_PASSWORD_KEY = re.compile(r"(?<![\w.-])(?:ssl)?password\s*=", re.IGNORECASE)
_OPTION = re.compile(r"--[\w-]+=")
_KEYWORD_START = re.compile(r"\s*([A-Za-z_]+)\s*=")


@dataclass(frozen=True, slots=True)
class Secrets:
    """Where a DSN's passwords are: the text spans to mask, every form to scrub, and whether that is all.

    ``spans`` are ``(start, end)`` in the DSN; ``forms`` the password as
    written and decoded; ``certain`` is false when where a password ends
    cannot be told, and then ``fragments`` are the pieces it may be cut into.
    """

    spans: tuple[tuple[int, int], ...]
    forms: tuple[str, ...]
    certain: bool
    fragments: tuple[str, ...] = ()

    def scrub(self, text: str, *, withhold: bool = True) -> str:
        """``text`` without the passwords; :data:`WITHHELD` when uncertain and ``withhold``.

        With ``withhold=False`` the fragments of an uncertain password are
        masked as well, and the rest of the text kept (for log lines).
        """
        if not self.certain and withhold:
            return WITHHELD
        forms = self.forms if self.certain else self.forms + self.fragments
        return _mask(text, [_occurrences(text, form) for form in set(forms) if form])


def secrets_of(dsn: str) -> Secrets:
    """The passwords in ``dsn`` (a URL if it holds ``://``, else a libpq key=value string)."""
    if "://" in dsn:
        return _url_secrets(dsn)
    if _PASSWORD_KEY.search(dsn):
        return _keyword_secrets(dsn)
    return Secrets((), (), True)


def is_keyword_dsn(text: str) -> bool:
    """Whether ``text`` is a libpq key=value string: it starts with a libpq keyword and ``=``."""
    match = _KEYWORD_START.match(text)
    return match is not None and match.group(1) in LIBPQ_KEYWORDS


def redacted(dsn: str) -> str:
    """``dsn`` with every password (``user:PASSWORD@``, ``?password=``, ``password=``) shown as ``***``.

    Works on text no parser accepts: the password is found by hand (see
    the module docstring). A DSN without a password is returned as it is.
    """
    return _mask(dsn, [list(secrets_of(dsn).spans)])


def _occurrences(text: str, form: str) -> list[tuple[int, int]]:
    found, at = [], text.find(form)
    while at >= 0:
        found.append((at, at + len(form)))
        at = text.find(form, at + 1)
    return found


def _mask(text: str, spans: list[list[tuple[int, int]]]) -> str:
    """``text`` with each span shown as ``***``; overlapping spans (two forms of one password) as one."""
    out, last = [], 0
    for start, end in sorted(span for group in spans for span in group):
        if start < last:
            last = max(last, end)
            continue
        out.append(text[last:start])
        out.append(_MASK)
        last = end
    out.append(text[last:])
    return "".join(out)


def scrub(text: str, dsn: str) -> str:
    """``text`` (a driver's message, a log line) without ``dsn``'s password, in any form it was given.

    Removes the password as written and decoded (``%41`` read as ``A``, a
    key=value string's quotes and backslashes undone). When ``dsn`` does not
    show where its password ends, returns :data:`WITHHELD` instead: the
    driver may quote any piece of it.
    """
    return secrets_of(dsn).scrub(text)


def _decoded(raw: str) -> tuple[str, ...]:
    # The two ways a driver may have read the percent-escapes.
    return (raw, unquote(raw, errors="replace"), unquote(raw, encoding="latin-1"))


def _url_secrets(dsn: str) -> Secrets:
    start = dsn.index("://") + 3
    at = dsn.rfind("@", start)
    spans: list[tuple[int, int]] = []
    forms: list[str] = []
    fragments: list[str] = []
    certain = True
    if at >= 0:
        userinfo = dsn[start:at]
        colon = userinfo.find(":")
        if any(c in userinfo for c in "/?#@"):
            # libpq ends the userinfo at the first "@" (or "/"), urllib at the
            # last "@" before the first "/", "?" or "#": the password's end is
            # a guess, and a driver may quote a piece of it as a host name.
            certain = False
            region = userinfo[colon + 1:] if colon >= 0 else userinfo
            fragments.extend(p for p in re.split(r"[/?#@:]", region) if len(p) >= _MIN_FRAGMENT)
        if colon >= 0 and at > start + colon + 1:
            spans.append((start + colon + 1, at))
            forms.extend(_decoded(dsn[start + colon + 1:at]))
    for match in _QUERY_PARAMETER.finditer(dsn, start):
        if not _is_secret_key(match.group(1)):
            continue
        end = match.end(2)
        rest = dsn[end:]
        if rest.startswith("#") or any(_not_a_parameter(p) for p in rest.split("&")[1:]):
            # A raw "#" or "&" in the password: the end of the URL may all be
            # it, and libpq names a parameter it does not know in its error.
            certain = False
            end = len(dsn)
            fragments.extend(p for p in re.split(r"[&#=]", rest) if len(p) >= _MIN_FRAGMENT)
        if end > match.start(2):
            spans.append((match.start(2), end))
            forms.extend(_decoded(dsn[match.start(2):end]))
    return Secrets(tuple(spans), tuple(forms), certain, tuple(fragments))


def _is_secret_key(key: str) -> bool:
    return any(form.lower() in _SECRET_KEYS for form in _decoded(key))


def _not_a_parameter(text: str) -> bool:
    key, sep, _ = text.partition("=")
    return not sep or unquote(key) not in LIBPQ_KEYWORDS


def _keyword_secrets(dsn: str) -> Secrets:
    """The ``password`` values of a libpq key=value string, tokenised as libpq does."""
    spans: list[tuple[int, int]] = []
    forms: list[str] = []
    pos, n = 0, len(dsn)
    while True:
        while pos < n and dsn[pos].isspace():
            pos += 1
        if pos >= n:
            return Secrets(tuple(spans), tuple(forms), True)
        key_start = pos
        while pos < n and not dsn[pos].isspace() and dsn[pos] != "=":
            pos += 1
        key = dsn[key_start:pos]
        while pos < n and dsn[pos].isspace():
            pos += 1
        if pos >= n or dsn[pos] != "=":
            return _unclear(dsn, spans, forms)
        pos += 1
        while pos < n and dsn[pos].isspace():
            pos += 1
        value = _keyword_value(dsn, pos)
        if value is None:
            return _unclear(dsn, spans, forms)
        span, text, pos = value
        if key not in LIBPQ_KEYWORDS:
            # libpq refuses the string, naming the key: it may be a piece of
            # a password written with a raw space ("password=a b=c").
            return _unclear(dsn, spans, forms)
        if key in _SECRET_KEYS and span[1] > span[0]:
            spans.append(span)
            forms.extend({dsn[span[0]:span[1]], text})


def _keyword_value(dsn: str, pos: int) -> tuple[tuple[int, int], str, int] | None:
    """The value at ``pos``: its span (inside any quotes), its unescaped text, where it ends."""
    n = len(dsn)
    quoted = pos < n and dsn[pos] == "'"
    start = pos + 1 if quoted else pos
    pos = start
    chars: list[str] = []
    while pos < n:
        c = dsn[pos]
        if quoted and c == "'":
            return (start, pos), "".join(chars), pos + 1
        if not quoted and c.isspace():
            break
        if c == "\\" and not quoted:
            return None  # an escape in a bare value: where the user meant it to end is a guess
        if c == "\\" and pos + 1 < n:
            pos += 1
            c = dsn[pos]
        chars.append(c)
        pos += 1
    if quoted:
        return None  # an unterminated quote: libpq refuses the string
    return (start, pos), "".join(chars), pos


def _unclear(dsn: str, spans: list[tuple[int, int]], forms: list[str]) -> Secrets:
    """A key=value string libpq would refuse: everything after a ``password`` keyword may be it."""
    for match in re.finditer(r"password\s*=\s*", dsn, re.IGNORECASE):
        end = match.end()
        spans.append((end, len(dsn)))
        tail = dsn[end:]
        forms.append(tail)
        forms.extend(p for p in re.split(r"[\s'\\]+", tail) if len(p) >= _MIN_FRAGMENT)
    return Secrets(tuple(spans), tuple(forms), False)


class Redactor:
    """Every password among some strings (a command line's arguments), kept out of texts and log lines.

    Built with :meth:`of`; :meth:`scrub` masks them in a text, and
    :meth:`scrubbing_logs` masks them in every log record made while it is active,
    whichever logger or handler the record goes to.
    """

    def __init__(self, secrets: list[Secrets], labels: list[str]) -> None:
        self.secrets = tuple(s for s in secrets if s.forms or s.fragments or not s.certain)
        self.labels = tuple(labels)

    @classmethod
    def of(cls, strings: list[str]) -> Redactor:
        """The passwords of every string that looks like a DSN (holds ``://`` or ``password=``).

        A command-line option written ``--name=VALUE`` counts as its ``VALUE``.
        """
        values = [s.split("=", 1)[1] if _OPTION.match(s) else s for s in strings]
        dsns = [s for s in values if "://" in s or _PASSWORD_KEY.search(s)]
        return cls([secrets_of(s) for s in dsns], [redacted(s) for s in dsns])

    def scrub(self, text: str, *, withhold: bool = False) -> str:
        """``text`` without any of the passwords (see :meth:`Secrets.scrub` for ``withhold``)."""
        for found in self.secrets:
            text = found.scrub(text, withhold=withhold)
        return text

    @contextlib.contextmanager
    def scrubbing_logs(self) -> Iterator[None]:
        """While active, every log record's message, traceback and stack are scrubbed as it is made."""
        if not self.secrets:
            yield
            return
        previous = logging.getLogRecordFactory()

        def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
            record = previous(*args, **kwargs)
            self._scrub_record(record)
            return record

        logging.setLogRecordFactory(factory)
        try:
            yield
        finally:
            logging.setLogRecordFactory(previous)

    def _scrub_record(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a message that does not format: logging reports it, unscrubbed args aside
            message = str(record.msg)
        record.msg, record.args = self.scrub(message), None
        if record.exc_info and record.exc_info[1] is not None:
            # Formatted now, so the handler's formatter uses this text (exc_text) as it is.
            record.exc_text = self.scrub(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = self.scrub(record.stack_info)

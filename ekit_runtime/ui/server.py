"""The dashboard's HTTP server: stdlib ``ThreadingHTTPServer``, no dependency, nothing remote.

Routes (GET): ``/`` the runs page (``?status=&workflow=&page=N``),
``/api/runs`` the same as JSON, ``/run/<id>`` a run's page, ``/api/run/<id>``
its JSON, ``/run/<id>/output/<name>`` one of its outputs whole (JSON, as
``text/plain``), ``/api/run/<id>/stream`` a queued run's live stream as
server-sent events (from ``?after=N`` or the ``Last-Event-ID`` a
reconnecting ``EventSource`` sends: see :mod:`ekit_runtime.queue.streams`),
``/static/app.js`` and ``/static/app.css``. With actions allowed,
POST ``/run/<id>/cancel``, ``retry``, ``answer``, ``approve`` and ``deny``
act on the queue; each must carry the process's random token in the form's
``token`` field *and* in the ``ekit_ui_<port>`` cookie (``SameSite=Strict``, set by
every page served, never by a refusal), and an ``Origin`` header, when sent, must
be this server's own (scheme, host and port): anything else is refused with 403.
Read-only, every POST is a 405. Bound to a loopback address, a request whose
``Host`` is not a literal loopback address or ``localhost`` at its port is a 403;
bound to another, one whose ``Host`` is not a literal IP address or ``localhost``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import secrets
import sys
import time
from collections.abc import Callable
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from ekit_runtime.queue import STATUSES, QueueUnavailableError, RunQueue
from ekit_runtime.queue.records import check_workflow_name
from ekit_runtime.sources import SourceError
from ekit_runtime.ui import fleet, pages
from ekit_runtime.ui.outputs import output_json
from ekit_runtime.ui.sources import QueueSource, Source
from ekit_runtime.ui.static import APP_CSS, APP_JS

__all__ = ["Dashboard", "make_server", "serve"]

_LOOPBACK_NAMES = frozenset({"localhost", "[::1]"})
_DOTTED_QUAD = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "form-action 'self'; frame-ancestors 'none'")
_VERBS = ("cancel", "retry", "answer", "approve", "deny")
_MAX_FORM = 64 * 1024
# A stream's response ends after this many seconds (the browser's EventSource
# reconnects from its last event at once), so that a tab left open does not
# hold a server thread forever; a comment line every _KEEPALIVE seconds shows
# a proxy that the response is alive.
_STREAM_SECONDS = 300.0
_KEEPALIVE = 15.0
_STREAM_POLL = 0.1


class _Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Dashboard(ThreadingHTTPServer):
    """The server: ``source`` is what it shows, ``token`` guards its actions (``None``: read-only)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], source: Source, *, allow_actions: bool = False) -> None:
        super().__init__(address, _Handler)
        self.source = source
        self.token: str | None = secrets.token_urlsafe(32) if allow_actions and source.can_act else None
        # One cookie per port: browsers share cookies between the ports of a host.
        self.cookie = f"ekit_ui_{self.server_address[1]}"
        self.stream_seconds = _STREAM_SECONDS
        """How long one response of ``/api/run/<id>/stream`` lasts before the client reconnects."""

    def host_allowed(self, header: str | None) -> bool:
        """Whether a request's ``Host`` header names this server.

        Bound to a loopback address, only a literal loopback address (an IPv4
        address in 127.0.0.0/8, ``[::1]``) or ``localhost``, at this server's
        port, is: a site whose own name was re-pointed at 127.0.0.1 (DNS
        rebinding) is refused, however much its name looks like an address
        (``127.attacker.example``). Bound to another address (``0.0.0.0``
        listens on 127.0.0.1 too), any literal IP address or ``localhost`` at
        its port is: still no name, which its owner could re-point.
        """
        loopback = _is_loopback(str(self.server_address[0]))
        return header is not None and _own_netloc(header.strip(), self.server_address[1], loopback)

    def origin_allowed(self, origin: str | None, host: str | None) -> bool:
        """Whether an action's ``Origin`` header (``None``: not sent) is this server's own.

        Its scheme must be ``http`` and its host and port those the request
        was sent to (``Host``): a page of another port of the same address is
        another site. A browser always sends ``Origin`` with a form's POST;
        other clients need not (the token and the cookie still guard them).
        """
        if origin is None:
            return True
        parts = _netloc_of_origin(origin)
        return parts is not None and host is not None and parts == _split_netloc(host.strip().lower())

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``."""
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"


def make_server(source: Source, host: str = "127.0.0.1", port: int = 0, *,
                allow_actions: bool = False) -> Dashboard:
    """A :class:`Dashboard` bound to ``host:port`` (0: any free port); call ``serve_forever()``.

    A ``port`` that is not a whole number from 0 to 65535 is a ``ValueError``
    naming it (the socket would raise ``OverflowError``, or take ``True`` as port 1).
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be a whole number from 0 to 65535, got {port!r:.80}")
    return Dashboard((host, port), source, allow_actions=allow_actions)


class _Handler(BaseHTTPRequestHandler):
    server: Dashboard
    server_version = "ekit-ui"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- answering ---------------------------------------------------------------

    def _send(self, code: int, body: str, ctype: str = "text/html; charset=utf-8",
              extra: dict[str, str] | None = None) -> None:
        data = body.encode("utf-8", "backslashreplace")
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        # Not "no-referrer": under it Chromium sends "Origin: null" with the
        # page's own form posts, and _check refuses every action.
        self.send_header("Referrer-Policy", "same-origin")
        self.send_header("X-Frame-Options", "DENY")
        self.send_header("Cache-Control", "no-store")
        token = self.server.token
        # Only with a page served: a refusal (a foreign Host, a forged form) or an error hands out nothing.
        if token is not None and code == 200 and ctype.startswith("text/html"):
            self.send_header("Set-Cookie", f"{self.server.cookie}={token}; Path=/; HttpOnly; SameSite=Strict")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _json(self, data: Any, code: int = 200) -> None:
        self._send(code, json.dumps(_encodable(data)), "application/json")

    def _error(self, code: int, message: str, as_json: bool = False) -> None:
        if as_json:
            self._json({"error": message}, code)
        else:
            self._send(code, pages.error_page(self.server.source.label, code, message))

    def _guard(self, body: Callable[[], None], as_json: bool = False) -> None:
        try:
            body()
        except _Refused as exc:
            self._error(exc.code, str(exc), as_json)
        except (SourceError, QueueUnavailableError) as exc:  # a file gone, a database down
            self._error(503, str(exc), as_json)
        except Exception as exc:  # never a traceback on the page
            print(f"ekit ui: {type(exc).__name__} answering {self.command}", file=sys.stderr)
            self._error(500, f"internal error: {type(exc).__name__}", as_json)

    # -- GET -----------------------------------------------------------------------

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = url.path
        as_json = path.startswith("/api/")
        self._guard(lambda: self._get(path, parse_qs(url.query, keep_blank_values=True)), as_json)

    def _host_checked(self) -> None:
        if len(self.headers.get_all("Host") or ()) > 1:  # RFC 9112 3.2: a proxy may route by the other
            raise _Refused(400, "refused: the request has more than one Host header")
        if not self.server.host_allowed(self.headers.get("Host")):
            raise _Refused(403, "refused: the request names another host (open the address ekit ui printed)")

    def _get(self, path: str, query: dict[str, list[str]]) -> None:
        self._host_checked()
        if path == "/static/app.js":
            self._send(200, APP_JS, "text/javascript; charset=utf-8")
        elif path == "/static/app.css":
            self._send(200, APP_CSS, "text/css; charset=utf-8")
        elif path in ("/", "/api/runs"):
            self._runs(query, as_json=path == "/api/runs")
        elif path.startswith("/run/") or path.startswith("/api/run/"):
            as_json = path.startswith("/api/")
            rest = path.removeprefix("/api" if as_json else "").removeprefix("/run/")
            run_id, slash, more = rest.partition("/")
            if slash and not as_json and more.startswith("output/") and "/" not in more[7:]:
                self._output(unquote(run_id), unquote(more[7:]))
                return
            if slash and as_json and more == "stream":
                self._stream(unquote(run_id), query)
                return
            if slash:
                raise _Refused(404, "no such page")
            self._run(unquote(rest), as_json)
        elif path == "/favicon.ico":
            self._send(204, "", "image/x-icon")
        else:
            raise _Refused(404, f"no page {path}")

    def _runs(self, query: dict[str, list[str]], as_json: bool) -> None:
        status = _one(query, "status")
        workflow = _one(query, "workflow")
        if status and status not in STATUSES and not (status == "incomplete"):
            raise _Refused(400, f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        raw_page = _one(query, "page") or "1"
        # The length first: int() refuses more than 4,300 digits with a ValueError of its own.
        if len(raw_page) > 9 or not (raw_page.isascii() and raw_page.isdigit()) or int(raw_page) < 1:
            raise _Refused(400, f"page must be a whole number from 1, got {raw_page!r:.80}")
        page = int(raw_page)
        if workflow:
            try:
                check_workflow_name(workflow)
            except ValueError as exc:
                raise _Refused(400, str(exc)) from None
        source = self.server.source
        token = self.server.token
        # One reading: the table, its count and links, the waiting runs and the chart.
        reading = source.overview(status, workflow, pages.PAGE_SIZE, (page - 1) * pages.PAGE_SIZE)
        shown, total = reading.shown, reading.total
        if as_json:
            n_pages = max(1, -(-total // pages.PAGE_SIZE))
            parts = fleet.runs_parts(reading, None if token is None else "", source.can_act)
            self._json({
                "total": total, "page": page, "pages": n_pages, "page_size": pages.PAGE_SIZE,
                "summary": pages.runs_summary(total, page, n_pages),
                "runs": [_run_dict(r) for r in shown],
                "tbody": pages.runs_tbody(shown),
                "nav": pages.runs_nav(page, n_pages, status, workflow),
                "waiting_total": reading.waiting_total,
                "parts": parts,
                "versions": pages.part_versions(parts, None),
            })
        else:
            parts = fleet.runs_parts(reading, token, source.can_act)
            self._send(200, pages.runs_page(source.label, shown, total, page, status,
                                            workflow, STATUSES, source.workflows(), parts, token))

    def _run(self, run_id: str, as_json: bool) -> None:
        view = self.server.source.view(run_id)
        if view is None:
            raise _Refused(404, f"no run {run_id!r}")
        if as_json:
            self._json(pages.run_json(view, can_act=self.server.token is not None))
        else:
            self._send(200, pages.run_page(self.server.source.label, view, self.server.token))

    def _output(self, run_id: str, name: str) -> None:
        """One output of the run's latest checkpoint, whole, as JSON text (never as a page)."""
        view = self.server.source.view(run_id)
        if view is None:
            raise _Refused(404, f"no run {run_id!r}")
        cp = view.checkpoint
        if cp is None or name not in cp.outputs:
            raise _Refused(404, f"run {run_id!r} records no output {name!r}")
        self._send(200, output_json(cp.outputs[name]) + "\n", "text/plain; charset=utf-8")

    def _stream(self, run_id: str, query: dict[str, list[str]]) -> None:
        """A queued run's stream as server-sent events, until the run ends (or ``stream_seconds``).

        Each event is ``id: OFFSET``, ``event: KIND`` and ``data:`` its JSON
        (:meth:`StreamEvent.to_dict`), so that an ``EventSource`` that
        reconnects sends the offset of the last event it got as
        ``Last-Event-ID`` and resumes after it: no gap, no repeat. Refusals
        (no such run, a bad offset) are plain HTTP errors, before any event.
        """
        source = self.server.source
        if not isinstance(source, QueueSource):
            raise _Refused(404, "only a queue's runs have a live stream (this dashboard shows a file)")
        after = _stream_offset(self.headers.get_all("Last-Event-ID") or [], query.get("after") or [])

        def read(after: int) -> Any:
            return source.act(lambda q: q.read_stream(run_id, after))

        try:
            page = read(after)
        except LookupError:
            raise _Refused(404, f"no run {run_id!r}") from None
        except ValueError as exc:
            raise _Refused(400, str(exc)) from None
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Security-Policy", _CSP)
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD":
            return
        until = time.monotonic() + self.server.stream_seconds
        quiet_since = time.monotonic()
        nap = _STREAM_POLL
        try:
            self.wfile.write(b"retry: 500\n\n")  # (a reconnect after a dropped response, in half a second)
            while True:
                if page.events:
                    self.wfile.write("".join(_sse(e) for e in page.events).encode("utf-8"))
                    self.wfile.flush()
                    quiet_since, nap = time.monotonic(), _STREAM_POLL
                if page.ended or time.monotonic() >= until:
                    return
                if time.monotonic() - quiet_since >= _KEEPALIVE:
                    self.wfile.write(b": still here\n\n")
                    self.wfile.flush()
                    quiet_since = time.monotonic()
                time.sleep(nap)
                nap = min(nap * 2, 5 * _STREAM_POLL)
                page = read(page.next_after)
        except (BrokenPipeError, ConnectionResetError):
            return  # the browser went away (it reconnects with Last-Event-ID if it wants more)
        except (LookupError, SourceError, QueueUnavailableError):
            return  # pruned, or the database went away: the client's reconnect is told why

    # -- POST ----------------------------------------------------------------------

    def do_POST(self) -> None:
        self._guard(self._post)

    def _post(self) -> None:
        self._host_checked()
        token = self.server.token
        source = self.server.source
        if token is None or not isinstance(source, QueueSource):
            self._drain()
            raise _Refused(405, "this dashboard is read-only (start it with --allow-actions to act)")
        path = urlsplit(self.path).path
        parts = path.split("/")
        if len(parts) != 4 or parts[:2] != ["", "run"] or parts[3] not in _VERBS:
            self._drain()
            raise _Refused(404, "no such action")
        form = self._form()
        self._check(token, form)
        run_id, verb = unquote(parts[2]), parts[3]
        by = (form.get("by") or "dashboard")[:200]
        step = form.get("step", "")
        calls: dict[str, Callable[[RunQueue], Any]] = {
            "cancel": lambda q: q.cancel(run_id),
            "retry": lambda q: q.retry(run_id),
            "answer": lambda q: q.answer(run_id, step, _value(form.get("value", "")), by=by),
            "approve": lambda q: q.approve(run_id, step, by=by),
            "deny": lambda q: q.deny(run_id, step, form.get("reason", ""), by=by),
        }
        try:
            source.act(calls[verb])
        except LookupError:
            raise _Refused(404, f"no run {run_id!r}") from None
        except ValueError as exc:  # RunStateError and bad arguments: nothing was written
            raise _Refused(409, str(exc)) from None
        # An answer given on the runs page leads back there; anything else to the run's page.
        back = "/" if form.get("back") == "runs" else pages.run_href(run_id)
        self._send(303, "", extra={"Location": back})

    def _drain(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if length.isdigit() and int(length) <= _MAX_FORM:
            self.rfile.read(int(length))

    def _form(self) -> dict[str, str]:
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > _MAX_FORM:
            raise _Refused(400, "a form of at most 64 KiB with a Content-Length is expected")
        raw = self.rfile.read(int(length)).decode("utf-8", "replace")
        return {k: v[0] for k, v in parse_qs(raw, keep_blank_values=True).items()}

    def _check(self, token: str, form: dict[str, str]) -> None:
        """The form's token and the cookie's must both be this process's; a foreign Origin is refused."""
        cookie = SimpleCookie()
        try:
            cookie.load(self.headers.get("Cookie", ""))
        except Exception:
            raise _Refused(403, "unreadable cookie") from None
        name = self.server.cookie
        held = cookie[name].value if name in cookie else ""
        given = form.get("token", "")
        if not (hmac.compare_digest(given.encode(), token.encode())
                and hmac.compare_digest(held.encode(), token.encode())):
            raise _Refused(403, "refused: the form's token or the dashboard's cookie is missing or wrong "
                                "(reload the page)")
        if not self.server.origin_allowed(self.headers.get("Origin"), self.headers.get("Host")):
            raise _Refused(403, "refused: the request comes from another site")


def _is_loopback(address: str) -> bool:
    """Whether the server's bound address is a loopback one (only there are Hosts checked)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _split_netloc(text: str) -> tuple[str, int] | None:
    """``name:port`` as ``(name, port)``, the port 80 when absent (as a browser omits it); ``None``
    when the port is not a plain number."""
    name, colon, port = text.rpartition(":")
    if not colon or text.endswith("]"):  # no port at all ("[::1]" holds colons of its own)
        return text, 80
    if not (port.isascii() and port.isdigit()) or len(port) > 5:
        return None
    return name, int(port)


def _own_netloc(header: str, port: int, loopback: bool) -> bool:
    """Whether a ``Host`` header is ``localhost`` or a literal IP address (a loopback one if
    ``loopback``), at ``port``: never a name, which its owner could re-point (DNS rebinding)."""
    # Names compare without case, in ASCII only: a non-ASCII letter may lower to an ASCII one.
    parts = _split_netloc(header.lower()) if header.isascii() else None
    if parts is None or parts[1] != port:
        return False
    name = parts[0]
    if name in _LOOPBACK_NAMES:
        return True
    address = _address(name)
    # Bound to loopback, an IPv4 one only ([::1] is named above, as a browser writes it).
    return address is not None and (not loopback or (address.version == 4 and address.is_loopback))


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address a Host's name spells (``[v6]``, or a dotted quad: not ``127.1``,
    ``0x7f.0.0.1`` nor ``2130706433``), else ``None``."""
    try:
        if name.startswith("[") and name.endswith("]"):
            return ipaddress.IPv6Address(name[1:-1])
        return ipaddress.IPv4Address(name) if _DOTTED_QUAD.fullmatch(name) else None
    except ValueError:  # an octet over 255, a leading zero
        return None


def _netloc_of_origin(origin: str) -> tuple[str, int] | None:
    """An ``Origin`` header's host and port, or ``None`` unless it is a plain ``http://HOST[:PORT]``."""
    scheme, sep, netloc = origin.strip().lower().partition("://")
    if scheme != "http" or not sep or not netloc or any(c in netloc for c in "/@?#\\"):
        return None
    return _split_netloc(netloc)


def _stream_offset(header: list[str], query: list[str]) -> int:
    """The offset a stream starts after: ``Last-Event-ID`` (a reconnect) over ``?after=``, else 0."""
    given = header or query
    if not given:
        return 0
    if len(given) > 1:
        raise _Refused(400, "give one Last-Event-ID header or one after= parameter")
    text = given[0].strip()
    # The length first: int() of thousands of digits costs, and no offset has more than 19.
    if not text or len(text) > 19 or not (text.isascii() and text.isdigit()):
        raise _Refused(400, f"an event's offset must be a whole number from 0, got {text!r:.40}")
    return int(text)


def _sse(event: Any) -> str:
    """One stream event as a server-sent event: its data one line of ASCII JSON (every other
    character escaped, so no client's idea of a line break, U+2028 or another, splits it)."""
    data = json.dumps(event.to_dict(), ensure_ascii=True)
    return f"id: {event.offset}\nevent: {event.kind}\ndata: {data}\n\n"


def _one(query: dict[str, list[str]], key: str) -> str:
    values = query.get(key)
    return values[0] if values else ""


def _value(text: str) -> Any:
    """An answer's value: the JSON it spells, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text
    except RecursionError:  # valid JSON, maybe, but deeper than Python reads (or any store writes)
        raise _Refused(400, "the answer is JSON nested too deeply to read") from None


def _encodable(value: Any) -> Any:
    """``value`` with each lone surrogate of its text spelt ``\\udcxx``, as the pages are sent:
    a live update shows what the page showed (JSON would hand the script the surrogate itself)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v) for v in value]
    return value


def _run_dict(r: Any) -> dict[str, Any]:
    return {
        "run_id": r.run_id, "workflow": r.workflow, "status": r.status, "priority": r.priority,
        "epoch": r.epoch, "owner": r.owner, "lease_until": r.lease_until,
        "cancel_requested": r.cancel_requested, "error": r.error, "created_at": r.created_at,
        "updated_at": r.updated_at, "steps_done": r.steps_done, "steps_total": r.steps_total,
        "cost": r.cost.to_dict(), "reason": r.reason,
    }


def serve(server: Dashboard, out: Any = None) -> None:
    """Print the URL (first line, flushed) and serve until interrupted."""
    out = sys.stdout if out is None else out
    out.write(server.url + "\n")
    out.flush()
    try:
        server.serve_forever()
    finally:
        server.server_close()


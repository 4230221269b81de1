"""A failure that says how long to wait is retried after exactly that long (within the cap).

HTTP errors carry ``Retry-After`` (delta-seconds or an HTTP-date) or OpenAI's
``retry-after-ms``; an exception of your own says it with a ``retry_after``
attribute. The sleep is injected (``Workflow.runner(sleep=...)``), so every
wait is recorded and none is waited for real; HTTP errors are the real
classes (``urllib.error.HTTPError``, the OpenAI SDK's ``RateLimitError``),
and one test gets its 429 from a real HTTP server on localhost.
"""

from __future__ import annotations

import asyncio
import email.message
import email.utils
import http.server
import importlib
import io
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ekit_core import Event, StepFailed, StepRetried
from ekit_runtime import ProgressPrinter, RetryPolicy, Step, Workflow, retry_after

NOW = 1_700_000_000.0  # the fake wall clock HTTP-dates are read against


def _http_error(headers: dict[str, str], code: int = 429) -> urllib.error.HTTPError:
    message = email.message.Message()
    for name, value in headers.items():
        message[name] = value
    return urllib.error.HTTPError("http://127.0.0.1/x", code, "Too Many Requests", message,
                                  io.BytesIO(b""))


def _date(seconds_from_now: float, now: float = NOW) -> str:
    return email.utils.formatdate(now + seconds_from_now, usegmt=True)


class _Recorded:
    """A run with a fake sleep: what it slept, and its retry and failure events."""

    def __init__(self, workflow: Workflow, **options: Any) -> None:
        self.slept: list[float] = []
        self.events: list[StepRetried | StepFailed] = []

        async def sleep(seconds: float) -> None:
            self.slept.append(seconds)

        def trace(event: Event) -> None:
            if isinstance(event, StepRetried | StepFailed):
                self.events.append(event)

        self.state = asyncio.run(workflow.runner(sleep=sleep, trace=trace, **options).run())


def _raising_then(errors: list[BaseException], output: str = "done") -> Any:
    """A step raising each of ``errors`` in turn, then returning ``output``."""
    left = list(errors)

    def run(context: dict[str, Any]) -> str:
        if left:
            raise left.pop(0)
        return output

    return run


POLICY = RetryPolicy(max_attempts=3, backoff_base=0.5, max_retry_after=120)


# -- reading the hint ---------------------------------------------------------------


def test_retry_after_reads_delta_seconds_and_the_ms_header_openai_sends() -> None:
    assert retry_after(_http_error({"Retry-After": "7"})) == 7.0
    assert retry_after(_http_error({"retry-after": " 2.5 "})) == 2.5  # a float, as the SDK allows
    assert retry_after(_http_error({"Retry-After-Ms": "1500"})) == 1.5
    # retry-after-ms is more precise than whole seconds: it wins, as in the OpenAI SDK.
    assert retry_after(_http_error({"retry-after": "2", "retry-after-ms": "1250"})) == 1.25
    assert retry_after(_http_error({})) is None
    assert retry_after(ValueError("no headers at all")) is None


def test_retry_after_reads_an_http_date_against_the_wall_clock_never_below_zero() -> None:
    assert retry_after(_http_error({"Retry-After": _date(30)}), now=lambda: NOW) == 30.0
    assert retry_after(_http_error({"Retry-After": _date(-30)}), now=lambda: NOW) == 0.0
    # "-0000" dates (RFC 5322's "UTC, no zone known") are read as UTC too.
    dash = email.utils.formatdate(NOW + 12)
    assert dash.endswith("-0000")
    assert retry_after(_http_error({"Retry-After": dash}), now=lambda: NOW) == 12.0
    # The default clock is the real one: a date a minute ahead is about a minute away.
    ahead = retry_after(_http_error({"Retry-After": _date(60, time.time())}))
    assert ahead is not None and 55 <= ahead <= 60


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "-inf", "soon", "", "1e999",
                                   "Wed, 99 Foo 2015 07:28:00 GMT"])
def test_retry_after_ignores_values_that_are_no_wait(value: str) -> None:
    assert retry_after(_http_error({"Retry-After": value}), now=lambda: NOW) is None
    assert retry_after(_http_error({"Retry-After-Ms": value}), now=lambda: NOW) is None


def test_a_bad_ms_header_falls_back_to_retry_after() -> None:
    assert retry_after(_http_error({"Retry-After-Ms": "-1", "Retry-After": "3"})) == 3.0


class _Quota(Exception):
    def __init__(self, seconds: object, headers: dict[str, str] | None = None) -> None:
        super().__init__("quota exceeded")
        self.retry_after = seconds
        if headers is not None:
            self.headers = headers


def test_your_own_exception_says_how_long_with_a_retry_after_attribute() -> None:
    assert retry_after(_Quota(3)) == 3.0
    assert retry_after(_Quota(0.25)) == 0.25
    # It comes first, before any headers the exception carries.
    assert retry_after(_Quota(3, {"Retry-After": "9"})) == 3.0
    # An attribute that is no number of seconds is ignored; headers still count.
    for bad in (-1, True, float("nan"), float("inf"), 10**400, "7", None):
        assert retry_after(_Quota(bad, {"retry-after": "9"})) == 9.0
        assert retry_after(_Quota(bad)) is None


def test_headers_that_cannot_be_read_ask_for_nothing_rather_than_raise() -> None:
    class Odd(Exception):
        @property
        def response(self) -> Any:
            raise RuntimeError("the response is gone")

    class NoGet(Exception):
        headers = 42

    assert retry_after(Odd()) is None
    assert retry_after(NoGet()) is None


class _PlainHeaders(Exception):
    """An error of a client that keeps its headers in a plain ``dict``, spelled as the server sent them."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__("too many requests")
        self.headers = headers


_SPELLINGS = st.sampled_from(["retry-after", "retry-after-ms"]).flatmap(
    lambda name: st.tuples(st.just(name), st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
)


@given(spelling=_SPELLINGS, seconds=st.integers(min_value=0, max_value=10**6), proxy=st.booleans())
def test_a_retry_after_key_in_a_plain_dict_matches_in_any_case(
    spelling: tuple[str, list[bool]], seconds: int, proxy: bool
) -> None:
    # A plain mapping's get() is case-sensitive, unlike httpx's or email's: the
    # server's own spelling ("Retry-After", "RETRY-AFTER") must still be read.
    name, upper = spelling
    key = "".join(c.upper() if up else c for c, up in zip(name, upper, strict=True))
    headers: Mapping[str, str] = {"Content-Type": "text/plain", key: str(seconds)}
    if proxy:
        headers = MappingProxyType(dict(headers))
    expected = seconds / 1000 if name == "retry-after-ms" else float(seconds)
    assert retry_after(_PlainHeaders(headers), now=lambda: NOW) == expected
    response = type("Response", (), {"headers": headers})()
    error = Exception("429")
    error.response = response  # type: ignore[attr-defined]
    assert retry_after(error, now=lambda: NOW) == expected


# -- through the runner ---------------------------------------------------------------


def test_a_retry_waits_exactly_what_the_server_asked() -> None:
    step = Step("call", _raising_then([_http_error({"Retry-After": "7"})]), retry=POLICY)
    run = _Recorded(Workflow([step]))
    assert run.state.outputs["call"] == "done"
    assert run.slept == [7.0]  # not the 0.5 s backoff
    (retried,) = run.events
    assert isinstance(retried, StepRetried)
    assert (retried.delay, retried.retry_after, retried.error_type) == (7.0, 7.0, "HTTPError")


def test_an_ms_header_and_an_http_date_are_waited_out_too() -> None:
    errors: list[BaseException] = [
        _http_error({"Retry-After-Ms": "1500"}),
        _http_error({"Retry-After": _date(30, time.time())}),
    ]
    run = _Recorded(Workflow([Step("call", _raising_then(errors), retry=POLICY)]))
    assert run.state.outputs["call"] == "done"
    assert run.slept[0] == 1.5
    assert 25 <= run.slept[1] <= 30  # measured against the real wall clock, whole seconds


def test_the_backoff_wins_when_the_server_asks_for_less() -> None:
    policy = RetryPolicy(max_attempts=2, backoff_base=4.0)
    run = _Recorded(Workflow([Step("call", _raising_then([_Quota(0.1)]), retry=policy)]))
    assert run.slept == [4.0]
    assert isinstance(run.events[0], StepRetried) and run.events[0].retry_after == 0.1


def test_a_server_asking_for_more_than_the_cap_fails_the_step_at_once() -> None:
    policy = RetryPolicy(max_attempts=5, backoff_base=0.5, max_retry_after=10)
    calls: list[int] = []

    def call(context: dict[str, Any]) -> str:
        calls.append(1)
        raise _http_error({"Retry-After": "3600"})

    run = _Recorded(Workflow([Step("call", call, retry=policy)]))
    assert run.state.outcome == "failed"
    assert calls == [1] and run.slept == []  # four attempts left unused, nothing waited
    (failed,) = run.events
    assert isinstance(failed, StepFailed)
    assert (failed.attempt, failed.retry_after) == (1, 3600.0)


def test_a_server_asking_for_exactly_the_cap_is_waited_for() -> None:
    policy = RetryPolicy(max_attempts=2, backoff_base=0.5, max_retry_after=10)
    run = _Recorded(Workflow([Step("call", _raising_then([_Quota(10)]), retry=policy)]))
    assert run.state.outputs["call"] == "done" and run.slept == [10.0]


def test_a_hint_changes_nothing_for_a_step_without_retries_or_for_errors_not_retried() -> None:
    no_retry = Step("a", _raising_then([_Quota(1)]))
    only_timeouts = Step("b", _raising_then([_Quota(1)]), retry=RetryPolicy(retry_on=TimeoutError))
    for step in (no_retry, only_timeouts):
        run = _Recorded(Workflow([step]))
        assert run.state.outcome == "failed" and run.slept == []


def test_an_openai_rate_limit_error_is_waited_out_as_its_response_asks() -> None:
    openai = pytest.importorskip(
        "openai", reason="the openai SDK is in the test extras; install .[test] to run this")
    # The SDK builds its errors on its HTTP client's classes (httpx, or httpx2 in later ones).
    annotation = openai.APIStatusError.__init__.__annotations__["response"]
    httpx = importlib.import_module(str(annotation).split(".")[0])
    request = httpx.Request("POST", "http://127.0.0.1/v1/chat/completions")
    errors: list[BaseException] = [
        openai.RateLimitError(
            "rate limited", response=httpx.Response(429, headers={"retry-after": "7"}, request=request),
            body=None),
        openai.RateLimitError(
            "rate limited",
            response=httpx.Response(429, headers={"retry-after-ms": "2500"}, request=request),
            body=None),
    ]
    run = _Recorded(Workflow([Step("llm", _raising_then(errors), retry=POLICY)]))
    assert run.state.outputs["llm"] == "done"
    assert run.slept == [7.0, 2.5]
    assert [e.error_type for e in run.events] == ["RateLimitError", "RateLimitError"]


# -- a real server ----------------------------------------------------------------------


@pytest.fixture
def busy_server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering 429 with ``Retry-After: 4`` once, then 200."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            if len(hits) == 1:
                self.send_response(429)
                self.send_header("Retry-After", "4")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = b"summary"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/summarize", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_429_from_a_real_server_is_retried_after_its_retry_after(
    busy_server: tuple[str, list[str]],
) -> None:
    url, hits = busy_server

    def fetch(context: dict[str, Any]) -> str:
        with urllib.request.urlopen(url, timeout=10) as response:  # raises HTTPError on 429
            return response.read().decode()

    run = _Recorded(Workflow([Step("fetch", fetch, retry=POLICY)]))
    assert run.state.outputs["fetch"] == "summary"
    assert run.slept == [4.0] and len(hits) == 2
    (retried,) = run.events
    assert isinstance(retried, StepRetried) and retried.retry_after == 4.0


def test_the_progress_lines_say_when_a_wait_is_the_servers() -> None:
    out = io.StringIO()
    printer = ProgressPrinter(out, tty=False)
    capped = RetryPolicy(max_attempts=3, backoff_base=0.5, max_retry_after=60)
    steps = [
        Step("asked", _raising_then([_http_error({"Retry-After": "12"})]), retry=capped),
        Step("refused", _raising_then([_http_error({"Retry-After": "3600"})]), retry=capped),
    ]
    run = _Recorded(Workflow(steps), isolate_failures=True)
    for event in run.events:
        printer(event)
    lines = out.getvalue().splitlines()
    assert any(line.endswith("(next in 12.0s as the server asked)") for line in lines), lines
    assert any("FAILED refused on attempt 1" in line
               and line.endswith("(the server asked to wait 60m00s)") for line in lines), lines

"""A tracer and spans that record what the OpenTelemetry adapter asked of them, for the tests."""

from __future__ import annotations

from typing import Any


class FakeSpan:
    def __init__(self, name: str, attributes: dict[str, Any], parent: Any) -> None:
        self.name = name
        self.attributes = dict(attributes)
        self.parent = parent
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.ended = 0

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def add_event(self, name: str, attributes: dict[str, Any]) -> None:
        self.events.append((name, attributes))

    def set_status(self, status: Any) -> None:
        self.attributes["status"] = status

    def end(self) -> None:
        self.ended += 1


class FakeTracer:
    def __init__(self) -> None:
        self.spans: list[FakeSpan] = []

    def start_span(self, name: str, context: Any = None, attributes: Any = None) -> FakeSpan:
        span = FakeSpan(name, attributes or {}, context)
        self.spans.append(span)
        return span

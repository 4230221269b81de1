"""An optional OpenTelemetry adapter: trace events become spans.

This module owns the mapping from :mod:`ekit_core.events` to spans. It
imports ``opentelemetry`` only when an :class:`OtelTracer` is built, never
at import time, so ekit keeps no runtime dependency: without
``opentelemetry-api`` installed, importing ekit works and only building an
``OtelTracer`` without a tracer of your own fails, with an ``ImportError``
that says what to install.

The mapping: one span per run (``ekit.run``), and under it one span per
step attempt (``ekit.step <name>``) from ``StepStarted`` to the event that
ends the attempt. Skipped steps and saved checkpoints are span events on
the run span. Failures set an error status when ``opentelemetry`` is
importable; the ``error.type`` attribute is always set.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ekit_core import (
    CheckpointSaved,
    Event,
    RunSettled,
    RunStarted,
    StepDenied,
    StepFailed,
    StepFinished,
    StepInterrupted,
    StepRetried,
    StepSkipped,
    StepStarted,
    StepWaiting,
)

__all__ = ["OtelTracer"]

_INSTALL_HINT = (
    "OtelTracer() without a tracer needs the 'opentelemetry-api' package "
    "(pip install opentelemetry-api); ekit itself does not depend on it"
)


def _otel_trace() -> ModuleType | None:
    try:
        return importlib.import_module("opentelemetry.trace")
    except ImportError:
        return None


class OtelTracer:
    """A ``trace`` callback that records a run as OpenTelemetry spans.

    ``tracer`` is an OpenTelemetry ``Tracer`` (anything with
    ``start_span(name, context=..., attributes=...)`` returning spans with
    ``set_attribute``, ``add_event`` and ``end``); ``None`` means
    ``opentelemetry.trace.get_tracer("ekit")``, which needs
    ``opentelemetry-api`` installed. Use one instance per run at a time.
    """

    def __init__(self, tracer: Any = None) -> None:
        self._otel = _otel_trace()
        if tracer is None:
            if self._otel is None:
                raise ImportError(_INSTALL_HINT)
            tracer = self._otel.get_tracer("ekit")
        if not callable(getattr(tracer, "start_span", None)):
            raise ValueError(f"tracer must have a start_span method, got {type(tracer).__name__}")
        self._tracer = tracer
        self._run: Any = None
        self._steps: dict[str, Any] = {}

    def _start(self, name: str, attributes: dict[str, Any], parent: Any = None) -> Any:
        context = None
        if parent is not None and self._otel is not None:
            context = self._otel.set_span_in_context(parent)
        return self._tracer.start_span(name, context=context, attributes=attributes)

    def _error(self, span: Any, error_type: str, message: str) -> None:
        span.set_attribute("error.type", error_type)
        if self._otel is not None:
            span.set_status(self._otel.Status(self._otel.StatusCode.ERROR, message))

    def _end_step(self, name: str) -> Any:
        return self._steps.pop(name, None)

    def __call__(self, event: Event) -> None:
        """Turn one trace event into span operations."""
        if isinstance(event, RunStarted):
            self._run = self._start(
                "ekit.run", {"ekit.steps.total": event.total, "ekit.steps.recorded": event.recorded}
            )
        elif isinstance(event, StepSkipped):
            if self._run is not None:
                self._run.add_event("ekit.step.skipped", {"ekit.step": event.name})
        elif isinstance(event, StepStarted):
            self._steps[event.name] = self._start(
                f"ekit.step {event.name}",
                {"ekit.step": event.name, "ekit.attempt": event.attempt, "ekit.delay": event.delay},
                self._run,
            )
        elif isinstance(event, StepFinished):
            span = self._end_step(event.name)
            if span is not None:
                usage = event.usage
                span.set_attribute("ekit.usage.input_tokens", usage.input_tokens)
                span.set_attribute("ekit.usage.output_tokens", usage.output_tokens)
                span.set_attribute("ekit.usage.llm_calls", usage.llm_calls)
                span.end()
        elif isinstance(event, StepRetried | StepFailed):
            span = self._end_step(event.name)
            if span is not None:
                span.set_attribute("ekit.retried", isinstance(event, StepRetried))
                self._error(span, event.error_type, event.message)
                span.end()
        elif isinstance(event, StepDenied | StepInterrupted | StepWaiting):
            span = self._end_step(event.name)
            if span is not None:
                outcome = ("denied" if isinstance(event, StepDenied) else
                           "waiting" if isinstance(event, StepWaiting) else "interrupted")
                span.set_attribute("ekit.outcome", outcome)
                span.end()
        elif isinstance(event, CheckpointSaved):
            if self._run is not None:
                self._run.add_event("ekit.checkpoint.saved", {"ekit.step_index": event.step_index})
        elif isinstance(event, RunSettled):
            # Anything still open belongs to this run; never leak a span.
            for name in list(self._steps):
                self._end_step(name).end()
            if self._run is not None:
                run, self._run = self._run, None
                run.set_attribute("ekit.outcome", event.outcome)
                run.set_attribute("ekit.steps.completed", event.completed)
                run.set_attribute("ekit.usage.total_tokens", event.cost.total_tokens)
                if event.outcome not in ("finished", "waiting"):  # (a parked run is no error)
                    self._error(run, event.outcome, f"run ended as {event.outcome}")
                run.end()

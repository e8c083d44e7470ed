"""OpenTelemetry spans per request and per session step, and request ids in log lines.

Spans are emitted when a request finishes, from the timestamps the engine
recorded (arrival, first scheduled, first token, finished), so nothing on the
hot path waits on tracing. A request span has children `queue`, `prefill`,
`decode`; a session turn also carries `restore` when it waited for its KV,
and the session's id, step number and what it parks on as attributes.

Export: `console` (stdout), `otlp` (OTLP/HTTP, needs
opentelemetry-exporter-otlp-proto-http), or none (spans are not recorded).
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every log record (the current request's, or '-')."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


class Tracer:
    """Builds span trees from finished requests. A no-op tracer when `exporter` is None."""

    def __init__(self, exporter: str | None = None, service_name: str = "sessionserve",
                 span_exporter: Any = None) -> None:
        self.enabled = exporter is not None or span_exporter is not None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if span_exporter is not None:  # tests pass an in-memory exporter
            self.provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        elif exporter == "console":
            self.provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif exporter == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif exporter is not None:
            raise ValueError(f"unknown trace exporter {exporter!r} (console | otlp)")
        self._tracer = self.provider.get_tracer("sessionserve")

    def record_request(self, *, name: str, request_id: str, wall_offset_s: float, arrival_s: float,
                       scheduled_s: float | None, first_token_s: float | None, finished_s: float,
                       attributes: dict[str, Any], restore_blocked_s: float = 0.0) -> None:
        """Emit one request's span tree. Times are engine-clock seconds; `wall_offset_s` maps them to wall time."""
        if not self.enabled:
            return

        def ns(t: float) -> int:
            return int((t + wall_offset_s) * 1e9)

        attrs = {"sessionserve.request_id": request_id, **{k: v for k, v in attributes.items() if v is not None}}
        root = self._tracer.start_span(name, start_time=ns(arrival_s), attributes=attrs)
        ctx = trace.set_span_in_context(root)
        start = scheduled_s if scheduled_s is not None else arrival_s
        phases = [("queue", arrival_s, start)]
        if restore_blocked_s > 0:
            phases.append(("restore", max(arrival_s, start - restore_blocked_s), start))
        if first_token_s is not None:
            phases += [("prefill", start, first_token_s), ("decode", first_token_s, finished_s)]
        for phase, t0, t1 in phases:
            span = self._tracer.start_span(phase, context=ctx, start_time=ns(t0))
            span.end(end_time=ns(max(t0, t1)))
        root.end(end_time=ns(finished_s))

    def shutdown(self) -> None:
        self.provider.shutdown()

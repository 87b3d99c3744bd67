"""An arc as OpenTelemetry spans, for people who already run a trace collector.

One span per arc (`invoke_agent hybridlm`), one per phase (prefill, decode, constrained,
external; children of the arc) and one per jump (`execute_tool {tool}`, a child of its
external phase), named and attributed after the GenAI semantic conventions: the
`gen_ai.*` attributes where the conventions have one (operation, model, seed, sampling
parameters, token usage, finish reason, tool name, type, call id, arguments and result,
`error.type`), `hybridlm.*` for the hybrid time (t, k, phase, mode). The spans are built
with the OpenTelemetry SDK and written by its own exporters: OTLP JSON lines to a file
(opentelemetry-exporter-otlp-json-file) or OTLP/HTTP protobuf to a collector's URL
(opentelemetry-exporter-otlp-proto-http). These packages are the `report` extra.

A trace holds wall time relative to the arc's start; `epoch_s` places it on the Unix
clock (the CLI takes the trace file's last modification as the end of the arc).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from hybridlm.errors import InputError
from hybridlm.report.arc import arc_view

SCOPE = "hybridlm.report.otel"


def _sdk():
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    except ImportError:
        raise InputError("--otel needs the OpenTelemetry SDK: pip install 'hybridlm[report]'") from None
    return Resource, TracerProvider, SimpleSpanProcessor, InMemorySpanExporter


def arc_spans(events: Iterable[dict], *, epoch_s: float | None = None, end_unix_s: float | None = None) -> list:
    """The arc's spans (opentelemetry.sdk ReadableSpan), ended, in start order. Wall time 0 is at Unix time
    `epoch_s`; without it, the arc's last wall time is at `end_unix_s` (now, without either). `events` may be
    a stream (read once)."""
    from opentelemetry import trace as api

    Resource, TracerProvider, SimpleSpanProcessor, InMemorySpanExporter = _sdk()
    view = arc_view(events)
    start, end = view["start"] or {}, view["end"] or {}
    last_wall = max([w for _, w, _ in view["wall_curve"]] + [0.0])
    base = (time.time() if end_unix_s is None else end_unix_s) - last_wall if epoch_s is None else epoch_s
    ns = lambda wall: int(round((base + wall) * 1e9))  # noqa: E731 - a one-line conversion, named for reading

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "hybridlm"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(SCOPE)

    arc = tracer.start_span("invoke_agent hybridlm", start_time=ns(0.0), attributes=_arc_attributes(view, start, end))
    arc_ctx = api.set_span_in_context(arc)
    phase_spans = []
    for p in view["phases"]:
        attrs = {"hybridlm.phase": p["phase"], "hybridlm.k": int(p["k"]), "hybridlm.t.start": int(p["t0"]),
                 "hybridlm.t.end": int(p["t1"]), "hybridlm.token_steps": int(p["steps"])}
        if p.get("mode"):
            attrs["hybridlm.mode"] = str(p["mode"])
        if isinstance(p.get("tokens"), int) and not isinstance(p["tokens"], bool):
            attrs["hybridlm.prefill.tokens"] = p["tokens"]
        span = tracer.start_span(p["phase"], context=arc_ctx, start_time=ns(p["wall0"]), attributes=attrs)
        phase_spans.append((p, span))
    descriptions = {t.get("name"): t.get("description") for t in start.get("tools") or [] if isinstance(t, dict)}
    for j in view["jumps"]:
        wall = float(j.get("wall_s") or 0.0)
        duration = float(j.get("duration_s") or 0.0)
        parent = next((s for p, s in phase_spans if p["phase"] == "external" and p["wall0"] <= wall <= p["wall1"]), arc)
        span = tracer.start_span(f"execute_tool {j.get('tool')}", context=api.set_span_in_context(parent),
                                 start_time=ns(max(wall - duration, 0.0)), attributes=_tool_attributes(j, descriptions))
        if j.get("error"):
            span.set_status(api.Status(api.StatusCode.ERROR, str(j["error"])))
        span.end(end_time=ns(wall))
    for p, span in phase_spans:
        span.end(end_time=ns(p["wall1"]))
    if end.get("stop_reason") not in (None, "answer"):
        arc.set_attribute("hybridlm.termination", str(end["stop_reason"]))
    arc.end(end_time=ns(last_wall))
    spans = sorted(memory.get_finished_spans(), key=lambda s: (s.start_time, s.parent is not None))
    provider.shutdown()
    return spans


def _arc_attributes(view: dict, start: dict, end: dict) -> dict:
    kernel, limits = start.get("kernel") or {}, start.get("limits") or {}
    attrs = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "hybridlm", "gen_ai.provider.name": "hybridlm",
             "gen_ai.usage.output_tokens": view["totals"]["token_steps"],
             "gen_ai.usage.input_tokens": sum(p["tokens"] for p in view["phases"]
                                              if isinstance(p.get("tokens"), int) and not isinstance(p["tokens"], bool)),
             "hybridlm.jumps": view["totals"]["jumps"]}
    optional = {"gen_ai.request.model": start.get("model"), "gen_ai.request.seed": start.get("seed"),
                "gen_ai.request.max_tokens": limits.get("max_token_steps"),
                "gen_ai.request.temperature": 0.0 if kernel.get("greedy") else kernel.get("temperature"),
                "gen_ai.request.top_k": kernel.get("top_k"), "gen_ai.request.top_p": kernel.get("top_p"),
                "hybridlm.task": start.get("task"), "hybridlm.tool_choice": start.get("tool_choice"),
                "hybridlm.max_jumps": limits.get("max_jumps")}
    attrs.update({k: v for k, v in optional.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)})
    if end.get("stop_reason"):
        attrs["gen_ai.response.finish_reasons"] = [str(end["stop_reason"])]
    return attrs


def _tool_attributes(j: dict, descriptions: dict) -> dict:
    arguments = j.get("arguments")
    attrs = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": str(j.get("tool")),
             "gen_ai.tool.type": "function", "gen_ai.tool.call.id": f"jump-{j.get('k')}",
             "gen_ai.tool.call.arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
             "gen_ai.tool.call.result": str(j.get("observation", "")),
             "hybridlm.k": int(j.get("k") or 0), "hybridlm.t": int(j.get("t") or 0)}
    if descriptions.get(j.get("tool")):
        attrs["gen_ai.tool.description"] = str(descriptions[j.get("tool")])
    if j.get("error"):
        attrs["error.type"] = str(j["error"])
    return attrs


def is_url(target: str) -> bool:
    return urlparse(str(target)).scheme in ("http", "https")


def export_arc(events: Iterable[dict], target: str | os.PathLike, *, epoch_s: float | None = None,
               end_unix_s: float | None = None, timeout_s: float = 10.0) -> int:
    """Export the arc's spans to an OTLP/HTTP URL or append them to a file as OTLP JSON lines.

    A URL without a path gets the OTLP traces path /v1/traces. Returns the number of spans.
    """
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    spans = arc_spans(events, epoch_s=epoch_s, end_unix_s=end_unix_s)
    target = str(target)
    if is_url(target):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise InputError("--otel URL needs opentelemetry-exporter-otlp-proto-http: pip install 'hybridlm[report]'") from None
        url = urlparse(target)
        endpoint = target if url.path not in ("", "/") else target.rstrip("/") + "/v1/traces"
        exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
    else:
        try:
            from opentelemetry.exporter.otlp.json.file import FileSpanExporter
        except ImportError:
            raise InputError("--otel FILE needs opentelemetry-exporter-otlp-json-file: pip install 'hybridlm[report]'") from None
        path = Path(target)
        if path.is_dir():
            raise InputError(f"--otel {target}: a folder; expected a file for OTLP JSON lines or an http(s) URL")
        path.parent.mkdir(parents=True, exist_ok=True)
        exporter = FileSpanExporter(path)
    try:
        result = exporter.export(spans)
    finally:
        exporter.shutdown()
    if result is not SpanExportResult.SUCCESS:
        raise InputError(f"--otel {target}: the spans could not be exported (see the log above)")
    return len(spans)


def export_trace(path: str | os.PathLike, target: str | os.PathLike) -> int:
    """Export a trace file's arc; its file was last written at the arc's end, which fixes the Unix time."""
    from hybridlm.engine.trace import iter_trace

    return export_arc(iter_trace(path), target, end_unix_s=Path(path).stat().st_mtime)

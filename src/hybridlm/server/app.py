"""The HTTP face of the service: an OpenAI-compatible API on FastAPI.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models[/{id}]
    GET  /v1/arcs/{id}          GET  /v1/arcs/{id}/report
    GET  /health                GET  /metrics  (Prometheus text)

Errors have OpenAI's shape and status: 400 for a bad parameter (its name in `param`), 401 for
a missing or wrong API key, 404 for an unknown model or arc, 413 for a body over the limit, 415 for
a body that is not application/json, 421 for a foreign Host, 403 for a foreign Origin
(hybridlm.server.guard), 503 when the batch and its queue are full (with Retry-After). /health
needs no key; /metrics needs the key when there is one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridlm.server import dialects as D, handlers as H
from hybridlm.server.bounds import SCREEN_BYTES, Screen
from hybridlm.server.guard import Guard, Policy
from hybridlm.server.metrics import Metrics
from hybridlm.server.service import Service
from hybridlm.server.wire import (
    APIError, DetokenizeBody, EmbeddingsBody, TokenizeBody, json_object, parse_body, parse_chat, parse_completion,
    refusal,
)

log = logging.getLogger("hybridlm.server")

DEFAULT_MAX_BODY = 8 * 2**20


def create_app(service: Service | None, *, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY,
               policy: Policy | None = None) -> FastAPI:
    """The app of `service`; None while the model loads (every route but /health answers 503
    "loading" until `ready(app, service)`)."""
    screen = Screen()  # (the process that reads a big body first: hybridlm.server.bounds)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        screen.close()

    app = FastAPI(title="hybridlm", summary="An OpenAI-compatible server of hybrid automata", docs_url=None,
                  redoc_url=None, lifespan=lifespan)
    policy = policy if policy is not None else Policy("127.0.0.1")
    if policy.cors_origins:  # (added first: the guard, added last, runs before it)
        app.add_middleware(CORSMiddleware, allow_origins=policy.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], expose_headers=["X-Hybridlm-Arcs"],
                           max_age=600)
    app.add_middleware(Guard, policy=policy)
    app.state.service = app.state.metrics = None
    if service is not None:
        ready(app, service)

    def svc() -> Service:
        s = app.state.service
        if s is None:
            raise APIError(503, "the model is loading; retry when /health says ok", type="server_error",
                           code="loading", headers={"Retry-After": "1"})
        return s

    class _Metrics:
        """The service's metrics once it is ready (a request while loading counts nowhere)."""

        def request(self, endpoint: str, status: int) -> None:
            if app.state.metrics is not None:
                app.state.metrics.request(endpoint, status)

        def ttft(self, seconds: float) -> None:
            if app.state.metrics is not None:
                app.state.metrics.ttft(seconds)

    metrics = _Metrics()

    # ------------------------------------------------------------------ errors in OpenAI's shape
    def endpoint(request: Request) -> str:
        """The route's template (/v1/arcs/{arc_id}), never the raw path: a label per arc id would
        grow the metrics without bound."""
        route = request.scope.get("route")
        return getattr(route, "path", None) or "unmatched"

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        metrics.request(endpoint(request), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        metrics.request(endpoint(request), exc.status_code)
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("request failed")
        metrics.request(endpoint(request), 500)
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}"[:500],
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    # ------------------------------------------------------------------ the key and the body
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided" if given else
                           "You didn't provide an API key (Authorization: Bearer KEY)", code="invalid_api_key")

    async def body_of(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise APIError(413, f"the request body is {int(declared):,} bytes; the limit is {max_body_bytes:,}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"the request body is over the limit of {max_body_bytes:,} bytes",
                               code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        if size >= SCREEN_BYTES:  # read first by a process of its own: a big body's reading holds no one here
            verdict = await run_in_threadpool(screen.check, raw)
            if not verdict.get("ok"):
                raise refusal(verdict)
        return raw

    # ------------------------------------------------------------------ health, metrics, models
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        service = app.state.service
        if service is None:
            return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
        if not service.alive:
            return JSONResponse({"status": "error", "reason": "the engine thread is not running"}, status_code=503)
        return {"status": "ok", "model": service.model_id}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        svc()
        return Response(app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict:
        service = svc()
        return {"id": name, "object": "model", "created": service.created, "owned_by": "hybridlm",
                "context_length": service.model.config.n_ctx, "dtype": H.dtype_name(service.model)}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card(name) for name in svc().names]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str, request: Request):
        authorize(request)
        H.check_model(svc(), model_id)
        return model_card(model_id)

    # ------------------------------------------------------------------ arcs
    def arc_of(arc_id: str):
        arcs = svc().arcs
        s = arcs.get(arc_id)
        if s is None:
            raise APIError(404, f"no arc {arc_id!r} (arcs of the last {arcs.max_arcs} sequences are kept)",
                           param="arc_id", code="arc_not_found")
        return s

    @app.get("/v1/arcs/{arc_id}")
    async def arc(arc_id: str, request: Request):
        authorize(request)
        s = arc_of(arc_id)
        text = "".join(line + "\n" for line in list(s.arc.lines()))
        return PlainTextResponse(text, media_type="application/x-ndjson")

    @app.get("/v1/arcs/{arc_id}/report")
    async def arc_report(arc_id: str, request: Request):
        authorize(request)
        s = arc_of(arc_id)
        from hybridlm.report import render_arc_report

        events = [e.to_dict() for e in list(s.arc.events)]
        html = await run_in_threadpool(render_arc_report, events)
        return HTMLResponse(html)

    # ------------------------------------------------------------------ completions
    def start(prep: H.Prepared) -> asyncio.Queue:
        service = svc()
        queue = H.attach(prep, asyncio.get_running_loop())
        service.submit(prep.sequences)
        with service.counters.lock:
            service.counters.prompt_tokens += sum(prep.prompt_tokens)
        return queue

    async def finished(request: Request, prep: H.Prepared, queue: asyncio.Queue, respond) -> dict | None:
        """The response body once every sequence has ended; None when the client went away."""
        service = svc()
        if not await H.wait_all(prep, queue, service, request.is_disconnected):
            metrics.request(endpoint(request), 499)
            return None
        for s in prep.sequences:
            delay = H.first_token_delay(prep, s)
            if delay is not None:
                metrics.ttft(delay)
        return respond(prep, service)

    async def run(request: Request, prep: H.Prepared, respond):
        queue = start(prep)
        headers = {"X-Hybridlm-Arcs": ",".join(s.name for s in prep.sequences)}
        if prep.stream:
            metrics.request(endpoint(request), 200)
            return StreamingResponse(H.stream(prep, queue, svc(), metrics.ttft), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        body = await finished(request, prep, queue, respond)
        if body is None:
            return Response(status_code=499)
        metrics.request(endpoint(request), 200)
        return JSONResponse(body, headers=headers)

    async def dialect(request: Request, chat: dict, respond, events):
        """A request of another dialect run as the chat request `chat`: `respond(chat.completion)` is
        its body, `events(the chat stream)` its stream."""
        body = parse_chat(chat)
        prep = await run_in_threadpool(H.prepare_chat, svc(), body)
        queue = start(prep)
        headers = {"X-Hybridlm-Arcs": ",".join(s.name for s in prep.sequences)}
        if prep.stream:
            metrics.request(endpoint(request), 200)
            return StreamingResponse(events(H.stream(prep, queue, svc(), metrics.ttft)), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        out = await finished(request, prep, queue, H.chat_response)
        if out is None:
            return Response(status_code=499)
        metrics.request(endpoint(request), 200)
        return JSONResponse(respond(out), headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        body = await run_in_threadpool(parse_chat, await body_of(request))  # (a big body's checks are not the loop's)
        prep = await run_in_threadpool(H.prepare_chat, svc(), body)
        return await run(request, prep, H.chat_response)

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        body = await run_in_threadpool(parse_completion, await body_of(request))
        prep = await run_in_threadpool(H.prepare_completion, svc(), body)
        return await run(request, prep, H.completion_response)

    # ------------------------------------------------------------------ other dialects of the chat
    conversations = D.Conversations()

    @app.post("/v1/responses")
    async def responses(request: Request):
        authorize(request)
        data = json_object(await body_of(request))
        chat, messages = D.responses_to_chat(data, conversations)
        return await dialect(request, chat, lambda out: D.chat_to_response(out, data, messages, conversations),
                             lambda stream: D.response_events(stream, data, messages, conversations))

    @app.post("/v1/messages")
    async def messages(request: Request):
        authorize(request)
        try:
            data = json_object(await body_of(request))
            chat = D.messages_to_chat(data)
            return await dialect(request, chat, lambda out: D.chat_to_message(out, data),
                                 lambda stream: D.message_events(stream, data))
        except APIError as exc:  # in Anthropic's shape
            metrics.request(endpoint(request), exc.status)
            return JSONResponse(D.anthropic_error(exc.status, exc.message), status_code=exc.status, headers=exc.headers)

    # ------------------------------------------------------------------ embeddings, tokens
    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        authorize(request)
        body = parse_body(await body_of(request), EmbeddingsBody)
        out = await run_in_threadpool(H.embeddings, svc(), body)
        metrics.request(endpoint(request), 200)
        return out

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        out = H.tokenize(svc(), parse_body(await body_of(request), TokenizeBody))
        metrics.request(endpoint(request), 200)
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        out = H.detokenize(svc(), parse_body(await body_of(request), DetokenizeBody))
        metrics.request(endpoint(request), 200)
        return out

    return app


def ready(app: FastAPI, service: Service) -> None:
    """The model has loaded: the app serves `service` from now on."""
    app.state.metrics = Metrics(service)
    app.state.service = service

"""The HTTP application: the OpenAI and Anthropic routes, /health and /metrics, the web
dashboard (/ and /dashboard.json), the Host header and API key checks, bounded request
bodies, an access log line per request, and errors in each API's own shape."""

from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from colibri_serve import anthropic_api, atlas, dashboard, logs, openai_api
from colibri_serve.listen import HostNames
from colibri_serve.metrics import Metrics
from colibri_serve.service import ApiError, Service

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = {"/health", *dashboard.STATIC}  # the dashboard's page and files hold no data


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(path: str, err: ApiError) -> JSONResponse:
    body = anthropic_api.error_body(err) if _is_anthropic(path) else openai_api.error_body(err)
    headers = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
    return JSONResponse(body, status_code=err.status, headers=headers)


class Gate:
    """Pure ASGI middleware in front of the application: the Host header (421 for a name
    the server does not answer to, when ``hosts`` is given), the API key (compared in
    constant time; /health and the dashboard's static files stay open), request bodies bounded to ``max_body`` bytes
    (413, by the declared length or as chunks arrive), requests counted by route
    and status, and each request's access log line."""

    def __init__(self, app, *, api_key: str | None, max_body: int, metrics: Metrics, routes=(),
                 hosts: HostNames | None = None):
        self.app, self.max_body, self.metrics, self.hosts = app, max_body, metrics, hosts
        self.routes = list(routes)  # the application's routes, for counting what it never saw
        self.expected = api_key.encode() if api_key else None

    def _route(self, scope) -> str:
        """The route a request is counted under: the one that answered, else (answered
        here: 401, 413) the one it was for; "unmatched" only for paths no route takes."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0] is not Match.NONE), None)
        return getattr(route, "path", "unmatched")

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if given is None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return hmac.compare_digest(given or b"", self.expected)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope.get("headers") or [])
        status = {"code": 500}
        started, record = time.perf_counter(), {}
        noting = logs.REQUEST.set(record)  # this request's task (and those it starts) note what its access line shows

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.hosts is not None and not self.hosts.allows(headers.get(b"host")):
                host = headers[b"host"].decode("latin-1")
                err = ApiError("misdirected", f"this server does not answer to the name in the Host header ({host!r}); "
                                              "start it with --allowed-host to allow a name")
                return await error_response(path, err)(scope, receive, counted_send)
            if self.expected is not None and path not in OPEN_PATHS and not self._authorised(headers):
                err = ApiError("unauthorized", "a valid API key is needed (Authorization: Bearer KEY or x-api-key)")
                return await error_response(path, err)(scope, receive, counted_send)
            too_large = ApiError("too_large", f"the request body is larger than {self.max_body} bytes")
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                return await error_response(path, too_large)(scope, receive, counted_send)
            seen = 0

            async def bounded_receive():
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > self.max_body:
                        raise too_large
                return message

            return await self.app(scope, bounded_receive, counted_send)
        finally:
            self.metrics.requests.labels(self._route(scope), str(status["code"])).inc()
            logs.access(scope, status["code"], time.perf_counter() - started, record)
            logs.REQUEST.reset(noting)


def create_app(service: Service, *, api_key: str | None = None, max_body: int = MAX_BODY_BYTES,
               hosts: HostNames | None = None) -> Gate:
    """The ASGI application (``.app`` is the FastAPI application inside the gate);
    ``hosts``: the names the Host header may give (None: any)."""
    metrics = Metrics(lambda: service.scheduler.stats() if service.status == "ready" else None)
    service.metrics = metrics
    app = FastAPI(title="colibri serve", version="0.1.0", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return error_response(request.url.path, err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request body")
        return error_response(request.url.path, ApiError("bad_request", message, param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, ApiError):  # FastAPI wraps failures while reading the body
            return error_response(request.url.path, exc.__cause__)
        path, method = request.url.path, request.method
        allowed = (exc.headers or {}).get("Allow", "")
        kind, message = {404: ("no_route", f"{path}: no such route"),
                         405: ("method_not_allowed", f"{path} takes {allowed or 'other methods'}, not {method}"),
                         413: ("too_large", str(exc.detail))}.get(exc.status_code, ("bad_request", str(exc.detail)))
        response = error_response(path, ApiError(kind, message))
        response.status_code = exc.status_code
        response.headers.update(exc.headers or {})  # Allow on a 405
        return response

    @app.get("/health")
    async def health():
        if service.status == "ready":
            # a weight file that failed to read is looked at again (a stat and a read: off the event loop)
            faults = await asyncio.to_thread(service.read_faults) if service.faulted else []
            if not faults:
                return {"status": "ok", "model": service.model_name}
            return JSONResponse({"status": "degraded", "model": service.model_name, "errors": faults}, status_code=503,
                                headers={"Retry-After": "5"})
        status = 503
        return JSONResponse({"status": service.status, "model": service.model_name}, status_code=status,
                            headers={"Retry-After": "5"} if service.status == "loading" else None)

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routers = [openai_api.router(service), anthropic_api.router(service), dashboard.router(service),
               atlas.router(service)]
    for router in routers:
        app.include_router(router)
    app.openapi = lambda: app.openapi_schema or _document_responses(app)
    # each route itself (newer FastAPI lists an included router as one entry)
    routes = [r for r in (*app.routes, *(r for router in routers for r in router.routes)) if hasattr(r, "path")]
    return Gate(app, api_key=api_key, max_body=max_body, metrics=metrics, routes=routes, hosts=hosts)


ERRORS = {"400": "Malformed or unsupported request, or a prompt longer than the context", "401": "Missing or wrong API key",
          "404": "Unknown model", "413": "Request body too large", "421": "A Host header naming another server",
          "429": "Queue full (Retry-After)",
          "503": "Model still loading, or a weight file could not be read (Retry-After)"}
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                          "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
# one server-sent event (an ``event:`` name where the API uses them, and its JSON ``data``)
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
STREAMING = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}


def _document_responses(app: FastAPI) -> dict:
    """The OpenAPI schema with the statuses the server really answers: its errors in
    each API's shape (400 where FastAPI would say 422), event streams where a route
    streams, Prometheus text for /metrics."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path == "/health":
                responses["503"] = {"description": "Model still loading, or degraded: a weight file could not be read"}
                continue
            error = ANTHROPIC_ERROR if _is_anthropic(path) else OPENAI_ERROR
            for code, text in ERRORS.items():
                responses[code] = {"description": text, "content": {"application/json": {"schema": error}}}
            if path in STREAMING:
                responses["200"].setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    app.openapi_schema = schema
    return schema

"""OpenAI-compatible HTTP surface over the same :class:`GatewayCore` as the gRPC API.

Transport only: requests are converted to :class:`GenerateCall`, errors come from the
same domain exceptions and are rendered in OpenAI's error shape. Tenants, quotas,
filters, tracing and failover are the core's, shared with gRPC.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from aiohttp import web
from opentelemetry import propagate, trace

from gateway import metrics
from gateway.core import Deadline, GatewayCore
from gateway.settings import GatewaySettings
from gateway.tenants import Tenant
from gateway.types import ChatTurn, Completion, GenerateCall, ModelMeta, Sampling, StreamOptions, TextDelta
from services.common.errors import InvalidArgument, LlmeshError, NotFound, map_exception
from services.common.limits import clip
from services.common.sampling import FIELDS, FieldSpec
from services.common.tracing import tracer

log = logging.getLogger(__name__)

_HTTP_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
    "CANCELLED": (499, "cancelled"),
}
_OPENAI_FINISH = {"stop": "stop", "length": "length", "content_filter": "content_filter",
                  "cancelled": "stop", "error": "stop"}
CORE_KEY = web.AppKey("core", GatewayCore)


def openai_param(field: str, body: dict[str, Any] | None = None) -> str:
    """The request field as an OpenAI client spelled it: the core names sampling fields
    ``sampling.<name>`` (the gRPC message layout); JSON bodies have them at the top level."""
    name = field.removeprefix("sampling.")
    if body is not None:
        if name == "max_tokens" and body.get("max_completion_tokens") is not None:
            return "max_completion_tokens"
        if name == "logprobs" and isinstance(body.get("logprobs"), bool):
            return "top_logprobs"
    return name


def error_body(exc: BaseException, request_body: dict[str, Any] | None = None,
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
    mapped = map_exception(exc)
    status, kind = _HTTP_STATUS.get(mapped.code.name, (500, "server_error"))
    message = mapped.message
    param = None
    if isinstance(exc, InvalidArgument):
        param = openai_param(exc.field, request_body)
        message = "; ".join(f"{openai_param(v.field, request_body)}: {v.description.replace('sampling.', '')}"
                            for v in exc.violations)
    code = "model_not_found" if mapped.code.name == "NOT_FOUND" else mapped.code.name.lower()
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return status, body, headers


def _json_error(exc: BaseException, request_body: dict[str, Any] | None = None) -> web.Response:
    status, body, headers = error_body(exc, request_body)
    return web.json_response(body, status=status, headers=headers)


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise InvalidArgument(name, f"must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise InvalidArgument(name, f"has the wrong type ({type(value).__name__})")
    return value


_SPECIAL_SAMPLING = frozenset({"stop", "max_tokens", "logprobs"})
"""Sampling fields whose OpenAI spelling differs from the domain's; every other field is
read from the body under its own name by :func:`_json_value`."""


def _sampling(body: dict[str, Any], default_max_tokens: int | None) -> Sampling:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise InvalidArgument("stop", "must be a string or a list of strings")
    n = _field(body, "n", int, 1)
    if n != 1:
        raise InvalidArgument("n", "only n=1 is supported")
    max_tokens = _field(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int)
    logprobs: int | None = None
    raw_logprobs = body.get("logprobs")
    if isinstance(raw_logprobs, bool):
        logprobs = _field(body, "top_logprobs", int, 0) if raw_logprobs else None
    elif raw_logprobs is not None:
        logprobs = _field(body, "logprobs", int)
    values = {spec.name: _json_value(body, spec) for spec in FIELDS if spec.name not in _SPECIAL_SAMPLING}
    return Sampling(
        stop=list(stop or []),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        logprobs=logprobs,
        **values,
    )


def _json_value(body: dict[str, Any], spec: FieldSpec) -> Any:
    """One sampling field from the JSON body under its own name (None or [] when absent)."""
    if spec.repeated:
        items = _field(body, spec.name, list, [])
        if not all(_json_is(item, spec.kind) for item in items):
            raise InvalidArgument(spec.name, f"must be a list of {_JSON_NAMES[spec.kind]}")
        return [spec.kind(item) for item in items]
    if spec.kind is float:
        return _float(_field(body, spec.name, (int, float)))
    return _field(body, spec.name, spec.kind)


_JSON_NAMES = {float: "numbers", int: "integers", bool: "booleans", str: "strings"}


def _json_is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _content(raw: Any, index: int) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        parts = []
        for part in raw:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidArgument(f"messages[{index}].content", "only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    if raw is None:
        return ""
    raise InvalidArgument(f"messages[{index}].content", "must be a string or a list of text parts")


def stream_options(options: dict[str, Any]) -> StreamOptions:
    """llmesh's pacing keys in OpenAI's ``stream_options`` object, named as in the gRPC
    ``StreamOptions`` (``interval``, ``max_delay_ms``) so an error names one field on both
    surfaces; the core checks their ranges."""
    names = {"interval": "stream_options.interval", "max_delay_ms": "stream_options.max_delay_ms"}
    values = {}
    for key, path in names.items():
        value = options.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(path, f"must be an integer, got {clip(repr(value), 32)}")
        values[key] = value
    return StreamOptions(**values)


def chat_call(body: dict[str, Any]) -> GenerateCall:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"messages[{i}]", "must be an object")
        turns.append(ChatTurn(role=str(m.get("role", "")), content=_content(m.get("content"), i)))
    return GenerateCall(model=_field(body, "model", str, ""), messages=turns,
                        sampling=_sampling(body, None))


def completion_call(body: dict[str, Any]) -> GenerateCall:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", "must be a string (one prompt per request)")
    if body.get("echo"):
        raise InvalidArgument("echo", "is not supported")
    # OpenAI's completions endpoint defaults max_tokens to 16.
    return GenerateCall(model=_field(body, "model", str, ""), prompt=prompt, sampling=_sampling(body, 16))


def _usage(c: Completion) -> dict[str, Any]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _llmesh_extra(c: Completion) -> dict[str, Any]:
    sb = c.served_by
    return {"served_by": {"worker_id": sb.worker_id, "zone": sb.zone, "device": sb.device,
                          "degraded": sb.degraded, "resumed": sb.resumed},
            "matched_stop": c.matched_stop,
            "timing": {"queue_ms": c.timing.queue_ms, "ttft_ms": c.timing.ttft_ms,
                       "total_ms": c.timing.total_ms}}


_TEXT_MARK = "\u2063llmesh-text\u2063"
"""Stands for a delta's text in the event template (json.dumps keeps it one string)."""


def _delta_event_parts(template: dict[str, Any]) -> tuple[bytes, bytes]:
    """The SSE event of ``template`` split around its :data:`_TEXT_MARK` string: the
    bytes before the text's JSON string and after it."""
    head, tail = f"data: {json.dumps(template)}\n\n".split(json.dumps(_TEXT_MARK))
    return head.encode(), tail.encode()


def _json_string(text: str) -> bytes:
    """``json.dumps(text).encode()``: the JSON encoder's own string escaper (ASCII, as
    ``json.dumps`` writes by default), without dumps' per-call set-up, once per event."""
    return encode_basestring_ascii(text).encode()


_WRITE_LIMIT = 64 * 1024
"""Unsent bytes a connection may hold for a text event to go to it directly."""


class _SseWriter:
    """A streamed response's text events, written to the connection by the code that
    released the text (the core's :class:`~gateway.core.DeltaSink`), instead of waking
    the handler's task and its generators once per event: at 32 streams that wake was
    most of this surface's CPU per token.

    Ready once aiohttp's own writer sent the headers and the first event, and while the
    connection holds less than :data:`_WRITE_LIMIT` unsent; otherwise the text waits for
    the handler's awaited write, which also waits for a slow client. The framing is
    aiohttp's: a streamed HTTP/1.1 response is chunked, one chunk per write (no
    compression on this surface)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunked = False
        self.head = self.tail = b""
        self.sent = 0
        """Events written here (the rest went through the handler)."""

    def start(self, request: web.Request, response: web.StreamResponse, head: bytes, tail: bytes) -> None:
        self.transport, self.chunked, self.head, self.tail = request.transport, response.chunked, head, tail

    def ready(self) -> bool:
        # Duck-typed: uvloop's transports are not asyncio.Transport subclasses.
        transport = self.transport
        return (transport is not None and not transport.is_closing()
                and transport.get_write_buffer_size() < _WRITE_LIMIT)

    def send(self, delta: TextDelta) -> None:
        assert self.transport is not None
        event = self.head + _json_string(delta.text) + self.tail
        self.transport.write(b"%x\r\n%b\r\n" % (len(event), event) if self.chunked else event)
        self.sent += 1


def _authenticate(request: web.Request) -> Tenant:
    return request.app[CORE_KEY].authenticate(
        request.headers.get("Authorization"), peer=request.remote or "", surface="http"
    )


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("body", f"is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return body


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    core = request.app[CORE_KEY]
    body: dict[str, Any] | None = None
    try:
        tenant = _authenticate(request)  # before the body is read
        body = await _body(request)
        call = chat_call(body) if chat else completion_call(body)
        stream = _field(body, "stream", bool, False)
        options = _field(body, "stream_options", dict, {})
        include_usage = _field(options, "include_usage", bool, False)
        call.stream_options = stream_options(options)
    except LlmeshError as exc:
        return _json_error(exc, body)
    created = int(time.time())
    rid = uuid.uuid4().hex
    call.request_id = rid
    object_name = "chat.completion" if chat else "text_completion"
    oid = ("chatcmpl-" if chat else "cmpl-") + rid
    if not stream:
        try:
            c = await core.generate(tenant, call, Deadline())
        except LlmeshError as exc:
            return _json_error(exc, body)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _OPENAI_FINISH.get(c.finish_reason, "stop"),
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        return web.json_response({"id": oid, "object": object_name, "created": created, "model": c.model,
                                  "choices": [choice], "usage": _usage(c), "llmesh": _llmesh_extra(c)})
    try:
        # Every chunk names the served model, also when the request left it empty (the
        # core caches the model list, so this costs no extra tier call).
        model = (await core.resolve_model(call.model)).id
    except LlmeshError as exc:
        return _json_error(exc, body)
    direct = _SseWriter()
    items = core.generate_stream(tenant, call, Deadline(), sink=direct)
    # Fail before the 200 when validation, auth or the first tier call fails.
    try:
        first = await items.__anext__()
    except LlmeshError as exc:
        return _json_error(exc, body)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    if request.version >= (1, 1):
        # What aiohttp would choose itself, said outright: the direct writer frames its
        # events by response.chunked.
        response.enable_chunked_encoding()
    await response.prepare(request)
    chunk_name = "chat.completion.chunk" if chat else "text_completion"

    async def send(payload: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(payload)}\n\n".encode())

    def chunk(delta: dict[str, Any] | str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {"id": oid, "object": chunk_name, "created": created, "model": model, "choices": [choice]}

    # A text delta's event is the same bytes as send(chunk(...)) but for its text: only
    # the text is encoded per delta.
    head, tail = _delta_event_parts(chunk({"content": _TEXT_MARK} if chat else _TEXT_MARK, None))

    awaited = 0
    try:
        if chat:
            await send(chunk({"role": "assistant", "content": ""}, None))
        item = first
        while True:
            if isinstance(item, TextDelta):
                await response.write(head + _json_string(item.text) + tail)
                awaited += 1
                if direct.transport is None:  # headers and a first event are out
                    direct.start(request, response, head, tail)
            else:
                model = item.model
                finish = _OPENAI_FINISH.get(item.finish_reason, "stop")
                await send(chunk({} if chat else "", finish))
                if include_usage:
                    await send({"id": oid, "object": chunk_name, "created": created, "model": model,
                                "choices": [], "usage": _usage(item)})
            try:
                item = await items.__anext__()
            except StopAsyncIteration:
                break
    except ConnectionResetError:
        # The client went away; closing the stream below aborts the generation downstream.
        log.info("HTTP client closed stream %s", rid)
        return response
    except Exception as exc:
        # The 200 is already sent: the error travels as an SSE event, as OpenAI's does.
        if not isinstance(exc, LlmeshError):
            log.exception("HTTP stream %s failed", rid)
        _, body_err, _ = error_body(exc, body)
        await send(body_err)
    finally:
        await items.aclose()  # type: ignore[attr-defined]
        metrics.HTTP_STREAM_EVENTS.labels("direct").inc(direct.sent)
        metrics.HTTP_STREAM_EVENTS.labels("awaited").inc(awaited)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


def _model_object(m: ModelMeta) -> dict[str, Any]:
    return {"id": m.id, "object": "model", "created": 0, "owned_by": "llmesh",
            "max_model_len": m.max_context_length}


async def models(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    try:
        _authenticate(request)
        metas = await core.list_models(Deadline.after(10))
    except LlmeshError as exc:
        return _json_error(exc)
    return web.json_response({"object": "list", "data": [_model_object(m) for m in metas]})


async def retrieve_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{id}`` (the client's ``models.retrieve``); 404 for a model not served."""
    core = request.app[CORE_KEY]
    name = request.match_info["model"]
    try:
        _authenticate(request)
        # An empty id would resolve to the default model; OpenAI has no such alias.
        meta = await core.resolve_model(name, Deadline.after(10)) if name else None
        if meta is None:
            raise NotFound("model: an id is required")
    except LlmeshError as exc:
        return _json_error(exc)
    return web.json_response(_model_object(meta))


@web.middleware
async def traced(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """One server span per HTTP request, continuing the caller's W3C ``traceparent`` as the
    gRPC interceptor does; the core's spans (and every tier below) hang off it."""
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path
    parent = propagate.extract(request.headers)
    with tracer().start_as_current_span(
        f"{request.method} {route}", context=parent, kind=trace.SpanKind.SERVER
    ) as span:
        span.set_attribute("http.request.method", request.method)
        span.set_attribute("http.route", route)
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR))
        return response


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own errors (unknown path, wrong method, body too large) and unexpected
    exceptions in OpenAI's error shape, so every client sees one format."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items()
                   if k.lower() not in ("content-type", "content-length")}
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        error = {"message": f"{request.method} {request.path}: {exc.reason}", "type": kind,
                 "param": None, "code": None}
        return web.json_response({"error": error}, status=exc.status, headers=headers)
    except Exception as exc:
        log.exception("HTTP %s %s failed", request.method, request.path)
        status, body, headers = error_body(exc)
        return web.json_response(body, status=status, headers=headers)


def build_app(core: GatewayCore, max_body_bytes: int = 0) -> web.Application:
    """The HTTP application; bodies beyond ``max_body_bytes`` (default: what the core's
    request limits allow in JSON) are refused with 413 as they are read."""
    limit = max_body_bytes or core.config.limits.max_json_bytes()
    app = web.Application(client_max_size=limit, middlewares=[traced, openai_errors])
    app[CORE_KEY] = core
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # served names may hold a "/"
    return app


def server_ssl_context(settings: GatewaySettings) -> ssl.SSLContext | None:
    """The gRPC port's TLS material, for the HTTP listener: None when the gateway is plaintext.

    A gateway that refuses plaintext gRPC must not answer plaintext HTTP beside it; with a
    client CA, client certificates are required here too (mutual TLS).
    """
    tls = settings.server_tls
    if tls is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert, tls.key or None)
    if tls.ca:
        context.load_verify_locations(cafile=tls.ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def start_http(core: GatewayCore, settings: GatewaySettings) -> web.AppRunner:
    # handler_cancellation: a client that hangs up on a non-streamed request cancels the
    # handler, and with it the generation downstream, instead of running it to the end.
    runner = web.AppRunner(build_app(core, settings.http_max_request_bytes()), access_log=None,
                           handler_cancellation=True)
    await runner.setup()
    context = server_ssl_context(settings)
    # Several gateway processes (--processes) share the HTTP port as they share the gRPC one.
    site = web.TCPSite(runner, settings.http_host, settings.http_port, ssl_context=context,
                       reuse_port=True if settings.processes > 1 else None)
    await site.start()
    log.info("OpenAI-compatible HTTP%s on %s:%d", "S" if context else "", settings.http_host,
             settings.http_port)
    return runner

"""Typed Python client for the public ``llmesh.v1.InferenceService``.

Two flavours with the same methods: :class:`Client` (blocking) and :class:`AsyncClient`
(asyncio, on ``grpc.aio``)::

    from llmesh.client import Client

    with Client("127.0.0.1:50051", api_key="...") as client:
        done = client.generate("What is the capital of France?", max_tokens=16)
        print(done.text, done.finish_reason, done.usage.completion_tokens)

        stream = client.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=32)
        for delta in stream:          # text deltas (str) as they arrive
            print(delta, end="", flush=True)
        print(stream.final.finish_reason, stream.final.timing.ttft_ms)

    async with AsyncClient() as client:
        stream = client.stream("Once upon a time")
        async for delta in stream:
            ...
        completion = stream.final     # or: completion = await stream.completion()

Streams
    ``stream()`` returns a :class:`CompletionStream` (``AsyncCompletionStream``). Iterating
    it yields the text deltas; once it is exhausted ``.final`` holds the :class:`Completion`
    (its ``text`` is the concatenation of the deltas). ``completion()`` drains the rest and
    returns it. ``cancel()`` (or leaving a ``with`` block early) cancels the call, which the
    mesh propagates down to the engine.

Connection options
    ``target`` (default ``127.0.0.1:50051``); ``api_key`` is sent on every call as
    ``authorization: Bearer <key>``; ``ca`` turns on TLS verified against that CA file
    (``tls=True`` with no ``ca`` uses the system roots); ``cert`` + ``key`` add a client
    certificate for mutual TLS; ``timeout`` is the default deadline of every call (a
    per-call ``timeout=`` overrides it, ``None`` means no deadline).

Retries
    Calls that fail with ``UNAVAILABLE`` before any response arrived are retried by gRPC
    itself, configured through the channel's service config (``retryPolicy`` with
    ``max_attempts`` in total, exponential backoff). The deadline covers all attempts.
    ``max_attempts=1`` turns retries off.

Errors
    Every failed call raises a subclass of :class:`LlmeshClientError` carrying the gRPC
    ``code``, the ``message`` and the decoded ``google.rpc`` details:
    ``field_violations`` (from ``BadRequest``) and ``retry_delay`` seconds (from
    ``RetryInfo``).
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, Unpack

import grpc
import grpc.aio
from google.protobuf import message as pb_message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from llmesh import __version__
from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common.sampling import SamplingOptions

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_TIMEOUT_S = 300.0
SERVICE_NAME = "llmesh.v1.InferenceService"

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "AsyncCompletionStream",
    "ChatMessage",
    "Client",
    "Completion",
    "CompletionStream",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FieldViolation",
    "GenerateOptions",
    "InternalError",
    "InvalidArgumentError",
    "LlmeshClientError",
    "ModelInfo",
    "NotFoundError",
    "PermissionDeniedError",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "ServedBy",
    "StreamProtocolError",
    "Timing",
    "TokenLogprob",
    "Tokenization",
    "UnauthenticatedError",
    "UnavailableError",
    "Usage",
    "completion_from_proto",
    "error_from_rpc",
]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""


@dataclass(frozen=True)
class ServedBy:
    worker_id: str = ""
    zone: str = ""
    device: str = ""
    """cpu, cuda or npu."""
    degraded: bool = False
    """Served by a zone marked degraded (the CPU fallback)."""
    resumed: int = 0
    """How many times the generation moved to another worker mid-way."""


@dataclass(frozen=True)
class Timing:
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """Alternatives as (token_id, logprob)."""


@dataclass(frozen=True)
class Completion:
    """One finished generation (unary ``generate`` or the end of a stream)."""

    text: str
    finish_reason: str
    """``stop``, ``length``, ``cancelled``, ``content_filter``, ``error`` ("" if unset)."""
    matched_stop: str
    """The stop string that ended generation, or ""."""
    usage: Usage
    served_by: ServedBy
    timing: Timing
    request_id: str
    model: str = ""
    token_ids: tuple[int, ...] = ()
    """Generated token ids, when ``logprobs`` was asked for."""
    logprobs: tuple[TokenLogprob, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tokenization:
    model: str
    token_ids: tuple[int, ...]
    count: int
    tokenizer_checksum: str


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_context_length: int
    tokenizer_checksum: str
    is_default: bool


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


MessageLike = ChatMessage | Mapping[str, str] | tuple[str, str]


class GenerateOptions(SamplingOptions, total=False):
    """Sampling and request options of ``generate``/``stream``; unset means model default.

    The sampling keys are the fields of the public ``SamplingParams`` (typed in
    :class:`services.common.sampling.SamplingOptions`): ``max_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``min_p``, ``min_tokens``, ``stop`` (a string or a list),
    ``stop_token_ids``, ``seed``, ``repetition_penalty``, ``presence_penalty``,
    ``frequency_penalty``, ``ignore_eos``, ``logprobs`` (top logprobs per generated token,
    0 = only the chosen token's) and any field the proto gains."""

    priority: int
    """Higher is admitted first under load."""
    request_id: str
    """Client-chosen id, echoed back and written to the audit log."""


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class LlmeshClientError(Exception):
    """A call failed. ``code`` is the gRPC status code; details are decoded."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        details: Sequence[pb_message.Message] = (),
    ) -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.details: tuple[pb_message.Message, ...] = tuple(details)
        """Every decoded ``google.rpc`` detail message (BadRequest, RetryInfo, ErrorInfo, ...)."""
        violations: list[FieldViolation] = []
        retry_delay: float | None = None
        for detail in self.details:
            if isinstance(detail, error_details_pb2.BadRequest):
                violations += [FieldViolation(v.field, v.description) for v in detail.field_violations]
            elif isinstance(detail, error_details_pb2.RetryInfo):
                retry_delay = detail.retry_delay.ToTimedelta().total_seconds()
        self.field_violations: tuple[FieldViolation, ...] = tuple(violations)
        """From ``google.rpc.BadRequest``: which request fields were wrong and why."""
        self.retry_delay: float | None = retry_delay
        """From ``google.rpc.RetryInfo``: seconds to wait before trying again."""
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.code.name}: {self.message}"
        if self.field_violations and not all(v.field in self.message for v in self.field_violations):
            text += " (" + "; ".join(f"{v.field}: {v.description}" for v in self.field_violations) + ")"
        if self.retry_delay is not None:
            text += f" (retry after {self.retry_delay:g} s)"
        return text


class InvalidArgumentError(LlmeshClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(LlmeshClientError):
    code = grpc.StatusCode.NOT_FOUND


class UnauthenticatedError(LlmeshClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(LlmeshClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(LlmeshClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(LlmeshClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(LlmeshClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class RequestCancelledError(LlmeshClientError):
    code = grpc.StatusCode.CANCELLED


class FailedPreconditionError(LlmeshClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class InternalError(LlmeshClientError):
    code = grpc.StatusCode.INTERNAL


class StreamProtocolError(LlmeshClientError):
    """The server broke the stream contract (e.g. no final message)."""

    code = grpc.StatusCode.INTERNAL


_ERROR_CLASSES: dict[grpc.StatusCode, type[LlmeshClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        UnauthenticatedError,
        PermissionDeniedError,
        ResourceExhaustedError,
        UnavailableError,
        DeadlineExceededError,
        RequestCancelledError,
        FailedPreconditionError,
        InternalError,
    )
}

_DETAIL_TYPES: dict[str, type[pb_message.Message]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (
        error_details_pb2.BadRequest,
        error_details_pb2.RetryInfo,
        error_details_pb2.ErrorInfo,
        error_details_pb2.DebugInfo,
        error_details_pb2.QuotaFailure,
        error_details_pb2.PreconditionFailure,
        error_details_pb2.RequestInfo,
        error_details_pb2.ResourceInfo,
        error_details_pb2.Help,
        error_details_pb2.LocalizedMessage,
    )
}


def _decode_details(status: status_pb2.Status) -> list[pb_message.Message]:
    decoded: list[pb_message.Message] = []
    for packed in status.details:
        cls = _DETAIL_TYPES.get(packed.TypeName())
        if cls is None:
            continue  # an application-specific detail this client does not know
        detail = cls()
        if packed.Unpack(detail):
            decoded.append(detail)
    return decoded


def error_from_rpc(err: grpc.RpcError) -> LlmeshClientError:
    """Turn a failed call (sync ``grpc.RpcError`` or ``grpc.aio.AioRpcError``) into our error."""
    code_fn = getattr(err, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(err, "details", None)
    message = (details_fn() if callable(details_fn) else None) or code.name.lower().replace("_", " ")
    details: list[pb_message.Message] = []
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        status = None  # inconsistent or missing rich status: keep code and message
    if status is not None:
        details = _decode_details(status)
    cls = _ERROR_CLASSES.get(code, LlmeshClientError)
    return cls(message, code=code, details=details)


# --------------------------------------------------------------------------- requests

_FINISH_REASONS: dict[int, str] = {
    inference_pb2.FINISH_REASON_UNSPECIFIED: "",
    inference_pb2.FINISH_REASON_STOP: "stop",
    inference_pb2.FINISH_REASON_LENGTH: "length",
    inference_pb2.FINISH_REASON_CANCELLED: "cancelled",
    inference_pb2.FINISH_REASON_CONTENT_FILTER: "content_filter",
    inference_pb2.FINISH_REASON_ERROR: "error",
}

# GenerateOptions keys that are fields of SamplingParams (the rest sit on the request),
# taken from the public proto so a field it gains is an option with no change here.
_SAMPLING_FIELDS = tuple(inference_pb2.SamplingParams.DESCRIPTOR.fields)


def _to_message(item: MessageLike, index: int) -> inference_pb2.ChatMessage:
    if isinstance(item, ChatMessage):
        role, content = item.role, item.content
    elif isinstance(item, Mapping):
        try:
            role, content = item["role"], item["content"]
        except KeyError as exc:
            raise ValueError(f"messages[{index}]: missing key {exc.args[0]!r}") from None
    elif isinstance(item, tuple) and len(item) == 2:
        role, content = item
    else:
        raise TypeError(f"messages[{index}]: expected ChatMessage, mapping or (role, content) tuple")
    return inference_pb2.ChatMessage(role=str(role), content=str(content))


def _sampling(options: Mapping[str, Any]) -> inference_pb2.SamplingParams:
    sampling = inference_pb2.SamplingParams()
    for f in _SAMPLING_FIELDS:
        value = options.get(f.name)
        if f.is_repeated:
            if not value:
                continue
            if isinstance(value, str):  # one stop string (a str is a sequence of them, too)
                value = [value]
        elif value is None:
            continue
        try:
            if f.is_repeated:
                getattr(sampling, f.name).extend(list(value))
            else:
                setattr(sampling, f.name, value)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{f.name}: invalid value {value!r} ({exc})") from None
    return sampling


_KNOWN_OPTIONS = frozenset((*(f.name for f in _SAMPLING_FIELDS), "priority", "request_id"))


def _input_fields(
    prompt: str | None, messages: Sequence[MessageLike] | None
) -> dict[str, Any]:
    if prompt is not None and messages is not None:
        raise ValueError("give either prompt or messages, not both")
    if prompt is None and messages is None:
        raise ValueError("give a prompt or messages")
    if messages is not None:
        return {"messages": [_to_message(m, i) for i, m in enumerate(messages)]}
    return {"prompt": prompt}


def _generate_fields(
    prompt: str | None,
    messages: Sequence[MessageLike] | None,
    model: str,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    unknown = set(options) - _KNOWN_OPTIONS
    if unknown:
        raise TypeError(f"unknown generate option(s): {', '.join(sorted(unknown))}")
    return {
        "model": model,
        **_input_fields(prompt, messages),
        "sampling": _sampling(options),
        "priority": int(options.get("priority") or 0),
        "request_id": str(options.get("request_id") or ""),
    }


def _stream_options(interval: int, max_delay_ms: int) -> inference_pb2.StreamOptions | None:
    if not interval and not max_delay_ms:
        return None
    try:
        return inference_pb2.StreamOptions(interval=interval, max_delay_ms=max_delay_ms)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"stream options: invalid value ({exc})") from None


def _logprobs(items: Sequence[inference_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in items
    ]


def completion_from_proto(
    resp: inference_pb2.GenerateResponse,
    *,
    text: str | None = None,
    token_ids: Sequence[int] = (),
    logprobs: Sequence[TokenLogprob] = (),
) -> Completion:
    """A :class:`Completion` from a response; ``text``/tokens override when they were streamed."""
    return Completion(
        text=resp.text if text is None else text,
        finish_reason=_FINISH_REASONS.get(resp.finish_reason, str(resp.finish_reason)),
        matched_stop=resp.matched_stop,
        usage=Usage(resp.usage.prompt_tokens, resp.usage.completion_tokens, resp.usage.cached_tokens),
        served_by=ServedBy(
            resp.served_by.worker_id,
            resp.served_by.zone,
            resp.served_by.device,
            resp.served_by.degraded,
            resp.served_by.resumed,
        ),
        timing=Timing(resp.timing.queue_ms, resp.timing.ttft_ms, resp.timing.total_ms),
        request_id=resp.request_id,
        model=resp.model,
        token_ids=tuple(resp.token_ids) or tuple(token_ids),
        logprobs=tuple(_logprobs(resp.logprobs)) or tuple(logprobs),
    )


def _tokenization(resp: inference_pb2.TokenizeResponse) -> Tokenization:
    return Tokenization(resp.model, tuple(resp.token_ids), resp.count, resp.tokenizer_checksum)


def _models(resp: inference_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [
        ModelInfo(m.id, m.max_context_length, m.tokenizer_checksum, m.is_default) for m in resp.models
    ]


# --------------------------------------------------------------------------- channels


@dataclass(frozen=True)
class RetryPolicy:
    """gRPC's own retry of calls that failed before any response (a ``retryPolicy``)."""

    max_attempts: int = 3
    """Attempts in total, first one included (gRPC caps this at 5); 1 disables retries."""
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    backoff_multiplier: float = 2.0
    retryable_codes: tuple[str, ...] = ("UNAVAILABLE",)

    def service_config(self) -> str:
        """The JSON service config for the ``grpc.service_config`` channel option."""
        method: dict[str, Any] = {"name": [{"service": SERVICE_NAME}]}
        if self.max_attempts > 1:
            method["retryPolicy"] = {
                "maxAttempts": self.max_attempts,
                "initialBackoff": f"{self.initial_backoff_s:.3f}s",
                "maxBackoff": f"{self.max_backoff_s:.3f}s",
                "backoffMultiplier": self.backoff_multiplier,
                "retryableStatusCodes": list(self.retryable_codes),
            }
        return json.dumps({"methodConfig": [method]})


class _Default(enum.Enum):
    TIMEOUT = enum.auto()


_DEFAULT = _Default.TIMEOUT
Timeout = float | None | _Default


@dataclass
class _Connection:
    """What both clients need to open a channel and decorate calls."""

    target: str
    api_key: str | None
    timeout: float | None
    retry: RetryPolicy
    credentials: grpc.ChannelCredentials | None
    options: list[tuple[str, Any]] = field(default_factory=list)

    def call_kwargs(self, timeout: Timeout, metadata: Sequence[tuple[str, str]] | None) -> dict[str, Any]:
        md: list[tuple[str, str]] = []
        if self.api_key:
            md.append(("authorization", f"Bearer {self.api_key}"))
        md += list(metadata or ())
        return {
            "timeout": self.timeout if isinstance(timeout, _Default) else timeout,
            "metadata": tuple(md) or None,
        }


def _read(path: str | Path | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def _connection(
    target: str,
    *,
    api_key: str | None,
    tls: bool | None,
    ca: str | Path | None,
    cert: str | Path | None,
    key: str | Path | None,
    server_name: str | None,
    timeout: float | None,
    retry: RetryPolicy | None,
    max_attempts: int | None,
    options: Sequence[tuple[str, Any]],
) -> _Connection:
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both cert and key")
    if retry is None:
        retry = RetryPolicy() if max_attempts is None else RetryPolicy(max_attempts=max_attempts)
    use_tls = bool(ca or cert) if tls is None else tls
    if not use_tls and (ca or cert):
        raise ValueError("ca/cert/key given but tls=False")
    credentials = None
    if use_tls:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(ca, "CA file"),
            private_key=_read(key, "client key"),
            certificate_chain=_read(cert, "client certificate"),
        )
    channel_options: list[tuple[str, Any]] = [
        ("grpc.primary_user_agent", f"llmesh-client/{__version__}"),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.enable_retries", 1 if retry.max_attempts > 1 else 0),
        ("grpc.service_config", retry.service_config()),
    ]
    if server_name:
        channel_options.append(("grpc.ssl_target_name_override", server_name))
    channel_options += list(options)
    return _Connection(target, api_key, timeout, retry, credentials, channel_options)


# --------------------------------------------------------------------------- streams


class _StreamState:
    """Accumulates deltas and the final message; shared by the sync and async streams."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.final: Completion | None = None
        self.error: LlmeshClientError | None = None
        self.done = False

    def accept(self, resp: inference_pb2.GenerateStreamResponse) -> str | None:
        """Take one message; return the delta text to yield (None for nothing)."""
        kind = resp.WhichOneof("kind")
        if kind == "delta":
            self.token_ids += resp.delta.token_ids
            self.logprobs += _logprobs(resp.delta.logprobs)
            if resp.delta.text:
                self.parts.append(resp.delta.text)
                return resp.delta.text
            return None
        if kind == "final":
            streamed = "".join(self.parts)
            self.final = completion_from_proto(
                resp.final,
                text=streamed if self.parts else resp.final.text,
                token_ids=self.token_ids,
                logprobs=self.logprobs,
            )
        return None

    def finish(self) -> None:
        self.done = True
        if self.final is None:
            self.error = StreamProtocolError("stream ended without a final message")
            raise self.error

    def fail(self, err: LlmeshClientError) -> LlmeshClientError:
        self.done = True
        self.error = err
        return err

    def require_final(self) -> Completion:
        if self.error is not None:
            raise self.error
        if self.final is None or not self.done:
            raise RuntimeError("the stream is not finished: iterate it to the end or call completion()")
        return self.final


class CompletionStream:
    """Iterator of text deltas of one ``GenerateStream`` call; ``.final`` once exhausted."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._state = _StreamState()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> str:
        state = self._state
        if state.error is not None:
            raise state.error
        if state.done:
            raise StopIteration
        while True:
            try:
                resp = next(self._call)
            except StopIteration:
                state.finish()
                raise
            except grpc.RpcError as err:
                raise state.fail(error_from_rpc(err)) from None
            except BaseException:
                self._call.cancel()  # KeyboardInterrupt and the like: stop the server's work
                raise
            text = state.accept(resp)
            if text is not None:
                return text

    @property
    def final(self) -> Completion:
        """The finished :class:`Completion`; raises if the stream is not exhausted (or failed)."""
        return self._state.require_final()

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._state.parts)

    @property
    def done(self) -> bool:
        return self._state.done

    def completion(self) -> Completion:
        """Drain the remaining deltas and return the final :class:`Completion`."""
        for _ in self:
            pass
        return self.final

    def cancel(self) -> None:
        """Cancel the call (the mesh aborts the generation)."""
        if not self._state.done:
            self._call.cancel()
            self._state.fail(RequestCancelledError("cancelled by the client"))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class AsyncCompletionStream:
    """Async iterator of text deltas of one ``GenerateStream`` call; ``.final`` once exhausted.

    If the task iterating it is cancelled, the call is cancelled too.
    """

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call
        self._state = _StreamState()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> str:
        state = self._state
        if state.error is not None:
            raise state.error
        if state.done:
            raise StopAsyncIteration
        while True:
            try:
                resp = await self._call.read()
            except grpc.RpcError as err:
                raise state.fail(error_from_rpc(err)) from None
            except BaseException:
                # asyncio.CancelledError: our caller went away, so should the generation.
                self._call.cancel()
                raise
            if resp is grpc.aio.EOF:
                state.finish()
                raise StopAsyncIteration
            text = state.accept(resp)
            if text is not None:
                return text

    @property
    def final(self) -> Completion:
        """The finished :class:`Completion`; raises if the stream is not exhausted (or failed)."""
        return self._state.require_final()

    @property
    def text(self) -> str:
        return "".join(self._state.parts)

    @property
    def done(self) -> bool:
        return self._state.done

    async def completion(self) -> Completion:
        """Drain the remaining deltas and return the final :class:`Completion`."""
        async for _ in self:
            pass
        return self.final

    def cancel(self) -> None:
        if not self._state.done:
            self._call.cancel()
            self._state.fail(RequestCancelledError("cancelled by the client"))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


# --------------------------------------------------------------------------- clients


class _ClientBase:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool | None = None,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """Open a channel to ``target``.

        ``api_key``: sent as ``authorization: Bearer <key>``. ``ca``: PEM CA to verify the
        server (turns TLS on); ``tls=True`` without ``ca`` uses the system roots.
        ``cert``/``key``: client certificate for mutual TLS. ``server_name``: expected
        name in the server certificate when it differs from the target host.
        ``timeout``: default deadline in seconds of every call (None = none).
        ``max_attempts``/``retry``: retries on UNAVAILABLE (see :class:`RetryPolicy`).
        ``options``: extra gRPC channel options.
        """
        self._conn = _connection(
            target,
            api_key=api_key,
            tls=tls,
            ca=ca,
            cert=cert,
            key=key,
            server_name=server_name,
            timeout=timeout,
            retry=retry,
            max_attempts=max_attempts,
            options=options,
        )
        self._open()

    def _open(self) -> None:
        raise NotImplementedError

    @property
    def target(self) -> str:
        return self._conn.target

    @property
    def retry_policy(self) -> RetryPolicy:
        return self._conn.retry


class Client(_ClientBase):
    """Blocking client. Use as a context manager or call :meth:`close`."""

    def _open(self) -> None:
        conn = self._conn
        if conn.credentials is not None:
            self._channel = grpc.secure_channel(conn.target, conn.credentials, options=conn.options)
        else:
            self._channel = grpc.insecure_channel(conn.target, options=conn.options)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """The whole completion of ``prompt`` (raw text) or ``messages`` (chat template)."""
        req = inference_pb2.GenerateRequest(**_generate_fields(prompt, messages, model, options))
        try:
            resp = self._stub.Generate(req, **self._conn.call_kwargs(timeout, metadata))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return completion_from_proto(resp)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
        stream_interval: int = 0,
        stream_max_delay_ms: int = 0,
        **options: Unpack[GenerateOptions],
    ) -> CompletionStream:
        """Start a streamed generation; iterate the result for text deltas.

        ``stream_interval`` asks for a delta per that many tokens (fewer messages, burstier
        text; the first delta still comes at once) and ``stream_max_delay_ms`` bounds how
        long text waits for it; 0 leaves both to the gateway's deployment defaults.
        """
        req = inference_pb2.GenerateStreamRequest(**_generate_fields(prompt, messages, model, options),
                                                  stream_options=_stream_options(stream_interval,
                                                                                 stream_max_delay_ms))
        call = self._stub.GenerateStream(req, **self._conn.call_kwargs(timeout, metadata))
        return CompletionStream(call)

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        add_generation_prompt: bool | None = None,
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> Tokenization:
        """Token ids of a prompt, or of messages rendered with the model's chat template."""
        req = inference_pb2.TokenizeRequest(model=model, **_input_fields(prompt, messages))
        if add_generation_prompt is not None:
            req.add_generation_prompt = add_generation_prompt
        try:
            resp = self._stub.Tokenize(req, **self._conn.call_kwargs(timeout, metadata))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return _tokenization(resp)

    def list_models(
        self, *, timeout: Timeout = _DEFAULT, metadata: Sequence[tuple[str, str]] | None = None
    ) -> list[ModelInfo]:
        try:
            resp = self._stub.ListModels(
                inference_pb2.ListModelsRequest(), **self._conn.call_kwargs(timeout, metadata)
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return _models(resp)

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected; raise :class:`UnavailableError` on timeout."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"{self.target} not reachable within {timeout:g} s") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncClient(_ClientBase):
    """asyncio client on grpc.aio. Create it inside a running loop; ``async with`` or ``await close()``."""

    def _open(self) -> None:
        conn = self._conn
        if conn.credentials is not None:
            self._channel = grpc.aio.secure_channel(conn.target, conn.credentials, options=conn.options)
        else:
            self._channel = grpc.aio.insecure_channel(conn.target, options=conn.options)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Completion:
        """The whole completion of ``prompt`` (raw text) or ``messages`` (chat template)."""
        req = inference_pb2.GenerateRequest(**_generate_fields(prompt, messages, model, options))
        try:
            resp = await self._stub.Generate(req, **self._conn.call_kwargs(timeout, metadata))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return completion_from_proto(resp)

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
        stream_interval: int = 0,
        stream_max_delay_ms: int = 0,
        **options: Unpack[GenerateOptions],
    ) -> AsyncCompletionStream:
        """Start a streamed generation (no await needed); ``async for`` over the result.

        ``stream_interval`` asks for a delta per that many tokens (fewer messages, burstier
        text; the first delta still comes at once) and ``stream_max_delay_ms`` bounds how
        long text waits for it; 0 leaves both to the gateway's deployment defaults.
        """
        req = inference_pb2.GenerateStreamRequest(**_generate_fields(prompt, messages, model, options),
                                                  stream_options=_stream_options(stream_interval,
                                                                                 stream_max_delay_ms))
        call = self._stub.GenerateStream(req, **self._conn.call_kwargs(timeout, metadata))
        return AsyncCompletionStream(call)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        model: str = "",
        add_generation_prompt: bool | None = None,
        timeout: Timeout = _DEFAULT,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> Tokenization:
        req = inference_pb2.TokenizeRequest(model=model, **_input_fields(prompt, messages))
        if add_generation_prompt is not None:
            req.add_generation_prompt = add_generation_prompt
        try:
            resp = await self._stub.Tokenize(req, **self._conn.call_kwargs(timeout, metadata))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return _tokenization(resp)

    async def list_models(
        self, *, timeout: Timeout = _DEFAULT, metadata: Sequence[tuple[str, str]] | None = None
    ) -> list[ModelInfo]:
        try:
            resp = await self._stub.ListModels(
                inference_pb2.ListModelsRequest(), **self._conn.call_kwargs(timeout, metadata)
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err) from None
        return _models(resp)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise UnavailableError(f"{self.target} not reachable within {timeout:g} s") from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

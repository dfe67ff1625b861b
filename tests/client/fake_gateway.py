"""A fake ``llmesh.v1.InferenceService`` that behaves like the public contract.

It runs the real shared server plumbing (``create_server``: error-mapping interceptor,
health, TLS) on port 0 in a thread with its own event loop, so blocking clients,
subprocesses and asyncio clients in the test loop can all call it.

Behaviour:
- the answer is ``echo: <input> (turn N)`` where the input is the prompt or the last
  user message and N counts the user messages; it streams word by word, then one final
  ``GenerateResponse`` (empty text, usage, served_by, timing);
- ``max_tokens`` cuts it (finish ``length``), ``stop`` strings end it (finish ``stop``,
  ``matched_stop``); with ``logprobs`` set, each delta carries a token id (its length)
  and logprobs;
- with ``api_key`` set, calls without ``authorization: Bearer <key>`` get UNAUTHENTICATED;
- ``fail_unavailable = N``: the next N calls fail with UNAVAILABLE before any response;
- prompts: ``slow:<s>`` sleeps before the first delta; ``drip...`` sleeps 0.2 s per delta;
  ``no-final`` ends the stream without the final message; ``break...`` fails with UNAVAILABLE
  after two deltas; ``exhausted`` -> RESOURCE_EXHAUSTED with RetryInfo 2.5 s; model
  ``missing`` -> NOT_FOUND; bad sampling values -> INVALID_ARGUMENT with field violations.
Every call (attempt) is recorded with its metadata and remaining deadline.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common import errors
from services.common.server import ServerHandle, create_server
from services.common.settings import ServerSettings

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


@dataclass
class CallRecord:
    method: str
    request: Any
    metadata: dict[str, str]
    time_remaining: float | None
    outcome: str = "running"
    """running, ok, error or cancelled."""


@dataclass
class FakeState:
    api_key: str | None = None
    fail_unavailable: int = 0
    calls: list[CallRecord] = field(default_factory=list)

    def attempts(self, method: str) -> list[CallRecord]:
        return [c for c in self.calls if c.method == method]


def _words(text: str) -> list[str]:
    return re.findall(r"\S+\s*", text)


def _validate(request: Any) -> None:
    has_messages = len(request.messages) > 0
    if bool(request.prompt) == has_messages:
        raise errors.InvalidArgument("prompt", "give exactly one of prompt or messages")
    if request.model == "missing":
        raise errors.NotFound(f"model {request.model!r} is not served")
    if not hasattr(request, "sampling"):
        return
    violations = []
    s = request.sampling
    if s.HasField("temperature") and s.temperature < 0:
        violations.append(
            errors.FieldViolation("sampling.temperature", f"must be >= 0, got {s.temperature:g}")
        )
    if s.HasField("top_p") and not 0 < s.top_p <= 1:
        violations.append(errors.FieldViolation("sampling.top_p", f"must be in (0, 1], got {s.top_p:g}"))
    if violations:
        raise errors.InvalidArgument.many(violations)


def _answer(request: Any) -> tuple[list[str], str, str, int]:
    """(deltas, finish_reason, matched_stop, prompt_tokens)."""
    if request.messages:
        users = [m for m in request.messages if m.role == "user"]
        last = users[-1].content if users else ""
        text = f"echo: {last} (turn {len(users)})"
        prompt_tokens = sum(len(_words(m.content)) for m in request.messages)
    else:
        text = f"echo: {request.prompt}"
        prompt_tokens = len(_words(request.prompt))
    finish, matched = "stop", ""
    stops = [(text.find(s), s) for s in request.sampling.stop if s and s in text]
    if stops:
        pos, matched = min(stops)
        text = text[:pos]
    deltas = _words(text)
    if request.sampling.HasField("max_tokens") and len(deltas) > request.sampling.max_tokens:
        deltas = deltas[: request.sampling.max_tokens]
        finish, matched = "length", ""
    return deltas, finish, matched, prompt_tokens


_FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH}


class FakeInferenceService(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.counter = 0

    def _admit(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> CallRecord:
        md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        record = CallRecord(method, request, md, context.time_remaining())
        self.state.calls.append(record)
        if self.state.api_key is not None and md.get("authorization") != f"Bearer {self.state.api_key}":
            record.outcome = "error"
            raise errors.Unauthenticated("missing or invalid API key")
        if self.state.fail_unavailable > 0:
            self.state.fail_unavailable -= 1
            record.outcome = "error"
            raise errors.Unavailable("fake: no zone can serve right now")
        return record

    def _final(self, request: Any, deltas: list[str], finish: str, matched: str, prompt_tokens: int,
               text: str) -> inference_pb2.GenerateResponse:
        self.counter += 1
        return inference_pb2.GenerateResponse(
            request_id=request.request_id or f"fake-{self.counter}",
            model=request.model or "tiny",
            text=text,
            finish_reason=_FINISH[finish],
            matched_stop=matched,
            usage=inference_pb2.Usage(
                prompt_tokens=prompt_tokens, completion_tokens=len(deltas), cached_tokens=1
            ),
            served_by=inference_pb2.ServedBy(
                worker_id="fake-worker-1", zone="zone-a", device="cpu", degraded=False, resumed=0
            ),
            timing=inference_pb2.Timing(queue_ms=0.5, ttft_ms=12.0, total_ms=34.0),
        )

    async def _special(self, request: Any) -> None:
        if request.prompt == "exhausted":
            raise errors.ResourceExhausted("tenant over its quota", retry_after_s=2.5)
        if request.prompt.startswith("slow:"):
            await asyncio.sleep(float(request.prompt.split(":", 1)[1]))

    async def Generate(self, request, context):
        record = self._admit("Generate", request, context)
        try:
            _validate(request)
            await self._special(request)
            deltas, finish, matched, prompt_tokens = _answer(request)
            reply = self._final(request, deltas, finish, matched, prompt_tokens, "".join(deltas))
        except asyncio.CancelledError:
            record.outcome = "cancelled"
            raise
        except Exception:
            record.outcome = "error"
            raise
        record.outcome = "ok"
        return reply

    async def GenerateStream(self, request, context):
        record = self._admit("GenerateStream", request, context)
        try:
            _validate(request)
            await self._special(request)
            deltas, finish, matched, prompt_tokens = _answer(request)
            for i, delta in enumerate(deltas):
                if request.prompt.startswith("break") and i == 2:
                    raise errors.Unavailable("fake: worker lost mid-stream")
                if request.prompt.startswith("drip"):
                    await asyncio.sleep(0.2)
                out = inference_pb2.StreamDelta(text=delta)
                if request.sampling.HasField("logprobs"):
                    # One "token" per delta: id = its length, with logprobs alternatives.
                    out.token_ids.append(len(delta))
                    out.logprobs.add(
                        token_id=len(delta), logprob=-0.5,
                        top=[inference_pb2.TopLogprob(token_id=len(delta) + 1, logprob=-1.5)]
                        * request.sampling.logprobs,
                    )
                yield inference_pb2.GenerateStreamResponse(delta=out)
            if request.prompt == "no-final":
                record.outcome = "ok"
                return
            yield inference_pb2.GenerateStreamResponse(
                final=self._final(request, deltas, finish, matched, prompt_tokens, "")
            )
        except asyncio.CancelledError:
            record.outcome = "cancelled"
            raise
        except Exception:
            record.outcome = "error"
            raise
        record.outcome = "ok"

    async def Tokenize(self, request, context):
        self._admit("Tokenize", request, context)
        _validate(request)
        if request.messages:
            text = "".join(f"<{m.role}>{m.content}" for m in request.messages)
            if not request.HasField("add_generation_prompt") or request.add_generation_prompt:
                text += "<assistant>"
        else:
            text = request.prompt
        ids = [len(w) for w in _words(text)]
        return inference_pb2.TokenizeResponse(
            model=request.model or "tiny", token_ids=ids, count=len(ids), tokenizer_checksum="sha256:fake"
        )

    async def ListModels(self, request, context):
        self._admit("ListModels", request, context)
        return inference_pb2.ListModelsResponse(
            models=[
                inference_pb2.ModelInfo(
                    id="tiny", max_context_length=2048, tokenizer_checksum="sha256:fake", is_default=True
                ),
                inference_pb2.ModelInfo(
                    id="smollm2", max_context_length=8192, tokenizer_checksum="sha256:other"
                ),
            ]
        )


class FakeGateway:
    """The fake service on 127.0.0.1:<ephemeral port>, in its own thread and event loop."""

    def __init__(self, *, tls_cert: str = "", tls_key: str = "", tls_client_ca: str = "") -> None:
        self.state = FakeState()
        self.settings = ServerSettings(
            host="127.0.0.1", port=0, tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=tls_client_ca
        )
        self.port = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def reset(self) -> None:
        self.state.api_key = None
        self.state.fail_unavailable = 0
        self.state.calls.clear()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        service = FakeInferenceService(self.state)
        handle: ServerHandle = await create_server(
            self.settings,
            tier="fake-gateway",
            register=lambda s: inference_pb2_grpc.add_InferenceServiceServicer_to_server(service, s),
            service_names=[SERVICE],
            tracing=False,
        )
        await handle.server.start()
        await handle.set_live(True)
        await handle.set_ready(True)
        self.port = handle.port
        self._started.set()
        await self._stop.wait()
        await handle.server.stop(0.5)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            self._error = exc
            self._started.set()
        finally:
            self._loop.close()

    def start(self) -> FakeGateway:
        self._thread = threading.Thread(target=self._run, name="fake-gateway", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("fake gateway did not start")
        if self._error is not None:
            raise RuntimeError("fake gateway failed to start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

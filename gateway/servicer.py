"""llmesh.v1.InferenceService: authenticate, convert, call the core, convert back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from gateway import convert
from gateway.core import Deadline, GatewayCore
from gateway.tenants import AuthenticationFailed, Tenant
from gateway.types import ChatTurn, TextDelta
from llmesh.v1 import inference_pb2, inference_pb2_grpc
from services.common.errors import InvalidArgument
from services.common.interceptors import refusing_handler

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


def _find_authorization(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    return _find_authorization(context.invocation_metadata())


class AuthGate(grpc.aio.ServerInterceptor):
    """Authenticates InferenceService calls from their metadata, before the request is read.

    A call without a valid key costs a hash and a status: its message (up to the size cap)
    is neither buffered whole nor parsed, so keyless callers cannot make the gateway
    allocate. The refusal is counted, audited and logged by the core. Health and
    reflection stay open for probes. The servicer still looks the tenant up (cheap).
    """

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        try:
            self.core.tenants.authenticate(_find_authorization(handler_call_details.invocation_metadata))
        except AuthenticationFailed as exc:
            refused = exc

            def record(context: grpc.aio.ServicerContext) -> None:
                self.core.record_auth_failure(refused, peer=context.peer() or "", surface="grpc")

            return refusing_handler(handler, exc, tier="gateway", method=method, on_refused=record)
        return handler


def _deadline(context: grpc.aio.ServicerContext) -> Deadline:
    return Deadline.after(context.time_remaining())


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self.core.authenticate(_authorization(context), peer=context.peer() or "", surface="grpc")

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        tenant = self._tenant(context)
        completion = await self.core.generate(tenant, convert.call_from_proto(request), _deadline(context))
        return convert.completion_to_proto(completion)

    async def GenerateStream(
        self, request: inference_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        tenant = self._tenant(context)
        stream = self.core.generate_stream(tenant, convert.call_from_proto(request), _deadline(context))
        try:
            async for item in stream:
                if isinstance(item, TextDelta):
                    yield convert.delta_to_proto(item)
                else:
                    yield inference_pb2.GenerateStreamResponse(final=convert.completion_to_proto(item))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        tenant = self._tenant(context)
        if request.prompt and request.messages:
            raise InvalidArgument("messages", "set either prompt or messages, not both")
        meta, encoded = await self.core.tokenize(
            tenant, request.model, request.prompt,
            [ChatTurn(m.role, m.content) for m in request.messages],
            request.add_generation_prompt if request.HasField("add_generation_prompt") else None,
            _deadline(context),
        )
        return inference_pb2.TokenizeResponse(
            model=meta.id, token_ids=encoded.token_ids, count=len(encoded.token_ids),
            tokenizer_checksum=encoded.tokenizer_checksum,
        )

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        self._tenant(context)
        models = await self.core.list_models(_deadline(context))
        default = (await self.core.resolve_model("", _deadline(context))).id if models else ""
        return inference_pb2.ListModelsResponse(models=[
            inference_pb2.ModelInfo(
                id=m.id, max_context_length=m.max_context_length,
                tokenizer_checksum=m.tokenizer_checksum, is_default=m.id == default,
            )
            for m in models
        ])

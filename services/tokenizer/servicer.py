"""TokenizerService servicer: convert, call the core, convert back (errors map centrally)."""

from __future__ import annotations

import grpc
from opentelemetry import trace

from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer import convert, metrics
from services.tokenizer.core import EncodeInput, EncodeResult, TokenizerCore

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


def _count(item: EncodeInput, result: EncodeResult) -> None:
    # Sizes only on the RPC span (the interceptor's); never the text.
    span = trace.get_current_span()
    span.set_attribute("llmesh.model", result.model)
    span.set_attribute("llmesh.prompt_tokens", result.count)
    metrics.INPUTS.labels(result.model, "messages" if item.messages else "prompt").inc()
    metrics.TOKENS.labels(result.model).inc(result.count)
    if result.truncated:
        metrics.TRUNCATIONS.labels(result.model).inc()


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        item = convert.encode_input_from_proto(request.input)
        result = await self.core.encode(item, "input")
        _count(item, result)
        return tokenizer_pb2.EncodeResponse(result=convert.encode_result_to_proto(result))

    async def EncodeBatch(
        self, request: tokenizer_pb2.EncodeBatchRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeBatchResponse:
        items = [convert.encode_input_from_proto(i) for i in request.inputs]
        results = await self.core.encode_batch(items, "inputs")
        for item, result in zip(items, results, strict=True):
            _count(item, result)
        return tokenizer_pb2.EncodeBatchResponse(
            results=[convert.encode_result_to_proto(r) for r in results]
        )

    async def ListModels(
        self, request: tokenizer_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ListModelsResponse:
        return tokenizer_pb2.ListModelsResponse(models=[
            convert.model_to_proto(model, is_default=name == self.core.default_model)
            for name, model in self.core.models.items()
        ])

"""TokenizerService servicer: convert, call the core, convert back (errors map centrally)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer import convert
from services.tokenizer.core import TokenizerCore
from services.tokenizer.metrics import count_encoded
from services.tokenizer.session import EncodeMux

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"].full_name


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def Encode(
        self, request: tokenizer_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeResponse:
        item = convert.encode_input_from_proto(request.input)
        result = await self.core.encode(item, "input")
        count_encoded(item, result)
        return tokenizer_pb2.EncodeResponse(result=convert.encode_result_to_proto(result))

    async def EncodeBatch(
        self, request: tokenizer_pb2.EncodeBatchRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.EncodeBatchResponse:
        items = [convert.encode_input_from_proto(i) for i in request.inputs]
        results = await self.core.encode_batch(items, "inputs")
        for item, result in zip(items, results, strict=True):
            count_encoded(item, result)
        return tokenizer_pb2.EncodeBatchResponse(
            results=[convert.encode_result_to_proto(r) for r in results]
        )

    async def Session(
        self,
        request_iterator: AsyncIterator[tokenizer_pb2.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[tokenizer_pb2.SessionResponse]:
        """Many Encode requests over one stream (services/tokenizer/session.py)."""
        async for frame in EncodeMux(self.core).serve(request_iterator):
            yield frame

    async def ListModels(
        self, request: tokenizer_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.ListModelsResponse:
        return tokenizer_pb2.ListModelsResponse(models=[
            convert.model_to_proto(model, is_default=name == self.core.default_model)
            for name, model in self.core.models.items()
        ])

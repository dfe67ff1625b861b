"""Proto <-> domain conversion for the tokenizer tier."""

from __future__ import annotations

from llmesh.tokenizer.v1 import tokenizer_pb2
from services.tokenizer.core import ChatMessage, EncodeInput, EncodeResult
from services.tokenizer.loader import LoadedTokenizer


def encode_input_from_proto(msg: tokenizer_pb2.EncodeInput) -> EncodeInput:
    return EncodeInput(
        model=msg.model,
        prompt=msg.prompt,
        messages=tuple(ChatMessage(role=m.role, content=m.content) for m in msg.messages),
        add_generation_prompt=(
            msg.add_generation_prompt if msg.HasField("add_generation_prompt") else None
        ),
        truncate_to=msg.truncate_to,
        add_special_tokens=msg.add_special_tokens if msg.HasField("add_special_tokens") else None,
    )


def encode_result_to_proto(result: EncodeResult) -> tokenizer_pb2.EncodeResult:
    return tokenizer_pb2.EncodeResult(
        model=result.model,
        token_ids=result.token_ids,
        count=result.count,
        truncated=result.truncated,
        tokenizer_checksum=result.tokenizer_checksum,
    )


def model_to_proto(model: LoadedTokenizer, *, is_default: bool) -> tokenizer_pb2.TokenizerModel:
    return tokenizer_pb2.TokenizerModel(
        model=model.name,
        tokenizer_checksum=model.checksum,
        max_context_length=model.max_context_length,
        vocab_size=model.vocab_size,
        eos_token_ids=list(model.eos_token_ids),
        is_default=is_default,
    )

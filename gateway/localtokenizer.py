"""The tokenizer's work inside the gateway's process (``tokenizer_transport: local``).

A request's prompt or chat is rendered and encoded by the very
:class:`~services.tokenizer.core.TokenizerCore` a tokenizer replica runs (its chat
templates, validation, limits and encode threads), without the round trip to another
process before the request can go to a router. Errors are the ones a replica's answer
gives the gateway: field violations with the public field paths, other messages prefixed
with the tier's name.
"""

from __future__ import annotations

import asyncio
import math

from gateway.tiers import TOKENIZER_FIELD_PREFIXES, tier_prefixed
from gateway.types import ChatTurn, Encoded, ModelMeta
from services.common import errors
from services.tokenizer.core import ChatMessage, EncodeInput, TokenizerCore
from services.tokenizer.metrics import count_encoded

_FIELD = TOKENIZER_FIELD_PREFIXES[0].rstrip(".")
"""The name the tokenizer's EncodeRequest gives the request's input (stripped again)."""


class LocalTokenizerTier:
    """The tokenizer tier as one in-process replica (the gateway's TokenizerTier)."""

    def __init__(self, core: TokenizerCore) -> None:
        self.core = core

    async def encode(
        self, model: str, prompt: str, messages: list[ChatTurn], *,
        add_generation_prompt: bool | None, timeout: float | None,
    ) -> Encoded:
        item = EncodeInput(
            model=model, prompt=prompt,
            messages=tuple(ChatMessage(role=m.role, content=m.content) for m in messages),
            add_generation_prompt=add_generation_prompt,
        )
        limit = timeout if timeout is not None and math.isfinite(timeout) else None
        try:
            # A timeout scope, not wait_for: no task of its own per request.
            async with asyncio.timeout(limit):
                result = await self.core.encode(item, _FIELD)
        except TimeoutError:
            raise errors.DeadlineExceeded("tokenizer: deadline passed") from None
        except errors.LlmeshError as exc:
            public = errors.with_public_fields(exc, TOKENIZER_FIELD_PREFIXES)
            raise tier_prefixed(public, "tokenizer") from None
        count_encoded(item, result)
        return Encoded(model=result.model, token_ids=result.token_ids,
                       tokenizer_checksum=result.tokenizer_checksum, truncated=result.truncated)

    async def list_models(self, *, timeout: float | None) -> list[ModelMeta]:
        return [
            ModelMeta(id=name, max_context_length=model.max_context_length,
                      tokenizer_checksum=model.checksum, is_default=name == self.core.default_model,
                      vocab_size=model.vocab_size)
            for name, model in self.core.models.items()
        ]

    async def close(self) -> None:
        self.core.close()

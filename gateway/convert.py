"""Conversions between protobuf messages and the gateway's domain types."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.types import (
    ChatTurn,
    Completion,
    GenerateCall,
    PostConfig,
    PostFinal,
    Sampling,
    StreamOptions,
    TextDelta,
    TokenGeneration,
    TokenLogprob,
    TopLogprob,
)
from llmesh.common.v1 import common_pb2
from llmesh.postprocess.v1 import postprocess_pb2
from llmesh.router.v1 import router_pb2
from llmesh.tokenizer.v1 import tokenizer_pb2
from llmesh.v1 import inference_pb2
from services.common import generation_convert
from services.common.generation import TokenRequest
from services.common.sampling import FIELDS
from services.common.sampling_convert import sampling_from_message


def sampling_from_proto(msg: inference_pb2.SamplingParams) -> Sampling:
    """Every field of :class:`Sampling` from the public message (unset stays None)."""
    return sampling_from_message(msg, FIELDS)


def call_from_proto(msg: inference_pb2.GenerateRequest | inference_pb2.GenerateStreamRequest) -> GenerateCall:
    call = GenerateCall(
        model=msg.model,
        prompt=msg.prompt,
        messages=[ChatTurn(role=m.role, content=m.content) for m in msg.messages],
        sampling=sampling_from_proto(msg.sampling),
        priority=msg.priority,
        request_id=msg.request_id,
    )
    if isinstance(msg, inference_pb2.GenerateStreamRequest) and msg.HasField("stream_options"):
        call.stream_options = StreamOptions(
            interval=msg.stream_options.interval, max_delay_ms=msg.stream_options.max_delay_ms,
        )
    return call


def engine_sampling(s: Sampling) -> common_pb2.EngineSampling:
    """The set fields that reach the engine (stop strings do not)."""
    return generation_convert.sampling_to_proto(s)


def token_request_of(g: TokenGeneration) -> TokenRequest:
    """The generation as every tier below the gateway takes it (the shared domain type)."""
    return TokenRequest(
        request_id=g.request_id, model=g.model, prompt_token_ids=tuple(g.prompt_token_ids),
        sampling=g.sampling, priority=g.priority,
    )


def token_request(g: TokenGeneration) -> common_pb2.TokenRequest:
    return generation_convert.request_to_proto(token_request_of(g))


def router_generate_request(g: TokenGeneration, resume_token_ids: list[int], resumed: int
                            ) -> router_pb2.GenerateRequest:
    """One generation (or its resumption after ``resume_token_ids``) as the router takes it."""
    return router_pb2.GenerateRequest(
        request=token_request(g), resume_token_ids=resume_token_ids, resumed=resumed, tenant=g.tenant,
    )


def encode_input(
    model: str, prompt: str, messages: list[ChatTurn], add_generation_prompt: bool | None
) -> tokenizer_pb2.EncodeInput:
    msg = tokenizer_pb2.EncodeInput(
        model=model, prompt=prompt,
        messages=[tokenizer_pb2.ChatMessage(role=m.role, content=m.content) for m in messages],
    )
    if add_generation_prompt is not None:
        msg.add_generation_prompt = add_generation_prompt
    return msg


def logprobs_from_common(items: Iterable[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            token_id=i.token_id, logprob=i.logprob,
            top=tuple(TopLogprob(t.token_id, t.logprob) for t in i.top),
        )
        for i in items
    ]


def logprobs_to_public(items: Iterable[TokenLogprob]) -> list[inference_pb2.TokenLogprob]:
    return [
        inference_pb2.TokenLogprob(
            token_id=i.token_id, logprob=i.logprob,
            top=[inference_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob) for t in i.top],
        )
        for i in items
    ]


_UPSTREAM = {
    "stop": postprocess_pb2.UPSTREAM_FINISH_REASON_STOP,
    "length": postprocess_pb2.UPSTREAM_FINISH_REASON_LENGTH,
    "abort": postprocess_pb2.UPSTREAM_FINISH_REASON_ABORT,
    "error": postprocess_pb2.UPSTREAM_FINISH_REASON_ERROR,
}


def upstream_finish(reason: str) -> int:
    return _UPSTREAM.get(reason, postprocess_pb2.UPSTREAM_FINISH_REASON_ERROR)


_FILTER = {
    "off": postprocess_pb2.FILTER_MODE_OFF,
    "redact": postprocess_pb2.FILTER_MODE_REDACT,
    "block": postprocess_pb2.FILTER_MODE_BLOCK,
}


def process_config(c: PostConfig) -> postprocess_pb2.ProcessConfig:
    return postprocess_pb2.ProcessConfig(
        model=c.model, stop=c.stop, skip_special_tokens=c.skip_special_tokens,
        include_stop_str_in_output=c.include_stop_str_in_output,
        filter_mode=_FILTER.get(c.filter_mode, postprocess_pb2.FILTER_MODE_OFF),
        skip_chars=c.skip_chars,
    )


_OUTPUT_FINISH = {
    postprocess_pb2.OUTPUT_FINISH_REASON_STOP: "stop",
    postprocess_pb2.OUTPUT_FINISH_REASON_LENGTH: "length",
    postprocess_pb2.OUTPUT_FINISH_REASON_CANCELLED: "cancelled",
    postprocess_pb2.OUTPUT_FINISH_REASON_CONTENT_FILTER: "content_filter",
    postprocess_pb2.OUTPUT_FINISH_REASON_ERROR: "error",
}


def post_final(msg: postprocess_pb2.ProcessFinal) -> PostFinal:
    return PostFinal(
        finish_reason=_OUTPUT_FINISH.get(msg.finish_reason, "error"), matched_stop=msg.matched_stop,
        completion_tokens=msg.completion_tokens, redactions=msg.redactions,
    )


_PUBLIC_FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "cancelled": inference_pb2.FINISH_REASON_CANCELLED,
    "content_filter": inference_pb2.FINISH_REASON_CONTENT_FILTER,
    "error": inference_pb2.FINISH_REASON_ERROR,
}


def completion_to_proto(c: Completion) -> inference_pb2.GenerateResponse:
    sb = c.served_by
    return inference_pb2.GenerateResponse(
        request_id=c.request_id, model=c.model, text=c.text,
        finish_reason=_PUBLIC_FINISH.get(c.finish_reason, inference_pb2.FINISH_REASON_ERROR),
        matched_stop=c.matched_stop,
        usage=inference_pb2.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                                  cached_tokens=c.cached_tokens),
        served_by=inference_pb2.ServedBy(worker_id=sb.worker_id, zone=sb.zone, device=sb.device,
                                         degraded=sb.degraded, resumed=sb.resumed),
        timing=inference_pb2.Timing(queue_ms=c.timing.queue_ms, ttft_ms=c.timing.ttft_ms,
                                    total_ms=c.timing.total_ms),
        token_ids=c.token_ids, logprobs=logprobs_to_public(c.logprobs),
    )


def delta_to_proto(d: TextDelta) -> inference_pb2.GenerateStreamResponse:
    return inference_pb2.GenerateStreamResponse(delta=inference_pb2.StreamDelta(
        text=d.text, token_ids=d.token_ids, logprobs=logprobs_to_public(d.logprobs),
    ))

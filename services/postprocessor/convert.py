"""Proto <-> domain conversion for the postprocessor tier."""

from __future__ import annotations

from llmesh.postprocess.v1 import postprocess_pb2
from services.common.errors import InvalidArgument
from services.postprocessor.core import FinalResult, FinishReason, SessionConfig, UpstreamFinish
from services.postprocessor.sensitive import FilterMode

_FILTER_MODES: dict[int, FilterMode | None] = {
    postprocess_pb2.FILTER_MODE_UNSPECIFIED: None,
    postprocess_pb2.FILTER_MODE_OFF: FilterMode.OFF,
    postprocess_pb2.FILTER_MODE_REDACT: FilterMode.REDACT,
    postprocess_pb2.FILTER_MODE_BLOCK: FilterMode.BLOCK,
}

_UPSTREAM: dict[int, UpstreamFinish] = {
    postprocess_pb2.UPSTREAM_FINISH_REASON_UNSPECIFIED: UpstreamFinish.UNSPECIFIED,
    postprocess_pb2.UPSTREAM_FINISH_REASON_STOP: UpstreamFinish.STOP,
    postprocess_pb2.UPSTREAM_FINISH_REASON_LENGTH: UpstreamFinish.LENGTH,
    postprocess_pb2.UPSTREAM_FINISH_REASON_ABORT: UpstreamFinish.ABORT,
    postprocess_pb2.UPSTREAM_FINISH_REASON_ERROR: UpstreamFinish.ERROR,
}

_FINISH: dict[FinishReason, int] = {
    FinishReason.STOP: postprocess_pb2.OUTPUT_FINISH_REASON_STOP,
    FinishReason.LENGTH: postprocess_pb2.OUTPUT_FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: postprocess_pb2.OUTPUT_FINISH_REASON_CANCELLED,
    FinishReason.CONTENT_FILTER: postprocess_pb2.OUTPUT_FINISH_REASON_CONTENT_FILTER,
    FinishReason.ERROR: postprocess_pb2.OUTPUT_FINISH_REASON_ERROR,
}


def session_config_from_proto(msg: postprocess_pb2.ProcessConfig) -> SessionConfig:
    if msg.filter_mode not in _FILTER_MODES:
        raise InvalidArgument("config.filter_mode", f"unknown value {msg.filter_mode}")
    return SessionConfig(
        model=msg.model,
        stop=tuple(msg.stop),
        skip_special_tokens=msg.skip_special_tokens if msg.HasField("skip_special_tokens") else True,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        filter_mode=_FILTER_MODES[msg.filter_mode],
        skip_chars=msg.skip_chars,
    )


def upstream_from_proto(value: int) -> UpstreamFinish:
    # An enum value newer than this build: treat as "ended, reason unknown".
    return _UPSTREAM.get(value, UpstreamFinish.UNSPECIFIED)


def final_to_proto(final: FinalResult) -> postprocess_pb2.ProcessFinal:
    return postprocess_pb2.ProcessFinal(
        finish_reason=_FINISH[final.finish_reason],  # type: ignore[arg-type]
        matched_stop=final.matched_stop,
        completion_tokens=final.completion_tokens,
        redactions=final.redactions,
    )


def delta(text: str) -> postprocess_pb2.ProcessResponse:
    return postprocess_pb2.ProcessResponse(delta=postprocess_pb2.TextDelta(text=text))


def final(result: FinalResult) -> postprocess_pb2.ProcessResponse:
    return postprocess_pb2.ProcessResponse(final=final_to_proto(result))

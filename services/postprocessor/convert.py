"""Proto <-> domain conversion for the postprocessor tier."""

from __future__ import annotations

from llmesh.postprocess.v1 import postprocess_pb2
from services.common.errors import InvalidArgument, request_error_to_proto
from services.postprocessor.core import FinalResult, FinishReason, SessionConfig, UpstreamFinish
from services.postprocessor.sensitive import FilterMode
from services.postprocessor.session import Frame, Open, SessionInput

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


def session_input_from_proto(msg: postprocess_pb2.SessionRequest) -> SessionInput:
    """One Session message; a bad config becomes that open's error, token columns that
    do not line up an error of every handle they name."""
    opens = []
    for entry in msg.opens:
        config: SessionConfig | Exception
        try:
            config = session_config_from_proto(entry.config)
        except InvalidArgument as exc:
            config = exc
        opens.append(Open(
            handle=entry.handle, config=config,
            trace_context={"traceparent": entry.traceparent} if entry.traceparent else {},
        ))
    tokens: list[tuple[int, list[int]]] = []
    malformed: list[tuple[int, Exception]] = []
    if len(msg.handles) != len(msg.token_counts) or sum(msg.token_counts) != len(msg.token_ids):
        error = InvalidArgument(
            "token_counts", f"{len(msg.handles)} handles, {len(msg.token_counts)} token counts "
            f"adding up to {sum(msg.token_counts)} and {len(msg.token_ids)} token ids do not line up",
        )
        malformed = [(handle, error) for handle in dict.fromkeys(msg.handles)]
    else:
        ids = list(msg.token_ids)
        offset = 0
        for handle, count in zip(msg.handles, msg.token_counts, strict=True):
            tokens.append((handle, ids[offset:offset + count]))
            offset += count
    return SessionInput(
        opens=opens, tokens=tokens,
        ends=[(end.handle, upstream_from_proto(end.finish_reason)) for end in msg.ends],
        closes=list(msg.closes), malformed=malformed,
    )


def frame_to_proto(frame: Frame) -> postprocess_pb2.SessionResponse:
    """One frame in column layout: handles and their texts, then finals and errors."""
    out = postprocess_pb2.SessionResponse()
    for handle, parts in frame.texts.items():
        out.handles.append(handle)
        out.texts.append("".join(parts))
    for handle, result in frame.finals:
        out.finals.append(postprocess_pb2.SessionFinal(handle=handle, final=final_to_proto(result)))
    for handle, error in frame.errors:
        out.errors.append(postprocess_pb2.SessionError(handle=handle, error=request_error_to_proto(error)))
    return out

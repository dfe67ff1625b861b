"""Proto <-> domain conversion for the worker (small named helpers, no logic)."""

from __future__ import annotations

import uuid

from llmesh.common.v1 import common_pb2
from llmesh.worker.v1 import worker_pb2
from services.common import generation_convert
from services.common.errors import request_error_to_proto
from services.common.generation_convert import delta_to_proto, final_to_proto, logprobs_to_proto
from services.worker.core import Delta, Failed, Final, LoadReport, WorkerIdentity
from services.worker.engine import EngineInfo, EngineRequest
from services.worker.session import Frame, Submission


def request_from_proto(r: common_pb2.TokenRequest, adapter: str = "") -> EngineRequest:
    """An empty request id gets a fresh one (the response carries it)."""
    request = generation_convert.request_from_proto(r)
    return EngineRequest(
        request_id=request.request_id or f"w-{uuid.uuid4().hex}",
        prompt_token_ids=request.prompt_token_ids,
        sampling=request.sampling,
        priority=request.priority,
        adapter=adapter,
        replay_token_ids=request.replay_token_ids,
    )


def generate_response(request_id: str, event: Delta | Final) -> worker_pb2.GenerateResponse:
    if isinstance(event, Delta):
        return worker_pb2.GenerateResponse(request_id=request_id, delta=delta_to_proto(event))
    return worker_pb2.GenerateResponse(request_id=request_id, final=final_to_proto(event))


def batch_response(request_id: str, event: Delta | Final | Failed) -> worker_pb2.GenerateBatchResponse:
    if isinstance(event, Delta):
        return worker_pb2.GenerateBatchResponse(request_id=request_id, delta=delta_to_proto(event))
    if isinstance(event, Failed):
        return worker_pb2.GenerateBatchResponse(
            request_id=request_id, error=request_error_to_proto(event.error)
        )
    return worker_pb2.GenerateBatchResponse(request_id=request_id, final=final_to_proto(event))


def load_to_proto(report: LoadReport) -> worker_pb2.Load:
    return worker_pb2.Load(
        running=report.engine.running,
        waiting=report.engine.waiting,
        kv_cache_usage=report.engine.kv_cache_usage,
        prefix_cache_hit_rate=report.engine.prefix_cache_hit_rate,
        in_flight=report.in_flight,
        max_num_seqs=report.max_num_seqs,
        scheduler_running=report.engine.scheduler_running,
        scheduler_waiting=report.engine.scheduler_waiting,
    )


def model_info_to_proto(identity: WorkerIdentity, info: EngineInfo) -> worker_pb2.GetModelInfoResponse:
    return worker_pb2.GetModelInfoResponse(
        model=identity.model,
        max_context_length=info.max_model_len,
        tokenizer_checksum=identity.tokenizer_checksum,
        device=identity.device,
        zone=identity.zone,
        worker_id=identity.worker_id,
        pid=identity.pid,
        vocab_size=info.vocab_size,
    )


def submission_from_proto(sub: worker_pb2.SessionSubmit, adapter: str | Exception) -> Submission:
    """A session submission; ``adapter`` is the LoRA name, or why the model is unknown."""
    request: EngineRequest | Failed = (
        Failed(adapter) if isinstance(adapter, Exception) else request_from_proto(sub.request, adapter)
    )
    return Submission(
        handle=sub.handle, request=request, timeout_s=sub.timeout_s or None,
        trace_context={"traceparent": sub.traceparent} if sub.traceparent else {},
    )


def frame_to_proto(frame: Frame) -> worker_pb2.SessionResponse:
    """One frame in column layout: handles, token counts and the token ids back to back
    (each column built as a list and handed to the message whole)."""
    tokens = frame.tokens.values()
    return worker_pb2.SessionResponse(
        handles=list(frame.tokens),
        token_counts=[len(t.token_ids) for t in tokens],
        token_ids=[token for t in tokens for token in t.token_ids],
        logprobs=[
            worker_pb2.SessionLogprobs(handle=handle, logprobs=logprobs_to_proto(t.logprobs))
            for handle, t in frame.tokens.items() if t.logprobs
        ],
        finals=[
            worker_pb2.SessionFinal(handle=handle, final=final_to_proto(final))
            for handle, final in frame.finals
        ],
        errors=[
            worker_pb2.SessionError(handle=handle, error=request_error_to_proto(error))
            for handle, error in frame.errors
        ],
    )

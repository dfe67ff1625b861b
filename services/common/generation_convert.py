"""Generation types <-> ``llmesh.common.v1`` messages (and the router's ``RouterFinal``):
the one converter of those boundaries.

The worker's servicer, the router's worker client and the router's servicer read and
write ``TokenRequest`` / ``TokenDelta`` / ``TokenFinal`` here and nowhere else; the
router writes its ``RouterFinal`` and the gateway reads it here too. So the
cores on either side (:mod:`services.router.core`, :mod:`services.worker.core`) work on
:mod:`services.common.generation` types only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2
from services.common.generation import (
    Delta,
    Final,
    FinishReason,
    RouterFinal,
    ServedBy,
    TokenLogprob,
    TokenRequest,
)
from services.common.sampling import ENGINE_FIELDS, Sampling
from services.common.sampling_convert import sampling_from_message, sampling_to_message

FINISH_TO_PROTO: dict[FinishReason, Any] = {
    FinishReason.STOP: common_pb2.ENGINE_FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.ENGINE_FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.ENGINE_FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.ENGINE_FINISH_REASON_ERROR,
}
FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in FINISH_TO_PROTO.items()}


def finish_from_proto(value: int) -> FinishReason:
    """A final without a (known) reason is the engine failing to say why it stopped:
    ERROR, as the gateway has always read it."""
    return FINISH_FROM_PROTO.get(value, FinishReason.ERROR)


def sampling_from_proto(s: common_pb2.EngineSampling) -> Sampling:
    """Unset optional fields stay None: the engine applies its defaults (proto3 presence, not zero)."""
    return sampling_from_message(s, ENGINE_FIELDS)


def sampling_to_proto(s: Sampling) -> common_pb2.EngineSampling:
    """The engine's fields of ``s`` (stop strings never leave the gateway)."""
    return sampling_to_message(s, common_pb2.EngineSampling(), ENGINE_FIELDS)


def request_from_proto(r: common_pb2.TokenRequest) -> TokenRequest:
    return TokenRequest(
        request_id=r.request_id,
        model=r.model,
        prompt_token_ids=tuple(r.prompt_token_ids),
        sampling=sampling_from_proto(r.sampling),
        priority=r.priority,
        replay_token_ids=tuple(r.replay_token_ids),
    )


def request_to_proto(r: TokenRequest) -> common_pb2.TokenRequest:
    return common_pb2.TokenRequest(
        request_id=r.request_id,
        model=r.model,
        prompt_token_ids=r.prompt_token_ids,
        sampling=sampling_to_proto(r.sampling),
        priority=r.priority,
        replay_token_ids=r.replay_token_ids,
    )


def logprobs_to_proto(logprobs: Iterable[TokenLogprob]) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob,
            top=[common_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
        )
        for lp in logprobs
    ]


def logprobs_from_proto(logprobs: Sequence[common_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
        for lp in logprobs
    ]


def delta_to_proto(delta: Delta) -> common_pb2.TokenDelta:
    if delta.logprobs:
        return common_pb2.TokenDelta(token_ids=delta.token_ids, logprobs=logprobs_to_proto(delta.logprobs))
    return common_pb2.TokenDelta(token_ids=delta.token_ids)


def delta_from_proto(delta: common_pb2.TokenDelta) -> Delta:
    return Delta(list(delta.token_ids), logprobs_from_proto(delta.logprobs) if delta.logprobs else None)


def final_to_proto(final: Final) -> common_pb2.TokenFinal:
    msg = common_pb2.TokenFinal(
        finish_reason=FINISH_TO_PROTO[final.finish_reason],
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        queue_ms=final.queue_ms,
        ttft_ms=final.ttft_ms,
        total_ms=final.total_ms,
    )
    if final.stop_token_id is not None:
        msg.stop_token_id = final.stop_token_id
    return msg


def final_from_proto(final: common_pb2.TokenFinal) -> Final:
    return Final(
        finish_reason=finish_from_proto(final.finish_reason),
        stop_token_id=final.stop_token_id if final.HasField("stop_token_id") else None,
        prompt_tokens=final.prompt_tokens,
        completion_tokens=final.completion_tokens,
        cached_tokens=final.cached_tokens,
        queue_ms=final.queue_ms,
        ttft_ms=final.ttft_ms,
        total_ms=final.total_ms,
    )


def router_final_to_proto(event: RouterFinal) -> router_pb2.RouterFinal:
    served = event.served_by
    return router_pb2.RouterFinal(
        final=final_to_proto(event.final),
        served_by=router_pb2.ServedBy(
            worker_id=served.worker_id, zone=served.zone, device=served.device,
            degraded=served.degraded, resumed=served.resumed,
        ),
        retries=event.retries,
    )


def router_final_from_proto(msg: router_pb2.RouterFinal) -> RouterFinal:
    served = msg.served_by
    return RouterFinal(
        final=final_from_proto(msg.final),
        served_by=ServedBy(worker_id=served.worker_id, zone=served.zone, device=served.device,
                           degraded=served.degraded, resumed=served.resumed),
        retries=msg.retries,
    )

"""Wire contract of the one generation converter (domain <-> llmesh.common.v1, and the
router's RouterFinal)."""

from __future__ import annotations

from llmesh.common.v1 import common_pb2
from llmesh.router.v1 import router_pb2
from services.common import generation_convert as gc
from services.common.generation import (
    Delta,
    Final,
    FinishReason,
    RouterFinal,
    ServedBy,
    TokenLogprob,
    TokenRequest,
)
from services.common.sampling import Sampling


def test_request_round_trip_keeps_unset_apart_from_zero() -> None:
    request = TokenRequest(
        request_id="r-1", model="m", prompt_token_ids=(1, 2, 3), priority=-2,
        sampling=Sampling(temperature=0.0, max_tokens=0, stop_token_ids=[7, 8], seed=5),
        replay_token_ids=(4, 5),
    )
    message = gc.request_to_proto(request)
    assert message.sampling.HasField("temperature") and message.sampling.temperature == 0.0
    assert message.sampling.HasField("max_tokens") and message.sampling.max_tokens == 0
    assert not message.sampling.HasField("top_p")
    again = gc.request_from_proto(common_pb2.TokenRequest.FromString(message.SerializeToString()))
    assert again == request
    assert again.sampling.top_p is None


def test_delta_round_trip_with_and_without_logprobs() -> None:
    plain = Delta([1, 2, 3])
    assert gc.delta_from_proto(gc.delta_to_proto(plain)) == plain
    with_logprobs = Delta([9], [TokenLogprob(9, -0.5, ((9, -0.5), (4, -1.25)))])
    message = gc.delta_to_proto(with_logprobs)
    assert [(t.token_id, t.logprob) for t in message.logprobs[0].top] == [(9, -0.5), (4, -1.25)]
    assert gc.delta_from_proto(message) == with_logprobs


def test_final_round_trip_keeps_stop_token_presence() -> None:
    for stop in (None, 0, 2):
        final = Final(FinishReason.STOP, stop, 3, 4, 1, 1.5, 2.5, 3.5)
        message = gc.final_to_proto(final)
        assert message.HasField("stop_token_id") is (stop is not None)
        assert gc.final_from_proto(message) == final


def test_every_finish_reason_has_a_wire_value_and_unspecified_reads_as_error() -> None:
    for reason in FinishReason:
        assert gc.finish_from_proto(gc.FINISH_TO_PROTO[reason]) is reason
    assert gc.finish_from_proto(common_pb2.ENGINE_FINISH_REASON_UNSPECIFIED) is FinishReason.ERROR


def test_router_final_round_trip_is_the_one_both_ends_use() -> None:
    """The router writes and the gateway reads a RouterFinal with this one converter: every
    field, the final's and who served it, comes back as it went."""
    event = RouterFinal(
        Final(FinishReason.LENGTH, stop_token_id=None, prompt_tokens=12, completion_tokens=34,
              cached_tokens=8, queue_ms=1.5, ttft_ms=20.25, total_ms=300.5),
        ServedBy(worker_id="w-1", zone="kunpeng", device="cpu", degraded=True, resumed=2),
        retries=1,
    )
    message = gc.router_final_to_proto(event)
    again = gc.router_final_from_proto(router_pb2.RouterFinal.FromString(message.SerializeToString()))
    assert again == event
    assert gc.router_final_from_proto(router_pb2.RouterFinal()) == RouterFinal(Final(FinishReason.ERROR))

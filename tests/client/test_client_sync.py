"""The blocking client against the fake gateway over real channels."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from llmesh.client import (
    ChatMessage,
    Client,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    LlmeshClientError,
    NotFoundError,
    PermissionDeniedError,
    RequestCancelledError,
    ResourceExhaustedError,
    RetryPolicy,
    StreamProtocolError,
    UnauthenticatedError,
    UnavailableError,
    error_from_rpc,
)

from .fake_gateway import FakeGateway


@pytest.fixture
def client(fake: FakeGateway):
    with Client(fake.address, timeout=10) as c:
        yield c


def test_generate_prompt(client: Client, fake: FakeGateway) -> None:
    done = client.generate("hello world", request_id="r-1", seed=7, temperature=0.0)
    assert done.text == "echo: hello world"
    assert done.finish_reason == "stop"
    assert done.matched_stop == ""
    assert done.request_id == "r-1"
    assert done.model == "tiny"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.cached_tokens) == (2, 3, 1)
    assert (done.served_by.worker_id, done.served_by.zone, done.served_by.device) == (
        "fake-worker-1", "zone-a", "cpu",
    )
    assert done.timing.ttft_ms == 12.0
    sent = fake.state.attempts("Generate")[0].request
    # Set optionals are present, unset ones absent (temperature 0 is not "unset").
    assert sent.sampling.HasField("temperature") and sent.sampling.temperature == 0.0
    assert sent.sampling.seed == 7
    assert not sent.sampling.HasField("max_tokens")
    assert json.loads(json.dumps(done.to_dict()))["usage"]["completion_tokens"] == 3


def test_generate_messages_in_every_form(client: Client, fake: FakeGateway) -> None:
    done = client.generate(
        messages=[
            ChatMessage("system", "be brief"),
            {"role": "user", "content": "first"},
            ("assistant", "ok"),
            {"role": "user", "content": "second"},
        ]
    )
    assert done.text == "echo: second (turn 2)"
    sent = fake.state.attempts("Generate")[0].request
    assert [m.role for m in sent.messages] == ["system", "user", "assistant", "user"]
    assert sent.prompt == ""


def test_max_tokens_and_stop(client: Client) -> None:
    done = client.generate("one two three four five", max_tokens=2)
    assert (done.text, done.finish_reason, done.usage.completion_tokens) == ("echo: one ", "length", 2)
    done = client.generate("one two three four", stop=["thr", "four"])
    assert (done.text, done.finish_reason, done.matched_stop) == ("echo: one two ", "stop", "thr")
    done = client.generate("alpha beta", stop="beta")
    assert done.matched_stop == "beta"


def test_stream_yields_deltas_then_final(client: Client) -> None:
    stream = client.stream("a b c")
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.final
    deltas = list(stream)
    assert deltas == ["echo: ", "a ", "b ", "c"]
    assert stream.done
    final = stream.final
    assert final.text == "".join(deltas) == stream.text
    assert final.finish_reason == "stop"
    assert final.usage.completion_tokens == 4
    assert list(stream) == []  # exhausted stays exhausted


def test_stream_completion_drains(client: Client) -> None:
    stream = client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert next(stream) == "echo: "
    done = stream.completion()
    assert (done.text, done.finish_reason) == ("echo: ", "length")


def test_tokenize_and_list_models(client: Client, fake: FakeGateway) -> None:
    toks = client.tokenize("abc de f")
    assert (toks.token_ids, toks.count, toks.tokenizer_checksum) == ((4, 3, 1), 3, "sha256:fake")
    chat = client.tokenize(messages=[{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert chat.count == 1
    sent = fake.state.attempts("Tokenize")[1].request
    assert sent.HasField("add_generation_prompt") and not sent.add_generation_prompt
    models = client.list_models()
    assert [(m.id, m.is_default, m.max_context_length) for m in models] == [
        ("tiny", True, 2048), ("smollm2", False, 8192),
    ]


def test_api_key_sent_as_bearer_metadata(fake: FakeGateway) -> None:
    fake.state.api_key = "s3cret"
    with Client(fake.address, timeout=10) as anonymous, pytest.raises(UnauthenticatedError) as info:
        anonymous.generate("hi")
    assert info.value.code is grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in info.value.message
    with Client(fake.address, api_key="wrong", timeout=10) as wrong, pytest.raises(UnauthenticatedError):
        list(wrong.stream("hi"))
    with Client(fake.address, api_key="s3cret", timeout=10) as good:
        assert good.generate("hi").text == "echo: hi"
        assert good.list_models()
        good.generate("hi", metadata=[("x-tenant", "demo")])
    last = fake.state.calls[-1]
    assert last.metadata["authorization"] == "Bearer s3cret"
    assert last.metadata["x-tenant"] == "demo"
    assert last.metadata["user-agent"].startswith("llmesh-client/")


def test_invalid_argument_carries_field_violations(client: Client) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.generate("x", temperature=-1.0, top_p=3.0)
    err = info.value
    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in err.field_violations] == ["sampling.temperature", "sampling.top_p"]
    assert "must be >= 0" in err.field_violations[0].description
    assert isinstance(err, LlmeshClientError)
    assert "INVALID_ARGUMENT" in str(err)


def test_not_found_and_resource_exhausted(client: Client) -> None:
    with pytest.raises(NotFoundError, match="missing"):
        client.generate("x", model="missing")
    with pytest.raises(ResourceExhaustedError) as info:
        client.generate("exhausted")
    assert info.value.retry_delay == pytest.approx(2.5)
    assert "retry after 2.5 s" in str(info.value)


def test_retries_unavailable_through_service_config(fake: FakeGateway) -> None:
    fake.state.fail_unavailable = 2
    with Client(fake.address, timeout=10, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01)) as c:
        assert c.generate("again").text == "echo: again"
    attempts = fake.state.attempts("Generate")
    assert [a.outcome for a in attempts] == ["error", "error", "ok"]


def test_stream_is_retried_before_the_first_message(fake: FakeGateway) -> None:
    fake.state.fail_unavailable = 1
    with Client(fake.address, timeout=10, max_attempts=2) as c:
        assert c.stream("again").completion().text == "echo: again"
    assert [a.outcome for a in fake.state.attempts("GenerateStream")] == ["error", "ok"]


def test_retries_give_up_after_max_attempts(fake: FakeGateway) -> None:
    fake.state.fail_unavailable = 10
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.01)
    with Client(fake.address, timeout=10, retry=policy) as c, pytest.raises(UnavailableError, match="zone"):
        c.generate("x")
    assert len(fake.state.attempts("Generate")) == 3


def test_no_retry_with_one_attempt(fake: FakeGateway) -> None:
    fake.state.fail_unavailable = 1
    with Client(fake.address, timeout=10, max_attempts=1) as c, pytest.raises(UnavailableError):
        c.generate("x")
    assert len(fake.state.attempts("Generate")) == 1
    config = json.loads(RetryPolicy(max_attempts=1).service_config())
    assert "retryPolicy" not in config["methodConfig"][0]


def test_other_codes_are_not_retried(fake: FakeGateway) -> None:
    with Client(fake.address, timeout=10, max_attempts=5) as c, pytest.raises(InvalidArgumentError):
        c.generate("x", temperature=-1)
    assert len(fake.state.attempts("Generate")) == 1


def test_deadline_exceeded_and_propagated(fake: FakeGateway) -> None:
    with Client(fake.address, timeout=0.4) as c:
        with pytest.raises(DeadlineExceededError):
            c.generate("slow:3")
        with pytest.raises(DeadlineExceededError):
            list(c.stream("slow:3"))
        # A per-call timeout overrides the default one.
        assert c.generate("quick", timeout=5).text == "echo: quick"
    remaining = [a.time_remaining for a in fake.state.attempts("Generate")]
    assert remaining[0] is not None and 0 < remaining[0] <= 0.45
    assert remaining[1] is not None and 0.45 < remaining[1] <= 5.05


def test_no_deadline_when_timeout_none(fake: FakeGateway) -> None:
    with Client(fake.address, timeout=None) as c:
        c.generate("x")
    assert fake.state.attempts("Generate")[0].time_remaining is None


def test_stream_error_after_some_deltas_is_not_retried(fake: FakeGateway) -> None:
    with Client(fake.address, timeout=10, max_attempts=3) as c:
        stream = c.stream("break one two three")
        got = []
        with pytest.raises(UnavailableError, match="mid-stream"):
            for delta in stream:
                got.append(delta)
        assert got == ["echo: ", "break "]
        assert stream.text == "echo: break "
        with pytest.raises(UnavailableError):
            _ = stream.final
        with pytest.raises(UnavailableError):
            next(stream)
    assert len(fake.state.attempts("GenerateStream")) == 1


def test_stream_without_final_is_a_protocol_error(client: Client) -> None:
    stream = client.stream("no-final")
    with pytest.raises(StreamProtocolError):
        list(stream)


def test_cancel_stream_reaches_the_server(client: Client, fake: FakeGateway) -> None:
    with client.stream("drip " + "word " * 50) as stream:
        assert next(stream) == "echo: "
    # Leaving the block early cancelled the call; the servicer sees the cancellation (on a
    # busy 2-core box the RST_STREAM can take a while to be processed: allow 10 s).
    for _ in range(500):
        if fake.state.attempts("GenerateStream")[0].outcome != "running":
            break
        time.sleep(0.02)
    assert fake.state.attempts("GenerateStream")[0].outcome == "cancelled"
    with pytest.raises(RequestCancelledError):
        _ = stream.final


def test_client_side_argument_errors(client: Client) -> None:
    with pytest.raises(ValueError, match="not both"):
        client.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(ValueError, match="prompt or messages"):
        client.generate()
    with pytest.raises(ValueError, match="max_tokens"):
        client.generate("x", max_tokens=-1)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        client.generate(messages=[{"role": "user"}])
    with pytest.raises(TypeError, match="unknown generate option"):
        client.generate("x", max_token=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="cert and key"):
        Client(cert="client.pem")


def test_unreachable_target_is_unavailable() -> None:
    from llmesh.procs import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=5, max_attempts=1) as c:
        with pytest.raises(UnavailableError):
            c.generate("x")
        with pytest.raises(UnavailableError, match="not reachable"):
            c.wait_ready(timeout=0.2)


def test_stream_collects_token_ids_and_logprobs(client: Client, fake: FakeGateway) -> None:
    stream = client.stream("ab c", logprobs=2)
    assert list(stream) == ["echo: ", "ab ", "c"]
    final = stream.final
    assert final.token_ids == (6, 3, 1)
    assert [lp.token_id for lp in final.logprobs] == [6, 3, 1]
    assert final.logprobs[0].logprob == pytest.approx(-0.5)
    assert final.logprobs[0].top == ((7, pytest.approx(-1.5)), (7, pytest.approx(-1.5)))
    assert fake.state.attempts("GenerateStream")[0].request.sampling.logprobs == 2


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return self._trailing


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, NotFoundError),
        (grpc.StatusCode.UNAUTHENTICATED, UnauthenticatedError),
        (grpc.StatusCode.PERMISSION_DENIED, PermissionDeniedError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.CANCELLED, RequestCancelledError),
        (grpc.StatusCode.FAILED_PRECONDITION, FailedPreconditionError),
        (grpc.StatusCode.INTERNAL, InternalError),
        (grpc.StatusCode.UNIMPLEMENTED, LlmeshClientError),
    ],
)
def test_error_class_per_status_code(code: grpc.StatusCode, cls: type[LlmeshClientError]) -> None:
    err = error_from_rpc(_FakeRpcError(code, "why"))
    assert type(err) is cls
    assert (err.code, err.message, err.details) == (code, "why", ())


def test_error_decoding_tolerates_bad_rich_status() -> None:
    from google.rpc import status_pb2

    # A rich status whose code disagrees with the call's: keep the call's code and message.
    rich = status_pb2.Status(code=5, message="other").SerializeToString()
    err = error_from_rpc(
        _FakeRpcError(grpc.StatusCode.UNAVAILABLE, "", (("grpc-status-details-bin", rich),))
    )
    assert isinstance(err, UnavailableError) and err.message == "unavailable"

"""Pure core and configuration tests (no server, no engine)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path

import pytest

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.worker.core import Delta, Failed, Final, WorkerCore, WorkerIdentity, request_violations
from services.worker.engine import EngineInfo, EngineRequest, OutputSink, RequestRejected, Sampling
from services.worker.fake_engine import FakeEngine
from services.worker.server import engine_args, resolve_device, worker_identity
from services.worker.settings import WorkerSettings

from .conftest import Bridged

INFO = EngineInfo(max_model_len=100, vocab_size=1000, max_num_seqs=4)


def fields(req: EngineRequest, prefix: str = "request") -> list[str]:
    return [v.field for v in request_violations(req, INFO, prefix)]


def test_valid_request_has_no_violations() -> None:
    req = EngineRequest("a", (1, 2, 3), Sampling(temperature=0.7, top_p=0.9, top_k=50, max_tokens=97,
                                                 min_tokens=2, stop_token_ids=(999,), logprobs=20,
                                                 seed=2**63 - 1))
    assert fields(req) == []
    assert fields(EngineRequest("a", (1,), Sampling(top_k=-1))) == []


def test_every_bad_field_is_reported_with_its_path() -> None:
    req = EngineRequest("a", (1, 1000), Sampling(temperature=math.nan, top_p=0.0, max_tokens=99))
    assert fields(req, "requests[3]") == [
        "requests[3].prompt_token_ids", "requests[3].sampling.temperature",
        "requests[3].sampling.top_p", "requests[3].sampling.max_tokens",
    ]


def test_prompt_must_leave_room_for_one_token() -> None:
    assert fields(EngineRequest("a", (1,) * 99)) == []
    assert fields(EngineRequest("a", (1,) * 100)) == ["request.prompt_token_ids"]
    assert fields(EngineRequest("a", (1,) * 50, Sampling(max_tokens=50))) == []
    assert fields(EngineRequest("a", (1,) * 50, Sampling(max_tokens=51))) == ["request.sampling.max_tokens"]


def test_request_id_length_is_bounded() -> None:
    assert fields(EngineRequest("x" * 257, (1,))) == ["request.request_id"]


async def test_core_validate_raises_invalid_argument_and_adapter_lookup(tiny_deepseek_dir: Path) -> None:
    identity = WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1, adapters=("sql-lora",))
    core = WorkerCore(FakeEngine(tiny_deepseek_dir), identity)
    with pytest.raises(InvalidArgument) as err:
        core.validate(EngineRequest("a", ()))
    assert err.value.field == "request.prompt_token_ids"
    assert core.adapter_for("") == "" and core.adapter_for("m") == ""
    assert core.adapter_for("sql-lora") == "sql-lora"
    with pytest.raises(NotFound):
        core.adapter_for("other", "requests[1].model")


def test_settings_env_and_engine_args(monkeypatch: pytest.MonkeyPatch, tiny_deepseek_dir: Path) -> None:
    monkeypatch.setenv("LLMESH_WORKER_MAX_NUM_SEQS", "16")
    monkeypatch.setenv("LLMESH_WORKER_ZONE", "zone-b")
    monkeypatch.setenv("LLMESH_WORKER_LORA_MODULES", '["a=/tmp/a"]')
    settings = WorkerSettings(model=str(tiny_deepseek_dir), enable_prefix_caching=False)
    assert (settings.max_num_seqs, settings.zone, settings.lora_modules) == (16, "zone-b", ("a=/tmp/a",))
    args = engine_args(settings, "cpu")
    assert args["max_num_seqs"] == 16 and args["enable_prefix_caching"] is False
    assert args["enable_lora"] is True and args["max_loras"] == 1
    assert args["enforce_eager"] is True and "gpu_memory_utilization" not in args
    assert "max_model_len" not in args  # None keeps vLLM's default
    assert engine_args(settings, "cuda")["gpu_memory_utilization"] == 0.9
    identity = worker_identity(settings, "cpu")
    assert identity.model == "tiny-deepseek" and identity.adapters == ("a",)


def test_resolve_device() -> None:
    assert resolve_device("auto", "fake") == "cpu"
    assert resolve_device("npu") == "npu"
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")


def test_temperature_above_the_engines_bound_is_refused_before_the_engine() -> None:
    assert fields(EngineRequest("a", (1,), Sampling(temperature=2.0))) == []
    assert fields(EngineRequest("a", (1,), Sampling(temperature=5.0))) == ["request.sampling.temperature"]


def test_logprobs_are_checked_against_the_engines_own_limit() -> None:
    low = EngineInfo(max_model_len=100, vocab_size=1000, max_num_seqs=4, max_logprobs=5)
    assert request_violations(EngineRequest("a", (1,), Sampling(logprobs=5)), low, "request") == []
    (violation,) = request_violations(EngineRequest("a", (1,), Sampling(logprobs=6)), low, "request")
    assert violation.field == "request.sampling.logprobs" and "5" in violation.description


async def test_an_engine_rejection_fails_only_that_request_of_a_batch(tiny_deepseek_dir: Path) -> None:
    """The engine refusing one request (RequestRejected) ends it with its own error; the
    batch goes on and nothing marks the engine unhealthy."""
    engine = FakeEngine(tiny_deepseek_dir)
    real_start = engine.start

    async def start(request: EngineRequest, sink: OutputSink) -> None:
        if request.request_id == "poison":
            raise RequestRejected("request.sampling.seed", "refused by the engine")
        await real_start(request, sink)

    engine.start = start  # type: ignore[method-assign]
    core = WorkerCore(engine, WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1))
    events = [e async for e in core.generate_batch([
        EngineRequest("poison", (5, 6), Sampling(max_tokens=2)),
        EngineRequest("fine", (5, 6), Sampling(max_tokens=2)),
    ])]
    failed = [(rid, e) for rid, e in events if isinstance(e, Failed)]
    assert [rid for rid, _ in failed] == ["poison"]
    assert isinstance(failed[0][1].error, InvalidArgument)
    assert failed[0][1].error.field == "request.sampling.seed"
    assert any(rid == "fine" and isinstance(e, Final) for rid, e in events)
    assert core.health.serving is False and not core.health.engine_dead  # not warmed up, not dead


async def test_a_batch_runs_without_a_task_per_request(tiny_deepseek_dir: Path) -> None:
    """GenerateBatch's requests feed one shared queue from the engine's step callbacks:
    50 requests add no task (there used to be a pump task per request)."""
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=2, max_running=64)
    core = WorkerCore(engine, WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1))
    baseline = len(asyncio.all_tasks())
    most = 0
    tokens: dict[str, int] = {}
    finals: dict[str, Final] = {}
    requests = [EngineRequest(f"b{i}", (5, i), Sampling(max_tokens=5)) for i in range(50)]
    async with contextlib.aclosing(core.generate_batch(requests)) as events:
        async for request_id, event in events:
            most = max(most, len(asyncio.all_tasks()))
            if isinstance(event, Delta):
                tokens[request_id] = tokens.get(request_id, 0) + len(event.token_ids)
            elif isinstance(event, Final):
                finals[request_id] = event
    assert most <= baseline
    assert tokens == {f"b{i}": 5 for i in range(50)}
    assert all(f.completion_tokens == 5 for f in finals.values()) and len(finals) == 50
    assert core.in_flight_ids() == []


@pytest.mark.parametrize("bridged", [False, True], ids=["step-loop", "generator-bridge"])
async def test_a_generate_consumer_that_leaves_aborts_in_the_engine_and_frees_its_id(
    tiny_deepseek_dir: Path, bridged: bool
) -> None:
    """Closing Generate's stream mid-way aborts the request in the engine and frees its id
    (a new request under it then runs); an engine death ends a running Generate with
    UNAVAILABLE. The same over the generator bridge the vLLM adapter uses today."""
    fake = FakeEngine(tiny_deepseek_dir, token_delay_ms=1, max_running=8)
    core = WorkerCore(Bridged(fake) if bridged else fake,  # type: ignore[arg-type]
                      WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1))
    request = EngineRequest("leaver", (5, 6), Sampling(ignore_eos=True))
    async with contextlib.aclosing(core.generate(request)) as events:
        async for event in events:
            assert isinstance(event, Delta)
            break
    assert core.in_flight_ids() == [] and fake.load().running == 0
    again = [e async for e in core.generate(EngineRequest("leaver", (5, 6), Sampling(max_tokens=3)))]
    assert isinstance(again[-1], Final) and again[-1].completion_tokens == 3
    doomed = core.generate(EngineRequest("doomed", (5, 7), Sampling(ignore_eos=True)))
    assert isinstance(await anext(doomed), Delta)
    fake.kill()
    with pytest.raises(Unavailable):
        while True:
            await anext(doomed)
    assert core.health.engine_dead and core.in_flight_ids() == []


async def test_plain_token_ids_reach_either_kind_of_consumer(tiny_deepseek_dir: Path) -> None:
    """An EngineRun as the engine's TokenSink: plain token ids go to a consumer's own
    ``step_tokens`` when it has one, else as a Delta (a copy); they are counted like
    deltas, and once the consumer went away nothing reaches it."""
    from services.worker.core import EngineRun

    core = WorkerCore(FakeEngine(tiny_deepseek_dir), WorkerIdentity("m", "sha256:x", "cpu", "z", "w", 1))
    got: list[object] = []
    run = EngineRun(core, EngineRequest("a", (5, 6)), got.append)
    engine_ids = [7, 8]
    run.step_tokens(engine_ids)
    run.step_tokens([])
    assert got == [Delta([7, 8], None)] and got[0].token_ids is not engine_ids  # type: ignore[attr-defined]

    class Direct:
        def __init__(self) -> None:
            self.plain: list[int] = []

        def __call__(self, event: object) -> None:
            raise AssertionError(f"not expected: {event!r}")

        def step_tokens(self, token_ids: list[int]) -> None:
            self.plain.extend(token_ids)

    direct = Direct()
    run2 = EngineRun(core, EngineRequest("b", (5, 6)), direct)
    run2.step_tokens([9])
    run2.step_tokens([10, 11])
    assert direct.plain == [9, 10, 11] and run2.completion == 3
    assert core._tokens_produced == 5
    run2.detach()
    run2.step_tokens([12])
    assert direct.plain == [9, 10, 11] and run2.completion == 3

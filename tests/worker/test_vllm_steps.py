"""``VllmEngine.start``: vLLM's outputs reach the worker's sink per engine step.

The adapter replaces each request's ``RequestOutputCollector`` with its own sink object,
so it depends on vLLM internals that are not public API; the first tests pin them (they
fail naming what changed when vLLM is upgraded). The rest run one in-process engine
(tiny DeepSeek-V2, random weights) shared by the module, and compare ``start`` with the
generator path (``generate``, which AsyncLLM.generate feeds through its collector).
The engine-death test runs last: it kills the engine core. The tests marked ``engine``
start engines (run them under the shared lock:
``flock /tmp/llmesh-engine.lock pytest tests/worker/test_vllm_steps.py``); the others need
vLLM installed but no engine (``-m "not engine"``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from services.worker.engine import (
    EngineDeadError,
    EngineOutput,
    EngineRequest,
    FinishReason,
    RequestRejected,
    Sampling,
)

pytest.importorskip("vllm.v1.engine.async_llm")

from vllm.exceptions import VLLMValidationError
from vllm.v1.engine import output_processor as vllm_output_processor
from vllm.v1.metrics import loggers as vllm_loggers

from services.worker import vllm_engine
from services.worker.vllm_engine import VllmEngine, check_vllm_internals

PROMPTS = [[1, 400, 17, 93, 5], [2, 77, 300, 12], [9, 8, 7, 6, 5, 4], [1000, 2000, 3000], [42] * 7,
           [5, 6, 7], [11, 12], [3000, 17, 5, 1]]


# -- pins on vLLM's source (no engine) ---------------------------------------------------

def test_vllm_only_puts_into_a_request_queue() -> None:
    """Everything vLLM's OutputProcessor does with a request's queue is ``put`` (the step
    outputs, the abort final, the handler's error): the adapter's sink implements only that."""
    source = inspect.getsource(vllm_output_processor.OutputProcessor)
    used = set(re.findall(r"\.queue\.(\w+)", source))
    assert used == {"put"}, (
        f"vLLM's OutputProcessor now calls {sorted(used)} on RequestState.queue; "
        "services/worker/vllm_engine.py's _StepSink implements only put(): review it against this vLLM"
    )
    for method in ("process_outputs", "abort_requests", "propagate_error"):
        body = inspect.getsource(getattr(vllm_output_processor.OutputProcessor, method))
        assert "queue.put(" in body, (
            f"vLLM's OutputProcessor.{method} no longer puts into the request's queue: "
            "the per-step sink of services/worker/vllm_engine.py would miss those outputs"
        )
    # abort_requests delivers a final ABORT output (the adapter relies on it for abort()).
    assert "FinishReason.ABORT" in inspect.getsource(vllm_output_processor.OutputProcessor.abort_requests), (
        "vLLM's abort no longer puts an ABORT final into the request's queue: "
        "VllmEngine.abort must deliver one itself"
    )
    put = inspect.signature(vllm_output_processor.RequestOutputCollector.put)
    assert list(put.parameters) == ["self", "output"], f"RequestOutputCollector.put is now {put}"


def step_sink(request: EngineRequest, sink: Any, live: dict[str, Any] | None = None) -> Any:
    live = {} if live is None else live
    live["i"] = vllm_engine._StepSink(vllm_engine._OutputConverter(request), sink, live, "i")
    return live["i"]


def test_step_sink_contract_without_an_engine() -> None:
    """Conversion, replay skipping, errors and 'nothing after the last item', on the sink
    object alone (as vLLM's output handler would call it)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    def output(tokens: list[int], finish: str | None = None) -> RequestOutput:
        done = finish is not None
        return RequestOutput("r", None, [1, 2], None, [CompletionOutput(
            0, "", tokens, None, None, finish_reason=finish, stop_reason=None)], finished=done)

    got: list[EngineOutput | Exception] = []
    live: dict[str, Any] = {}
    request = EngineRequest("r", (1, 2), replay_token_ids=(7, 8, 9))
    sink = step_sink(request, got.append, live)
    for out in (output([7]), output([8, 9, 10]), output([11]), output([12], "length"), output([13])):
        sink.put(out)
    assert [o.token_ids for o in got if isinstance(o, EngineOutput)] == [[10], [11], [12]]
    last = got[-1]
    assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.LENGTH and not live
    sink.put(RuntimeError("after the final"))
    assert len(got) == 3

    for exc, kind, text in (
        (VLLMValidationError("bad value", parameter="temperature"), RequestRejected,
         "request.sampling.temperature"),
        (vllm_engine.VllmEngineDeadError(), EngineDeadError, ""),
        (RuntimeError("handler bug"), EngineDeadError, "handler bug"),
    ):
        got.clear()
        sink = step_sink(EngineRequest("r", (1,)), got.append)
        sink.put(exc)
        sink.put(output([5]))
        assert len(got) == 1 and isinstance(got[0], kind) and text in str(got[0]), got

    def raising(item: object) -> None:
        raise ValueError("a broken sink")

    # A sink that raises must not end vLLM's output handler (it would end the engine).
    step_sink(EngineRequest("r", (1,)), raising).put(output([5]))


def test_engine_core_outputs_convert_without_an_engine() -> None:
    """``_StepSink.step`` on hand-made ``EngineCoreOutput``s: replay skipping, logprob rows
    wider than the request asked for, the stop token (a stop id, or EOS as the last
    token), cached tokens and timings from vLLM's request stats, unknown finishes as
    ERROR, and nothing after the final."""
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine import FinishReason as VllmFinish
    from vllm.v1.metrics.stats import RequestStateStats
    from vllm.v1.outputs import LogprobsLists

    @dataclass
    class State:
        stats: Any
        num_cached_tokens: int = 3

    def rows(tokens: list[int]) -> LogprobsLists:
        # Sampled token first, then the batch's top 3 (ids 100+, 200+, 300+).
        ids = np.array([[t, 100 + t, 200 + t, 300 + t] for t in tokens])
        lps = np.array([[-0.5, -0.1, -0.2, -0.3] for _ in tokens])
        return LogprobsLists(ids, lps, np.zeros(len(tokens), dtype=np.int64))

    stats = RequestStateStats(arrival_time=1.0)
    stats.queued_ts, stats.scheduled_ts, stats.first_token_latency = 10.0, 10.25, 0.5
    state = State(stats)
    got: list[EngineOutput | Exception] = []
    live: dict[str, Any] = {}
    request = EngineRequest("r", (1, 2), Sampling(logprobs=2), replay_token_ids=(7, 8))
    sink = step_sink(request, got.append, live)
    sink.step(EngineCoreOutput("i", [7], new_logprobs=rows([7])), state)
    sink.step(EngineCoreOutput("i", [8, 9], new_logprobs=rows([8, 9])), state)
    sink.step(EngineCoreOutput("i", [11], new_logprobs=rows([11]), finish_reason=VllmFinish.STOP,
                               stop_reason=11), state)
    sink.step(EngineCoreOutput("i", [12]), state)
    outputs = [o for o in got if isinstance(o, EngineOutput)]
    assert [o.token_ids for o in outputs] == [[9], [11]] and len(got) == 2 and not live
    lp = outputs[0].logprobs
    assert lp is not None and [(x.token_id, x.logprob, x.top) for x in lp] == [
        (9, -0.5, ((109, -0.1), (209, -0.2)))]
    last = outputs[-1]
    assert (last.finish_reason, last.stop_token_id, last.cached_tokens, last.prompt_tokens) == (
        FinishReason.STOP, 11, 3, 2)
    assert last.queue_ms == pytest.approx(250.0) and last.ttft_ms == pytest.approx(500.0)

    for reason, stop_reason, expected, stop_token in (
        (VllmFinish.STOP, None, FinishReason.STOP, 5),  # EOS: the last token
        (VllmFinish.LENGTH, None, FinishReason.LENGTH, None),
        (VllmFinish.ABORT, None, FinishReason.ABORT, None),
        (VllmFinish.REPETITION, None, FinishReason.ERROR, None),
    ):
        got.clear()
        sink = step_sink(EngineRequest("r", (1,)), got.append)
        sink.step(EngineCoreOutput("i", [4, 5], finish_reason=reason, stop_reason=stop_reason), state)
        (final,) = got
        assert isinstance(final, EngineOutput) and final.logprobs is None
        assert (final.token_ids, final.finish_reason, final.stop_token_id) == ([4, 5], expected, stop_token)


class _FakeLLM:
    """Just what ``VllmEngine.start`` touches of AsyncLLM, with a hook that runs while
    add_request is "awaiting the engine core" (where the output handler may run)."""

    def __init__(self, during_add: Any) -> None:
        from types import SimpleNamespace

        self.output_processor = SimpleNamespace(request_states={})
        self.during_add = during_add

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kwargs: Any) -> Any:
        from types import SimpleNamespace

        from vllm.sampling_params import RequestOutputKind

        collector = vllm_output_processor.RequestOutputCollector(RequestOutputKind.DELTA, f"{request_id}-int")
        state = SimpleNamespace(queue=collector)
        self.output_processor.request_states[collector.request_id] = state
        self.during_add(self.output_processor.request_states, collector)
        return collector


def fake_engine(during_add: Any) -> VllmEngine:
    from services.worker.engine import EngineInfo

    engine = object.__new__(VllmEngine)
    engine.llm = _FakeLLM(during_add)  # type: ignore[assignment]
    engine._info = EngineInfo(max_model_len=64, vocab_size=100, max_num_seqs=1)
    engine._loras = {}
    engine._live = {}
    engine.priority_scheduling = False
    return engine


def fake_output(tokens: list[int], finish: str | None = None) -> Any:
    from vllm.outputs import CompletionOutput, RequestOutput

    return RequestOutput("r", None, [1, 2], None, [CompletionOutput(
        0, "", tokens, None, None, finish_reason=finish, stop_reason=None)], finished=finish is not None)


async def test_what_came_before_the_swap_is_handed_over_first() -> None:
    """An output, an abort's final or the handler's error put into vLLM's collector while
    add_request was still awaiting reaches the sink first, then the later steps."""
    def first_step(states: dict[str, Any], collector: Any) -> None:
        collector.put(fake_output([5]))

    got: list[EngineOutput | Exception] = []
    engine = fake_engine(first_step)
    await engine.start(EngineRequest("r", (1, 2), Sampling(max_tokens=3)), got.append)
    (state,) = engine.llm.output_processor.request_states.values()
    state.queue.put(fake_output([6, 7], "length"))  # type: ignore[union-attr]  # it is the step sink now
    assert [o.token_ids for o in got if isinstance(o, EngineOutput)] == [[5], [6, 7]] and not engine._live

    def aborted(states: dict[str, Any], collector: Any) -> None:
        states.pop(collector.request_id)  # abort_requests drops the state and puts a final
        collector.put(fake_output([], "abort"))

    got.clear()
    await fake_engine(aborted).start(EngineRequest("r", (1, 2)), got.append)
    assert len(got) == 1 and isinstance(got[0], EngineOutput) and got[0].finish_reason is FinishReason.ABORT

    def died(states: dict[str, Any], collector: Any) -> None:
        collector.put(vllm_engine.VllmEngineDeadError())

    got.clear()
    engine = fake_engine(died)
    await engine.start(EngineRequest("r", (1, 2)), got.append)
    assert len(got) == 1 and isinstance(got[0], EngineDeadError) and not engine._live

    def vanished(states: dict[str, Any], collector: Any) -> None:
        states.pop(collector.request_id)  # not vLLM's contract: gone without a final

    got.clear()
    await fake_engine(vanished).start(EngineRequest("r", (1, 2)), got.append)
    assert len(got) == 1 and isinstance(got[0], EngineOutput) and got[0].finish_reason is FinishReason.ERROR


# -- one real engine for the module ------------------------------------------------------

@dataclass
class Counted:
    """The engine with a counter of vLLM's ``process_outputs`` calls (one per engine step
    and chunk of at most VLLM_V1_OUTPUT_PROC_CHUNK_SIZE requests)."""

    engine: VllmEngine
    calls: list[int] = field(default_factory=lambda: [0])


@pytest.fixture(scope="module")
async def counted(tiny_deepseek_dir: Path) -> AsyncIterator[Counted]:
    engine = VllmEngine.build({
        "model": str(tiny_deepseek_dir), "tokenizer": str(tiny_deepseek_dir), "enforce_eager": True,
        "max_num_seqs": 16, "max_model_len": 2048, "seed": 0,
    })
    counted = Counted(engine)
    processor = engine.llm.output_processor
    original = processor.process_outputs

    def counting(*args: Any, **kwargs: Any) -> Any:
        counted.calls[0] += 1
        return original(*args, **kwargs)

    processor.process_outputs = counting  # type: ignore[method-assign]
    yield counted
    await engine.shutdown()


@dataclass
class Recorder:
    """A sink recording each item with the process_outputs call and the task it came in."""

    calls: list[int]
    items: list[tuple[int, asyncio.Task[Any] | None, EngineOutput | Exception]] = field(default_factory=list)
    after_last: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)
    first: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, item: EngineOutput | Exception) -> None:
        if self.done.is_set():
            self.after_last += 1
            return
        self.items.append((self.calls[0], asyncio.current_task(), item))
        self.first.set()
        if isinstance(item, Exception) or item.finish_reason is not None:
            self.done.set()

    @property
    def outputs(self) -> list[EngineOutput]:
        return [item for _, _, item in self.items if isinstance(item, EngineOutput)]

    @property
    def tokens(self) -> list[int]:
        return [t for out in self.outputs for t in out.token_ids]

    @property
    def last(self) -> EngineOutput | Exception:
        return self.items[-1][2]

    async def wait(self, timeout: float = 120.0) -> EngineOutput | Exception:
        await asyncio.wait_for(self.done.wait(), timeout)
        assert self.after_last == 0, "the sink got something after its last item"
        return self.last


@dataclass
class StepRecorder(Recorder):
    """A :class:`Recorder` that is also a ``TokenSink``: plain token ids come to
    :meth:`step_tokens` (recorded as outputs too, so :attr:`tokens` covers both ways)."""

    plain_steps: int = 0

    def step_tokens(self, token_ids: list[int]) -> None:
        assert token_ids and not self.done.is_set()
        self.plain_steps += 1
        self.items.append((self.calls[0], asyncio.current_task(), EngineOutput(list(token_ids))))
        self.first.set()


def greedy(request_id: str, prompt: list[int], max_tokens: int, **sampling: Any) -> EngineRequest:
    return EngineRequest(request_id, tuple(prompt),
                         Sampling(temperature=0.0, max_tokens=max_tokens, **sampling))


async def via_start(counted: Counted, requests: list[EngineRequest]) -> list[Recorder]:
    recorders = [Recorder(counted.calls) for _ in requests]
    for request, recorder in zip(requests, recorders, strict=True):
        await counted.engine.start(request, recorder)
    for recorder in recorders:
        await recorder.wait()
    return recorders


async def via_generate(engine: VllmEngine, requests: list[EngineRequest]) -> list[list[EngineOutput]]:
    async def one(request: EngineRequest) -> list[EngineOutput]:
        return [out async for out in engine.generate(request)]

    return list(await asyncio.gather(*(one(r) for r in requests)))


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


async def wait_engine_idle(engine: VllmEngine) -> None:
    for _ in range(400):
        if engine.llm.output_processor.get_num_unfinished_requests() == 0 and not engine._live:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("requests still tracked by the engine adapter")


# -- behaviour through the real engine ---------------------------------------------------

@pytest.mark.engine
async def test_internals_are_where_the_adapter_expects_them(counted: Counted) -> None:
    engine = counted.engine
    check_vllm_internals(engine.llm)  # what VllmEngine.__init__ checked
    request = greedy("pin", PROMPTS[0], 4)
    params, prompt, _, _ = engine._submission(request)
    collector = await engine.llm.add_request("pin", prompt, params)
    try:
        state = engine.llm.output_processor.request_states[collector.request_id]
        assert state.queue is collector, (
            "AsyncLLM.add_request no longer hands its collector to the RequestState")
        assert collector.request_id.startswith("pin"), collector.request_id
    finally:
        await engine.llm.abort("pin")
    final: Any = collector.get_nowait()
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    await wait_engine_idle(engine)


@pytest.mark.engine
async def test_a_submission_is_checked_inline_without_the_renderers_thread_pool(
        counted: Counted, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker hands vLLM token ids as an engine input (``type: token``): AsyncLLM
    checks it in the caller's task. A raw prompt would go through the renderer's thread
    pool (``process_inputs_async``), a thread hop on every first token."""
    processor = counted.engine.llm.input_processor
    inline, pooled = [], []
    process_inputs = processor.process_inputs

    def recorded(*args: Any, **kwargs: Any) -> Any:
        inline.append(asyncio.current_task())
        return process_inputs(*args, **kwargs)

    async def thread_pool(*args: Any, **kwargs: Any) -> Any:
        pooled.append(args)
        raise AssertionError("the submission went through the renderer's thread pool")

    monkeypatch.setattr(processor, "process_inputs", recorded)
    monkeypatch.setattr(processor, "process_inputs_async", thread_pool)
    (recorder,) = await via_start(counted, [greedy("inline", PROMPTS[0], 4)])
    assert len(recorder.tokens) >= 1
    assert not pooled and len(inline) == 1 and inline[0] is not None
    await wait_engine_idle(counted.engine)


@pytest.mark.engine
async def test_every_request_of_a_step_reaches_its_sink_in_one_handler_call(counted: Counted) -> None:
    max_tokens = 12
    requests = [greedy(f"step-{i}", p, max_tokens, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    recorders = await via_start(counted, requests)
    handler = counted.engine.llm.output_handler
    per_call: dict[int, list[int]] = {}
    for i, recorder in enumerate(recorders):
        assert len(recorder.tokens) == max_tokens
        last = recorder.last
        assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.LENGTH
        for call, task, _ in recorder.items:
            assert task is handler, "a sink was called outside vLLM's output handler"
            per_call.setdefault(call, []).append(i)
    # One output per request per handler call, and the steps where every request ran
    # delivered all of them in one call.
    assert all(len(ids) == len(set(ids)) for ids in per_call.values()), per_call
    assert sum(1 for ids in per_call.values() if len(ids) == len(requests)) >= max_tokens // 2, per_call
    assert len(per_call) <= 2 * max_tokens, per_call
    await wait_engine_idle(counted.engine)


@pytest.mark.engine
async def test_greedy_start_equals_generate(counted: Counted) -> None:
    # One request at a time on both paths: the same batches in the engine. (Concurrent
    # submissions batch differently from run to run, and the random tiny model's near-tied
    # logits then pick other tokens on either path.)
    for i, prompt in enumerate(PROMPTS[:4]):
        (native,) = await via_start(counted, [greedy(f"eq-{i}", prompt, 16)])
        (generated,) = await via_generate(counted.engine, [greedy(f"eq-g{i}", prompt, 16)])
        assert native.tokens == tokens_of(generated), f"prompt {i}"
        ours, theirs = native.last, generated[-1]
        assert isinstance(ours, EngineOutput)
        assert (ours.finish_reason, ours.stop_token_id, ours.prompt_tokens, ours.cached_tokens) == (
            theirs.finish_reason, theirs.stop_token_id, theirs.prompt_tokens, theirs.cached_tokens)
        assert ours.queue_ms is not None and ours.ttft_ms is not None and ours.ttft_ms > 0


@pytest.mark.engine
async def test_a_token_sink_gets_plain_steps_as_token_ids(counted: Counted) -> None:
    """A sink with ``step_tokens`` gets a request's steps that do not end it as the engine
    core's token ids (in vLLM's output handler, like every other output) and the last one
    as an EngineOutput: the same tokens and final as a plain sink. A request that asked for
    logprobs, and the replayed part of a resumed one, keep the general path."""
    engine = counted.engine
    handler = engine.llm.output_handler
    (plain,) = await via_start(counted, [greedy("ts-ref", PROMPTS[2], 16, ignore_eos=True)])
    stepped = StepRecorder(counted.calls)
    await engine.start(greedy("ts", PROMPTS[2], 16, ignore_eos=True), stepped)
    last = await stepped.wait()
    assert stepped.tokens == plain.tokens and len(stepped.tokens) == 16
    # Every step but the last one (and a first one that came before the sink was swapped in).
    assert 14 <= stepped.plain_steps <= 15, stepped.plain_steps
    assert all(task is handler for _, task, _ in stepped.items)
    assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.LENGTH
    assert last.ttft_ms is not None and last.prompt_tokens == len(PROMPTS[2])

    with_logprobs = StepRecorder(counted.calls)
    await engine.start(greedy("ts-lp", PROMPTS[2], 6, ignore_eos=True, logprobs=1), with_logprobs)
    await with_logprobs.wait()
    assert with_logprobs.plain_steps == 0
    assert [lp.token_id for out in with_logprobs.outputs for lp in (out.logprobs or [])] == plain.tokens[:6]

    replay = tuple(plain.tokens[:5])
    resumed = StepRecorder(counted.calls)
    await engine.start(EngineRequest("ts-replay", tuple(PROMPTS[2]),
                                     Sampling(temperature=0.0, max_tokens=11, ignore_eos=True),
                                     replay_token_ids=replay), resumed)
    await resumed.wait()
    assert resumed.tokens == plain.tokens[5:]
    assert 0 < resumed.plain_steps < 11
    await wait_engine_idle(engine)


@pytest.mark.engine
async def test_stop_token_ids(counted: Counted) -> None:
    (reference,) = await via_start(counted, [greedy("stop-ref", PROMPTS[3], 8, ignore_eos=True)])
    stop = reference.tokens[3]
    (stopped,) = await via_start(counted, [greedy("stop", PROMPTS[3], 8, stop_token_ids=[stop])])
    last = stopped.last
    assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.STOP
    assert last.stop_token_id == stop
    assert stopped.tokens == reference.tokens[:reference.tokens.index(stop) + 1]
    request = greedy("stop-g", PROMPTS[3], 8, stop_token_ids=[stop])
    (generated,) = await via_generate(counted.engine, [request])
    assert tokens_of(generated) == stopped.tokens and generated[-1].stop_token_id == stop


@pytest.mark.engine
async def test_vllms_prometheus_logger_is_left_out_by_default(counted: Counted) -> None:
    """The worker's default: vLLM's Prometheus logger (histograms observed per output
    token per step) is not there, the worker's own scheduler-stats logger is, and the
    load it reports still follows the engine."""
    manager = counted.engine.llm.logger_manager
    assert manager is not None, "no stat loggers: the worker's load reports would stop"
    kinds = [type(logger) for logger in manager.stat_loggers]
    assert vllm_engine.NoPrometheusStatLogger in kinds
    assert vllm_loggers.PrometheusStatLogger not in kinds, kinds
    recorder = Recorder(counted.calls)
    await counted.engine.start(greedy("no-prom", PROMPTS[0], 48), recorder)
    await asyncio.wait_for(recorder.first.wait(), 120)
    assert counted.engine.load().scheduler_running >= 1
    await recorder.wait()
    await wait_engine_idle(counted.engine)


@pytest.mark.engine
async def test_steady_steps_skip_vllms_iteration_stats_unless_exported(
        counted: Counted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``vllm_metrics`` nothing reads vLLM's per-token iteration stats: a started
    request is counted on its first step and on steps with engine events only, and its
    final still has the queue time and TTFT those give. Counted on every step once an
    engine exports them (the flag alone switches it; the engine is the same)."""
    engine = counted.engine
    assert engine.vllm_metrics is False
    processor = engine.llm.output_processor
    original = processor._update_stats_from_output
    seen: list[str] = []

    def spy(state: Any, out: Any, *args: Any) -> Any:
        seen.append(out.request_id)
        return original(state, out, *args)

    monkeypatch.setattr(processor, "_update_stats_from_output", spy)
    (quiet,) = await via_start(counted, [greedy("stats-quiet", PROMPTS[3], 24, ignore_eos=True)])
    assert len(quiet.tokens) == 24
    assert 1 <= len(seen) <= 4, f"{len(seen)} stats updates for 24 steps"
    last = quiet.last
    assert isinstance(last, EngineOutput) and last.ttft_ms is not None and last.ttft_ms > 0
    assert last.queue_ms is not None
    seen.clear()
    monkeypatch.setattr(engine, "vllm_metrics", True)
    (counted_every,) = await via_start(counted, [greedy("stats-every", PROMPTS[3], 24, ignore_eos=True)])
    assert counted_every.tokens == quiet.tokens
    assert len(seen) >= 24
    await wait_engine_idle(engine)


def test_vllm_metrics_setting_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vllm_metrics`` decides whether vLLM's own Prometheus logger is kept: the no-op
    stand-in goes in only when it is off (as by default)."""
    from services.worker.server import default_engine_factory
    from services.worker.settings import WorkerSettings

    seen: list[list[Any]] = []

    def from_engine_args(args: Any, stat_loggers: list[Any]) -> Any:
        seen.append(stat_loggers)
        raise RuntimeError("stop here")

    monkeypatch.setattr(vllm_engine.AsyncLLM, "from_engine_args", from_engine_args)
    monkeypatch.setattr(vllm_engine, "configure_device_environment", lambda *a, **k: None)
    for enabled in (False, True):
        settings = WorkerSettings(model="/nonexistent", engine="vllm", vllm_metrics=enabled)
        with pytest.raises(RuntimeError, match="stop here"):
            default_engine_factory(settings, "cpu")()
    assert WorkerSettings(model="/m").vllm_metrics is False
    off, on = seen
    assert vllm_engine.NoPrometheusStatLogger in off and len(off) == 2
    assert vllm_engine.NoPrometheusStatLogger not in on and len(on) == 1


@pytest.mark.engine
async def test_cached_tokens_and_vllms_own_metrics_when_asked(smollm2_dir: Path) -> None:
    """On SmolLM2: vLLM's CPU build turns prefix caching off for MLA models (the tiny DeepSeek).
    This engine is built with ``vllm_metrics``: vLLM's Prometheus logger is kept and counts."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    engine = VllmEngine.build({"model": str(smollm2_dir), "tokenizer": str(smollm2_dir),
                               "enforce_eager": True, "max_num_seqs": 4, "max_model_len": 512,
                               "enable_prefix_caching": True}, vllm_metrics=True)
    try:
        manager = engine.llm.logger_manager
        assert manager is not None
        assert vllm_loggers.PrometheusStatLogger in [type(logger) for logger in manager.stat_loggers]
        counted = Counted(engine)
        prompt = [(7 * i) % 3000 + 10 for i in range(300)]  # blocks of 128 tokens on CPU
        (first,) = await via_start(counted, [greedy("cache-1", prompt, 2)])
        (again,) = await via_start(counted, [greedy("cache-2", prompt, 2)])
        (generated,) = await via_generate(engine, [greedy("cache-g", prompt, 2)])
        assert isinstance(first.last, EngineOutput) and isinstance(again.last, EngineOutput)
        assert first.last.cached_tokens == 0 and first.last.prompt_tokens == 300
        assert 0 < again.last.cached_tokens < 300
        assert again.last.cached_tokens == generated[-1].cached_tokens
        labels = {"model_name": str(smollm2_dir), "engine": "0"}
        generated_tokens = REGISTRY.get_sample_value("vllm:generation_tokens_total", labels)
        assert generated_tokens is not None and generated_tokens >= 6
        # Exported: every step of a started request is counted, not only its first.
        (longer,) = await via_start(counted, [greedy("count-all", prompt[:40], 12, ignore_eos=True)])
        assert len(longer.tokens) == 12
        assert REGISTRY.get_sample_value("vllm:generation_tokens_total", labels) == generated_tokens + 12
    finally:
        await engine.shutdown()
        unregister_vllm_metrics()  # the process's registry as the other tests expect it


@pytest.mark.engine
async def test_replay_is_not_emitted_and_the_rest_equals_an_undisturbed_run(counted: Counted) -> None:
    sampling: dict[str, Any] = {"ignore_eos": True, "logprobs": 2}
    (undisturbed,) = await via_start(counted, [greedy("replay-ref", PROMPTS[1], 24, **sampling)])
    replay = tuple(undisturbed.tokens[:10])
    request = EngineRequest("replay", tuple(PROMPTS[1]), Sampling(temperature=0.0, max_tokens=14, **sampling),
                            replay_token_ids=replay)
    (resumed,) = await via_start(counted, [request])
    assert resumed.tokens == undisturbed.tokens[10:]
    assert all(out.token_ids or out.finished for out in resumed.outputs), "an empty delta was emitted"
    lps = [lp for out in resumed.outputs for lp in (out.logprobs or [])]
    assert [lp.token_id for lp in lps] == resumed.tokens
    last = resumed.last
    assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.LENGTH
    (generated,) = await via_generate(counted.engine, [EngineRequest(
        "replay-g", tuple(PROMPTS[1]), request.sampling, replay_token_ids=replay)])
    assert tokens_of(generated) == resumed.tokens


@pytest.mark.engine
async def test_logprobs(counted: Counted) -> None:
    (native,) = await via_start(counted, [greedy("lp", PROMPTS[2], 5, logprobs=3)])
    (generated,) = await via_generate(counted.engine, [greedy("lp-g", PROMPTS[2], 5, logprobs=3)])
    ours = [lp for out in native.outputs for lp in (out.logprobs or [])]
    theirs = [lp for out in generated for lp in (out.logprobs or [])]
    assert [lp.token_id for lp in ours] == native.tokens and len(ours) == 5
    for lp, other in zip(ours, theirs, strict=True):
        assert lp.logprob <= 0 and len(lp.top) == 3 and lp.top[0][1] >= lp.top[-1][1]
        assert lp.token_id == other.token_id and [t for t, _ in lp.top] == [t for t, _ in other.top]
        assert math.isclose(lp.logprob, other.logprob, abs_tol=1e-3)


@pytest.mark.engine
async def test_started_requests_skip_vllms_output_processor(counted: Counted,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of a started request goes from the engine core's output to its sink
    without vLLM's output processor building a ``RequestOutput``: at most an output that
    landed before ``start`` took the request's place goes that way. (A request of
    ``generate`` does, every step.)"""
    engine = counted.engine
    built: list[str] = []
    make = vllm_output_processor.RequestState.make_request_output

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        built.append(self.external_req_id)
        return make(self, *args, **kwargs)

    monkeypatch.setattr(vllm_output_processor.RequestState, "make_request_output", spy)
    requests = [greedy(f"skip-{i}", p, 10, ignore_eos=True) for i, p in enumerate(PROMPTS[:4])]
    recorders = await via_start(counted, requests)
    assert [len(r.tokens) for r in recorders] == [10] * 4
    assert len(built) <= len(requests), built
    (generated,) = await via_generate(engine, [greedy("skip-g", PROMPTS[4], 10, ignore_eos=True)])
    assert len(tokens_of(generated)) == 10 and built.count("skip-g") >= 5, built
    await wait_engine_idle(engine)


@pytest.mark.engine
async def test_each_request_of_a_step_gets_its_own_logprobs_beside_vllms_own_path(counted: Counted) -> None:
    """One batch: started requests asking for 1 and 3 top logprobs (the engine core's rows
    are as wide as the largest request's) and one without, beside a request of
    ``generate`` (vLLM's own output path) asking for 2; each gets what it asked for."""
    engine = counted.engine
    started = [greedy("lp-1", PROMPTS[0], 6, ignore_eos=True, logprobs=1),
               greedy("lp-3", PROMPTS[1], 6, ignore_eos=True, logprobs=3),
               greedy("lp-none", PROMPTS[2], 6, ignore_eos=True)]
    generated, recorders = await asyncio.gather(
        via_generate(engine, [greedy("lp-g2", PROMPTS[3], 6, ignore_eos=True, logprobs=2)]),
        via_start(counted, started),
    )
    for recorder, width in zip(recorders, (1, 3, None), strict=True):
        lps = [lp for out in recorder.outputs for lp in (out.logprobs or [])]
        assert len(recorder.tokens) == 6
        if width is None:
            assert not lps
            continue
        assert [lp.token_id for lp in lps] == recorder.tokens
        assert all(len(lp.top) == width and lp.logprob <= 0 for lp in lps)
        # Greedy: the sampled token is the most likely one.
        assert all(lp.top[0][0] == lp.token_id and math.isclose(lp.top[0][1], lp.logprob, abs_tol=1e-4)
                   for lp in lps)
    theirs = [lp for out in generated[0] for lp in (out.logprobs or [])]
    assert len(tokens_of(generated[0])) == 6 and all(len(lp.top) == 2 for lp in theirs)
    await wait_engine_idle(engine)


@pytest.mark.engine
async def test_abort_delivers_an_abort_final_and_frees_the_request(counted: Counted) -> None:
    engine = counted.engine
    running = Recorder(counted.calls)
    await engine.start(greedy("abort-run", PROMPTS[0], 1500, ignore_eos=True), running)
    await asyncio.wait_for(running.first.wait(), 60)
    at_once = Recorder(counted.calls)  # aborted before its first step
    await engine.start(greedy("abort-now", PROMPTS[1], 1500, ignore_eos=True), at_once)
    await engine.abort("abort-now")
    await engine.abort("abort-run")
    for recorder in (running, at_once):
        last = await recorder.wait()
        assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.ABORT
    assert len(running.tokens) < 1500
    await engine.abort("abort-run")  # already gone: ignored
    await wait_engine_idle(engine)
    # The engine core freed them: its next report (with the next step) shows nothing else running.
    await via_start(counted, [greedy("after-abort", PROMPTS[2], 2)])
    assert engine.stats.running <= 1


@pytest.mark.engine
@pytest.mark.parametrize(("sampling", "prompt", "field_path"), [
    ({"temperature": float("nan")}, [5], "request.sampling.temperature"),  # SamplingParams refuses it
    ({"logprobs": 30}, [5], "request.sampling.logprobs"),  # add_request refuses the rest
    ({"max_tokens": 1}, [5] * 2049, "request.prompt_token_ids"),
    ({}, [5, 4096], "request.prompt_token_ids"),
])
async def test_refused_values_name_the_field(counted: Counted, sampling: dict[str, Any], prompt: list[int],
                                             field_path: str) -> None:
    recorder = Recorder(counted.calls)
    request = EngineRequest("bad", tuple(prompt), Sampling(**sampling))
    with pytest.raises(RequestRejected) as err:
        await counted.engine.start(request, recorder)
    assert err.value.field == field_path, err.value
    assert not recorder.items
    await wait_engine_idle(counted.engine)


@pytest.mark.engine
async def test_a_cancelled_start_leaves_nothing_running(counted: Counted) -> None:
    """Cancelled before add_request registered the request, and at once after it did
    (while it sends the request to the engine core): either start raised CancelledError
    and nothing stays in the engine, or it had returned and the request runs (aborted here)."""
    engine = counted.engine
    processor = engine.llm.output_processor
    add_request = processor.add_request
    cancel_on_register: list[asyncio.Task[None]] = []

    def spy(request: Any, *args: Any, **kwargs: Any) -> None:
        add_request(request, *args, **kwargs)
        for task in cancel_on_register:
            asyncio.get_running_loop().call_soon(task.cancel)

    processor.add_request = spy  # type: ignore[method-assign]
    outcomes: list[str] = []
    try:
        for when in ("before", "after registering"):
            recorder = Recorder(counted.calls)
            request = greedy(f"cancel-{len(outcomes)}", PROMPTS[0], 1500, ignore_eos=True)
            task = asyncio.create_task(engine.start(request, recorder))
            if when == "before":
                task.cancel()
            else:
                cancel_on_register[:] = [task]
            try:
                await task
            except asyncio.CancelledError:
                assert not recorder.items
                outcomes.append(f"cancelled {when}")
            else:
                outcomes.append(f"started ({when})")
                await engine.abort(request.request_id)
                last = await recorder.wait()
                assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.ABORT
            await wait_engine_idle(engine)
    finally:
        del processor.add_request
    assert outcomes[0] == "cancelled before", outcomes
    print("cancellation outcomes:", outcomes)


@pytest.mark.engine
async def test_engine_death_reaches_every_running_sink(counted: Counted) -> None:
    """Runs last: kills the module's engine core."""
    engine = counted.engine
    recorders = [Recorder(counted.calls) for _ in range(3)]
    for i, recorder in enumerate(recorders):
        await engine.start(greedy(f"dies-{i}", PROMPTS[i], 1500, ignore_eos=True), recorder)
    await asyncio.gather(*(asyncio.wait_for(r.first.wait(), 60) for r in recorders))
    cores = []
    for child in psutil.Process().children(recursive=True):
        try:  # engines shut down earlier may linger as zombies
            if child.status() != psutil.STATUS_ZOMBIE and "EngineCor" in child.name():  # 15 characters
                cores.append(child)
        except psutil.Error:
            continue
    assert cores, "no engine-core process found"
    for core in cores:
        core.send_signal(signal.SIGKILL)
    for recorder in recorders:
        last = await recorder.wait(timeout=60)
        assert isinstance(last, EngineDeadError), last
    assert engine.errored and not engine._live
    with pytest.raises(EngineDeadError):
        await engine.start(greedy("too-late", PROMPTS[0], 4), Recorder(counted.calls))


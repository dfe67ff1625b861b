"""The fake engine alone: determinism, the greedy-resume property, sampling limits, load."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.worker.engine import (
    Engine,
    EngineDeadError,
    EngineOutput,
    EngineRequest,
    FinishReason,
    Sampling,
)
from services.worker.fake_engine import FakeEngine, FakeModel, fake_greedy, next_token


async def run(engine: FakeEngine, prompt: list[int], **sampling: object) -> tuple[list[int], object]:
    req = EngineRequest(request_id=f"r{id(prompt)}-{len(prompt)}", prompt_token_ids=tuple(prompt),
                        sampling=Sampling(**sampling))  # type: ignore[arg-type]
    tokens: list[int] = []
    last = None
    async for out in engine.generate(req):
        tokens += out.token_ids
        last = out
    return tokens, last


@pytest.fixture(scope="module")
def model(tiny_deepseek_dir: Path) -> FakeModel:
    return FakeModel.from_dir(tiny_deepseek_dir)


def test_reads_vocab_and_special_tokens(model: FakeModel, smollm2_dir: Path) -> None:
    assert model.vocab_size == 4096
    assert model.eos_token_id == 1
    assert {0, 1, 2} <= model.special_ids
    smol = FakeModel.from_dir(smollm2_dir)
    assert smol.vocab_size == 49152
    assert set(range(17)) <= smol.special_ids


def test_next_token_is_a_function_of_the_tail(model: FakeModel) -> None:
    assert next_token([9, 10, 11, 12, 13], model) == next_token([99, 10, 11, 12, 13], model)
    assert next_token([10, 11, 12, 13], model) != next_token([10, 11, 12, 14], model)


@given(prompt=st.lists(st.integers(3, 4095), min_size=1, max_size=12))
@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_never_emits_special_tokens(model: FakeModel, prompt: list[int]) -> None:
    assert not set(fake_greedy(prompt, 20, model)) & model.special_ids


@given(prompt=st.lists(st.integers(3, 4095), min_size=1, max_size=10), n=st.integers(2, 24), data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_greedy_resume_equals_undisturbed_run(tiny_deepseek_dir: Path, prompt: list[int], n: int,
                                              data: st.DataObject) -> None:
    k = data.draw(st.integers(1, n - 1))

    async def scenario() -> None:
        engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0)
        full, final = await run(engine, prompt, max_tokens=n)
        assert len(full) == n and final.finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
        head, _ = await run(engine, prompt, max_tokens=k)
        tail, _ = await run(engine, prompt + head, max_tokens=n - k)
        assert head + tail == full

    asyncio.run(scenario())


async def test_satisfies_the_engine_protocol(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir)
    assert isinstance(engine, Engine)
    info = engine.info
    assert (info.vocab_size, info.max_model_len, info.eos_token_ids) == (4096, 2048, (1,))


async def test_eos_after_min_tokens_and_ignore_eos(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0, eos_after=3)
    tokens, final = await run(engine, [10, 11], max_tokens=10)
    assert len(tokens) == 4 and tokens[-1] == 1
    assert final.finish_reason is FinishReason.STOP and final.stop_token_id == 1  # type: ignore[attr-defined]
    tokens, final = await run(engine, [10, 11], max_tokens=10, min_tokens=6)
    assert len(tokens) == 7 and tokens[-1] == 1
    tokens, final = await run(engine, [10, 11], max_tokens=10, ignore_eos=True)
    assert len(tokens) == 10 and 1 not in tokens
    assert final.finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]


async def test_stop_token_ids(tiny_deepseek_dir: Path, model: FakeModel) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0)
    expected = fake_greedy([20, 21, 22], 8, model)
    stop = expected[4]
    assert stop not in expected[:4]
    tokens, final = await run(engine, [20, 21, 22], max_tokens=8, stop_token_ids=(stop,))
    assert tokens == expected[:5]
    assert final.finish_reason is FinishReason.STOP and final.stop_token_id == stop  # type: ignore[attr-defined]
    # min_tokens suppresses the stop until enough tokens were generated.
    tokens, _ = await run(engine, [20, 21, 22], max_tokens=8, min_tokens=6, stop_token_ids=(stop,))
    assert tokens == expected


async def test_context_length_bounds_generation(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0, max_model_len=8)
    tokens, final = await run(engine, [5, 6, 7, 8, 9])
    assert len(tokens) == 3 and final.finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]


async def test_logprobs(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0)
    req = EngineRequest("lp", (5, 6), Sampling(max_tokens=3, logprobs=3))
    outs = [out async for out in engine.generate(req)]
    for out in outs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for token, lp in zip(out.token_ids, out.logprobs, strict=True):
            assert lp.token_id == token and len(lp.top) == 3 and lp.top[0][0] == token


async def test_running_limit_waiting_and_abort(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=2, max_running=2)
    started = asyncio.Event()

    async def consume(i: int) -> FinishReason | None:
        req = EngineRequest(f"q{i}", (30 + i, 31), Sampling(max_tokens=100_000 if i < 3 else 5))
        reason = None
        async for out in engine.generate(req):
            started.set()
            reason = out.finish_reason
        return reason

    tasks = [asyncio.ensure_future(consume(i)) for i in range(4)]
    await started.wait()
    await asyncio.sleep(0.02)
    load = engine.load()
    assert (load.running, load.waiting) == (2, 2)
    for i in range(3):
        await engine.abort(f"q{i}")
    results = await asyncio.gather(*tasks)
    assert results[:3] == [FinishReason.ABORT] * 3
    assert results[3] is FinishReason.LENGTH
    assert (engine.load().running, engine.load().waiting) == (0, 0)


async def test_kill_fails_running_generations(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=1)

    async def consume() -> None:
        async for _ in engine.generate(EngineRequest("k", (7, 8), Sampling(max_tokens=10_000))):
            pass

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0.02)
    engine.kill()
    with pytest.raises(EngineDeadError):
        await task
    assert engine.errored
    with pytest.raises(EngineDeadError):
        await engine.check_health()


async def test_echo_repeats_the_prompt_and_resumes_by_replay(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=0, echo=True)
    prompt = [100, 200, 300]
    tokens, last = await run(engine, prompt, max_tokens=7, ignore_eos=True)
    assert tokens == [100, 200, 300, 100, 200, 300, 100]
    assert last.finish_reason is FinishReason.LENGTH  # type: ignore[attr-defined]
    # Forced replay of the first 4 tokens continues exactly where the undisturbed run went.
    req = EngineRequest(request_id="echo-resume", prompt_token_ids=tuple(prompt),
                        replay_token_ids=(100, 200, 300, 100),
                        sampling=Sampling(max_tokens=3, ignore_eos=True))
    rest = [t async for out in engine.generate(req) for t in out.token_ids]
    assert rest == tokens[4:]


async def test_one_step_gives_every_running_request_its_token(tiny_deepseek_dir: Path) -> None:
    """Step-based like a batched accelerator: 8 concurrent requests of 10 tokens take
    about 10 steps of one shared timer, not 80 timers; an aborted request leaves the
    step to the others (cancel-safe)."""
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=10, max_running=16)
    results = await asyncio.gather(*(run(engine, [5, i], max_tokens=10) for i in range(8)))
    assert all(len(tokens) == 10 for tokens, _ in results)
    assert 10 <= engine.steps <= 13, engine.steps
    before = engine.steps
    victim = asyncio.ensure_future(run(engine, [9, 9], max_tokens=50))
    survivor = asyncio.ensure_future(run(engine, [7, 7], max_tokens=5))
    await asyncio.sleep(0.025)
    victim.cancel()
    tokens, last = await survivor
    assert tokens == fake_greedy([7, 7], 5, engine.model) and last.finish_reason is FinishReason.LENGTH
    assert engine.steps - before <= 7


async def test_a_step_hands_every_running_request_its_token_in_one_callback(tiny_deepseek_dir: Path) -> None:
    """No task or generator per request: each step is one timer callback that calls the
    sink of every running request (outside any task), one step after the other; once
    nothing runs no timer is armed."""
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=1, max_running=16)
    calls: list[tuple[int, str, object]] = []
    finals: dict[str, EngineOutput] = {}
    all_done = asyncio.Event()

    def sink_for(rid: str) -> Callable[[EngineOutput | Exception], None]:
        def sink(out: EngineOutput | Exception) -> None:
            assert isinstance(out, EngineOutput)
            calls.append((engine.steps, rid, asyncio.current_task()))
            if out.finished:
                finals[rid] = out
                if len(finals) == 8:
                    all_done.set()
        return sink

    ids = [f"s{i}" for i in range(8)]
    for i, rid in enumerate(ids):
        await engine.start(EngineRequest(rid, (5, i), Sampling(max_tokens=10)), sink_for(rid))
    await asyncio.wait_for(all_done.wait(), 10)
    assert all(task is None for _, _, task in calls), "a sink ran inside a task"
    steps = [step for step, _, _ in calls]
    assert steps == sorted(steps), "one step's outputs were interleaved with another's"
    by_step: dict[int, list[str]] = defaultdict(list)
    for step, rid, _ in calls:
        by_step[step].append(rid)
    assert sorted(by_step) == list(range(1, 11))
    assert all(sorted(rids) == ids for rids in by_step.values())
    assert all(out.finish_reason is FinishReason.LENGTH for out in finals.values())
    assert engine._step_handle is None  # idle: no timer


async def test_a_token_sink_gets_plain_steps_as_token_ids(tiny_deepseek_dir: Path) -> None:
    """A sink with ``step_tokens`` gets every token that does not end its request there
    and the last one as an EngineOutput; a request with logprobs gets EngineOutputs only.
    The tokens are the same either way."""
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=1)

    class Sink:
        def __init__(self) -> None:
            self.plain: list[int] = []
            self.outputs: list[EngineOutput] = []
            self.done = asyncio.Event()

        def __call__(self, out: EngineOutput | Exception) -> None:
            assert isinstance(out, EngineOutput)
            self.outputs.append(out)
            if out.finished:
                self.done.set()

        def step_tokens(self, token_ids: list[int]) -> None:
            self.plain.extend(token_ids)

        @property
        def tokens(self) -> list[int]:
            return self.plain + [t for out in self.outputs for t in out.token_ids]

    plain, with_logprobs = Sink(), Sink()
    await engine.start(EngineRequest("p", (5, 1), Sampling(max_tokens=6)), plain)
    await engine.start(EngineRequest("l", (5, 1), Sampling(max_tokens=6, logprobs=1)), with_logprobs)
    await asyncio.wait_for(asyncio.gather(plain.done.wait(), with_logprobs.done.wait()), 10)
    assert len(plain.plain) == 5 and len(plain.outputs) == 1
    assert plain.outputs[0].finish_reason is FinishReason.LENGTH and len(plain.outputs[0].token_ids) == 1
    assert with_logprobs.plain == [] and len(with_logprobs.outputs) == 6
    assert plain.tokens == with_logprobs.tokens


async def test_kill_and_abort_reach_running_and_waiting_sinks(tiny_deepseek_dir: Path) -> None:
    engine = FakeEngine(tiny_deepseek_dir, token_delay_ms=1, max_running=2)
    got: dict[str, list[EngineOutput | Exception]] = defaultdict(list)
    changed = asyncio.Event()

    def sink_for(rid: str) -> Callable[[EngineOutput | Exception], None]:
        def sink(out: EngineOutput | Exception) -> None:
            got[rid].append(out)
            changed.set()
        return sink

    async def until(condition: Callable[[], bool]) -> None:
        while not condition():
            changed.clear()
            await asyncio.wait_for(changed.wait(), 5)

    for i in range(4):
        rid = f"k{i}"
        await engine.start(EngineRequest(rid, (5, i), Sampling(max_tokens=10_000)), sink_for(rid))
    assert (engine.load().running, engine.load().waiting) == (2, 2)
    await engine.abort("k3")  # waiting: leaves at once, ends ABORT
    await engine.abort("k0")  # running: its slot goes to k2
    assert (engine.load().running, engine.load().waiting) == (2, 0)
    await until(lambda: bool(got["k0"] and got["k3"]))
    for rid in ("k0", "k3"):
        last = got[rid][-1]
        assert isinstance(last, EngineOutput) and last.finish_reason is FinishReason.ABORT
    await until(lambda: bool(got["k2"]))
    engine.kill()
    assert engine.load().running == 0
    await until(lambda: all(got[rid] and isinstance(got[rid][-1], EngineDeadError) for rid in ("k1", "k2")))
    with pytest.raises(EngineDeadError):
        await engine.start(EngineRequest("late", (5,)), sink_for("late"))

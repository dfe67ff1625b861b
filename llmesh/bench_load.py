"""Closed-loop load generation for ``llmesh bench``: seeded workload, drivers, statistics.

One driver per protocol turns a :class:`BenchRequest` into a :class:`RequestResult`
(time to first token, gaps between streamed chunks, output tokens, error). The OpenAI
HTTP driver is the same code for llmesh's gateway and for ``vllm serve``, so the two are
measured like for like; the gRPC driver drives llmesh through :class:`llmesh.client.AsyncClient`.
:func:`run_level` runs a list of requests with a fixed number of concurrent streams
(closed loop: each stream sends its next request when the previous one finished) and
:class:`CpuMeter` reads the CPU time of the serving processes before and after.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import aiohttp
import psutil

_WORD_TEXT = (
    "the bank ledger account balance transfer payment customer branch credit debit loan rate "
    "interest policy report risk audit compliance market trade order settlement clearing fund "
    "deposit withdrawal statement quarter annual review summary client portfolio asset bond "
    "equity share price yield currency exchange limit approval request system service network "
    "model answer question explain describe please write short long story about history of "
    "a an and or but with without for from into over under between during after before city "
    "river mountain ocean forest garden library museum school teacher student doctor engineer"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split(" "))
"""Common words; prompts are seeded draws from these (no dataset download needed)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload."""

    index: int
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class WorkloadSpec:
    """Prompt and output length distribution (uniform, inclusive bounds)."""

    prompt_words: tuple[int, int] = (16, 96)
    """Words per prompt (about 1.3 tokens each for English BPE)."""
    output_tokens: tuple[int, int] = (96, 128)
    """max_tokens per request; EOS is ignored, so every request generates exactly this many."""


def make_workload(count: int, seed: int, spec: WorkloadSpec | None = None) -> list[BenchRequest]:
    """``count`` requests drawn from ``seed``: the same seed gives the same requests."""
    spec = spec or WorkloadSpec()
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n_words = rng.randint(*spec.prompt_words)
        words = [rng.choice(WORDS) for _ in range(n_words)]
        # A per-request prefix keeps prefix caching from turning the run into cache hits.
        prompt = f"Request {seed}-{i}: " + " ".join(words)
        out.append(BenchRequest(index=i, prompt=prompt, max_tokens=rng.randint(*spec.output_tokens)))
    return out


@dataclass
class RequestResult:
    """What one request measured."""

    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    """Send to first non-empty text chunk."""
    latency_s: float = math.nan
    """Send to end of stream."""
    output_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)
    """Gaps between successive non-empty text chunks (inter-token latency when one token per chunk)."""
    text: str = ""

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (vLLM's TPOT)."""
        if not self.ok or self.output_tokens < 2:
            return math.nan
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


class Driver(Protocol):
    """Sends one request and measures it; never raises for a failed request."""

    async def __call__(self, request: BenchRequest) -> RequestResult: ...


class _Timeline:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last: float | None = None
        self.result = RequestResult()
        self.parts: list[str] = []

    def chunk(self, text: str) -> None:
        if not text:
            return
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft_s = now - self.start
        else:
            self.result.chunk_gaps_s.append(now - self.last)
        self.last = now
        self.parts.append(text)

    def finish(self, output_tokens: int | None, error: str = "") -> RequestResult:
        r = self.result
        r.latency_s = time.perf_counter() - self.start
        r.text = "".join(self.parts)
        r.output_tokens = output_tokens if output_tokens is not None else len(self.parts)
        r.error = error
        r.ok = not error and r.output_tokens > 0 and self.last is not None
        if not error and not r.ok:
            r.error = "no output"
        return r


class OpenAIHttpDriver:
    """Streams ``/v1/completions`` (SSE) from any OpenAI-compatible server."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 600.0, api_key: str = "") -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model = model
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIHttpDriver:
        # No connection cap: the load generator, not the pool, sets the concurrency.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers=self.headers,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, request: BenchRequest) -> RequestResult:
        assert self._session is not None, "use `async with OpenAIHttpDriver(...)`"
        body = {
            "model": self.model, "prompt": request.prompt, "max_tokens": request.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        line_ = _Timeline()
        usage_tokens: int | None = None
        try:
            async with self._session.post(f"{self.base_url}/completions", json=body) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300]
                    return line_.finish(None, f"HTTP {resp.status}: {text}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        message = obj["error"].get("message", obj["error"])
                        return line_.finish(None, f"stream error: {message}")
                    for choice in obj.get("choices") or []:
                        line_.chunk(choice.get("text") or "")
                    if obj.get("usage"):
                        usage_tokens = int(obj["usage"].get("completion_tokens") or 0)
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
            return line_.finish(None, f"{type(exc).__name__}: {exc}")
        return line_.finish(usage_tokens)


class LlmeshGrpcDriver:
    """Streams ``llmesh.v1.InferenceService/GenerateStream`` through the Python client."""

    def __init__(self, target: str, model: str = "", *, timeout_s: float = 600.0, api_key: str = "") -> None:
        self.target = target
        self.model = model
        self.timeout_s = timeout_s
        self.api_key = api_key or None
        self._client: Any = None

    async def __aenter__(self) -> LlmeshGrpcDriver:
        from llmesh.client import AsyncClient

        # One attempt: the bench counts failures instead of hiding them behind retries.
        self._client = AsyncClient(self.target, api_key=self.api_key, timeout=self.timeout_s, max_attempts=1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()

    async def __call__(self, request: BenchRequest) -> RequestResult:
        from llmesh.client import LlmeshClientError

        assert self._client is not None, "use `async with LlmeshGrpcDriver(...)`"
        line_ = _Timeline()
        stream = self._client.stream(request.prompt, model=self.model, max_tokens=request.max_tokens,
                                     temperature=0.0, ignore_eos=True)
        try:
            async for delta in stream:
                line_.chunk(delta)
        except LlmeshClientError as exc:
            return line_.finish(None, f"{exc.code.name}: {exc.message}")
        return line_.finish(stream.final.usage.completion_tokens)


# --------------------------------------------------------------------------- CPU


class CpuSample(NamedTuple):
    """Cumulative CPU seconds at one moment: whole trees, and the engine processes in them."""

    trees: dict[str, float]
    """Per group: every process of its trees (the processes and all their children)."""
    engines: dict[str, float]
    """Per engine group: the children only (vLLM's engine core), not the serving process."""


class CpuMeter:
    """CPU seconds (user + system) of groups of process trees, e.g. one group per tier.

    ``engine_groups`` name the groups whose children are inference engines (the worker's
    and ``vllm serve``'s engine core): their children are also counted apart, so a
    comparison can leave the engine out on both sides and compare serving code only.
    """

    def __init__(self, groups: Mapping[str, Sequence[int]], engine_groups: Collection[str] = ()) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self.engine_groups = set(engine_groups) & set(self.groups)
        self._procs: dict[int, psutil.Process] = {}

    def _root(self, pid: int) -> psutil.Process | None:
        try:
            root = self._procs.get(pid) or psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None
        self._procs[pid] = root
        return root

    @staticmethod
    def _cpu(procs: Sequence[psutil.Process]) -> float:
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def sample(self) -> CpuSample:
        """Cumulative CPU seconds per group (and of children alive now)."""
        trees: dict[str, float] = {}
        engines: dict[str, float] = {}
        for name, pids in self.groups.items():
            own = children = 0.0
            for pid in pids:
                root = self._root(pid)
                if root is None:
                    continue
                try:
                    kids = root.children(recursive=True)
                except psutil.NoSuchProcess:
                    kids = []
                own += self._cpu([root])
                children += self._cpu(kids)
            trees[name] = own + children
            if name in self.engine_groups:
                engines[name] = children
        return CpuSample(trees, engines)

    @staticmethod
    def delta(before: CpuSample, after: CpuSample) -> CpuSample:
        def minus(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
            return {name: max(0.0, a.get(name, 0.0) - b.get(name, 0.0)) for name in b}

        return CpuSample(minus(after.trees, before.trees), minus(after.engines, before.engines))


# --------------------------------------------------------------------------- stats


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no values."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free interval for the median of the population ``values`` were drawn
    from: the order statistics x(j) and x(n-j+1), j the largest rank with P(B <= j-1) <=
    (1 - confidence)/2 for B ~ Binomial(n, 1/2) (each value falls below the median with
    probability one half). It covers the median with at least ``confidence``, whatever
    the distribution; None when there are too few values for any such pair (fewer than 6
    at 95 %). NaNs are left out."""
    data = sorted(v for v in values if not math.isnan(v))
    n = len(data)
    tail = (1.0 - confidence) / 2.0
    below = 0.0  # P(B <= j - 1), summed as j grows
    j = 0
    while j < n // 2:
        below += math.comb(n, j) / 2.0**n
        if below > tail:
            break
        j += 1
    if j == 0:
        return None
    return data[j - 1], data[n - j]


def _ms(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": _round(percentile(values, 50) * 1000.0),
        "p99": _round(percentile(values, 99) * 1000.0),
        "mean": _round(sum(values) / len(values) * 1000.0) if values else math.nan,
    }


def _round(value: float, digits: int = 3) -> float:
    return value if math.isnan(value) else round(value, digits)


@dataclass
class LevelResult:
    """One concurrency level of one system."""

    concurrency: int
    results: list[RequestResult]
    duration_s: float
    cpu_s: dict[str, float] = field(default_factory=dict)
    engine_cpu_s: dict[str, float] = field(default_factory=dict)
    """The part of ``cpu_s`` spent by engine processes (children of engine groups)."""

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        tokens = sum(r.output_tokens for r in ok)
        errors = [r.error for r in self.results if not r.ok]
        per_1k = {tier: _round(cpu / tokens * 1000.0, 4) if tokens else math.nan
                  for tier, cpu in self.cpu_s.items()}
        if self.cpu_s:
            per_1k["total"] = _round(sum(self.cpu_s.values()) / tokens * 1000.0, 4) if tokens else math.nan
        return {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "completed": len(ok),
            "errors": len(errors),
            "error_samples": sorted(set(errors))[:3],
            "duration_s": _round(self.duration_s),
            "output_tokens": tokens,
            "output_tokens_per_s": _round(tokens / self.duration_s if self.duration_s > 0 else math.nan),
            "requests_per_s": _round(len(ok) / self.duration_s if self.duration_s > 0 else math.nan),
            "ttft_ms": _ms([r.ttft_s for r in ok]),
            "itl_ms": _ms([g for r in ok for g in r.chunk_gaps_s]),
            "tpot_ms": _ms([r.tpot_s for r in ok if not math.isnan(r.tpot_s)]),
            "latency_ms": _ms([r.latency_s for r in ok]),
            "cpu_s": {tier: _round(v, 3) for tier, v in self.cpu_s.items()},
            "cpu_s_per_1k_tokens": per_1k,
            **self._serving_cpu(tokens),
        }

    def _serving_cpu(self, tokens: int) -> dict[str, Any]:
        """CPU per output token without the engine processes: what the serving code costs."""
        if not self.engine_cpu_s:
            return {}
        serving = {tier: max(0.0, cpu - self.engine_cpu_s.get(tier, 0.0)) for tier, cpu in self.cpu_s.items()}
        us = {tier: _round(cpu / tokens * 1e6, 1) if tokens else math.nan for tier, cpu in serving.items()}
        us["total"] = _round(sum(serving.values()) / tokens * 1e6, 1) if tokens else math.nan
        return {
            "engine_cpu_s": {tier: _round(v, 3) for tier, v in self.engine_cpu_s.items()},
            "serving_cpu_us_per_token": us,
        }


ProgressHook = Callable[[RequestResult], None]


async def run_level(
    send: Callable[[BenchRequest], Awaitable[RequestResult]],
    requests: Sequence[BenchRequest],
    concurrency: int,
    *,
    cpu: CpuMeter | None = None,
    on_result: ProgressHook | None = None,
) -> LevelResult:
    """Send ``requests`` over ``concurrency`` closed-loop streams; measure wall and CPU time."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    pending: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for r in requests:
        pending.put_nowait(r)
    results: list[RequestResult | None] = [None] * len(requests)
    position = {id(r): i for i, r in enumerate(requests)}

    async def stream_loop() -> None:
        while True:
            try:
                req = pending.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                res = await send(req)
            except Exception as exc:  # a driver bug must not stop the level
                res = RequestResult(error=f"{type(exc).__name__}: {exc}")
            results[position[id(req)]] = res
            if on_result is not None:
                on_result(res)

    before = cpu.sample() if cpu else None
    start = time.perf_counter()
    await asyncio.gather(*(stream_loop() for _ in range(min(concurrency, len(requests)) or 1)))
    duration = time.perf_counter() - start
    after = cpu.sample() if cpu else None
    done = [r if r is not None else RequestResult(error="not sent") for r in results]
    used = CpuMeter.delta(before, after) if before is not None and after is not None else CpuSample({}, {})
    return LevelResult(concurrency=concurrency, results=done, duration_s=duration,
                       cpu_s=used.trees, engine_cpu_s=used.engines)

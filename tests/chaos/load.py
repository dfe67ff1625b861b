"""Steady, bounded load for chaos tests, and the checks made on what it saw.

:class:`LoadLoop` keeps ``concurrency`` streaming requests in flight through the gateway
until stopped (or until ``max_requests`` / ``max_seconds``, so a broken mesh cannot
make a test run forever). Workers run the deterministic fake engine, so an undisturbed
run of each prompt is the reference its every later stream must equal: a lost, repeated
or reordered piece of text shows up as a mismatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from llmesh.procs import TierProcess, spawn_tier
from llmesh.v1 import inference_pb2, inference_pb2_grpc

MAX_TOKENS = 40
TOKEN_DELAY_MS = 10
PROMPTS = [f"chaos prompt {i}: the ledger of branch {i * 7} must balance" for i in range(8)]
CALL_TIMEOUT_S = 30.0


def stream_request(prompt: str, max_tokens: int = MAX_TOKENS) -> inference_pb2.GenerateStreamRequest:
    return inference_pb2.GenerateStreamRequest(
        prompt=prompt,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


@dataclass
class Outcome:
    """One request of the load."""

    prompt: str
    code: grpc.StatusCode
    text: str
    worker_id: str = ""
    zone: str = ""
    resumed: int = 0
    completion_tokens: int = 0
    started: float = 0.0
    first_token: float = 0.0
    ended: float = 0.0
    details: str = ""

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


async def one_stream(stub: inference_pb2_grpc.InferenceServiceStub, prompt: str,
                     max_tokens: int = MAX_TOKENS) -> Outcome:
    parts: list[str] = []
    out = Outcome(prompt=prompt, code=grpc.StatusCode.OK, text="", started=time.monotonic())
    final = None
    try:
        async for item in stub.GenerateStream(stream_request(prompt, max_tokens), timeout=CALL_TIMEOUT_S):
            if item.HasField("delta"):
                if not parts:
                    out.first_token = time.monotonic()
                parts.append(item.delta.text)
            else:
                final = item.final
    except grpc.aio.AioRpcError as err:
        out.code = err.code()
        out.details = err.details() or ""
    out.ended = time.monotonic()
    out.text = "".join(parts)
    if final is not None:
        out.worker_id = final.served_by.worker_id
        out.zone = final.served_by.zone
        out.resumed = final.served_by.resumed
        out.completion_tokens = final.usage.completion_tokens
    elif out.ok:
        out.code = grpc.StatusCode.UNKNOWN
        out.details = "stream ended without a final message"
    return out


async def references(channel: grpc.aio.Channel, prompts: Sequence[str] = PROMPTS) -> dict[str, str]:
    """The undisturbed text of every prompt."""
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    refs = {}
    for prompt in prompts:
        out = await one_stream(stub, prompt)
        assert out.ok, f"reference run failed: {out.code.name} {out.details}"
        assert out.completion_tokens == MAX_TOKENS
        refs[prompt] = out.text
    return refs


class LoadLoop:
    """``concurrency`` closed-loop streams over ``prompts`` (round robin) until :meth:`stop`."""

    def __init__(self, channel: grpc.aio.Channel, prompts: Sequence[str] = PROMPTS, *, concurrency: int = 6,
                 max_requests: int = 600, max_seconds: float = 40.0) -> None:
        self.stub = inference_pb2_grpc.InferenceServiceStub(channel)
        self.prompts = list(prompts)
        self.concurrency = concurrency
        self.max_requests = max_requests
        self.deadline = time.monotonic() + max_seconds
        self.outcomes: list[Outcome] = []
        self._sent = 0
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _loop(self, offset_s: float) -> None:
        # The fake engine is step-based like an accelerator: streams started together
        # advance and end together, so unstaggered loops would leave gaps between waves in
        # which no stream is mid-way (a fault landing there hits nothing). Starting each
        # loop at its own phase keeps some stream mid-way at every moment.
        await asyncio.sleep(offset_s)
        while (not self._stopping.is_set() and self._sent < self.max_requests
               and time.monotonic() < self.deadline):
            prompt = self.prompts[self._sent % len(self.prompts)]
            self._sent += 1
            self.outcomes.append(await one_stream(self.stub, prompt))

    async def __aenter__(self) -> LoadLoop:
        stream_s = MAX_TOKENS * TOKEN_DELAY_MS / 1000.0
        self._tasks = [asyncio.create_task(self._loop(i * stream_s / self.concurrency))
                       for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def run_for(self, seconds: float) -> None:
        """Let the load run (the loop ends early if it hits its bounds)."""
        await asyncio.sleep(seconds)

    async def stop(self) -> list[Outcome]:
        self._stopping.set()
        if self._tasks:
            await asyncio.gather(*self._tasks)
            self._tasks = []
        return self.outcomes

    def done_since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started >= t]


def assert_clean(outcomes: Sequence[Outcome], refs: dict[str, str], *, least: int = 10) -> None:
    """Every request succeeded with exactly its reference text (nothing lost or duplicated)."""
    assert len(outcomes) >= least, f"only {len(outcomes)} requests ran"
    failed = [f"{o.code.name}: {o.details}" for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {sorted(set(failed))[:5]}"
    wrong = [o for o in outcomes if o.text != refs[o.prompt]]
    assert not wrong, (
        f"{len(wrong)} of {len(outcomes)} streams differ from their reference; first: "
        f"got {wrong[0].text!r}, want {refs[wrong[0].prompt]!r} (resumed {wrong[0].resumed})"
    )
    short = [o for o in outcomes if o.completion_tokens != MAX_TOKENS]
    assert not short, f"{len(short)} streams reported a wrong completion_tokens"


# --------------------------------------------------------------------------- processes


def metric(proc: TierProcess, name: str, host: str = "127.0.0.1") -> float:
    """Sum of all samples of a Prometheus metric of one process."""
    text = urllib.request.urlopen(f"http://{host}:{proc.metrics_port}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(\{{.*\}})?\s+(\S+)$", line)
        if match:
            total += float(match.group(2))
    return total


def kill9(proc: TierProcess) -> None:
    proc.popen.send_signal(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(10)


def respawn(procs: list[TierProcess], proc: TierProcess) -> TierProcess:
    """Start the same command again (same ports, same flags) in place of a dead process."""
    assert not proc.alive(), f"{proc.name} is still running"
    argv = proc.argv
    netns = argv[3] if argv[:3] == ["ip", "netns", "exec"] else ""
    args = argv[argv.index("llmesh.cli") + 2:]
    log_dir: Path | None = proc.log_path.parent if proc.log_path else None
    new = spawn_tier(proc.name, proc.tier, args, address=proc.address, service=proc.service, log_dir=log_dir,
                     zone=proc.zone, metrics_port=proc.metrics_port, netns=netns)
    procs[procs.index(proc)] = new
    return new


async def wait_until(predicate, timeout: float, interval: float = 0.2) -> bool:  # type: ignore[no-untyped-def]
    """Poll a (blocking) predicate in a thread until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return True
        await asyncio.sleep(interval)
    return False

"""A stub OpenAI-compatible completions server (SSE), standing in for ``vllm serve`` in tests.

It streams one chunk per token (like vLLM), then a usage chunk when asked, then
``[DONE]``. ``fail_every=N`` answers every N-th request with HTTP 500.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

from llmesh.procs import free_port


class StubOpenAI:
    """Runs in its own thread and event loop, so sync code (``llmesh bench``'s main) can call it."""

    def __init__(self, *, fail_every: int = 0, token_delay_s: float = 0.001) -> None:
        self.fail_every = fail_every
        self.token_delay_s = token_delay_s
        self.port = free_port()
        self.requests: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if self.fail_every and len(self.requests) % self.fail_every == 0:
            error = {"error": {"message": "stub failure", "type": "server_error"}}
            return web.json_response(error, status=500)
        n = int(body.get("max_tokens") or 16)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(self.token_delay_s)
            chunk = {"id": "cmpl-stub", "object": "text_completion", "model": body.get("model"),
                     "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        done = {"id": "cmpl-stub", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
        await resp.write(f"data: {json.dumps(done)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-stub", "object": "text_completion", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}}
            await resp.write(f"data: {json.dumps(usage)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def start(self) -> StubOpenAI:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

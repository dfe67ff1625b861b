"""The event loop every tier process runs on: uvloop by default, asyncio's own on request.

uvloop (libuv under asyncio's API) is the loop vLLM's OpenAI server runs on through
uvicorn; grpc.aio and aiohttp run on any asyncio loop. Measured on the whole mesh
(docs/benchmarks.md, 4 December 2026) it takes a few µs of CPU off every output token
and serves more tokens per second on the same cores. ``--event-loop asyncio`` (or
``LLMESH_<TIER>_EVENT_LOOP=asyncio``) keeps the standard library's loop, and a host
without uvloop installed falls back to it with a warning.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

EventLoop = Literal["uvloop", "asyncio"]


def loop_factory(kind: EventLoop) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of ``kind``'s loop (None: asyncio's default)."""
    if kind != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on asyncio's own event loop")
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Coroutine[Any, Any, T], kind: EventLoop) -> T:
    """``asyncio.run(main)`` on the event loop ``kind``."""
    factory = loop_factory(kind)
    log.info("event loop: %s", "uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)

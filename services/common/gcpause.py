"""The cyclic garbage collector in a serving process: the startup heap frozen, full
collections timed.

A tier imports a great deal before it serves (grpc, OpenTelemetry, protobuf; the worker
vLLM and torch as well: about 600,000 tracked objects). Python's oldest-generation
collection walks every one of them: measured here at 340 ms in a process that imported
vLLM. While it runs the event loop serves nothing, so every stream on the process stalls,
and a worker stalled for 0.4 s is counted silent by its router. :func:`freeze_startup_heap`,
called after the imports and again once the tier has warmed up, collects the startup
garbage and moves every object left into the collector's permanent generation
(``gc.freeze``): a full collection then walks only what was allocated since (0.0 ms right
after the freeze, in that same process). Objects made while serving are collected as
before.

:func:`watch_full_collections` records how long each full collection took
(``llmesh_gc_full_collection_seconds``), so a pause shows on the dashboards instead of as
an unexplained latency spike.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from services.common.metrics import FULL_COLLECTIONS

log = logging.getLogger(__name__)

OLDEST = 2
"""The oldest generation: its collection walks every tracked object not frozen."""

_watched: dict[str, Any] = {}
"""The callback installed per tier (one per process; kept to remove it in tests)."""


def freeze_startup_heap(tier: str, stage: str) -> int:
    """Collect what startup left over, then freeze every surviving object out of later
    collections; returns how many objects are frozen now. Called after each stage of
    startup (imports, warm-up), each call's collection walks only what the stage made."""
    started = time.perf_counter()
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d startup objects frozen out of the garbage collector after the %s "
             "(%d more, %.0f ms)", tier, frozen, stage, frozen - before,
             (time.perf_counter() - started) * 1000.0)
    return frozen


def watch_full_collections(tier: str) -> None:
    """Time every full collection in this process into :data:`FULL_COLLECTIONS`."""
    if tier in _watched:
        return
    histogram = FULL_COLLECTIONS.labels(tier)
    started = 0.0

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        nonlocal started
        if info.get("generation") != OLDEST:
            return
        if phase == "start":
            started = time.perf_counter()
        else:
            histogram.observe(time.perf_counter() - started)

    gc.callbacks.append(on_collection)
    _watched[tier] = on_collection


def unwatch(tier: str) -> None:
    """Remove :func:`watch_full_collections`' callback (tests)."""
    callback = _watched.pop(tier, None)
    if callback is not None and callback in gc.callbacks:
        gc.callbacks.remove(callback)

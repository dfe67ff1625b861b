"""Where one request's time to first token goes, hop by hop: every Session frame each tier
sends and receives on the way, timestamped, for sequential requests through a fake-engine
mesh's gateway.

Usage: ``.venv/bin/python scripts/first_token_timeline.py [--requests 60] [--token-delay-ms 20]
[--tokens 3] [--gap-s 0.2] [--protocol grpc|http]``

A ``sitecustomize`` hook (written to a temporary directory put on the tiers'
``PYTHONPATH``, so the tiers' code is not touched) wraps the framed transport of
``services/common/sessionwire.py`` in every tier process: each frame written (``send``)
and each frame read, by a caller (``crecv``) or by a listener (``srecv``), appends the
``CLOCK_MONOTONIC`` nanoseconds, its direction and kind to a file of that process. This
process sends the requests (``llmesh.client``'s GenerateStream, or with ``--protocol
http`` the streamed ``/v1/completions`` that ``llmesh bench`` drives) one at a time, ``--gap-s``
apart as a user at one stream does, and notes when each was sent and when its first text
came. Per request the frames between the two are lined up; the most common sequence is
printed with the median offset of every frame from the send and the median step from the
frame before, then the median of (time to first token - the worker's time between the
submission and its first frame), the tiers' part of it. Pings and pongs are left out.

The fake engine's ``--token-delay-ms`` (20) keeps the first token apart from the next ones,
as a real engine's step does. Each request wakes every tier from idle, as one stream at a
time does on a real mesh: the figures are cold paths, each timestamp costs a few
microseconds. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HOOK = '''
import os, sys, time
_dir = os.environ.get("LLMESH_TIMELINE_DIR")
if _dir:
    import importlib.abc, importlib.util
    _fd = os.open(os.path.join(_dir, f"{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, ("argv " + " ".join(sys.argv)[:300] + "\\n").encode())

    def _note(event, kind, size):
        os.write(_fd, b"%d %s %d %d\\n" % (time.monotonic_ns(), event, kind, size))

    def _wrap(module):
        frame, read_frame, on_frame = module.frame, module.read_frame, module._Connection._frame

        def timed_frame(kind, payload=b""):
            _note(b"send", kind, len(payload))
            return frame(kind, payload)

        async def timed_read_frame(reader):
            kind, payload = await read_frame(reader)
            _note(b"crecv", kind, len(payload))
            return kind, payload

        def timed_on_frame(self, kind, payload):
            _note(b"srecv", kind, len(payload))
            return on_frame(self, kind, payload)

        module.frame, module.read_frame = timed_frame, timed_read_frame
        module._Connection._frame = timed_on_frame

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "services.common.sessionwire":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _wrap(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())
'''

TIERS = ("gateway", "tokenizer", "router", "worker", "postprocessor")
KINDS = ("MESSAGE", "HELLO", "END", "STATUS", "PING", "PONG")


def _tier(argv: str) -> str:
    """The tier a process runs: its first argument (``-m llmesh.cli TIER``, which
    ``sitecustomize`` sees as ``-m TIER``); its other arguments may name other tiers."""
    words = argv.split()
    if len(words) > 1 and words[1] in TIERS:
        return words[1]
    return next((t for t in TIERS if t in argv), argv[:40])


def _read_events(log_dir: Path) -> list[tuple[int, str]]:
    """(ns, "tier:direction:kind") of every frame every tier sent or read."""
    events: list[tuple[int, str]] = []
    for path in log_dir.glob("*.log"):
        lines = path.read_text().splitlines()
        if not lines or not lines[0].startswith("argv "):
            continue
        tier = _tier(lines[0].removeprefix("argv "))
        for line in lines[1:]:
            ns, event, kind, _size = line.split()
            if KINDS[int(kind)] in ("PING", "PONG"):
                continue
            events.append((int(ns), f"{tier}:{event}:{KINDS[int(kind)]}"))
    events.sort()
    return events


def report(events: list[tuple[int, str]], requests: list[tuple[int, int]]) -> None:
    times = [ns for ns, _ in events]
    paths: list[tuple[list[tuple[int, str]], int]] = []
    for sent, first in requests:
        lo, hi = bisect.bisect_left(times, sent), bisect.bisect_right(times, first)
        paths.append(([(ns - sent, label) for ns, label in events[lo:hi]], first - sent))
    if not paths:
        print("no request answered")
        return
    shapes = collections.Counter(tuple(label for _, label in path) for path, _ in paths)
    shape, count = shapes.most_common(1)[0]
    alike = [(path, ttft) for path, ttft in paths if tuple(label for _, label in path) == shape]
    print(f"{len(paths)} requests, {len(shapes)} different paths; the commonest:")
    for other, n in shapes.most_common(3):
        print(f"  {n:4d} x " + " ".join(label.replace(":MESSAGE", "") for label in other))
    print(f"{count} took the most common path, its frames (median us):")
    print(f"{'from send':>10} {'step':>8}  frame")
    previous = 0.0
    for i, label in enumerate(shape):
        offset = statistics.median(path[i][0] for path, _ in alike) / 1000
        print(f"{offset:10.0f} {offset - previous:+8.0f}  {label}")
        previous = offset
    first = statistics.median(ttft for _, ttft in alike) / 1000
    print(f"{first:10.0f} {first - previous:+8.0f}  first text at the client")
    tiers_part = []
    for path, ttft in paths:
        got = [ns for ns, label in path if label == "worker:srecv:MESSAGE"]
        answered = [ns for ns, label in path if label == "worker:send:MESSAGE"]
        if got and answered:
            tiers_part.append((ttft - (answered[0] - got[0])) / 1000)
    print(f"time to first token, median of all: {statistics.median(t for _, t in paths) / 1000:.0f} us")
    if tiers_part:
        print(f"less the worker's submission-to-first-frame: {statistics.median(tiers_part):.0f} us "
              f"({len(tiers_part)} requests)")


async def _drive(target: str, model: str, prompts: list[tuple[str, int]], warmup: int,
                 gap_s: float) -> list[tuple[int, int]]:
    """Over gRPC: ``llmesh.client``'s GenerateStream."""
    from llmesh.client import AsyncClient

    client = AsyncClient(target, timeout=60, max_attempts=1)
    timed: list[tuple[int, int]] = []
    try:
        for i, (prompt, max_tokens) in enumerate(prompts):
            await asyncio.sleep(gap_s)
            sent, first = time.monotonic_ns(), 0
            stream = client.stream(prompt, model=model, max_tokens=max_tokens, temperature=0.0,
                                   ignore_eos=True)
            async for text in stream:
                if text and not first:
                    first = time.monotonic_ns()
            if i >= warmup and first:
                timed.append((sent, first))
    finally:
        await client.close()
    return timed


async def _drive_http(url: str, model: str, prompts: list[tuple[str, int]], warmup: int,
                      gap_s: float, on_measured: Callable[[], None] | None = None,
                      timeout_s: float = 60) -> list[tuple[int, int]]:
    """Over HTTP: the streamed ``/v1/completions`` of ``llmesh bench``'s client, whose time
    to first token counts from just after the send time noted here. ``on_measured`` is
    called once the warm-ups are done, before the first measured request."""
    from llmesh.bench_load import BenchRequest, OpenAIHttpDriver

    timed: list[tuple[int, int]] = []
    async with OpenAIHttpDriver(url, model, timeout_s=timeout_s) as driver:
        for i, (prompt, max_tokens) in enumerate(prompts):
            if i == warmup and on_measured is not None:
                on_measured()
            await asyncio.sleep(gap_s)
            sent = time.monotonic_ns()
            result = await driver(BenchRequest(index=i, prompt=prompt, max_tokens=max_tokens))
            if i >= warmup and result.ok and math.isfinite(result.ttft_s):
                timed.append((sent, sent + int(result.ttft_s * 1e9)))
    return timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60, help="requests timed (after 5 warm-ups)")
    parser.add_argument("--token-delay-ms", type=float, default=20.0, help="the fake engine's step")
    parser.add_argument("--tokens", type=int, default=3, help="output tokens per request")
    parser.add_argument("--gap-s", type=float, default=0.2, help="pause before every request")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                        help="GenerateStream, or the streamed /v1/completions llmesh bench drives")
    args = parser.parse_args(argv)

    from llmesh import bench
    from llmesh.bench_load import WorkloadSpec, make_workload

    opts = bench.options_from_args(bench.build_parser().parse_args(["--quick"]))
    warmup = 5
    workload = make_workload(args.requests + warmup, seed=7, spec=WorkloadSpec(
        prompt_words=(16, 64), output_tokens=(args.tokens, args.tokens)))
    with tempfile.TemporaryDirectory(prefix="llmesh-timeline-") as tmp:
        hook_dir, log_dir = Path(tmp) / "hook", Path(tmp) / "frames"
        hook_dir.mkdir()
        log_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
        os.environ["LLMESH_TIMELINE_DIR"] = str(log_dir)
        config = bench._fake_mesh_config(opts, token_delay_ms=args.token_delay_ms, batch_max_wait_ms=None)
        print("starting a fake-engine mesh", file=sys.stderr)
        prompts = [(r.prompt, r.max_tokens) for r in workload]
        with bench._started_mesh(config, Path(tmp) / "logs") as mesh:
            if args.protocol == "http":
                timed = asyncio.run(_drive_http(mesh.state()["http"], opts.model_name, prompts, warmup,
                                                args.gap_s))
            else:
                target = f"{config.gateway.host}:{config.gateway.port}"
                timed = asyncio.run(_drive(target, opts.model_name, prompts, warmup, args.gap_s))
        report(_read_events(log_dir), timed)
    return 0


if __name__ == "__main__":
    sys.exit(main())

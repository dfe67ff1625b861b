"""What the kernel's scheduler did to one-stream first tokens on the real engine: per
request, how long llmesh's threads and the client's sat runnable but off the CPU, on the
way in and on the way out, and which threads ran meanwhile.

Usage (root, for tracefs): ``.venv/bin/python scripts/first_token_sched.py [--requests 20]
[--tokens 4] [--gap-s 1.25] [--layout edge|default] [--keep DIR]``

A mesh on the bench's engine settings (``llmesh bench --quick``'s SmolLM2, one vLLM CPU
worker; ``--layout edge`` puts the tokenizer, router and postprocessor in the gateway's
process as ``deploy/local/edge.yaml`` does) gets sequential streamed ``/v1/completions``,
``--gap-s`` apart, as one user does. Meanwhile the kernel records every ``sched_switch``
and ``sched_wakeup`` (``/sys/kernel/tracing``, monotonic clock), and the hook of
``scripts/first_token_timeline.py`` timestamps every Session frame the tiers write and
read. Per request the report gives the time to first token, the time from the worker's
first frame to the client's first text, and the time llmesh's threads (and this
process's, the client) were runnable but waiting: "in" from the send to the engine
core's first wake-up after the worker read the submission, "out" from 1 ms before the
worker's frame with the first token (the engine's first output wakes the worker a few hundred µs before
it) to the first text, the engine's prefill between left out; then the threads that held
a CPU while ours waited in those two, summed over all requests. A thread "waits" from its
wake-up, or from being preempted while runnable, to its next switch onto a CPU.

The trace buffer is 64 MiB per CPU; tracefs's state is put back at the end. Not a test:
it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import first_token_timeline

TRACING = Path("/sys/kernel/tracing")
EVENTS = ("sched_switch", "sched_wakeup")
_LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+): (\w+): (.*)$")
_WAKEUP = re.compile(r" pid=(\d+)")
_SWITCH = re.compile(r"prev_comm=(.+?) prev_pid=(\d+) prev_prio=\d+ prev_state=(\S+) ==> "
                     r"next_comm=(.+?) next_pid=(\d+)")


@dataclass
class Request:
    sent: int  # CLOCK_MONOTONIC ns
    first: int
    frames: list[tuple[int, str]] = field(default_factory=list)
    wait_in: int = 0
    wait_out: int = 0


def _write(name: str, value: str) -> None:
    (TRACING / name).write_text(value)


class Trace:
    """The scheduler's switch and wake-up events, recorded while on; what tracefs had
    before (clock, buffer size, whether tracing was on and these events enabled) is put
    back on leaving."""

    def __init__(self) -> None:
        self._clock = (TRACING / "trace_clock").read_text().split("[")[1].split("]")[0]
        self._size = (TRACING / "buffer_size_kb").read_text().split()[0]
        self._on = (TRACING / "tracing_on").read_text().strip()
        self._enabled = {e: (TRACING / "events/sched" / e / "enable").read_text().strip() for e in EVENTS}

    def __enter__(self) -> Trace:
        _write("tracing_on", "0")
        _write("trace", "")
        _write("trace_clock", "mono")  # CLOCK_MONOTONIC, as the frames' timestamps
        _write("buffer_size_kb", "65536")
        for event in EVENTS:
            (TRACING / "events/sched" / event / "enable").write_text("1")
        return self

    def on(self, value: bool) -> None:
        _write("tracing_on", "1" if value else "0")

    def save(self, path: Path) -> None:
        shutil.copyfile(TRACING / "trace", path)

    def __exit__(self, *exc: object) -> None:
        _write("tracing_on", "0")
        for event, enabled in self._enabled.items():
            (TRACING / "events/sched" / event / "enable").write_text(enabled)
        _write("trace", "")
        _write("trace_clock", self._clock)
        _write("buffer_size_kb", self._size)
        _write("tracing_on", self._on)


def _engine_wakeups(trace: Path) -> list[int]:
    """When a thread of vLLM's engine core was woken (ns), in order."""
    found = []
    with open(trace) as f:
        for line in f:
            if "sched_wakeup: comm=VLLM::EngineCor" in line:
                m = _LINE.match(line)
                if m:
                    found.append(int(float(m.group(4)) * 1e9))
    return found


def _regions(requests: list[Request], engine_wakeups: list[int]) -> list[tuple[int, int, int, int, Request]]:
    """Per request: (sent, submitted, first output, first text): "in" runs from the send to
    the engine core's first wake-up after the worker read the submission frame, "out" from
    1 ms before the worker's first frame (the engine's output wakes the worker a few
    hundred µs before it) to the first text; the engine's prefill lies between."""
    regions = []
    for r in requests:
        read = next((t for t, label in r.frames if label == "worker:srecv:MESSAGE"), None)
        # The first token's frame: the worker's last before the first text (an earlier
        # one may carry a load report).
        sent_out = next((t for t, label in reversed(r.frames) if label == "worker:send:MESSAGE"), None)
        if read is None or sent_out is None:
            continue
        submitted = next((t for t in engine_wakeups if t >= read), r.first)
        regions.append((r.sent, min(submitted, sent_out), sent_out - 1_000_000, r.first, r))
    return regions


def analyse(trace: Path, ours: dict[int, str], requests: list[Request]) -> collections.Counter[str]:
    """Fill each request's waits; return µs others held a CPU while ours waited, by thread
    name. Requests whose frames are not all there (no submission read, no first frame) are
    left out."""
    regions = _regions(requests, _engine_wakeups(trace))
    ready: dict[int, int] = {}
    held: collections.Counter[str] = collections.Counter()
    with open(trace) as f:
        for line in f:
            m = _LINE.match(line)
            if not m:
                continue
            ns, event, rest = int(float(m.group(4)) * 1e9), m.group(5), m.group(6)
            if event == "sched_wakeup":
                woken = _WAKEUP.search(rest)
                if woken and int(woken.group(1)) in ours:
                    ready.setdefault(int(woken.group(1)), ns)
                continue
            s = _SWITCH.search(rest)
            if event != "sched_switch" or not s:
                continue
            prev, state, nxt = int(s.group(2)), s.group(3), int(s.group(5))
            if prev in ours and state.startswith("R"):
                ready[prev] = ns  # preempted while runnable
            if nxt not in ready:
                continue
            since = ready.pop(nxt)
            for sent, submitted, out_from, first, req in regions:
                if sent <= since and ns <= submitted:
                    req.wait_in += ns - since
                elif out_from <= since and ns <= first:
                    req.wait_out += ns - since
                else:
                    continue
                if prev not in ours:
                    held[s.group(1)] += (ns - since) // 1000
                break
    return held


def report(requests: list[Request], held: collections.Counter[str]) -> None:
    requests = [r for r in requests if any(label == "worker:send:MESSAGE" for _, label in r.frames)]
    print(f"{'TTFT':>9} {'frame->text':>11} {'wait in':>8} {'wait out':>8}   (µs; waits summed over "
          "llmesh's and the client's threads)")
    for r in requests:
        out_from = next((t for t, label in reversed(r.frames) if label == "worker:send:MESSAGE"), r.first)
        print(f"{(r.first - r.sent) / 1e3:9.0f} {(r.first - out_from) / 1e3:11.0f} "
              f"{r.wait_in / 1e3:8.0f} {r.wait_out / 1e3:8.0f}")
    if not requests:
        print("no request answered")
        return
    for name, values in (("TTFT", [r.first - r.sent for r in requests]),
                         ("wait in", [r.wait_in for r in requests]),
                         ("wait out", [r.wait_out for r in requests])):
        print(f"median {name}: {statistics.median(values) / 1e3:.0f} µs")
    print("threads on a CPU while ours waited (µs over all requests):")
    for name, us in held.most_common(8):
        print(f"  {name:24s} {us:8d}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="requests traced (after 3 warm-ups)")
    parser.add_argument("--tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--gap-s", type=float, default=1.25, help="pause before every request")
    parser.add_argument("--layout", choices=("edge", "default"), default="edge",
                        help="edge: tokenizer, router and postprocessor in the gateway's process")
    parser.add_argument("--keep", type=Path, help="keep the raw trace, frames and threads here")
    args = parser.parse_args(argv)
    if not TRACING.is_dir() or os.geteuid() != 0:
        print("first_token_sched: needs root and tracefs at /sys/kernel/tracing", file=sys.stderr)
        return 2

    from llmesh import bench
    from llmesh.bench_load import WorkloadSpec, make_workload

    local = (["--tokenizer-transport", "local", "--postprocessor-transport", "local",
              "--router-transport", "local"] if args.layout == "edge" else [])
    with tempfile.TemporaryDirectory(prefix="llmesh-sched-") as tmp:
        work = args.keep or Path(tmp)
        hook_dir, frame_dir = work / "hook", work / "frames"
        for d in (hook_dir, frame_dir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        (hook_dir / "sitecustomize.py").write_text(first_token_timeline.HOOK)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(hook_dir), os.environ.get("PYTHONPATH", "")) if p)
        os.environ["LLMESH_TIMELINE_DIR"] = str(frame_dir)
        opts = bench.options_from_args(bench.build_parser().parse_args(
            ["--quick", "--no-progress", "--out", str(work / "bench"), *local]))
        warmup = 3
        workload = make_workload(args.requests + warmup, seed=99, spec=WorkloadSpec(
            prompt_words=opts.workload.prompt_words, output_tokens=(args.tokens, args.tokens)))
        prompts = [(r.prompt, r.max_tokens) for r in workload]
        print(f"starting a real-engine mesh ({args.layout} layout)", file=sys.stderr)
        with Trace() as trace, bench._started_mesh(bench._engine_mesh_config(opts), work / "logs") as mesh:
            timed = asyncio.run(first_token_timeline._drive_http(
                mesh.state()["http"], opts.model_name, prompts, warmup, args.gap_s,
                on_measured=lambda: trace.on(True), timeout_s=120))
            trace.on(False)
            requests = [Request(sent, first) for sent, first in timed]
            trace.save(work / "trace.txt")
            ours = {int(tid): proc.tier for proc in mesh.procs
                    for tid in os.listdir(f"/proc/{proc.pid}/task")}
        ours.update({int(t): "client" for t in os.listdir("/proc/self/task")})
        frames = first_token_timeline._read_events(frame_dir)
        for r in requests:
            r.frames = [(ns, label) for ns, label in frames if r.sent <= ns <= r.first]
        held = analyse(work / "trace.txt", ours, requests)
        if args.keep:
            (work / "threads.json").write_text(json.dumps(ours))
        report(requests, held)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Frontend CPU per output token of ``VllmEngine.start``: the per-request bridge vs the native path.

Usage (one real engine; run it under the shared lock):
    flock /tmp/llmesh-engine.lock env PYTHONPATH=. python tests/worker/vllm_step_cpu.py [MODEL_DIR]

Builds one engine (tiny DeepSeek by default) in this process and runs rounds of
``--waves`` x ``--concurrency`` requests (random prompts, greedy, ``ignore_eos``,
``--max-tokens`` each), alternating three ways of feeding a sink:

* ``bridged``: a task per request draining ``AsyncLLM.generate``, which awaits vLLM's
  per-request collector (what ``start`` did first);
* ``collector``: ``VllmEngine.start`` with vLLM's own ``OutputProcessor.process_outputs``
  (a ``RequestOutput`` per request and step, put into the sink that replaced the
  request's collector: what ``start`` did next);
* ``native``: ``VllmEngine.start`` as it is (``VllmEngine._process_outputs`` turns the
  engine core's ``EngineCoreOutput``s into the sinks' outputs directly).

The figure is this process's utime + stime (``/proc/self/stat``: every thread of the
frontend; the engine core is another process and is not counted) per output token.
Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_s() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


async def run_round(engine: Any, mode: str, prompts: list[list[int]], waves: int, max_tokens: int,
                    tag: str) -> dict[str, float]:
    from services.worker.engine import EngineOutput, EngineRequest, Sampling
    from tests.worker.conftest import start_from_generator

    sampling = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = 0
    cpu0, wall0 = process_cpu_s(), time.perf_counter()
    for wave in range(waves):
        remaining = len(prompts)
        done = asyncio.Event()

        def sink(item: EngineOutput | Exception, done: asyncio.Event = done) -> None:
            nonlocal tokens, remaining
            if isinstance(item, Exception):
                raise item
            tokens += len(item.token_ids)
            if item.finish_reason is not None:
                remaining -= 1
                if not remaining:
                    done.set()

        tasks = []
        for i, prompt in enumerate(prompts):
            request = EngineRequest(f"{tag}-{wave}-{i}", tuple(prompt), sampling)
            if mode == "bridged":
                tasks.append(start_from_generator(engine.generate(request), sink))
            else:
                await engine.start(request, sink)
        await done.wait()
        await asyncio.gather(*tasks)
    cpu, wall = process_cpu_s() - cpu0, time.perf_counter() - wall0
    return {"tokens": tokens, "cpu_us_per_token": round(cpu / tokens * 1e6, 1),
            "tok_s": round(tokens / wall, 1)}


async def main(model_dir: Path, concurrency: int, waves: int, max_tokens: int,
               repeats: int) -> dict[str, Any]:
    from services.worker.vllm_engine import VllmEngine

    engine = VllmEngine.build({"model": str(model_dir), "tokenizer": str(model_dir), "enforce_eager": True,
                               "max_num_seqs": max(64, concurrency), "max_model_len": 2048, "seed": 0})
    rng = random.Random(0)
    vocab = engine.info.vocab_size
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(32)] for _ in range(concurrency)]
    processor = engine.llm.output_processor
    step_reader = processor.process_outputs
    try:
        await run_round(engine, "native", prompts[:2], 1, 8, "warm-n")
        await run_round(engine, "bridged", prompts[:2], 1, 8, "warm-b")
        rounds: dict[str, list[dict[str, float]]] = {"bridged": [], "collector": [], "native": []}
        for r in range(repeats):
            order = list(rounds) if r % 2 == 0 else list(reversed(rounds))
            for mode in order:
                if mode == "collector":
                    processor.process_outputs = engine._vllm_process_outputs  # type: ignore[method-assign]
                result = await run_round(engine, "bridged" if mode == "bridged" else "start", prompts,
                                         waves, max_tokens, f"{mode}{r}")
                processor.process_outputs = step_reader  # type: ignore[method-assign]
                rounds[mode].append(result)
                print(json.dumps({"round": r, "mode": mode, **result}), file=sys.stderr, flush=True)
    finally:
        await engine.shutdown()
    summary: dict[str, Any] = {"model": model_dir.name, "concurrency": concurrency, "waves": waves,
                               "max_tokens": max_tokens, "loadavg": os.getloadavg()}
    for mode, rs in rounds.items():
        values = [r["cpu_us_per_token"] for r in rs]
        summary[mode] = {"cpu_us_per_token": values, "median": statistics.median(values),
                         "spread": round(max(values) - min(values), 1), "tok_s": [r["tok_s"] for r in rs]}
    # Each repeat ran every mode back to back: the ratio within a repeat is what compares
    # (the host is shared; absolute figures drift between runs).
    for mode, base in (("native", "collector"), ("native", "bridged"), ("collector", "bridged")):
        ratios = [n["cpu_us_per_token"] / b["cpu_us_per_token"]
                  for n, b in zip(rounds[mode], rounds[base], strict=True)]
        summary[f"{mode}_over_{base}"] = {"per_repeat": [round(x, 3) for x in ratios],
                                          "median": round(statistics.median(ratios), 3)}
    return summary


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else Path.home() / ".cache/llmesh/models/tiny-deepseek"
    print(json.dumps(asyncio.run(main(model, concurrency=32, waves=3, max_tokens=128, repeats=5)), indent=2))

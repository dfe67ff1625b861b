"""The postprocessor's own work per token, without a process or a socket around it:
detokenization, stop strings, the sensitive-data filter.

Usage: ``.venv/bin/python scripts/postprocessor_cost.py [--filter-mode off|redact|block]
[--streams 32] [--tokens 128] [--model-dir DIR] [--text FILE] [--gateway]``

``streams`` sessions of one model are fed ``tokens`` tokens each, one token per session
in turn (as frames of a step-based engine deliver them), then ended. The tokens are the
model's encoding of ``--text`` (this repository's README by default: prose, tables and
numbers), each stream starting at its own place in it. It prints the process CPU per
token; wall-clock figures move with the machine, so for a comparison between two trees
count instructions, which do not:

    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python scripts/postprocessor_cost.py --streams 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        .venv/bin/python scripts/postprocessor_cost.py --streams 32

(the difference of the two "Collected" totals over 32 x 128 tokens). ``--gateway`` feeds
the gateway's in-process postprocessor instead (postprocessor_transport local,
gateway/localpost.py: the same sessions with the request's bookkeeping and its text
handed to a listener), the part of the gateway's CPU that layout adds. Not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from llmesh.models import DEFAULT_MODEL, model_path
from services.postprocessor.core import PostprocessCore, SessionConfig, UpstreamFinish
from services.postprocessor.sensitive import FilterMode
from services.tokenizer.loader import load_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--filter-mode", choices=[m.value for m in FilterMode], default="off")
    parser.add_argument("--streams", type=int, default=32, help="sessions fed in turn (0: load only)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per session")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="tokenizer directory (default: the prepared default model)")
    parser.add_argument("--text", type=Path, default=Path(__file__).resolve().parent.parent / "README.md",
                        help="text whose tokens are streamed")
    parser.add_argument("--gateway", action="store_true",
                        help="through the gateway's in-process postprocessor (postprocessor_transport local)")
    args = parser.parse_args()
    directory = args.model_dir or model_path(DEFAULT_MODEL)
    models = load_models([f"model={directory}"])
    ids = models["model"].tokenizer.encode(args.text.read_text(), add_special_tokens=False).ids
    core = PostprocessCore(models, default_filter_mode=FilterMode(args.filter_mode))
    if args.gateway:
        asyncio.run(_through_gateway(core, ids, args))
        return
    sessions = [core.open(SessionConfig(model="model")) for _ in range(args.streams)]
    started = time.process_time()
    for k in range(args.tokens):
        for j, session in enumerate(sessions):
            session.feed([ids[(j * args.tokens + k) % len(ids)]])
    for session in sessions:
        session.end(UpstreamFinish.LENGTH)
    tokens = args.streams * args.tokens
    if tokens:
        cpu_us = (time.process_time() - started) / tokens * 1e6
        print(f"{tokens} tokens, filter {args.filter_mode}: {cpu_us:.2f} us of CPU per token")


async def _through_gateway(core: PostprocessCore, ids: list[int], args: argparse.Namespace) -> None:
    from gateway.localpost import LocalPostprocessorTier
    from gateway.types import PostConfig

    tier = LocalPostprocessorTier(core)
    config = PostConfig(model="model", stop=[], filter_mode=args.filter_mode)
    sessions = [await tier.open(0, config, timeout=None) for _ in range(args.streams)]
    released: list[str] = []
    for session in sessions:
        session.listen(released.append)
    started = time.process_time()
    for k in range(args.tokens):
        for j, session in enumerate(sessions):
            session.send_tokens_nowait([ids[(j * args.tokens + k) % len(ids)]])
    for session in sessions:
        await session.send_end("length")
        await session.close(graceful=True)
    tokens = args.streams * args.tokens
    if tokens:
        cpu_us = (time.process_time() - started) / tokens * 1e6
        print(f"{tokens} tokens, filter {args.filter_mode}, in the gateway: {cpu_us:.2f} us of CPU per token")


if __name__ == "__main__":
    main()

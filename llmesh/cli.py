"""The ``llmesh`` command: one subcommand per tier and tool.

Each subcommand lives in its own module with ``main(argv) -> int``; modules are
imported only when their subcommand runs, so ``llmesh tokenizer`` on a Kunpeng CPU host
never imports vLLM.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("llmesh.up", "start a whole local mesh (all tiers) and wait for Ctrl-C"),
    "status": ("llmesh.status", "print the running local mesh as JSON"),
    "gateway": ("gateway.cli", "public llmesh.v1.InferenceService gateway"),
    "tokenizer": ("services.tokenizer.cli", "tokenizer tier (chat templates, encoding)"),
    "postprocessor": ("services.postprocessor.cli", "postprocessor tier (detokenize, stops, filter)"),
    "router": ("services.router.cli", "router tier (batching, health, zone failover)"),
    "worker": ("services.worker.cli", "inference worker (vLLM, token ids in/out)"),
    "model": ("llmesh.models", "prepare and list models (default SmolLM2, tiny DeepSeek)"),
    "certs": ("llmesh.certs", "write a development CA and server/client certificates"),
    "generate": ("llmesh.chat", "send one prompt to the gateway and stream the answer"),
    "chat": ("llmesh.chat", "interactive chat with the gateway"),
    "bench": ("llmesh.bench", "benchmark llmesh against vllm serve"),
}


def usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: llmesh COMMAND [options]   (llmesh COMMAND --help for details)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from llmesh import __version__

        print(f"llmesh {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"llmesh: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    if name in ("generate", "chat"):
        return int(module.main(rest, mode=name) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())

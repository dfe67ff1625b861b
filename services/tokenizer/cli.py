"""``llmesh tokenizer``: serve llmesh.tokenizer.v1.TokenizerService."""

from __future__ import annotations

import argparse
import sys

from services.common import eventloop
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.processes import run_processes
from services.common.settings import add_settings_arguments, settings_from_args
from services.common.tracing import setup_tracing
from services.tokenizer.loader import ModelLoadError
from services.tokenizer.settings import TokenizerSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh tokenizer",
        description="Tokenizer tier: renders chat templates and encodes text with HF tokenizers "
        "(no torch or transformers needed). Serves llmesh.tokenizer.v1.TokenizerService with "
        "health, reflection and Prometheus metrics.",
    )
    add_settings_arguments(parser, TokenizerSettings)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(TokenizerSettings, args)
    except ValueError as exc:
        print(f"llmesh tokenizer: error: {exc}", file=sys.stderr)
        return 2
    setup_logging("tokenizer", settings.log_level, settings.log_format)
    # --processes N forks here, before any grpc object exists (services/common/processes.py);
    # each process loads its own tokenizer after the fork.
    return run_processes(settings, tier="tokenizer", serve=_serve)


def _serve(settings: TokenizerSettings) -> int:
    setup_tracing(settings.service_name or "llmesh-tokenizer")
    start_metrics_server(settings.metrics_port, settings.host)
    from services.tokenizer.server import serve

    try:
        eventloop.run(serve(settings), settings.event_loop)
    except ModelLoadError as exc:
        print(f"llmesh tokenizer: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0

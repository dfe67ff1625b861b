"""``llmesh postprocessor``: serve llmesh.postprocess.v1.PostprocessService."""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

from services.common import eventloop
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.processes import run_processes
from services.common.settings import add_settings_arguments, settings_from_args
from services.common.tracing import setup_tracing
from services.postprocessor.settings import PostprocessorSettings
from services.tokenizer.loader import ModelLoadError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh postprocessor",
        description="Postprocessor tier: turns token-id deltas into UTF-8-safe text deltas, "
        "applies stop strings and the sensitive-data filter (redact or block cards, IBANs, "
        "resident IDs, phone numbers, e-mail addresses), and reports finish reasons. Serves "
        "llmesh.postprocess.v1.PostprocessService with health, reflection and Prometheus metrics.",
    )
    add_settings_arguments(parser, PostprocessorSettings)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(PostprocessorSettings, args)
    except (ValidationError, ValueError) as exc:
        print(f"llmesh postprocessor: error: {exc}", file=sys.stderr)
        return 2
    setup_logging("postprocessor", settings.log_level, settings.log_format)
    # --processes N forks here, before any grpc object exists (services/common/processes.py);
    # each process loads its own tokenizer after the fork.
    return run_processes(settings, tier="postprocessor", serve=_serve)


def _serve(settings: PostprocessorSettings) -> int:
    setup_tracing(settings.service_name or "llmesh-postprocessor")
    start_metrics_server(settings.metrics_port, settings.host)
    from services.postprocessor.server import serve

    try:
        eventloop.run(serve(settings), settings.event_loop)
    except ModelLoadError as exc:
        print(f"llmesh postprocessor: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0

"""``llmesh gateway``: the public llmesh.v1.InferenceService."""

from __future__ import annotations

import argparse
import sys

from gateway.settings import GatewaySettings
from services.common import eventloop
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.processes import run_processes
from services.common.settings import add_settings_arguments, settings_from_args
from services.common.tracing import setup_tracing, shutdown_tracing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh gateway",
        description="Public gRPC gateway (llmesh.v1.InferenceService): auth, quotas, validation, "
        "deadlines; drives tokenizer -> router -> postprocessor. Every flag can also be set "
        "through the environment variable shown in its help.",
    )
    add_settings_arguments(parser, GatewaySettings)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(GatewaySettings, args)
    except ValueError as exc:
        print(f"llmesh gateway: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging("gateway", settings.log_level, settings.log_format)
    # --processes N forks here, before any grpc object exists (services/common/processes.py);
    # the gRPC and HTTP ports are shared by every process.
    return run_processes(settings, tier="gateway", serve=_serve, ports=("port", "http_port"))


def _serve(settings: GatewaySettings) -> int:
    setup_tracing(settings.service_name or "llmesh-gateway")
    start_metrics_server(settings.metrics_port, settings.host)
    try:
        eventloop.run(__import__("gateway.server", fromlist=["serve"]).serve(settings), settings.event_loop)
    finally:
        shutdown_tracing()
    return 0

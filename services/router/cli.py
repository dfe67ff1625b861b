"""``llmesh router``: the RouterService process."""

from __future__ import annotations

import argparse
import contextlib
import sys

from services.common import eventloop
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.settings import add_settings_arguments, settings_from_args
from services.common.tracing import setup_tracing
from services.router.settings import RouterSettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmesh router",
        description=(
            "Router tier: routes token-level generations to workers with zone-aware "
            "failover, dynamic batching windows, health checks and mid-stream resume. "
            "Every flag can also be set as LLMESH_ROUTER_<FLAG> in the environment."
        ),
    )
    add_settings_arguments(parser, RouterSettings)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(RouterSettings, args)
        settings.all_workers()  # read --workers-file now: a bad file fails at start
    except (ValueError, OSError) as exc:
        print(f"llmesh router: invalid settings: {exc}", file=sys.stderr)
        return 2
    setup_logging("router", settings.log_level, settings.log_format)
    setup_tracing(settings.service_name or "llmesh-router")
    start_metrics_server(settings.metrics_port, settings.host)
    from services.router.server import serve

    with contextlib.suppress(KeyboardInterrupt):
        eventloop.run(serve(settings), settings.event_loop)
    return 0

"""``llmesh worker``: serve a model over ``llmesh.worker.v1.WorkerService``."""

from __future__ import annotations

import argparse
import os
import sys

from services.common import eventloop
from services.common.logs import setup_logging
from services.common.metrics import start_metrics_server
from services.common.settings import add_settings_arguments, settings_from_args
from services.common.tracing import setup_tracing
from services.worker.settings import WorkerSettings

EPILOG = """\
examples:
  llmesh worker --model ~/.cache/llmesh/models/smollm2-135m-instruct --zone kunpeng --device cpu \\
      --cpu-kvcache-space-gb 2 --port 50061
  llmesh worker --engine fake --model ~/.cache/llmesh/models/tiny-deepseek --port 50062
  llmesh worker --model /models/tiny-deepseek --device cpu --tensor-parallel-size 2 \
      --cpu-omp-threads-bind '0|1' --engine-args '{"kv_cache_dtype": "auto"}'
  # multi-node data parallel, 2 nodes x 8: leader, then one follower per other node
  llmesh worker --model /models/DeepSeek-V3 --data-parallel-size 16 --data-parallel-size-local 8 \
      --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345 --enable-expert-parallel
  llmesh worker --headless --model /models/DeepSeek-V3 --data-parallel-size 16 \
      --data-parallel-size-local 8 --data-parallel-start-rank 8 --data-parallel-address 10.0.0.1 \
      --data-parallel-rpc-port 13345 --enable-expert-parallel

Readiness health (service llmesh.worker.v1.WorkerService) turns SERVING after a warm-up
generation; liveness is the empty service name. If the engine dies the worker reports
NOT_SERVING and exits with code 3. With --engine fake, SIGUSR1 toggles a wedged engine and
SIGUSR2 kills the (fake) engine. Device notes: services/worker/README.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmesh worker",
        description="Inference worker: vLLM AsyncLLM behind a token-id gRPC service.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_arguments(parser, WorkerSettings)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(WorkerSettings, args)
        from services.worker.server import check_settings

        check_settings(settings)
    except ValueError as exc:
        print(f"llmesh worker: {exc}", file=sys.stderr)
        return 2
    # Our logs go to stderr; vLLM's too (it defaults to stdout), before vLLM is imported.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    setup_logging("worker", settings.log_level, settings.log_format)
    setup_tracing(settings.service_name or "llmesh-worker")
    if settings.headless:
        from services.worker.server import serve_headless

        return serve_headless(settings)
    start_metrics_server(settings.metrics_port, settings.host)
    from services.worker.server import serve

    try:
        return eventloop.run(serve(settings), settings.event_loop)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

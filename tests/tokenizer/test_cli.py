"""``llmesh tokenizer`` as a real process: flags, env, readiness, metrics, clean SIGTERM exit."""

from __future__ import annotations

import urllib.request

import grpc

from llmesh.procs import free_port, spawn_tier
from llmesh.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.cli import main
from services.tokenizer.servicer import SERVICE_NAME
from tests.tokenizer.conftest import TINY


def test_help_lists_settings_flags(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    for flag in ("--models", "--max-messages", "--encode-threads", "LLMESH_TOKENIZER_MODELS"):
        assert flag in out


def test_process_serves_and_stops_cleanly(tiny_deepseek_dir, tmp_path):
    port, metrics_port = free_port(), free_port()
    proc = spawn_tier(
        "tokenizer", "tokenizer",
        ["--port", str(port), "--metrics-port", str(metrics_port), "--drain-seconds", "0"],
        address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=tmp_path,
        env={"LLMESH_TOKENIZER_MODELS": f'["{TINY}={tiny_deepseek_dir}"]'},
    )
    try:
        proc.wait_serving(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
            reply = stub.Encode(tokenizer_pb2.EncodeRequest(
                input=tokenizer_pb2.EncodeInput(prompt="hello")), timeout=10)
            assert reply.result.model == TINY and reply.result.count > 0
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert f'llmesh_tokenizer_inputs_total{{kind="prompt",model="{TINY}"}}' in body
    finally:
        code = proc.stop()
    log = (tmp_path / "tokenizer.log").read_text()
    assert code == 0, log
    assert "event loop: uvloop" in log  # the default of every tier


def test_cpu_tiers_import_neither_torch_nor_transformers():
    """Kunpeng CPU hosts run the tokenizer and postprocessor without torch or transformers."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import services.tokenizer.cli, services.tokenizer.server, services.tokenizer.bench\n"
        "import services.postprocessor.cli, services.postprocessor.server\n"
        "from services.tokenizer.settings import default_model_specs\n"
        "default_model_specs()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"

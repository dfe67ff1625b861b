"""``llmesh postprocessor`` as a real process: readiness, one stream, metrics, SIGTERM."""

from __future__ import annotations

import urllib.request

import grpc

from llmesh.postprocess.v1 import postprocess_pb2 as pb
from llmesh.postprocess.v1 import postprocess_pb2_grpc
from llmesh.procs import free_port, spawn_tier
from services.postprocessor.cli import main
from services.postprocessor.servicer import SERVICE_NAME
from tests.postprocessor.conftest import TINY


def test_help_and_bad_settings(capsys):
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0
    out = capsys.readouterr().out
    for flag in ("--models", "--default-filter-mode", "--max-stop-strings", "LLMESH_POSTPROCESSOR_MODELS"):
        assert flag in out
    assert main(["--default-filter-mode", "sometimes"]) == 2
    assert "default_filter_mode" in capsys.readouterr().err


def test_process_serves_and_stops_cleanly(tiny_deepseek_dir, tmp_path, tokenizers):
    port, metrics_port = free_port(), free_port()
    proc = spawn_tier(
        "postprocessor", "postprocessor",
        ["--port", str(port), "--metrics-port", str(metrics_port), "--drain-seconds", "0",
         "--models", f"{TINY}={tiny_deepseek_dir}", "--default-filter-mode", "block"],
        address=f"127.0.0.1:{port}", service=SERVICE_NAME, log_dir=tmp_path,
    )
    try:
        proc.wait_serving(timeout=60)
        ids = tokenizers[TINY].tokenizer.encode("mail me: a.b@example.org now", add_special_tokens=False).ids
        requests = [
            pb.ProcessRequest(config=pb.ProcessConfig()),
            pb.ProcessRequest(tokens=pb.ProcessTokens(token_ids=ids)),
            pb.ProcessRequest(end=pb.ProcessEnd(finish_reason=pb.UPSTREAM_FINISH_REASON_STOP)),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = postprocess_pb2_grpc.PostprocessServiceStub(channel)
            replies = list(stub.Process(iter(requests), timeout=10))
        text = "".join(r.delta.text for r in replies if r.HasField("delta"))
        assert text == "mail me: "
        assert replies[-1].final.finish_reason == pb.OUTPUT_FINISH_REASON_CONTENT_FILTER
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert 'llmesh_postprocessor_redactions_total{kind="email"} 1.0' in body
        assert 'llmesh_postprocessor_finishes_total{reason="content_filter"} 1.0' in body
        assert "a.b@example.org" not in (tmp_path / "postprocessor.log").read_text()
    finally:
        code = proc.stop()
    assert code == 0, (tmp_path / "postprocessor.log").read_text()

"""``llmesh generate`` and ``llmesh chat`` as subprocesses against the fake gateway."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmesh import chat
from llmesh.client import (
    Completion,
    InvalidArgumentError,
    ServedBy,
    Timing,
    Usage,
)

from .fake_gateway import FakeGateway

REPO = Path(__file__).resolve().parents[2]


def llmesh(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMESH_")}
    return subprocess.run(
        [sys.executable, "-m", "llmesh.cli", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**clean, **(env or {})},
    )


def test_help() -> None:
    for mode, flag in (("generate", "--json"), ("chat", "--system")):
        run = llmesh(mode, "--help")
        assert run.returncode == 0, run.stderr
        assert f"llmesh {mode}" in run.stdout
        for option in (flag, "--target", "--api-key", "--ca", "--cert", "--key", "--timeout", "--max-tokens"):
            assert option in run.stdout


def test_generate_streams_and_summarises(fake: FakeGateway) -> None:
    run = llmesh(
        "generate", "hello big world", "--target", fake.address, "--max-tokens", "3", "--temperature", "0",
        "--request-id", "cli-1",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "echo: hello big \n"
    summary = run.stderr.strip().splitlines()[-1]
    for part in ("finish=length", "tokens=3+3", "served_by=fake-worker-1 (zone-a, cpu)", "ttft=12ms",
                 "request_id=cli-1"):
        assert part in summary
    sent = fake.state.attempts("GenerateStream")[0].request
    assert sent.prompt == "hello big world" and sent.sampling.max_tokens == 3
    assert sent.sampling.HasField("temperature")


def test_generate_chat_template_stop_and_stdin(fake: FakeGateway) -> None:
    run = llmesh(
        "generate", "--target", fake.address, "--chat", "--system", "be brief", "--stop", "(turn",
        "--no-summary", stdin="what now?\n",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "echo: what now? \n"  # cut before the stop string
    assert run.stderr == ""
    sent = fake.state.attempts("GenerateStream")[0].request
    assert [(m.role, m.content) for m in sent.messages] == [("system", "be brief"), ("user", "what now?")]
    assert list(sent.sampling.stop) == ["(turn"]


def test_generate_json(fake: FakeGateway) -> None:
    run = llmesh("generate", "x y", "--target", fake.address, "--json", "--no-summary")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["text"] == "echo: x y"
    assert doc["finish_reason"] == "stop"
    assert doc["usage"]["completion_tokens"] == 3
    assert doc["served_by"]["zone"] == "zone-a"
    assert fake.state.attempts("Generate")  # --json uses the unary RPC


def test_generate_api_key_from_env_and_auth_errors(fake: FakeGateway) -> None:
    fake.state.api_key = "cli-key"
    run = llmesh("generate", "hi", "--target", fake.address)
    assert run.returncode == 1
    assert "UNAUTHENTICATED" in run.stderr and "API key" in run.stderr
    assert "Traceback" not in run.stderr
    run = llmesh("generate", "hi", "--target", fake.address, env={"LLMESH_API_KEY": "cli-key"})
    assert run.returncode == 0, run.stderr
    assert fake.state.calls[-1].metadata["authorization"] == "Bearer cli-key"


def test_generate_reports_field_violations_and_unreachable(fake: FakeGateway) -> None:
    run = llmesh("generate", "hi", "--target", fake.address, "--temperature", "-2")
    assert run.returncode == 1
    assert "INVALID_ARGUMENT" in run.stderr and "field sampling.temperature: must be >= 0" in run.stderr
    from llmesh.procs import free_port

    run = llmesh("generate", "hi", "--target", f"127.0.0.1:{free_port()}", "--timeout", "3",
                 "--max-attempts", "1")
    assert run.returncode == 1 and "UNAVAILABLE" in run.stderr


def test_generate_with_mutual_tls(mtls_gateway: FakeGateway, dev_certs: dict[str, Path]) -> None:
    run = llmesh(
        "generate", "over tls", "--target", mtls_gateway.address, "--ca", str(dev_certs["ca"]),
        "--cert", str(dev_certs["client_cert"]), "--key", str(dev_certs["client_key"]), "--no-summary",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "echo: over tls\n"
    run = llmesh("generate", "x", "--target", mtls_gateway.address, "--cert", "only-a-cert.pem")
    assert run.returncode == 2 and "cert and key" in run.stderr


def test_chat_with_piped_stdin_keeps_and_resets_history(fake: FakeGateway) -> None:
    script = "first question\n\nsecond one\n/reset\nthird\n/exit\nnever sent\n"
    run = llmesh("chat", "--target", fake.address, "--system", "sys prompt", stdin=script)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "echo: first question (turn 1)",
        "echo: second one (turn 2)",
        "echo: third (turn 1)",
    ]
    assert "(conversation reset)" in run.stderr
    calls = fake.state.attempts("GenerateStream")
    assert len(calls) == 3
    second = [(m.role, m.content) for m in calls[1].request.messages]
    assert second == [
        ("system", "sys prompt"),
        ("user", "first question"),
        ("assistant", "echo: first question (turn 1)"),
        ("user", "second one"),
    ]
    assert [m.role for m in calls[2].request.messages] == ["system", "user"]


def test_chat_stops_at_the_first_error_when_piped(fake: FakeGateway) -> None:
    run = llmesh("chat", "--target", fake.address, "--top-p", "5", stdin="one\ntwo\n")
    assert run.returncode == 1
    assert "INVALID_ARGUMENT" in run.stderr and "sampling.top_p" in run.stderr
    assert len(fake.state.attempts("GenerateStream")) == 1


def test_summary_line_and_error_format() -> None:
    done = Completion(
        text="x", finish_reason="stop", matched_stop="</s>", usage=Usage(5, 7, 2),
        served_by=ServedBy("w1", "kunpeng", "cpu", degraded=True, resumed=1),
        timing=Timing(1.0, 45.4, 300.0), request_id="r9",
    )
    line = chat.summary_line(done)
    assert line == (
        "[finish=stop stop='</s>' tokens=5+7 (cached 2) served_by=w1 (kunpeng, cpu, degraded, resumed 1x) "
        "ttft=45ms total=300ms request_id=r9]"
    )
    from google.rpc import error_details_pb2

    err = InvalidArgumentError(
        "bad", details=[error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="prompt", description="too long"),
        ])],
    )
    assert chat.format_error(err) == "error: INVALID_ARGUMENT: bad\n  field prompt: too long"


def test_main_rejects_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        chat.main([], mode="shout")


def _spawn(*args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMESH_")}
    return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
        [sys.executable, "-m", "llmesh.cli", *args], cwd=REPO, env=clean,
        # A suite started in the background of a non-interactive shell inherits SIGINT
        # ignored, and Python then never raises KeyboardInterrupt: the CLI runs as a
        # user's terminal runs it, with the default disposition.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs,
    )


def _wait_outcome(fake: FakeGateway, method: str) -> str:
    for _ in range(200):
        attempts = fake.state.attempts(method)
        if attempts and attempts[-1].outcome != "running":
            return attempts[-1].outcome
        time.sleep(0.02)
    return "running"


def test_ctrl_c_cancels_the_generation(fake: FakeGateway) -> None:
    proc = _spawn(
        "generate", "drip " + "word " * 100, "--target", fake.address,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.read(len("echo: "))  # the first delta arrived: the call is running
        assert first == b"echo: "
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert b"interrupted" in err
    assert _wait_outcome(fake, "GenerateStream") == "cancelled"


def test_chat_on_a_terminal(fake: FakeGateway) -> None:
    leader, follower = pty.openpty()
    proc = _spawn("chat", "--target", fake.address, "--summary",
                  stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""

    def read_until(marker: bytes, timeout: float = 20.0) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < end:
            ready, _, _ = select.select([leader], [], [], 0.1)
            if ready:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # the child closed the terminal
                    break
        assert marker in seen, seen

    try:
        read_until(b"> ")
        os.write(leader, b"hello tty\n")
        read_until(b"echo: hello tty (turn 1)")
        read_until(b"finish=stop")
        os.write(leader, b"again\n")
        read_until(b"echo: again (turn 2)")
        os.write(leader, b"/exit\n")
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)

"""``llmesh bench`` end to end against a tiny fake-engine mesh and a stub OpenAI server (no vLLM).

Checks the report's shape (levels, ratios, CPU per tier, overhead and batching phases),
that failures are counted rather than hidden, and that a PNG is written. Never speed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmesh import bench
from llmesh.bench_load import WorkloadSpec, make_workload, median_interval, percentile
from llmesh.bench_report import RATIO_FIGURES, ratio, ratios
from llmesh.meshconfig import GatewayConfig, MeshConfig, RouterConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from services.router.settings import RouterSettings
from tests.bench.stub_openai import StubOpenAI

TIERS = {"gateway", "router", "worker", "tokenizer", "postprocessor"}
LEVEL_KEYS = {"concurrency", "requests", "completed", "errors", "error_samples", "duration_s",
              "output_tokens", "output_tokens_per_s", "requests_per_s", "ttft_ms", "itl_ms", "tpot_ms",
              "latency_ms", "cpu_s", "cpu_s_per_1k_tokens", "engine_cpu_s", "serving_cpu_us_per_token"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bench_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=free_port(), settings={"drain_seconds": 0}),
        router=RouterConfig(zones=["zone-a"]),
        workers=[WorkerConfig(zone="zone-a", engine="fake", settings={"fake_token_delay_ms": 1})],
    )
    mesh = Mesh(config, log_dir=tmp_path_factory.mktemp("bench-mesh"))
    try:
        mesh.start()
        yield mesh
    finally:
        mesh.stop()


@pytest.fixture
def stub() -> Iterator[StubOpenAI]:
    server = StubOpenAI().start()
    yield server
    server.stop()


def _common_args(mesh: Mesh, tmp_path: Path) -> list[str]:
    state = tmp_path / "mesh.json"
    state.write_text(json.dumps(mesh.state()))
    return [
        "--model", str(mesh.model_dir), "--target", f"127.0.0.1:{mesh.config.gateway.port}",
        "--target-http", f"http://127.0.0.1:{mesh.config.gateway.http_port}", "--mesh-state", str(state),
        "--concurrency", "1,4", "--min-requests", "4", "--requests-per-stream", "1",
        "--prompt-words", "4-8", "--output-tokens", "6-12", "--out", str(tmp_path / "out"), "--no-progress",
    ]


def _report(tmp_path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "out" / "bench.json").read_text())
    return data


def _check_level(level: dict[str, Any], concurrency: int, tiers: set[str]) -> None:
    assert set(level) == LEVEL_KEYS
    assert level["concurrency"] == concurrency
    assert level["requests"] == max(4, concurrency)
    assert level["errors"] == 0 and level["completed"] == level["requests"], level["error_samples"]
    # EOS is ignored, so every request generates exactly its max_tokens (6..12).
    assert 6 * level["requests"] <= level["output_tokens"] <= 12 * level["requests"]
    for fig in ("ttft_ms", "itl_ms", "tpot_ms", "latency_ms"):
        assert level[fig]["p50"] is not None and level[fig]["p50"] <= level[fig]["p99"]
    assert level["ttft_ms"]["p99"] <= level["latency_ms"]["p99"]
    assert set(level["cpu_s_per_1k_tokens"]) == tiers | {"total"}
    # The worker's and vllm serve's children are engine processes, reported apart.
    assert set(level["engine_cpu_s"]) == tiers & {"worker", "vllm"}
    assert set(level["serving_cpu_us_per_token"]) == tiers | {"total"}
    # A short level can fall inside one CPU clock tick: only the sum over levels must move.
    assert level["cpu_s_per_1k_tokens"]["total"] >= 0


def test_llmesh_against_stub_reference(bench_mesh: Mesh, stub: StubOpenAI, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*_common_args(bench_mesh, tmp_path), "--reference-url", stub.url,
            "--reference-pid", str(os.getpid()), "--skip-overhead", "--skip-batching",
            "--paired-ttft-requests", "5", "--paired-ttft-tokens", "3", "--paired-ttft-gap-s", "0.05",
            "--paired-blocks", "2", "--paired-concurrency", "3"]
    assert bench.main(argv) == 0
    report = _report(tmp_path)
    assert set(report["systems"]) == {"llmesh", "reference"}
    for name, tiers in (("llmesh", TIERS), ("reference", {"vllm"})):
        levels = report["systems"][name]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 4]
        for level, c in zip(levels, (1, 4), strict=True):
            _check_level(level, c, tiers)
        if name == "llmesh":
            assert sum(lv["cpu_s_per_1k_tokens"]["total"] for lv in levels) > 0
    # Both systems got the very same requests (like for like).
    # Warm-up, two levels, the paired TTFT's 3 + 5, then the paired blocks: 3 warm-up requests
    # and two blocks of 4 (max(--min-requests, 1 x 3 streams)).
    assert len(stub.requests) == 2 + 4 + 4 + 3 + 5 + 3 + 2 * 4
    spec = WorkloadSpec((4, 8), (6, 12))
    # Level c uses seed 1000 * --seed + c (--seed defaults to 0).
    assert {r["prompt"] for r in stub.requests[2:10]} == {
        r.prompt for c in (1, 4) for r in make_workload(4, seed=c, spec=spec)
    }
    # The paired phase: its own prompts, one at a time, each also sent to the mesh.
    paired_spec = WorkloadSpec((4, 8), (3, 3))
    assert [r["prompt"] for r in stub.requests[10:18]] == [
        r.prompt for r in make_workload(3 + 5, seed=7171, spec=paired_spec)]
    assert all(r["max_tokens"] == 3 for r in stub.requests[10:18])
    paired = report["paired_ttft"]
    assert paired["pairs"] == paired["requests"] == 5 and paired["output_tokens_per_request"] == 3
    assert paired["gap_s"] == 0.05
    for side in ("llmesh", "reference"):
        assert paired[side]["requests"] == 5 and paired[side]["errors"] == 0, paired[side]["error_samples"]
    added = paired["added_ttft_ms"]
    assert all(math.isfinite(v) for v in added.values())
    assert added["p25"] <= added["p50"] <= added["p75"]
    # Each pair's difference is kept; five pairs are too few for a 95 % interval.
    assert len(paired["differences_ms"]) == 5
    assert percentile(paired["differences_ms"], 50) == pytest.approx(added["p50"], abs=0.002)
    assert paired["p50_interval_ms"] is None
    out = capsys.readouterr().out
    assert "Added TTFT at one stream, paired (5 prompts" in out
    assert "95 % interval of the median n/a" in out
    _check_paired_blocks(report, stub, out)
    rows = report["ratios"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    for row in rows:
        assert {".".join(p) for p in RATIO_FIGURES} | {"concurrency", "ttft_p50_added_ms"} == set(row)
        c = row["concurrency"]
        mine = next(lv for lv in report["systems"]["llmesh"]["levels"] if lv["concurrency"] == c)
        ref = next(lv for lv in report["systems"]["reference"]["levels"] if lv["concurrency"] == c)
        assert row["output_tokens_per_s"] == pytest.approx(
            mine["output_tokens_per_s"] / ref["output_tokens_per_s"], rel=1e-3)
        assert row["errors"] == 1.0  # 0 / 0
    png = tmp_path / "out" / "bench.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def _check_paired_blocks(report: dict[str, Any], stub: StubOpenAI, out: str) -> None:
    """The paired throughput phase: blocks alternating in pairs, the same requests to both
    systems in each pair, every block's figures and their sums."""
    blocks = report["paired_throughput"]
    assert blocks["concurrency"] == 3 and blocks["blocks_per_system"] == 2
    assert blocks["requests_per_block"] == 4
    assert blocks["order"] == ["llmesh", "reference", "reference", "llmesh"]
    assert [b["system"] for b in blocks["blocks"]] == blocks["order"]
    # The reference's part of the phase: the warm-up (16 tokens each), then its two blocks,
    # each the requests of the pair (the mesh got the same ones).
    warm, first, second = stub.requests[18:21], stub.requests[21:25], stub.requests[25:29]
    assert all(r["max_tokens"] == 16 for r in warm)
    assert {r["prompt"] for r in first} != {r["prompt"] for r in second}
    for system in ("llmesh", "reference"):
        mine = [b for b in blocks["blocks"] if b["system"] == system]
        assert all(b["errors"] == 0 and b["requests"] == 4 for b in mine)
        total = blocks[system]
        assert total["requests"] == 8 and total["errors"] == 0, total["error_samples"]
        assert total["output_tokens"] == sum(b["output_tokens"] for b in mine)
        assert total["duration_s"] == pytest.approx(sum(b["duration_s"] for b in mine), abs=0.002)
        # duration_s is rounded to the ms; blocks of a fake engine last tens of ms.
        assert total["output_tokens_per_s"] == pytest.approx(total["output_tokens"] / total["duration_s"],
                                                             rel=0.02)
        tiers = TIERS if system == "llmesh" else {"vllm"}
        assert set(total["serving_cpu_us_per_token"]) == tiers | {"total"}
    assert blocks["blocks"][0]["output_tokens"] == blocks["blocks"][1]["output_tokens"]
    assert blocks["output_tokens_per_s_ratio"] == pytest.approx(
        blocks["llmesh"]["output_tokens_per_s"] / blocks["reference"]["output_tokens_per_s"], rel=1e-3)
    pair_tok_s = [b["output_tokens_per_s"] for b in blocks["blocks"]]
    expected = [pair_tok_s[0] / pair_tok_s[1], pair_tok_s[3] / pair_tok_s[2]]
    assert blocks["pair_ratios"] == pytest.approx(expected, rel=1e-3)
    # Blocks of a fake engine last tens of ms, within a CPU clock tick or two: a side may
    # show no serving CPU at all, so only the ratio's definition is checked.
    serving = [blocks[system]["serving_cpu_us_per_token"]["total"] for system in ("llmesh", "reference")]
    assert blocks["serving_cpu_ratio"] == ratio(*serving)
    assert "Throughput at 3 streams, paired (2 blocks of 4 requests per system" in out


def test_block_order_alternates_in_pairs() -> None:
    assert bench.block_order(["a", "b"], 3) == ["a", "b", "b", "a", "a", "b"]
    assert bench.block_order(["a", "b"], 0) == []


def test_grpc_protocol_overhead_and_batching(bench_mesh: Mesh, tmp_path: Path) -> None:
    argv = [*_common_args(bench_mesh, tmp_path), "--llmesh-protocol", "grpc", "--skip-reference",
            "--overhead-requests", "6", "--batching-concurrency", "2", "--fake-token-delay-ms", "1"]
    assert bench.main(argv) == 0
    report = _report(tmp_path)
    assert set(report["systems"]) == {"llmesh"} and "ratios" not in report
    assert report["systems"]["llmesh"]["label"] == "llmesh (grpc)"
    for level, c in zip(report["systems"]["llmesh"]["levels"], (1, 4), strict=True):
        _check_level(level, c, TIERS)
    overhead = report["overhead"]
    assert set(overhead["paths"]) == {"worker (direct)", "router (direct)", "gateway gRPC", "gateway HTTP"}
    for figs in overhead["paths"].values():
        assert figs["requests"] == 6 and figs["errors"] == 0, figs["error_samples"]
    assert set(overhead["added_ms"]) == {"router_ttft_p50", "router_total_p50", "router_gateway_ttft_p50",
                                         "router_gateway_total_p50", "router_gateway_http_ttft_p50"}
    assert set(overhead["added_paired_ms"]) == {"router_ttft_p50", "router_gateway_ttft_p50",
                                                "router_gateway_http_ttft_p50"}
    assert all(math.isfinite(v) for v in overhead["added_paired_ms"].values())
    batching = report["batching"]
    assert [row["concurrency"] for row in batching["comparison"]] == [2]
    row = batching["comparison"][0]
    assert row["on_errors"] == 0 and row["off_errors"] == 0
    assert row["on_tok_s"] > 0 and row["off_tok_s"] > 0
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == PNG_MAGIC


def test_failed_requests_are_counted(bench_mesh: Mesh, tmp_path: Path) -> None:
    failing = StubOpenAI(fail_every=4).start()
    try:
        argv = [*_common_args(bench_mesh, tmp_path), "--reference-url", failing.url, "--skip-llmesh",
                "--skip-overhead", "--skip-batching"]
        assert bench.main(argv) == 0
    finally:
        failing.stop()
    levels = _report(tmp_path)["systems"]["reference"]["levels"]
    # 2 warm-up requests then 4 + 4: requests 4 and 8 of the stub fail -> 1 in each level.
    assert [lv["errors"] for lv in levels] == [1, 1]
    assert [lv["completed"] for lv in levels] == [3, 3]
    assert all("HTTP 500" in lv["error_samples"][0] for lv in levels)


def test_bad_arguments_exit_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--concurrency", "0"], ["--concurrency", "a,b"], ["--output-tokens", "9-3"],
                 ["--paired-ttft-requests", "0"], ["--paired-ttft-tokens", "x"], ["--paired-blocks", "-1"],
                 ["--paired-concurrency", "0"]):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--concurrency" in err and "--paired-ttft-requests: must be >= 1, got 0" in err
    assert "--paired-blocks: must be >= 0, got -1" in err
    assert "--paired-concurrency: must be >= 1, got 0" in err


def test_grpc_protocol_needs_a_grpc_target(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="needs --target"):
        bench.main(["--target-http", "http://127.0.0.1:9", "--llmesh-protocol", "grpc", "--skip-reference",
                    "--skip-overhead", "--skip-batching", "--out", str(tmp_path), "--no-progress"])


def test_help_documents_the_phases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--quick", "--target", "--reference-url", "--llmesh-protocol", "--concurrency", "--out",
                 "--skip-paired-ttft", "--paired-ttft-requests", "--paired-ttft-gap-s", "--paired-blocks",
                 "--paired-concurrency"):
        assert flag in text


def test_workload_is_seeded() -> None:
    spec = WorkloadSpec(prompt_words=(3, 9), output_tokens=(5, 7))
    a, b = make_workload(20, 7, spec), make_workload(20, 7, spec)
    assert a == b
    assert a != make_workload(20, 8, spec)
    assert all(5 <= r.max_tokens <= 7 for r in a)
    assert len({r.prompt for r in a}) == 20


def test_cpu_meter_counts_engine_children_apart() -> None:
    """A serving process whose child burns CPU: the child's time is the engine's, not the
    serving process's (the comparison with vllm serve leaves engine processes out)."""
    import subprocess
    import sys
    import time

    from llmesh.bench_load import CpuMeter

    child = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"
             "time.sleep(30)")
    parent = ("import subprocess, sys, time\n"
              f"subprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        meter = CpuMeter({"vllm": [proc.pid]}, engine_groups=("vllm",))
        deadline = time.monotonic() + 20
        while not meter._root(proc.pid).children() and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.05)
        before = meter.sample()
        time.sleep(1.5)  # the child burns its 0.6 s
        used = CpuMeter.delta(before, meter.sample())
        assert used.engines["vllm"] >= 0.4
        assert used.trees["vllm"] - used.engines["vllm"] < 0.2
    finally:
        for kid in meter._root(proc.pid).children(recursive=True):  # type: ignore[union-attr]
            kid.kill()
        proc.kill()
        proc.wait()


def test_median_interval_is_the_order_statistics_binomial_tails_allow() -> None:
    # n = 10: P(B <= 1) = 11/1024 <= 0.025 < P(B <= 2) = 56/1024, so x(2) and x(9).
    values = [float(v) for v in (7, 3, 9, 1, 5, 10, 2, 8, 4, 6)]
    assert median_interval(values) == (2.0, 9.0)
    # n = 6 is the smallest with an interval at 95 % (1/64 <= 0.025 < 1/32): min and max.
    assert median_interval([4.0, 1.0, 6.0, 2.0, 5.0, 3.0]) == (1.0, 6.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert median_interval([]) is None
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, math.nan]) is None  # NaNs left out
    # n = 96: ranks 38 and 59 (P(B <= 37) = 0.0158 <= 0.025 < P(B <= 38) = 0.0260).
    interval = median_interval([float(i) for i in range(1, 97)])
    assert interval == (38.0, 59.0)
    lo, hi = interval
    # A lower confidence narrows it.
    narrow = median_interval([float(i) for i in range(1, 97)], confidence=0.5)
    assert narrow is not None and lo < narrow[0] <= narrow[1] < hi


def test_percentile_and_ratio() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(0.0, 0.0) == 1.0
    assert ratio(1.0, 0.0) is None
    assert ratio(math.nan, 1.0) is None
    rows = ratios([{"concurrency": 1, "output_tokens_per_s": 50.0, "ttft_ms": {"p50": 12.0}}],
                  [{"concurrency": 1, "output_tokens_per_s": 100.0, "ttft_ms": {"p50": 10.0}},
                   {"concurrency": 8, "output_tokens_per_s": 1.0}])
    assert len(rows) == 1
    assert rows[0]["output_tokens_per_s"] == 0.5 and rows[0]["ttft_ms.p50"] == 1.2
    assert rows[0]["ttft_p50_added_ms"] == 2.0
    assert rows[0]["itl_ms.p99"] is None


def test_capacity_phase_reports_cpu_per_token_of_every_tier(tiny_deepseek_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--capacity``: the whole mesh over the step-based fake engine; the report has
    tokens/s and CPU microseconds per output token for every tier (shape only, never speed)."""
    argv = ["--capacity", "--model", str(tiny_deepseek_dir), "--capacity-streams", "6",
            "--capacity-tokens", "16", "--capacity-step-ms", "1", "--capacity-idle-s", "1",
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert bench.main(argv) == 0
    capacity = _report(tmp_path)["capacity"]
    idle = capacity["idle_cpu_ms_per_s"]
    assert set(idle) == TIERS | {"total"} and all(ms >= 0 for ms in idle.values())
    assert idle["total"] == pytest.approx(sum(v for k, v in idle.items() if k != "total"), abs=0.1)
    assert capacity["idle_us_per_token"] == pytest.approx(
        idle["total"] * 1000.0 / capacity["output_tokens_per_s"], rel=0.01, abs=0.1)
    assert capacity["errors"] == 0, capacity["error_samples"]
    assert capacity["requests"] == 6 and capacity["output_tokens"] == 6 * 16
    assert capacity["output_tokens_per_s"] > 0
    per_token = capacity["cpu_us_per_token"]
    assert set(per_token) == TIERS | {"total"}
    assert all(us is not None and us >= 0 for us in per_token.values())
    assert per_token["total"] == pytest.approx(sum(v for k, v in per_token.items() if k != "total"), abs=1)
    out = capsys.readouterr().out
    assert "| tier | CPU us per output token |" in out and "| gateway |" in out
    assert "Idle mesh before the load:" in out


def test_capacity_phase_over_http_drives_the_openai_listener(
    tiny_deepseek_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--capacity-protocol http``: the capacity load goes through the gateway's streamed
    /v1/completions (the real-engine phase's path), every request of it, and the report
    says so."""
    calls: list[str] = []
    real_call = bench.OpenAIHttpDriver.__call__

    async def counted(self: Any, request: Any) -> Any:
        calls.append(self.base_url)
        return await real_call(self, request)

    monkeypatch.setattr(bench.OpenAIHttpDriver, "__call__", counted)
    argv = ["--capacity", "--capacity-protocol", "http", "--model", str(tiny_deepseek_dir),
            "--capacity-streams", "4", "--capacity-tokens", "12", "--capacity-step-ms", "1",
            "--capacity-idle-s", "0", "--out", str(tmp_path / "out"), "--no-progress"]
    assert bench.main(argv) == 0
    capacity = _report(tmp_path)["capacity"]
    assert capacity["protocol"] == "http"
    assert capacity["errors"] == 0 and capacity["output_tokens"] == 4 * 12, capacity["error_samples"]
    assert len(calls) == 4 + 4  # the warm-up's four, then the measured ones
    assert all(url.startswith("http://") and url.endswith("/v1") for url in calls)
    assert set(capacity["cpu_us_per_token"]) == TIERS | {"total"}
    assert capacity["idle_cpu_ms_per_s"] is None and capacity["idle_us_per_token"] is None


def test_with_capacity_adds_the_phase_and_worker_transport_reaches_the_router(
    tiny_deepseek_dir: Path, tmp_path: Path
) -> None:
    """``--with-capacity`` runs the capacity phase beside the others (here all skipped), and
    ``--worker-transport calls`` is the router's transport in the meshes the bench starts
    (without the flag the bench takes the router's default, session)."""
    argv = ["--with-capacity", "--skip-llmesh", "--skip-reference", "--skip-overhead", "--skip-batching",
            "--worker-transport", "calls", "--model", str(tiny_deepseek_dir), "--capacity-streams", "6",
            "--capacity-tokens", "16", "--capacity-step-ms", "1", "--capacity-idle-s", "0",
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert bench.main(argv) == 0
    report = _report(tmp_path)
    assert report["meta"]["worker_transport"] == "calls" and report["systems"] == {}
    capacity = report["capacity"]
    assert capacity["worker_transport"] == "calls"
    assert capacity["errors"] == 0 and capacity["output_tokens"] == 6 * 16, capacity["error_samples"]
    config = bench._fake_mesh_config(bench.options_from_args(bench.build_parser().parse_args(argv)),
                                     token_delay_ms=1, batch_max_wait_ms=None)
    assert config.router.settings["worker_transport"] == "calls"
    default = bench.options_from_args(bench.build_parser().parse_args([]))
    assert default.worker_transport == RouterSettings.model_fields["worker_transport"].default == "session"


def test_router_transport_local_runs_the_router_in_the_gateway(tiny_deepseek_dir: Path,
                                                               tmp_path: Path) -> None:
    """``--router-transport local`` (with both other tiers local: deploy/local/edge.yaml's
    layout): the meshes the bench starts run only gateway and worker processes, the report
    says so, and the overhead phase has no path straight to a router."""
    argv = ["--with-capacity", "--skip-llmesh", "--skip-reference", "--skip-batching",
            "--router-transport", "local", "--tokenizer-transport", "local",
            "--postprocessor-transport", "local", "--overhead-requests", "4",
            "--model", str(tiny_deepseek_dir), "--capacity-streams", "4",
            "--capacity-tokens", "12", "--capacity-step-ms", "1", "--capacity-idle-s", "0",
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert bench.main(argv) == 0
    report = _report(tmp_path)
    assert report["meta"]["router_transport"] == "local"
    capacity = report["capacity"]
    assert capacity["router_transport"] == "local"
    assert capacity["errors"] == 0 and capacity["output_tokens"] == 4 * 12, capacity["error_samples"]
    assert set(capacity["cpu_us_per_token"]) == {"worker", "gateway", "total"}
    overhead = report["overhead"]
    assert set(overhead["paths"]) == {"worker (direct)", "gateway gRPC", "gateway HTTP"}
    for figs in overhead["paths"].values():
        assert figs["requests"] == 4 and figs["errors"] == 0, figs["error_samples"]
    assert set(overhead["added_paired_ms"]) == {"router_gateway_ttft_p50", "router_gateway_http_ttft_p50"}
    assert "router_ttft_p50" not in overhead["added_ms"]


class _Path:
    """A driver double that logs which request it got and answers with a fixed TTFT."""

    def __init__(self, name: str, log: list[tuple[str, int]], ttft_s: float) -> None:
        self.name, self.log, self.ttft_s = name, log, ttft_s

    async def __aenter__(self) -> _Path:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def __call__(self, request: Any) -> Any:
        from llmesh.bench_load import RequestResult

        self.log.append((self.name, request.index))
        return RequestResult(ok=True, ttft_s=self.ttft_s + request.index / 1000, latency_s=1.0,
                             output_tokens=1)


async def test_overhead_paths_take_each_request_in_turn() -> None:
    """Each request goes down every path, the order rotating, so background load falls on
    all paths alike; the paired figure is the median of per-request differences."""
    requests = make_workload(2 + 3, seed=1, spec=WorkloadSpec(prompt_words=(2, 2), output_tokens=(1, 1)))
    assert [r.index for r in requests] == [0, 1, 2, 3, 4]
    log: list[tuple[str, int]] = []
    drivers = {name: _Path(name, log, ttft) for name, ttft in (("w", 0.001), ("r", 0.003), ("g", 0.010))}
    levels = await bench.interleaved(drivers, requests, warmup=2)
    assert log[6:] == [("w", 2), ("r", 2), ("g", 2), ("r", 3), ("g", 3), ("w", 3),
                       ("g", 4), ("w", 4), ("r", 4)]
    assert [len(level.results) for level in levels.values()] == [3, 3, 3]
    assert bench.paired_added_ms(levels, "g", "w") == pytest.approx(9.0)


def test_vllm_serve_runs_the_model_in_the_workers_dtype(smollm2_dir: Path, tiny_deepseek_dir: Path) -> None:
    """The reference gets the dtype llmesh's CPU worker runs the model in: float32 for the
    float32 default model (vLLM's auto would take bf16 there), bf16's auto otherwise."""
    for model, dtype in ((smollm2_dir, "float32"), (tiny_deepseek_dir, "auto")):
        opts = bench.options_from_args(bench.build_parser().parse_args(["--model", str(model)]))
        argv = bench.reference_argv(opts, 8000)
        assert argv[argv.index("--dtype") + 1] == dtype

"""Container images, checked statically (Docker cannot build here), and the image's
health check script run for real against a tier process, in plaintext and mutual TLS."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.tools import consistency
from llmesh.cli import COMMANDS
from llmesh.procs import TierProcess, free_port, spawn_tier
from tests.deploy.conftest import REPO, by_kind

DOCKER = REPO / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
HEALTHCHECK = DOCKER / "healthcheck.py"
CPU_TIERS = {"gateway", "tokenizer", "postprocessor", "router"}
# An exact version (x.y.z) or a digest: floating tags (latest, 3.11, slim) are not pins.
PINNED = re.compile(r"^[^@\s]+:(?:[a-z]*\d+\.\d+\.\d+[\w.-]*)$|^[^@\s]+@sha256:[0-9a-f]{64}$")


def stages(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile's instructions, split into build stages."""
    result: list[list[tuple[str, str]]] = []
    for instruction in consistency.dockerfile_instructions(path):
        if instruction[0] == "FROM":
            result.append([])
        assert result, f"{path.name}: an instruction before the first FROM"
        result[-1].append(instruction)
    return result


def test_there_is_an_image_per_tier_kind() -> None:
    assert {p.name for p in DOCKERFILES} == {
        "tiers.Dockerfile",
        "worker-cpu.Dockerfile",
        "worker-cuda.Dockerfile",
        "worker-ascend.Dockerfile",
    }


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned(path: Path) -> None:
    names: set[str] = set()
    for stage in stages(path):
        words = [w for w in stage[0][1].split() if not w.startswith("--platform")]
        image = words[0]
        if len(words) >= 3 and words[1].upper() == "AS":
            names.add(words[2])
        if image in names:
            continue  # an earlier stage
        assert PINNED.match(image), f"{path.name}: FROM {image} is not pinned to an exact tag or digest"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_llmesh_as_non_root_with_a_healthcheck(path: Path) -> None:
    final = stages(path)[-1]
    users = [arg for ins, arg in final if ins == "USER"]
    assert users, f"{path.name}: no USER in the final stage"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{path.name}: runs as root"
    checks = [arg for ins, arg in final if ins == "HEALTHCHECK"]
    assert len(checks) == 1 and "NONE" not in checks[0].upper()
    assert '["llmesh-healthcheck", "--readiness"]' in checks[0]
    assert any(
        ins == "COPY"
        and "deploy/docker/healthcheck.py /usr/local/bin/llmesh-healthcheck" in arg
        and "0755" in arg
        for ins, arg in final
    ), f"{path.name}: llmesh-healthcheck is not installed"
    entry = [consistency.exec_form(arg) for ins, arg in final if ins == "ENTRYPOINT"]
    cmd = [consistency.exec_form(arg) for ins, arg in final if ins == "CMD"]
    assert entry, f"{path.name}: no ENTRYPOINT"
    parsed = consistency.llmesh_command(entry[-1] + (cmd[-1] if cmd else []))
    assert parsed is not None and parsed[0] in COMMANDS
    if path.name.startswith("worker-"):
        assert entry[-1][-2:] == ["llmesh", "worker"]
        device = path.name.removeprefix("worker-").removesuffix(".Dockerfile")
        assert f"--device={ {'ascend': 'npu'}.get(device, device) }" in cmd[-1]
    else:
        assert entry[-1] == ["llmesh"] and parsed[0] in CPU_TIERS
    assert consistency.check_dockerfile(path).problems == []


def ignored(rules: list[str], path: str) -> bool:
    """Docker's .dockerignore matching (last matching rule wins; a directory covers its files)."""
    result = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        parts = path.split("/")
        candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(c, pattern) or fnmatch.fnmatch(c, pattern.replace("**/", "*/"))
            for c in candidates
        ):
            result = not negate
    return result


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_copied_files_exist_and_survive_the_dockerignore(path: Path) -> None:
    ignore = path.with_name(path.name + ".dockerignore")
    assert ignore.is_file(), f"{path.name}: no Dockerfile-specific .dockerignore"
    rules = [
        line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert ignored(rules, ".venv/bin/python")  # the context stays small
    for ins, arg in consistency.dockerfile_instructions(path):
        if ins != "COPY" or "--from=" in arg:
            continue
        sources = [w for w in arg.split() if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"{path.name}: COPY {source}: not in the repository"
            assert not ignored(rules, source.rstrip("/") or "."), f"{path.name}: {source} is dockerignored"


def test_ascend_image_sources_cann_before_python() -> None:
    text = (DOCKER / "ascend-env.sh").read_text()
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in text
    assert text.rstrip().endswith('exec "$@"')
    bash = shutil.which("bash")
    if bash:
        subprocess.run([bash, "-n", str(DOCKER / "ascend-env.sh")], check=True)
    final = stages(DOCKER / "worker-ascend.Dockerfile")[-1]
    entry = next(consistency.exec_form(arg) for ins, arg in final if ins == "ENTRYPOINT")
    assert entry[0] == "llmesh-ascend-env"
    assert any(ins == "COPY" and "/usr/local/bin/llmesh-ascend-env" in arg for ins, arg in final)


def test_manifest_images_come_from_these_dockerfiles(rendered: dict[str, list[dict[str, Any]]]) -> None:
    dockerfile_for = {"llmesh": "tiers.Dockerfile"}
    deployable = {k: v for k, v in rendered.items() if k != "deploy/k8s/zones/worker"}  # a template
    for objects in deployable.values():
        for dep in by_kind(objects, "Deployment"):
            for container in dep["spec"]["template"]["spec"]["containers"]:
                name = container["image"].split("@")[0].rsplit("/", 1)[-1]
                base = name.split(":")[0]
                assert (DOCKER / dockerfile_for.get(base, f"{base}.Dockerfile")).is_file(), container["image"]
                if container["command"][0] == "llmesh-ascend-env":
                    assert base == "worker-ascend"


# ---------------------------------------------------------------------------- health check


def run_healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), *args], capture_output=True, text=True, timeout=30, check=False
    )


def start_tokenizer(model_dir: Path, extra: list[str], tmp_path: Path) -> tuple[TierProcess, int]:
    port = free_port()
    proc = spawn_tier(
        f"tokenizer-{port}",
        "tokenizer",
        ["--port", str(port), "--models", f"smollm2={model_dir}", *extra],
        address=f"127.0.0.1:{port}",
        service="llmesh.tokenizer.v1.TokenizerService",
        log_dir=tmp_path,
    )
    return proc, port


def stop(proc: TierProcess) -> None:
    proc.popen.terminate()
    try:
        proc.popen.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        proc.popen.wait(timeout=10)


def test_healthcheck_reads_the_tier_from_the_process_and_checks_it(smollm2_dir: Path, tmp_path: Path) -> None:
    proc, _port = start_tokenizer(smollm2_dir, [], tmp_path)
    try:
        proc.wait_serving(timeout=120)
        ready = run_healthcheck("--readiness", "--pid", str(proc.pid))
        assert ready.returncode == 0, ready.stderr
        assert ready.stdout.strip() == "tokenizer llmesh.tokenizer.v1.TokenizerService: SERVING"
        live = run_healthcheck("--liveness", "--pid", str(proc.pid))
        assert live.returncode == 0 and live.stdout.strip() == "tokenizer (liveness): SERVING"
    finally:
        stop(proc)


def test_healthcheck_fails_when_nothing_serves(tmp_path: Path) -> None:
    port = free_port()
    # A process whose command line says `llmesh router --port N` but that serves nothing.
    idle = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "llmesh", "router", f"--port={port}"]
    )
    try:
        result = run_healthcheck("--readiness", "--pid", str(idle.pid), "--timeout", "1")
        assert result.returncode == 1
        assert "router llmesh.router.v1.RouterService: UNAVAILABLE" in result.stderr
    finally:
        idle.kill()
        idle.wait(timeout=10)
    not_llmesh = run_healthcheck("--pid", str(idle.pid))
    assert not_llmesh.returncode == 1
    # Gone (or, should the pid be reused at once, some process that is not a tier).
    assert "cannot read process" in not_llmesh.stderr or "is not an llmesh tier" in not_llmesh.stderr


def test_healthcheck_speaks_mutual_tls(smollm2_dir: Path, tmp_path: Path) -> None:
    from llmesh.certs import write_dev_certs

    certs = write_dev_certs(tmp_path / "certs")
    tls = [
        f"--tls-cert={certs['server_cert']}",
        f"--tls-key={certs['server_key']}",
        f"--tls-client-ca={certs['ca']}",
        f"--downstream-tls-ca={certs['ca']}",
        f"--downstream-tls-cert={certs['client_cert']}",
        f"--downstream-tls-key={certs['client_key']}",
    ]
    proc, port = start_tokenizer(smollm2_dir, tls, tmp_path)
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=certs["ca"].read_bytes(),
            private_key=certs["client_key"].read_bytes(),
            certificate_chain=certs["client_cert"].read_bytes(),
        )
        proc.wait_serving(timeout=120, credentials=credentials)
        result = run_healthcheck("--readiness", "--pid", str(proc.pid))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip().endswith("SERVING")
        # A plaintext probe (what kubelet's native gRPC probe would do) cannot pass.
        from llmesh.procs import check_health

        assert check_health(f"127.0.0.1:{port}", "llmesh.tokenizer.v1.TokenizerService") == "UNREACHABLE"
    finally:
        stop(proc)

"""``llmesh up``: start a whole local mesh as processes and stop it cleanly.

Start order follows dependencies (tokenizer and postprocessor, then workers, then the
router that needs the workers, then the public gateway last, so the public port only
opens once everything behind it is SERVING). Stop order is the reverse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from llmesh.home import certs_dir, run_dir
from llmesh.meshconfig import MeshConfig, load_mesh_config
from llmesh.procs import TierProcess, free_port, spawn_tier

SERVICES = {
    "gateway": "llmesh.v1.InferenceService",
    "tokenizer": "llmesh.tokenizer.v1.TokenizerService",
    "postprocessor": "llmesh.postprocess.v1.PostprocessService",
    "router": "llmesh.router.v1.RouterService",
    "worker": "llmesh.worker.v1.WorkerService",
}
STATE_FILE = "mesh.json"
DEFAULT_CPU_KVCACHE_GB = 2
"""KV cache per CPU worker (GiB) unless the config sets cpu_kvcache_space_gb."""


def _flags(settings: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list | dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def resolve_model(spec: str) -> Path:
    from llmesh.models import MODELS, ensure_model

    if spec in MODELS:
        return ensure_model(spec)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SystemExit(f"llmesh up: model {spec!r} is neither a known name nor a model directory")
    return path


class Mesh:
    """The processes of one local mesh."""

    def __init__(self, config: MeshConfig, *, log_dir: Path, host: str = "127.0.0.1") -> None:
        self.config = config
        self.log_dir = log_dir
        self.host = host
        self.procs: list[TierProcess] = []
        self.tls_dir = Path(config.tls.certs_dir).expanduser() if config.tls.certs_dir else certs_dir()
        self.model_dir = resolve_model(config.model)
        from services.common.modelinfo import served_model_name

        self.model_name = served_model_name(self.model_dir, config.served_model_name)

    # -- TLS ---------------------------------------------------------------------------
    # Each tier serves and dials with its own certificate (identity
    # spiffe://llmesh.local/tier/<tier>), so internal servers can tell the gateway and the
    # router from a client holding client.pem (see services/common/authz.py).

    def _server_tls_flags(self, tier: str) -> list[str]:
        if not self.config.tls.enabled:
            return []
        d = self.tls_dir
        flags = ["--tls-cert", str(d / f"{tier}.pem"), "--tls-key", str(d / f"{tier}-key.pem")]
        if self.config.tls.mutual:
            flags += ["--tls-client-ca", str(d / "ca.pem")]
        return flags

    def _client_tls_flags(self, tier: str) -> list[str]:
        return _flags(self._client_tls_settings(tier))

    def _client_tls_settings(self, tier: str) -> dict[str, str]:
        if not self.config.tls.enabled:
            return {}
        d = self.tls_dir
        settings = {"downstream_tls_ca": str(d / "ca.pem")}
        if self.config.tls.mutual:
            settings |= {"downstream_tls_cert": str(d / f"{tier}.pem"),
                         "downstream_tls_key": str(d / f"{tier}-key.pem")}
        return settings

    def credentials(self, identity: str = "operator") -> grpc.ChannelCredentials | None:
        """Channel credentials for talking to the mesh as ``identity`` (a tier, ``client``
        or ``operator``, whose certificate is ``<identity>.pem``); health checks work with
        any of them."""
        if not self.config.tls.enabled:
            return None
        d = self.tls_dir
        mutual = self.config.tls.mutual
        return grpc.ssl_channel_credentials(
            root_certificates=(d / "ca.pem").read_bytes(),
            private_key=(d / f"{identity}-key.pem").read_bytes() if mutual else None,
            certificate_chain=(d / f"{identity}.pem").read_bytes() if mutual else None,
        )

    def _ensure_certs(self) -> None:
        if not self.config.tls.enabled:
            return
        from llmesh.certs import CertificatesExistError, ensure_dev_certs

        try:
            ensure_dev_certs(self.tls_dir)
        except CertificatesExistError as exc:
            raise RuntimeError(
                f"{exc}; per-tier certificates are needed: `llmesh certs --force --out {self.tls_dir}`"
            ) from exc

    # -- starting --------------------------------------------------------------------------

    def _env(self, tier: str) -> dict[str, str]:
        env = {"OTEL_SERVICE_NAME": f"llmesh-{tier}"}
        if self.config.otel.exporter:
            env["OTEL_TRACES_EXPORTER"] = self.config.otel.exporter
        if self.config.otel.endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.config.otel.endpoint
        return env

    def _spawn(self, name: str, tier: str, args: list[str], *, port: int, zone: str = "",
               env: dict[str, str] | None = None, server_tls: bool = True,
               processes: int = 1) -> TierProcess:
        # Several processes (a CPU tier's --processes) serve /metrics on consecutive ports.
        metrics_port = free_port(self.host) if processes == 1 else free_port_block(self.host, processes)
        argv = ["--host", self.host, "--port", str(port), "--metrics-port", str(metrics_port),
                "--log-format", "json", *args]
        if processes > 1:
            argv += ["--processes", str(processes)]
        if server_tls:
            argv += self._server_tls_flags(tier)
        proc = spawn_tier(
            name, tier, argv, address=f"{self.host}:{port}", service=SERVICES[tier],
            env={**self._env(tier), **(env or {})}, log_dir=self.log_dir, zone=zone,
            metrics_port=metrics_port,
        )
        proc.extra["spawn"] = {"name": name, "tier": tier, "args": args, "zone": zone, "env": env,
                               "server_tls": server_tls, "processes": processes}
        self.procs.append(proc)
        return proc

    def _respawn(self, proc: TierProcess) -> TierProcess:
        """Start ``proc`` again on fresh ports (its ports were taken between pick and bind)."""
        spec = dict(proc.extra["spawn"])  # type: ignore[call-overload]
        self.procs.remove(proc)
        return self._spawn(spec.pop("name"), spec.pop("tier"), spec.pop("args"),
                           port=free_port(self.host), **spec)

    def _wait(self, procs: list[TierProcess], timeout: float) -> None:
        """Wait until each of ``procs`` is SERVING. A process that lost the race for the
        port it was given (free_port picks a port, another process may bind it first) is
        started again on fresh ports; ``procs`` is updated in place."""
        creds = self.credentials()
        for i, proc in enumerate(procs):
            for attempt in range(4):
                try:
                    proc.wait_serving(timeout=timeout, credentials=creds)
                    break
                except RuntimeError:
                    log_text = proc.log_path.read_text(errors="replace") if proc.log_path else ""
                    lost_port = "Failed to bind" in log_text or "Address already in use" in log_text
                    if not lost_port or attempt == 3 or proc.tier == "gateway":
                        raise
                    print(f"  {proc.name:<16} port taken, restarting on another", file=sys.stderr)
                    if proc.log_path is not None:
                        proc.log_path.write_text("")
                    proc = self._respawn(proc)
                    procs[i] = proc
            print(f"  {proc.name:<16} SERVING  {proc.address}  pid {proc.pid}", file=sys.stderr)

    def start(self) -> None:
        cfg = self.config
        self._ensure_certs()
        model_flag = json.dumps([f"{self.model_name}={self.model_dir}"])
        # A transport "local": the gateway runs that tier's work itself, and none starts.
        local_tok = cfg.gateway.settings.get("tokenizer_transport") == "local"
        local_post = cfg.gateway.settings.get("postprocessor_transport") == "local"
        local_router = cfg.gateway.settings.get("router_transport") == "local"
        tokenizers = [
            self._spawn(f"tokenizer-{i}", "tokenizer",
                        ["--models", model_flag, *_flags(cfg.tokenizer.settings)],
                        port=free_port(self.host), processes=cfg.tokenizer.processes)
            for i in range(0 if local_tok else cfg.tokenizer.replicas)
        ]
        posts = [
            self._spawn(f"postprocessor-{i}", "postprocessor",
                        ["--models", model_flag, *_flags(cfg.postprocessor.settings)],
                        port=free_port(self.host), processes=cfg.postprocessor.processes)
            for i in range(0 if local_post else cfg.postprocessor.replicas)
        ]
        workers = []
        for i, w in enumerate(cfg.workers):
            model_dir = resolve_model(w.model) if w.model else self.model_dir
            env = {}
            settings = dict(w.settings)
            if w.device == "cpu" and w.engine == "vllm":
                # vLLM's CPU backend otherwise reserves gpu_memory_utilization (0.92) of
                # the host's memory per engine and refuses to start beside anything else.
                settings.setdefault("cpu_kvcache_space_gb", DEFAULT_CPU_KVCACHE_GB)
            if w.cpu_omp_threads_bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = w.cpu_omp_threads_bind
            if w.engine_args:
                settings["engine_args"] = {**settings.get("engine_args", {}), **w.engine_args}
            args = ["--model", str(model_dir), "--served-model-name", self.model_name,
                    "--zone", w.zone, "--device", w.device, "--engine", w.engine,
                    "--worker-id", f"worker-{i}-{w.zone}", *_flags(settings)]
            workers.append(self._spawn(f"worker-{i}", "worker", args, port=free_port(self.host),
                                       zone=w.zone, env=env))
        self._wait(tokenizers, timeout=120)
        self._wait(posts, timeout=120)
        self._wait(workers, timeout=600)
        zones = cfg.router.zones or list(dict.fromkeys(w.zone for w in cfg.workers))
        worker_list = [
            {"address": p.address, "zone": w.zone, "device": w.device, "models": [self.model_name],
             "worker_id": f"worker-{i}-{w.zone}"}
            for i, (p, w) in enumerate(zip(workers, cfg.workers, strict=True))
        ]
        router_settings = {
            "workers": worker_list, "zones": zones, "degraded_zones": cfg.router.degraded_zones,
            **({"tokenizer_models": [f"{self.model_name}={self.model_dir}"]} if local_tok
               else {"tokenizer_target": tokenizers[0].address}),
            **self._client_tls_settings("router"), **cfg.router.settings,
        }
        routers = [
            self._spawn(f"router-{i}", "router", _flags(router_settings), port=free_port(self.host))
            for i in range(0 if local_router else cfg.router.replicas)
        ]
        self._wait(routers, timeout=120)
        gw_args = [
            # router_transport local: the gateway runs the router, with the settings a
            # router process would get.
            *(["--local-router", json.dumps(router_settings)] if local_router
              else ["--router-targets", json.dumps([p.address for p in routers])]),
            *(["--local-models", model_flag] if local_tok or local_post else []),
            *([] if local_tok else ["--tokenizer-targets", json.dumps([p.address for p in tokenizers])]),
            *([] if local_post else ["--postprocessor-targets", json.dumps([p.address for p in posts])]),
            "--default-filter-mode", cfg.gateway.default_filter_mode,
            *self._client_tls_flags("gateway"), *_flags(cfg.gateway.settings),
        ]
        if cfg.gateway.audit_log:
            gw_args += ["--audit-log", cfg.gateway.audit_log]
        if cfg.gateway.http_port >= 0:
            gw_args += ["--http-port", str(cfg.gateway.http_port), "--http-host", cfg.gateway.host]
        if cfg.tenants:
            tenants_file = self.log_dir / "tenants.json"
            tenants_file.write_text(json.dumps([t.model_dump() for t in cfg.tenants]))
            gw_args += ["--tenants-file", str(tenants_file)]
        gateway = self._spawn("gateway", "gateway", gw_args, port=cfg.gateway.port,
                              processes=cfg.gateway.processes)
        gateway.address = f"{cfg.gateway.host}:{cfg.gateway.port}"
        self._wait([gateway], timeout=120)

    def http_url(self) -> str:
        """The OpenAI-compatible base URL ('' when off); https when the mesh serves TLS."""
        gw = self.config.gateway
        if gw.http_port < 0:
            return ""
        return f"{'https' if self.config.tls.enabled else 'http'}://{gw.host}:{gw.http_port}"

    def state(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "tls": self.config.tls.enabled,
            "certs_dir": str(self.tls_dir) if self.config.tls.enabled else "",
            "mutual_tls": self.config.tls.mutual,
            "http": self.http_url(),
            "processes": [
                {"name": p.name, "tier": p.tier, "zone": p.zone, "address": p.address, "pid": p.pid,
                 "metrics_port": p.metrics_port, "service": p.service,
                 # pid is the supervisor's when process_count > 1 (`llmesh status` lists each)
                 "process_count": _process_count(p),
                 "log": str(p.log_path) if p.log_path else ""}
                for p in self.procs
            ],
        }

    def stop(self) -> None:
        """Stop front to back: the gateway first (no new requests), then the routers, then
        everything behind them together. Each group gets SIGTERM at once, then is awaited."""
        groups = (("gateway",), ("router",), ("worker", "postprocessor", "tokenizer"))
        for tiers in groups:
            members = [p for p in reversed(self.procs) if p.tier in tiers]
            for proc in members:
                proc.terminate()
            for proc in members:
                proc.stop(timeout=20)


def _process_count(proc: TierProcess) -> int:
    spec = proc.extra.get("spawn")
    return int(spec.get("processes", 1)) if isinstance(spec, dict) else 1


def free_port_block(host: str, count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive ports that were all free a moment ago (the
    metrics ports of a tier's processes: base + index)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    sock.bind((host, port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host}")


def grpcurl_hint(config: MeshConfig, tls_dir: Path) -> str:
    """A grpcurl command line that works against this mesh's gateway: ``-plaintext``, or
    ``-cacert`` (plus ``-cert``/``-key`` with the client certificate under mutual TLS),
    and the API key header when tenants are configured."""
    gw = config.gateway
    if not config.tls.enabled:
        flags = ["-plaintext"]
    else:
        flags = ["-cacert", str(tls_dir / "ca.pem")]
        if config.tls.mutual:
            flags += ["-cert", str(tls_dir / "client.pem"), "-key", str(tls_dir / "client-key.pem")]
    if config.tenants:
        flags += ["-H", "'authorization: Bearer <your API key>'"]
    body = ('\'{"messages":[{"role":"user","content":"What is the capital of France?"}]}\'')
    return " ".join(["grpcurl", *flags, "-d", body, f"{gw.host}:{gw.port}",
                     "llmesh.v1.InferenceService/GenerateStream"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="llmesh up",
        description="Start a whole local mesh (tokenizer, postprocessor, workers, router, gateway) "
        "on the embedded default model, wait until every process is SERVING, print the endpoints, "
        "and stop everything on Ctrl-C or SIGTERM. With the gateway's tokenizer_transport, "
        "postprocessor_transport or router_transport 'local' (the mesh config's gateway settings) "
        "that tier runs in the gateway's process and none is started (deploy/local/edge.yaml: all "
        "three).",
    )
    parser.add_argument("--config", help="mesh YAML (see deploy/local/*.yaml); default: one CPU worker")
    parser.add_argument("--log-dir", help="where process logs go (default ${LLMESH_HOME}/run/logs)")
    args = parser.parse_args(argv)
    config = load_mesh_config(args.config)
    state_dir = run_dir()
    log_dir = Path(args.log_dir) if args.log_dir else state_dir / "logs"
    state_dir.mkdir(parents=True, exist_ok=True)
    # The handlers only flip a flag: a threading.Event set from a signal handler deadlocks
    # when a second signal lands while the first handler holds the Event's lock (pkill
    # and then timeout's SIGTERM, Ctrl-C pressed twice).
    stop = {"signalled": False}

    def stop_on_signal(signum: int, frame: object) -> None:
        stop["signalled"] = True

    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    mesh = Mesh(config, log_dir=log_dir)
    state_path = state_dir / STATE_FILE
    print(f"llmesh up: starting the mesh on {mesh.model_name} (logs in {log_dir})", file=sys.stderr)
    try:
        mesh.start()
        state_path.write_text(json.dumps({**mesh.state(), "pid": os.getpid()}, indent=2))
        gw = config.gateway
        scheme = "TLS" if config.tls.enabled else "plaintext"
        print(f"\nllmesh is up: gateway {gw.host}:{gw.port} ({scheme}), model {mesh.model_name}")
        if gw.http_port >= 0:
            print(f"OpenAI-compatible HTTP: {mesh.http_url()}/v1")
        print(f"try:  {grpcurl_hint(config, mesh.tls_dir)}")
        status_as = " (as operator.pem)" if config.tls.enabled and config.tls.mutual else ""
        print(f"status: llmesh status{status_as}    stop: Ctrl-C", flush=True)
        checked = 0.0
        while not stop["signalled"]:
            time.sleep(0.1)
            if time.monotonic() - checked < 1.0:
                continue
            checked = time.monotonic()
            for proc in mesh.procs:
                if not proc.alive() and not proc.extra.get("reported"):
                    proc.extra["reported"] = True
                    print(f"llmesh up: {proc.name} exited with code {proc.popen.returncode}",
                          file=sys.stderr, flush=True)
    except (TimeoutError, RuntimeError) as exc:
        print(f"llmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        print("llmesh up: stopping", file=sys.stderr, flush=True)
        mesh.stop()
        if state_path.exists():
            state_path.unlink()
        time.sleep(0)
    print("llmesh up: stopped", file=sys.stderr)
    return 0

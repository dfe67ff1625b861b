"""Gateway settings (env prefix ``LLMESH_GATEWAY_``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import SettingsConfigDict

from gateway.validation import MAX_STREAM_INTERVAL, MAX_STREAM_MAX_DELAY_MS
from services.common.limits import RequestLimits, RequestLimitSettings
from services.common.retry import RetryPolicy
from services.common.settings import ServerSettings
from services.router.settings import RouterSettings


class GatewaySettings(RequestLimitSettings, ServerSettings):
    """Everything the gateway reads at start-up (request limits shared with the tokenizer)."""

    model_config = SettingsConfigDict(
        env_prefix="LLMESH_GATEWAY_", frozen=True, use_attribute_docstrings=True, extra="ignore",
    )

    port: int = 50051
    """Public gRPC port."""
    tokenizer_targets: list[str] = ["127.0.0.1:50061"]
    """Tokenizer tier replicas (host:port, or dns:///name:port)."""
    tokenizer_transport: Literal["calls", "session", "local"] = "session"
    """How requests reach the tokenizers: ``session`` (one long-lived Session per tokenizer
    replica carrying every request's Encode: the encodes asked for in one moment share a
    message, and the replica answers what is ready in one frame), ``calls`` (one Encode
    call per request; ListModels is always a call) or ``local`` (no tokenizer tier: the
    gateway renders and encodes in its own process with the tokenizers of
    ``local_models`` and the request limits below; tokenizer_targets is then unused).
    Under ``session`` a tokenizer replica without Session (an older release, during a
    rolling upgrade) gets calls on its own, and is asked for Session again after a
    minute."""
    router_targets: list[str] = ["127.0.0.1:50071"]
    """Router replicas; a stream whose router dies is resumed through the next one."""
    router_transport: Literal["calls", "session", "local"] = "session"
    """How requests reach the routers: ``session`` (one long-lived Session per router
    replica carrying every request: submissions of one moment share a message, and the
    router answers with one frame per step for all of them; a broken session resumes its
    requests elsewhere), ``calls`` (one Generate call per request, one message per token)
    or ``local`` (no router tier: the gateway runs a router in its own process and event
    loop with the settings of ``local_router`` and calls its core directly, each step's
    tokens handed over in the process; its loopback port serves readiness; router_targets
    is then unused). Under ``session`` a router replica without Session
    (an older release, during a rolling upgrade) gets calls on its own, and is asked for
    Session again after a minute."""
    local_router: dict[str, Any] = Field(default_factory=dict)
    """Settings of the gateway's in-process router (router_transport ``local``), as the
    router tier takes them (``llmesh router --help``: workers, zones, tokenizer_models,
    downstream TLS to the workers, ...). It listens on 127.0.0.1, on a port of its own
    choosing, in plaintext (only this process calls it); its metrics are the gateway's."""
    postprocessor_targets: list[str] = ["127.0.0.1:50062"]
    """Postprocessor replicas; a stream whose postprocessor dies is replayed into the next one."""
    postprocessor_transport: Literal["calls", "session", "local"] = "session"
    """How requests reach the postprocessors: ``session`` (one long-lived Session per
    postprocessor replica carrying every request: what the requests send in one moment
    shares a message, answered by one frame of text for all of them; a broken session
    replays its requests into another replica), ``calls`` (one Process stream per
    request) or ``local`` (no postprocessor tier: the gateway runs the same pipeline in
    its own process on the router's frames as they arrive, with the tokenizers of
    ``local_models``; postprocessor_targets is then unused). Under ``session`` a
    postprocessor replica without Session (an older release, during a rolling upgrade)
    gets calls on its own, and is asked for Session again after a minute."""
    local_models: list[str] = []
    """Models of the gateway's in-process tiers (tokenizer_transport or
    postprocessor_transport ``local``) as ``name=dir`` or ``dir``, the first the default,
    as the tokenizer and postprocessor tiers take them; empty: the prepared default model
    (smollm2-135m-instruct)."""
    local_encode_threads: int = Field(default=2, ge=1)
    """Threads encoding prompts for tokenizer_transport ``local`` (the tokenizer tier's
    encode_threads)."""
    default_model: str = ""
    """Model used when a request leaves ``model`` empty; empty means the tokenizer tier's default."""
    tenants_file: str = ""
    """YAML/JSON file with tenants (name, key_sha256, requests_per_minute, tokens_per_minute,
    filter_mode). When tenants exist, every call needs ``authorization: Bearer <key>``."""
    default_filter_mode: str = "off"
    """Output filter for callers without a tenant entry: off, redact or block."""
    audit_log: str = ""
    """Path of the JSON-lines audit log ('-' for stderr, empty to disable)."""
    max_request_bytes: int = 0
    """Largest request accepted, in bytes: gRPC refuses a bigger message (RESOURCE_EXHAUSTED)
    before reading it, and HTTP a bigger body (413). 0 derives both from the request limits
    (every field at its limit: about 0.9 MB for gRPC and 2.6 MB for HTTP's JSON with the
    defaults)."""
    max_logprobs: int = 20
    """Most top logprobs per token a caller may ask for."""
    default_max_tokens: int = 512
    """max_tokens when a request leaves it unset (capped by the context left)."""
    default_temperature: float = 0.0
    """temperature when a request leaves it unset: 0 (greedy) gives the same answer to the
    same prompt, which is what a caller that did not ask for sampling expects. A negative
    value leaves it to the engine (vLLM: the model's generation_config, else 1.0)."""
    max_resumes: int = Field(default=3, ge=0)
    """How many times one stream may move to another router replica (retrying before the
    first token, resuming after it), and separately to another postprocessor replica,
    beyond one try of each other replica (services/common/retry.py)."""
    retry_base_backoff_ms: float = Field(default=50.0, ge=0.0)
    """Pause before a stream's first move to another replica; it doubles with each further
    move. Half of it is drawn at random, so streams failing together come back spread out;
    a pause that would reach the request's deadline fails it with DEADLINE_EXCEEDED at once."""
    retry_max_backoff_ms: float = Field(default=500.0, ge=0.0)
    """Upper bound of the pause between a stream's moves to another replica."""
    stream_interval: int = Field(default=1, ge=1, le=MAX_STREAM_INTERVAL)
    """Tokens per GenerateStream delta (and HTTP chunk) when a request does not choose
    (stream_options.interval): 1 sends every token's text as it comes; N sends a delta per
    N tokens' text, so the gateway and the client handle N times fewer edge messages, at
    the price of burstier text. The first delta always goes out at once, and
    the text, stop strings and filters are the same whatever the interval."""
    stream_max_delay_ms: int = Field(default=100, ge=1, le=MAX_STREAM_MAX_DELAY_MS)
    """Longest time text is held back waiting for the stream interval to fill, so a slow
    engine still streams (a request may choose with stream_options.max_delay_ms)."""
    http_port: int = -1
    """OpenAI-compatible HTTP port (-1 disables it)."""
    http_host: str = "127.0.0.1"
    """Address of the OpenAI-compatible HTTP listener."""

    def failover_policy(self) -> RetryPolicy:
        """How a stream moves between router (and postprocessor) replicas: the same policy
        type as the router's between workers, with the gateway's values."""
        return RetryPolicy(
            max_failovers=self.max_resumes,
            count_replicas=True,
            base_backoff_s=self.retry_base_backoff_ms / 1000.0,
            max_backoff_s=self.retry_max_backoff_ms / 1000.0,
            jitter=0.5,
        )

    def limits(self) -> RequestLimits:
        return self.request_limits(max_logprobs=self.max_logprobs)

    def grpc_max_request_bytes(self) -> int:
        return self.max_request_bytes or self.limits().max_message_bytes()

    def http_max_request_bytes(self) -> int:
        return self.max_request_bytes or self.limits().max_json_bytes()

    @model_validator(mode="after")
    def _local_router_is_a_router(self) -> GatewaySettings:
        # A bad in-process router fails the gateway at start, naming the field, as a router
        # process would fail with the same settings.
        if self.router_transport == "local":
            local_router_settings(self)
        return self


LOCAL_ROUTER_HOST = "127.0.0.1"


def local_router_settings(settings: GatewaySettings) -> RouterSettings:
    """The in-process router's settings (router_transport ``local``): ``local_router``'s,
    listening on loopback in plaintext on a port it picks, without a metrics server of its
    own (its metrics are in the gateway's registry), without a drain of its own (the
    gateway drained before it stops) and without a scheduler slice or nice of its own
    (the gateway's ``latency_slice_us`` and ``latency_nice`` are the process's); its TLS
    to the workers is the gateway's (``downstream_tls_*``) unless ``local_router`` sets
    it. Raises ValueError naming ``local_router.<field>``."""
    # TLS to the workers: the gateway's own unless local_router names the router's.
    inherited = {key: getattr(settings, key)
                 for key in ("downstream_tls_ca", "downstream_tls_cert", "downstream_tls_key")}
    values = {**inherited, **settings.local_router, "host": LOCAL_ROUTER_HOST, "port": 0,
              "metrics_port": -1, "tls_cert": "", "tls_key": "", "tls_client_ca": "", "drain_seconds": 0.0,
              "latency_slice_us": 0, "latency_nice": 0}
    unknown = sorted(set(settings.local_router) - set(RouterSettings.model_fields))
    if unknown:
        raise ValueError(f"local_router.{unknown[0]}: not a router setting")
    if not (values.get("workers") or values.get("workers_file") or values.get("dns_targets")):
        raise ValueError("local_router.workers: router_transport local needs the router's workers "
                         "(workers, workers_file or dns_targets)")
    try:
        router = RouterSettings.model_validate(values)
        router.all_workers()
    except ValidationError as exc:
        problems = "; ".join(f"local_router.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ValueError(problems) from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"local_router: {exc}") from None
    return router

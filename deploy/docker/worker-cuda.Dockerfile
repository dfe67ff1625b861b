# syntax=docker/dockerfile:1.7
# CUDA worker: vLLM's own CUDA image (torch, CUDA runtime and vLLM at the version
# llmesh's `cuda` extra pins) with llmesh installed on top. linux/amd64 (and arm64 for
# Grace-Hopper nodes where the base image publishes it). From the repository root:
#   docker buildx build -f deploy/docker/worker-cuda.Dockerfile -t llmesh/worker-cuda:0.1.0 .

FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY scripts ./scripts
COPY protos ./protos
COPY llmesh ./llmesh
COPY services ./services
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM vllm/vllm-openai:v0.32.0
RUN groupadd --system --gid 10001 llmesh \
    && useradd --system --uid 10001 --gid llmesh --home-dir /home/llmesh --create-home llmesh
# The image's vLLM satisfies the `cuda` extra, so pip keeps it and adds only llmesh's
# own dependencies (grpcio, pydantic-settings, ...).
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir --find-links=/wheels "llmesh[cuda]"
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/llmesh-healthcheck
ENV LLMESH_HOME=/home/llmesh/.cache/llmesh \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/llmesh
# gRPC 50081, Session frames 50082 (the router learns it from gRPC), metrics 9090.
EXPOSE 50081 50082 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["llmesh-healthcheck", "--readiness"]
ENTRYPOINT ["llmesh", "worker"]
CMD ["--device=cuda", "--host=0.0.0.0", "--port=50081", "--session-port=50082", "--metrics-port=9090"]

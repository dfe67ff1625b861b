# syntax=docker/dockerfile:1.7
# Ascend NPU worker: the vllm-ascend image (CANN toolkit, torch-npu, vLLM and the
# vllm-ascend plugin, which is source-only on PyPI and built against CANN) with llmesh
# installed on top. Its tag must match the vLLM version llmesh pins. linux/arm64 for
# Kunpeng NPU servers (the base image is multi-arch). From the repository root:
#   docker buildx build --platform linux/arm64 \
#       -f deploy/docker/worker-ascend.Dockerfile -t llmesh/worker-ascend:0.1.0 .

FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY scripts ./scripts
COPY protos ./protos
COPY llmesh ./llmesh
COPY services ./services
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM quay.io/ascend/vllm-ascend:v0.32.0
# Non-root, in the HwHiAiUser group (gid 1000 on Ascend hosts) that owns /dev/davinci*.
RUN (getent group HwHiAiUser || groupadd --gid 1000 HwHiAiUser) \
    && groupadd --system --gid 10001 llmesh \
    && useradd --system --uid 10001 --gid llmesh --groups HwHiAiUser \
        --home-dir /home/llmesh --create-home llmesh
# torch-npu and vLLM come with the image; the `ascend` extra only asks for torch-npu.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir --find-links=/wheels "llmesh[ascend]"
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/llmesh-healthcheck
# CANN's environment comes from its set_env.sh, which must be sourced in the process
# that starts Python: llmesh-ascend-env does that and then execs its arguments.
COPY --chmod=0755 deploy/docker/ascend-env.sh /usr/local/bin/llmesh-ascend-env
ENV LLMESH_HOME=/home/llmesh/.cache/llmesh \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/llmesh
# gRPC 50081, Session frames 50082 (the router learns it from gRPC), metrics 9090.
EXPOSE 50081 50082 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["llmesh-healthcheck", "--readiness"]
ENTRYPOINT ["llmesh-ascend-env", "llmesh", "worker"]
CMD ["--device=npu", "--host=0.0.0.0", "--port=50081", "--session-port=50082", "--metrics-port=9090"]

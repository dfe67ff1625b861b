# syntax=docker/dockerfile:1.7
# CPU tiers: gateway, tokenizer, postprocessor and router in one image, without vLLM or
# torch (they run on Kunpeng arm64 nodes as well as x86-64). Multi-arch build from the
# repository root:
#   docker buildx build --platform linux/amd64,linux/arm64 \
#       -f deploy/docker/tiers.Dockerfile -t llmesh/llmesh:0.1.0 .
# Run one tier per container: `docker run llmesh/llmesh:0.1.0 tokenizer --port=50061 ...`.

FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
# The wheel build generates the gRPC stubs from protos/ (setup.py); stubs are not in git.
COPY pyproject.toml setup.py README.md ./
COPY scripts ./scripts
COPY protos ./protos
COPY llmesh ./llmesh
COPY services ./services
COPY gateway ./gateway
# llmesh and every dependency as wheels for the target platform; no extras: no vLLM.
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11.13-slim-bookworm
RUN groupadd --system --gid 10001 llmesh \
    && useradd --system --uid 10001 --gid llmesh --home-dir /home/llmesh --create-home llmesh
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels llmesh
COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/llmesh-healthcheck
ENV LLMESH_HOME=/home/llmesh/.cache/llmesh \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/llmesh
# gRPC: gateway 50051, tokenizer 50061, postprocessor 50062, router 50071; Session frames:
# tokenizer 50065, postprocessor 50063, router 50072 (pass --session-port: its default
# picks a free port); metrics 9090.
EXPOSE 50051 50061 50062 50063 50065 50071 50072 9090
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["llmesh-healthcheck", "--readiness"]
ENTRYPOINT ["llmesh"]
CMD ["gateway", "--host=0.0.0.0", "--metrics-port=9090"]

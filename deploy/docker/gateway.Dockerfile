# visor gateway: the untrusted side. `.[gateway]` only: no torch, no model, no GPU libraries.
# Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t registry.example.com/visor/gateway:0.1.0 .
# Runs as uid 10001 with a read-only root filesystem; writable: /tmp (tmpfs or emptyDir).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# pillow-simd compiles against these; the runtime stage carries only their shared libraries.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libjpeg62-turbo-dev zlib1g-dev \
      libpng-dev libwebp-dev libtiff-dev libfreetype-dev libseccomp-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ./
COPY protos protos
COPY shared shared
COPY visor visor
COPY gateway gateway
COPY core core
COPY bench bench
RUN python -m venv /opt/visor \
 && /opt/visor/bin/pip install --no-cache-dir ".[gateway]" \
 && /opt/visor/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"

FROM ${PYTHON_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjpeg62-turbo zlib1g libpng16-16 libwebp7 \
      libwebpdemux2 libwebpmux3 libtiff6 libfreetype6 libseccomp2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/visor /opt/visor
ENV PATH=/opt/visor/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    VISOR_GATEWAY_LISTEN=0.0.0.0:50051 \
    VISOR_GATEWAY_METRICS_LISTEN=0.0.0.0:9101 \
    VISOR_DEPLOYMENT_SECRET_FILE=/etc/visor/deployment/deployment.secret
# The deployment secret is mounted from outside: the same file the cores mount.
USER 10001:10001
EXPOSE 50051 9101
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["visor", "health", "--target", "127.0.0.1:50051", "--service", "visor.v1.Gateway"]
ENTRYPOINT ["visor", "gateway"]
CMD ["--config", "/etc/visor/visor.toml"]

# visor core: the GPU side. `.[core]` (add `gpu` for TensorRT: --build-arg EXTRAS=core,gpu).
# The model is NOT in the image: mount a llava-hf checkpoint directory at /models/model.
# Build from the repository root:
#   docker build -f deploy/docker/core.Dockerfile -t registry.example.com/visor/core:0.1.0 .
# Runs as uid 10001 with a read-only root filesystem; writable: /var/lib/visor (LMDB feature
# cache + ONNX/TensorRT artifacts, a volume) and /tmp (tmpfs or emptyDir).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG EXTRAS=core
WORKDIR /src
COPY pyproject.toml README.md hatch_build.py ./
COPY protos protos
COPY shared shared
COPY visor visor
COPY gateway gateway
COPY core core
COPY bench bench
RUN python -m venv /opt/visor \
 && /opt/visor/bin/pip install --no-cache-dir "torch==2.13.0" \
 && /opt/visor/bin/pip install --no-cache-dir ".[${EXTRAS}]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/visor /opt/visor
ENV PATH=/opt/visor/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    VISOR_CORE_LISTEN=0.0.0.0:50052 \
    VISOR_CORE_METRICS_LISTEN=0.0.0.0:9102 \
    VISOR_CORE_MODEL=/models/model \
    VISOR_CORE_ARTIFACTS_DIR=/var/lib/visor/artifacts \
    VISOR_CACHE_PATH=/var/lib/visor/cache \
    VISOR_CORE_TLS_CERT=/etc/visor/tls/tls.crt \
    VISOR_CORE_TLS_KEY=/etc/visor/tls/tls.key \
    VISOR_CORE_TLS_CLIENT_CA=/etc/visor/tls/ca.crt \
    VISOR_DEPLOYMENT_SECRET_FILE=/etc/visor/deployment/deployment.secret
# Mount points only: the model, the certificates, the deployment secret (the same file the
# gateways mount) and the state come from outside.
VOLUME ["/models", "/var/lib/visor"]
USER 10001:10001
EXPOSE 50052 9102
# mTLS is required off loopback, so the check dials itself with the core's own certificate
# (it carries clientAuth; see `visor certs dev`). Shell form: the paths come from the ENV above.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD visor health --target localhost:50052 --service visor.v1.Core \
      --ca "$VISOR_CORE_TLS_CLIENT_CA" --cert "$VISOR_CORE_TLS_CERT" --key "$VISOR_CORE_TLS_KEY"
ENTRYPOINT ["visor", "core"]

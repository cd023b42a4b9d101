# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target worker   -t disagg-worker .    # GPU inference worker (CUDA torch + NIXL)
#   docker build --target operator -t disagg-operator .  # the kopf operator (no torch)
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG PYTHON_BASE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build the package wheel once
FROM ${PYTHON_BASE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY worker/ worker/
COPY operator/src/ operator/src/
RUN pip install --no-cache-dir build==1.2.2 \
 && python -m build --wheel --outdir /wheels .

# ---------------------------------------------------------------- worker: CUDA runtime + torch + nixl
FROM ${CUDA_BASE} AS worker
ARG TORCH_VERSION=2.9.1
ARG NIXL_VERSION=1.5.1
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HOME=/var/cache/huggingface
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# torch (its default Linux build is the CUDA one) before nixl, which declares torch
RUN pip install "torch==${TORCH_VERSION}" \
 && pip install "nixl==${NIXL_VERSION}"
COPY --from=wheel /wheels/ /wheels/
# the s3 extra: s3:// model sources in the fetch-model init container
RUN pip install "$(ls /wheels/*.whl)[s3]" && rm -rf /wheels
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin disagg \
 && mkdir -p /var/cache/huggingface /models \
 && chown disagg:disagg /var/cache/huggingface /models
USER 10001
# HTTP API (/v1, /health, /ready, /metrics) and the NIXL side channel
EXPOSE 8000 5600
ENTRYPOINT ["disagg", "worker"]
CMD ["--help"]

# ---------------------------------------------------------------- operator: slim Python + kopf
FROM ${PYTHON_BASE} AS operator
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY --from=wheel /wheels/ /wheels/
# the operator needs neither torch nor nixl: install the package without its worker dependencies
RUN pip install --no-deps /wheels/*.whl \
 && pip install "kopf>=1.37,<2" "kubernetes>=29,<38" "pydantic>=2.6,<3" "pyyaml>=6,<7" \
    "prometheus-client>=0.20,<1" "httpx>=0.27,<1" \
 && rm -rf /wheels \
 && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin disagg
USER 10001
EXPOSE 8080
ENTRYPOINT ["disagg", "operator"]

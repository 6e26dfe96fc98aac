# ChatTTS speech service for CPU boxes: linux/amd64 and linux/arm64 from this one file.
#   docker compose up -d --build
#   another platform's image: docker buildx build --platform linux/arm64 .
#                             (podman build --arch arm64 .)
# Build arguments:
#   BASE_IMAGE       Debian base image (default debian:trixie-slim: Python 3.13, and Debian's
#                    CPU builds of torch and torchaudio)
#   TORCH_INDEX_URL  empty (default): torch and torchaudio are Debian's CPU builds (python3-torch,
#                    python3-torchaudio 2.6; a ~2.4 GB image). Set: the versions requirements.txt
#                    pins, from that index (https://download.pytorch.org/whl/cpu: PyTorch's CPU
#                    builds; https://pypi.org/simple: the CUDA builds, a ~6.5 GB image)
#   DOWNLOAD_MODEL   1 = bake the real weights into the image at build time (needs the hub)
#   HF_ENDPOINT      hub mirror for DOWNLOAD_MODEL=1
ARG BASE_IMAGE=debian:trixie-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=""
ARG DOWNLOAD_MODEL=0
ARG HF_ENDPOINT=https://huggingface.co
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# g++ builds the decode loop's C++ kernels here only; the runtime image carries the library.
# On arm64 the kernels written with AVX2 intrinsics compile through SIMDe's headers (NEON)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv g++ \
 && if [ "$(dpkg --print-architecture)" = arm64 ]; then \
        apt-get install -y --no-install-recommends libsimde-dev ; \
    fi \
 && if [ -z "${TORCH_INDEX_URL}" ]; then \
        apt-get install -y --no-install-recommends python3-torch python3-torchaudio ; \
    fi \
 && rm -rf /var/lib/apt/lists/*
# the venv sees Debian's torch (system site packages) unless TORCH_INDEX_URL installs its own
RUN python3 -m venv --system-site-packages /opt/venv
WORKDIR /app
COPY requirements.txt ./
# (pip's bytecode of every module, ~300 MB, goes: the runtime stage writes what a start uses)
RUN grep -E '^(torch|torchaudio)==' requirements.txt > torch-requirements.txt \
 && grep -v -E '^(torch|torchaudio)==' requirements.txt > rest-requirements.txt \
 && if [ -n "${TORCH_INDEX_URL}" ]; then \
        /opt/venv/bin/pip install --index-url "${TORCH_INDEX_URL}" -r torch-requirements.txt ; \
    fi \
 && /opt/venv/bin/pip install -r rest-requirements.txt \
 && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +
COPY chattts_service ./chattts_service
ENV CHATTTS_KERNEL_DIR=/opt/chattts-kernels
RUN /opt/venv/bin/python -m chattts_service.kernels.build
RUN mkdir -p /models/chattts \
 && if [ "${DOWNLOAD_MODEL}" = "1" ]; then \
        HF_ENDPOINT="${HF_ENDPOINT}" \
        /opt/venv/bin/python -m chattts_service.tools.model download /models/chattts ; \
    fi

FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX_URL=""
# libgomp1: OpenMP runtime torch uses on CPU; numactl: CPU/memory node pinning; libjemalloc2:
# the allocator the server preloads (glibc's fragments under steady load). Debian's torch
# takes its BLAS from the system: OpenBLAS (on torch's OpenMP threads), not the reference BLAS
# the package falls back to, which decodes audio 40x slower
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 numactl libjemalloc2 \
 && if [ -z "${TORCH_INDEX_URL}" ]; then \
        apt-get install -y --no-install-recommends \
            python3-torch python3-torchaudio libopenblas0-openmp ; \
    fi \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 chattts \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/chattts chattts \
 && mkdir -p /voices && chown 10001:10001 /voices
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/chattts-kernels /opt/chattts-kernels
COPY --from=build --chown=10001:10001 /models /models
WORKDIR /app
COPY chattts_service ./chattts_service
COPY server.py warmup.py bench.py ./
COPY benchmarks ./benchmarks
COPY docker/entrypoint.sh /usr/local/bin/chattts-entrypoint
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    CHATTTS_KERNEL_DIR=/opt/chattts-kernels \
    CHATTTS_MODEL_DIR=/models/chattts \
    CHATTTS_VOICES_DIR=/voices \
    CHATTTS_PORT=8090
# Written once, here: the bytecode of every module a start imports, by a start of a tiny
# random-weight model (without it each container start compiles torch and ChatTTS again: ~10 s)
RUN PYTHONDONTWRITEBYTECODE='' sh -c '\
    python -m chattts_service.tools.testmodel /tmp/bytecode-model --size tiny >/dev/null 2>&1 \
 && python -m chattts_service.tools.warmup --model-dir /tmp/bytecode-model --no-verify \
 && python -c "import chattts_service.transport.serve, chattts_service.app, gunicorn.workers.gthread" \
 && rm -rf /tmp/bytecode-model'
USER 10001:10001
EXPOSE 8090 10200
# a first start downloads the model into the volume: the start period allows for it
HEALTHCHECK --interval=15s --timeout=5s --start-period=1200s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('CHATTTS_PORT', '8090'), timeout=4).status == 200 else 1)"]
ENTRYPOINT ["chattts-entrypoint"]
CMD ["python", "server.py"]

# syntax=docker/dockerfile:1
# moeserve for NVIDIA GPUs: torch's CUDA 13 build, the Triton kernels, NVSHMEM and NIXL, in a venv
# on PATH. The install steps are deploy/docker/install.sh's (CI runs its cpu flavour), so this file
# only lays out the system around them. Build and push: docs/deploy/container.md.
#
#   docker build -t moeserve:latest .
#   docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models moeserve:latest \
#       moeserve launch --model /models/Qwen3-30B-A3B --host 0.0.0.0
ARG BASE_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# torch's version, and an index to take it from when pip's default one serves a build for another CUDA
# (install.sh checks the build is CUDA 13's, as NVSHMEM's and NIXL's wheels here are).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=

# python3-dev and gcc: Triton compiles each kernel's launcher against Python's headers at first use.
# libibverbs and its providers, librdmacm: NVSHMEM's and NIXL's InfiniBand/RoCE transports load them.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev libibverbs1 ibverbs-providers librdmacm1 \
    && rm -rf /var/lib/apt/lists/*

# Only what the package build reads: a change to tests or docs does not invalidate the install layer.
COPY pyproject.toml README.md /src/
COPY moeserve /src/moeserve
COPY deploy/docker/install.sh /src/deploy/docker/install.sh
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_VERSION="${TORCH_VERSION}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" \
    /src/deploy/docker/install.sh --flavour cuda --prefix /opt/moeserve --src /src \
    && rm -rf /src

# The demo checkpoint and any other cache in one folder a volume can keep across restarts.
ENV PATH=/opt/moeserve/bin:${PATH} \
    MOESERVE_CACHE_DIR=/var/cache/moeserve \
    PYTHONUNBUFFERED=1
RUN moeserve --help > /dev/null
WORKDIR /workspace
EXPOSE 8000
CMD ["moeserve", "launch", "--host", "0.0.0.0", "--port", "8000"]

#!/usr/bin/env bash
# Installs moeserve into a virtual environment: the one recipe the container image runs and CI
# tests (CI runs the cpu flavour in a fresh venv, so a broken step fails there, not at a docker build).
#
#   deploy/docker/install.sh --flavour cpu|cuda --prefix VENV [--src DIR]
#
#   cpu   torch's CPU build (TORCH_VERSION, default 2.13.0) and the package: no CUDA wheel.
#   cuda  torch's CUDA 13 build, the package with its GPU extras (Triton, nvshmem4py), NVSHMEM's
#         wheel (its device bitcode links the kernels' put variants) and NIXL.
#
# Environment: TORCH_VERSION; TORCH_INDEX_URL, an index to take torch from (e.g. PyTorch's own
# channel for a given CUDA or for CPU builds), when pip's configured index would give another build;
# PIP_* as pip reads them (its cache is used: a second run installs from it).
# The package is installed as a wheel, not editable: the venv works without the source tree.
set -euo pipefail

flavour="" prefix="" src="$(cd "$(dirname "$0")/../.." && pwd)"
while [ $# -gt 0 ]; do
    case "$1" in
        --flavour) flavour="${2:?}"; shift 2 ;;
        --prefix) prefix="${2:?}"; shift 2 ;;
        --src) src="${2:?}"; shift 2 ;;
        *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
case "$flavour" in
    cpu | cuda) ;;
    *) echo "install.sh: --flavour cpu or cuda is required" >&2; exit 2 ;;
esac
[ -n "$prefix" ] || { echo "install.sh: --prefix VENV is required" >&2; exit 2; }

# CUDA 13 builds, as torch's default Linux wheel is (and the `gpu` extra's nvshmem4py-cu13): one
# process must not load two CUDA majors' libraries. NVSHMEM's version is the one torch's CUDA builds
# pin (2.11 to 2.13), whose host library torch loads: NVSHMEM refuses device code linked from
# another version, and pip refuses a second pin. CI links and checks the kernels against the same.
CUDA_MAJOR=13
NVSHMEM_WHEEL="nvidia-nvshmem-cu$CUDA_MAJOR==3.4.5"
NIXL_WHEEL="nixl-cu$CUDA_MAJOR==1.5.1"
torch_version="${TORCH_VERSION:-2.13.0}"

[ -x "$prefix/bin/python" ] || python3 -m venv "$prefix"
pip=("$prefix/bin/python" -m pip install --disable-pip-version-check --quiet)
torch_index=()
[ -z "${TORCH_INDEX_URL:-}" ] || torch_index=(--index-url "$TORCH_INDEX_URL")

# torch first and alone: the package's own `torch>=` requirement is then already met, so no
# later resolve swaps the build for another one from the default index.
"${pip[@]}" "${torch_index[@]}" "torch==$torch_version"
if [ "$flavour" = cpu ]; then
    "${pip[@]}" "$src"
else
    "${pip[@]}" "$src[gpu]" "$NVSHMEM_WHEEL" "$NIXL_WHEEL"
fi

# What was installed, checked without a GPU (a docker build has none): the torch build's CUDA
# version, and the GPU packages' distributions. From / so that a source tree in the working folder
# is not what gets imported.
(cd / && "$prefix/bin/python" - "$flavour" "$CUDA_MAJOR") <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

import torch

import moeserve

flavour, cuda_major = sys.argv[1:]
cuda = torch.version.cuda
if flavour == "cpu" and cuda is not None:
    sys.exit(f"install.sh: the cpu flavour got torch {torch.__version__}, a CUDA {cuda} build")
if flavour == "cuda":
    if cuda is None or cuda.split(".")[0] != cuda_major:
        sys.exit(
            f"install.sh: torch {torch.__version__} is built for CUDA {cuda}, not CUDA {cuda_major} as NVSHMEM and NIXL "
            f"here are: set TORCH_INDEX_URL to an index with torch's CUDA {cuda_major} build"
        )
    for name in ("triton", f"nvshmem4py-cu{cuda_major}", f"nvidia-nvshmem-cu{cuda_major}", f"nixl-cu{cuda_major}"):
        try:
            version(name)
        except PackageNotFoundError:
            sys.exit(f"install.sh: {name} is not installed")
print(f"install.sh: moeserve {version('moeserve')} ({moeserve.__file__}), torch {torch.__version__}, flavour {flavour}")
PY

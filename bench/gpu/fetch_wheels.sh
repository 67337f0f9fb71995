#!/usr/bin/env bash
# Download the wheels bench/gpu/wheels.txt pins into .whl/ at the repository root, for the GPU
# machine (Python 3.12, manylinux x86-64, no network there). Run on any machine with pip and a
# registry; it replaces .whl/ wholesale, so the folder holds exactly one version of each.
#   bench/gpu/fetch_wheels.sh [PYTHON]   (default: python3)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
python="${1:-python3}"
dest="$root/.whl"
platforms=()
for tag in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$root/bench/gpu/wheels.txt" | grep -v '^$')
rm -rf "$dest"
mkdir -p "$dest"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform any -d "$dest" "${pins[@]}"
count=$(find "$dest" -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#pins[@]}" ]; then
    echo "fetch_wheels: ${#pins[@]} pins but $count wheels in $dest" >&2
    exit 1
fi
du -cb "$dest"/*.whl | awk '{printf "%9.1f KiB  %s\n", $1 / 1024, $2}' | sed "s|$dest/||"

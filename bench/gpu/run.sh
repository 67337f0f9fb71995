#!/usr/bin/env bash
# The GPU runbook, from the repository root on a lent GPU machine (no network there):
#   bench/gpu/run.sh STAGE... | all [--dry-run] [--budget SECONDS] [--out-dir DIR]
# Installs the wheels carried in .whl/ (bench/gpu/fetch_wheels.sh fetches them; carry ".whl"),
# then runs bench/gpu/runbook.py, which says what each stage proves and where its records go.
# On a machine without CUDA every stage is checked and skipped (a dry run), and nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
python="${PYTHON:-python3}"
site="${MOESERVE_WHEEL_SITE:-/tmp/moeserve-site}"
dry_run=0
for arg in "$@"; do
    [ "$arg" = "--dry-run" ] && dry_run=1
done
if [ "$dry_run" = 0 ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        # A failed install is reported, not fatal: the runbook names the packages it could not import,
        # and the stages that need none of them still run.
        "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
            || echo "run.sh: installing the wheels in .whl/ failed (they are for CPython 3.12 on x86-64)" >&2
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "run.sh: no .whl/ here (run bench/gpu/fetch_wheels.sh and carry .whl): stages needing its packages will fail" >&2
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$python" bench/gpu/runbook.py "$@"

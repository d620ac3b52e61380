#!/usr/bin/env bash
# Run pytest groups on the GPU machine, each under its own time limit, each logged to
# $OUT/<name>.log so one hang or a cut-off run still leaves every other group's summary.
#   tools/gpu_check.sh NAME:SECONDS:"pytest args" [...]
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if ! python3 -c "import jaxbuf._capsule" 2>/dev/null; then
    pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
        tail -20 "$OUT/install.log"; exit 1; }
fi
for group in "$@"; do
    name=${group%%:*}; rest=${group#*:}; seconds=${rest%%:*}; args=${rest#*:}
    start=$(date +%s)
    # shellcheck disable=SC2086 # args is a word list on purpose
    timeout -k 10 "$seconds" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider $args \
        >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$OUT/$name.log")"
done

#!/usr/bin/env bash
# Run pytest groups on the GPU machine, each under its own time limit, each logged to
# $OUT/<name>.log so one hang or a cut-off run still leaves every other group's summary.
#   tools/gpu_check.sh NAME:SECONDS:"pytest args" [...]
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
# The machine's own interpreter: a bare `pip` may belong to another one.
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || {
    tail -20 "$OUT/install.log"; exit 1; }
(cd /tmp && python3 -c "import jaxbuf.kernels") || { echo "jaxbuf.kernels not importable"; exit 1; }
for group in "$@"; do
    name=${group%%:*}; rest=${group#*:}; seconds=${rest%%:*}; args=${rest#*:}
    start=$(date +%s)
    # eval: args may quote a -k expression.
    eval timeout -k 10 "$seconds" python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
        "$args" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$OUT/$name.log")"
done

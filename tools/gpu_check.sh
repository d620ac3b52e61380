#!/usr/bin/env bash
# Run pytest groups on the GPU machine, each under its own time limit, each logged, so that a
# hang or a cut-off run still leaves every other group's summary.
#   tools/gpu_check.sh NAME:SECONDS:"pytest args" [...]
# Logs go to $OUT/logs.tgz (the device tool returns few files): NAME.log per group, and from
# tests/conftest.py failures-*.log (each failure as it happens) and stacks-*.log (every
# thread's Python stack, dumped when a group overruns its time).
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}
export JAXBUF_REPORT_DIR=${JAXBUF_REPORT_DIR:-/tmp/jaxbuf_reports}
mkdir -p "$OUT" "$JAXBUF_REPORT_DIR"
trap 'tar czf "$OUT/logs.tgz" -C "$JAXBUF_REPORT_DIR" .' EXIT
# The machine's own interpreter: a bare `pip` may belong to another one.
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$JAXBUF_REPORT_DIR/install.log" 2>&1 || {
    tail -20 "$JAXBUF_REPORT_DIR/install.log"; exit 1; }
(cd /tmp && python3 -c "import jaxbuf.kernels") || { echo "jaxbuf.kernels not importable"; exit 1; }
for group in "$@"; do
    name=${group%%:*}; rest=${group#*:}; seconds=${rest%%:*}; args=${rest#*:}
    start=$(date +%s)
    eval "argv=($args)"  # args may quote a -k expression
    # setsid: pytest leads a process group of its own (workers, subprocesses) to signal.
    setsid python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider "${argv[@]}" \
        >"$JAXBUF_REPORT_DIR/$name.log" 2>&1 &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && (( $(date +%s) - start < seconds )); do sleep 1; done
    if kill -0 "$pid" 2>/dev/null; then
        kill -USR1 -- "-$pid" 2>/dev/null; sleep 3   # conftest: stacks of every process
        kill -KILL -- "-$pid" 2>/dev/null
        echo "(overran ${seconds}s: stacks in stacks-*.log)" >>"$JAXBUF_REPORT_DIR/$name.log"
    fi
    wait "$pid"; rc=$?
    echo "== $name rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$JAXBUF_REPORT_DIR/$name.log")"
done

#!/usr/bin/env bash
# On the GPU machine: the hot-path suites of the original release (.baseline/, an unpacked
# `git archive` of it, carried by the device tool) and of this tree, alternately, in one
# session, so that "before" and "after" columns come from the same machine and run.
#   tools/gpu_bench.sh SUITE... (default: the hot paths: capsule, to_torch, copy_to_uva, staging, apply)
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
suites=("$@"); [ ${#suites[@]} -gt 0 ] || suites=(extensible.views uva.copy_to_uva staged.stage staged.apply)
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
if [ -d .baseline ]; then
    (cd .baseline && python3 setup.py -q build_ext --inplace >>"$OUT/install.log" 2>&1)
    (cd .baseline && python3 -m jaxbuf bench --only "${suites[@]}" --json "$OUT/before.json" >"$OUT/before.txt" 2>&1)
    echo "== before rc=$?"
fi
(cd /tmp && python3 -m jaxbuf bench --only "${suites[@]}" --json "$OUT/after.json" >"$OUT/after.txt" 2>&1)
echo "== after rc=$?"

#!/usr/bin/env bash
# On the GPU machine (which has no NIXL and no network): jaxbuf.transfer over VRAM.
#   tools/gpu_transfer.sh [WHEEL_DIR]   (default: ./.wheels)
# WHEEL_DIR holds the NIXL wheel for the machine's Python, fetched beforehand on a machine
# with network access, e.g. for Python 3.12:
#   pip download nixl-cu13==1.5.1 --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d .wheels
# and carried with the tree (the device tool's carry: [".wheels"]). The wheel is unpacked into
# /tmp/site and put on PYTHONPATH; nothing is installed into the machine's interpreter.
# Runs: `jaxbuf info` (what CUDA chunks get: fabric / POSIX handles, GPUDirect RDMA), the
# transfer tests marked gpu (VRAM in one process and in two), the CPU transfer tests, and the
# transfer bench suites on cuda:0, writing everything under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
WHEELS=${1:-.wheels}
SITE=/tmp/site
rc=0
if ! python3 -c "import nixl_cu13._api" 2>/dev/null; then
    shopt -s nullglob
    wheels=("$WHEELS"/nixl*.whl)
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no NIXL wheel under $WHEELS (see the header of $0)"; exit 2
    fi
    python3 -m pip install -q --no-deps --target "$SITE" "${wheels[@]}" >"$OUT/nixl-install.log" 2>&1 \
        || { tail -20 "$OUT/nixl-install.log"; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { tail -20 "$OUT/install.log"; exit 1; }
python3 -m jaxbuf info >"$OUT/info.txt" 2>&1; echo "== info rc=$?"
grep -A8 "CUDA allocations" "$OUT/info.txt"; grep -A4 "transfer engines" "$OUT/info.txt"
python3 -m pytest -q -rs -p no:cacheprovider tests/test_transfer_cuda.py tests/test_transfer.py \
    tests/test_transfer_bench.py >"$OUT/tests.txt" 2>&1
status=$?; echo "== tests rc=$status"; tail -15 "$OUT/tests.txt"; [ $status -eq 0 ] || rc=$status
(cd /tmp && python3 -m jaxbuf bench --device cuda:0 --only transfer \
    --json "$OUT/bench-transfer-cuda.json" >"$OUT/bench.txt" 2>&1)
status=$?; echo "== bench rc=$status"; grep "│" "$OUT/bench.txt" | head -40; [ $status -eq 0 ] || rc=$status
exit $rc

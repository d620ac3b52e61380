#!/usr/bin/env bash
# Builds jaxbuf's C extensions (the capsule module and its DLPack C exchange API, the stager
# and packer, the CUDA call module, the CPU driver's batched copy) with AddressSanitizer and
# UndefinedBehaviorSanitizer in a temporary copy of the tree, and runs the tests that reach
# that C there, with the ASan runtime preloaded.
#
#   tools/sanitize.sh [pytest args...]      (PYTHON=... picks the interpreter; arguments
#                                           replace the default list of test files)
#
# The source tree is left as it was: the sanitized .so files live only in the copy, which is
# put first on PYTHONPATH (an editable install's finder comes after it). Leak detection is
# off: CPython keeps objects alive until exit by design. Any ASan report or UB aborts the
# process, so a test that reaches a fault fails (the state machine and the C fuzz test run
# each risky call in a child process, which inherits the preload and the options).
#
# Which tests run: those that reach jaxbuf's C (TESTS below: the ctypes stand-ins of the CUDA
# call module, the CPU driver's batched copy, the stager and packer, capsules and lifetimes,
# the C exchange API with torch and tvm-ffi, the C fuzz and the state machine). torch 2.13 and JAX 0.10 tolerate the preloaded runtime
# (the state machine's torch and JAX workers and test_staged import them), so nothing is left
# out for them. On an idle 2-core CPU machine the whole list takes about 2.5 minutes; pass
# files to run fewer.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
ROOT=$(pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/jaxbuf-sanitize.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# The tracked and new (not ignored) files: no build output of the source tree is copied.
git ls-files -z --cached --others --exclude-standard | (cd "$ROOT" && xargs -0 cp --parents -t "$WORK")
ln -s ../kernels "$WORK/jaxbuf/kernels"  # jaxbuf.kernels, as the package maps it

SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
(
    cd "$WORK"
    CFLAGS="$SAN_FLAGS -g -O1" LDFLAGS="-fsanitize=address,undefined" \
        "$PYTHON" setup.py -q build_ext --inplace --build-temp "$WORK/build" >"$WORK/build.log" 2>&1 ||
            { cat "$WORK/build.log"; exit 1; }
)

ASAN_RUNTIME=$(gcc -print-file-name=libasan.so)
UBSAN_RUNTIME=$(gcc -print-file-name=libubsan.so)
export LD_PRELOAD="$ASAN_RUNTIME $UBSAN_RUNTIME"
# detect_leaks=0: CPython leaks by design. The CUDA driver library and XLA install their own
# signal handlers: ASan must not take them over.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allow_user_segv_handler=1:handle_segv=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
export PYTHONPATH="$WORK${PYTHONPATH:+:$PYTHONPATH}"
export JAXBUF_SANITIZED=1
# The sanitizer job runs more examples than the default run.
export JAXBUF_STATEFUL_EXAMPLES=${JAXBUF_STATEFUL_EXAMPLES:-25}
export JAXBUF_C_FUZZ_EXAMPLES=${JAXBUF_C_FUZZ_EXAMPLES:-600}

cd "$WORK"
# Prove the sanitized builds are the ones imported.
"$PYTHON" - <<'EOF'
import importlib, os
for name in ("jaxbuf._capsule", "jaxbuf._staging", "jaxbuf.drivers._cuda_calls",
             "jaxbuf.drivers._host_calls"):
    module = importlib.import_module(name)
    path = os.path.realpath(module.__file__)
    assert path.startswith(os.path.realpath(os.environ["PYTHONPATH"].split(":")[0])), path
    assert b"__asan" in open(path, "rb").read(), f"{path} is not built with ASan"
    print(f"sanitized: {name} ({path})")
EOF

TESTS=(
    tests/test_cuda_calls.py
    tests/test_driver_host.py
    tests/test_staged.py
    tests/test_later_wins.py
    tests/test_jax_ring.py
    tests/test_lifetime.py
    tests/test_dlpack_spec.py
    tests/test_dlpack_c_api.py
    tests/test_views.py
    tests/test_bad_input.py
    tests/test_c_fuzz.py
    tests/test_state_machine.py
)
# Arguments, when given, replace the list (a path, -k, ...).
if [ $# -gt 0 ]; then TESTS=("$@"); fi
# ASan keeps freed blocks in its quarantine (256 MiB by default), so a test that bounds the
# process's RSS measures the sanitizer, not jaxbuf: it runs in the main job only.
"$PYTHON" -m pytest -q -ra -p no:cacheprovider "${TESTS[@]}" \
    --deselect tests/test_views.py::test_unconsumed_capsules_do_not_leak

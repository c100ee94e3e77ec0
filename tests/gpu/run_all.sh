#!/usr/bin/env bash
# Every GPU test, on the H200 machine: tests/gpu/run_all.sh [section ...] (default: all).
# Prints one PASSED/FAILED line per step and a summary; exits non-zero if any step failed.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}
failed=()
passed=0

step() {
  echo "=== $*"
  if "$@"; then passed=$((passed + 1)); echo "PASSED: $*"; else failed+=("$*"); echo "FAILED: $*"; fi
}

# Collectives (issue 3): P = 1 in one process, P = 2, 4, 8 processes sharing the GPU, and a
# rank that dies before the call (the others must fail with the timeout error, not hang).
section_collectives() {
  step "$PY" -m pytest -q -m gpu tests/test_all_reduce.py tests/test_all_gather.py \
    tests/test_reduce_scatter.py tests/test_all_to_all.py
  for n in 2 4 8; do
    step "$PY" -m pk_jax.launch -n "$n" --share-gpu --timeout 400 \
      tests/gpu/test_collectives_mp.py main
  done
  for n in 2 4; do
    PK_JAX_TIMEOUT_S=5 step "$PY" -m pk_jax.launch -n "$n" --share-gpu --timeout 120 \
      tests/gpu/test_collectives_mp.py dead
  done
}

# Fused tensor-parallel GEMMs (issue 5): P = 1 in one process (every mode), then P = 2, 4, 8
# processes sharing the GPU (tests/gpu/tp_mp.py: exact integer cases, stragglers, repeats).
section_tp() {
  step "$PY" -m pytest -q -m "gpu and not large" tests/test_gemm_rs.py tests/test_ag_gemm.py \
    tests/test_gemm_ar.py
  for n in 2 4 8; do
    step "$PY" -m pk_jax.launch -n "$n" --share-gpu --timeout 500 tests/gpu/tp_mp.py
  done
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(collectives)
for s in "${sections[@]}"; do "section_$s"; done
echo "=== summary: $passed passed, ${#failed[@]} failed"
for f in "${failed[@]}"; do echo "failed: $f"; done
[ ${#failed[@]} -eq 0 ]

#!/usr/bin/env bash
# Every GPU test and benchmark, on the H200 machine: tests/gpu/run_all.sh [section ...]
# Sections: install sass unit runtime collectives collectives_mp tp tp_mp grouped attention
# emulator moe moe_fused moe_mp ring ulysses ulysses_bwd sanitize sanitize_scale racecheck
# examples users large large_cpu bench link overlap soak state hazards (default: all but
# moe_fused, moe_mp, ulysses_bwd, sanitize_scale and racecheck (both part of sanitize),
# large_cpu, bench, link, overlap, soak and hazards).
# PK_JAX_REQUIRE_GPU=1 (the default here; 0 turns it off): a pytest step whose selected tests
# need an sm_90 GPU or the extension fails at collection when this machine has neither, instead
# of passing with every GPU test skipped (tests/conftest.py).
# The P = 1 sections (install unit collectives tp examples) may run side by side in separate
# invocations, slowing one another (bench/results/gpu_suite_notes.md); the multi-process ones
# and bench want the GPU alone.
# PK_JAX_SUITE_BUDGET_S: the run's wall-clock budget in seconds (below, at BUDGET).
# PK_JAX_SUITE_STEPS="4 37 ..." (or 4,37,...): run only these steps, numbered in this run's
# order as every "=== [n]" line shows (`PYTHON=true PK_JAX_SUITE_BUDGET_S=1 tests/gpu/run_all.sh`
# lists the default sections' numbers without running anything); the others are left out
# unreported. tests/gpu/lanes.sh runs several such runs side by side in one device call.
# PK_JAX_TEST_SHARD=i/n: every pytest step runs only the i-th of n shares of its tests
# (tests/conftest.py), so that a step longer than a device call runs as n lanes or calls.
# Prints one PASSED/FAILED line per step and a summary; exits non-zero if any step failed.
# Each pytest step is its own process: a kernel that times out traps, and a trapped CUDA
# context is unusable for the rest of that process.
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PK_JAX_REQUIRE_GPU=${PK_JAX_REQUIRE_GPU:-1}
PY=${PYTHON:-python3}
LIMIT=${PK_JAX_STEP_TIMEOUT:-300}
SIZES=${PK_JAX_MP_SIZES:-2 4 8}  # process counts for the multi-process steps
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

# Launches N processes: one per GPU where the host has enough, else all sharing GPU 0.
launch() {
  local n=$1; shift
  local share=(--share-gpu)
  [ "${GPUS:-0}" -ge "$n" ] && share=()
  # a budget (below) lowers the launcher's own bound: it stops every process it started
  if [ "$1" = --timeout ] && [ -n "$BUDGET" ]; then
    local t=$2; shift 2
    set -- --timeout "$(( t < $(left) ? t : $(left) ))" "$@"
  fi
  "$PY" -m pk_jax.launch -n "$n" "${share[@]}" "$@"
}
# The launch bound of the ring and Ulysses runs through JAX: four processes time-slicing the GPU
# need most of 250 s alone, more beside other work (bench/results/gpu_suite_notes.md).
sp_bound() { echo $(( $1 > 2 ? 400 : 250 )); }

failed=()
skipped=()
passed=0
nstep=0
only=${PK_JAX_SUITE_STEPS:-}
only=" ${only//,/ } "  # numbers apart by spaces or commas

# PK_JAX_SUITE_BUDGET_S: no step runs past this many seconds after the script starts, so that a
# run fits a device call and leaves nothing running behind it. A step is bounded by what is
# left; one that cannot get 30 s is SKIPPED, and skipped steps fail the run like failed ones.
BUDGET=${PK_JAX_SUITE_BUDGET_S:-}
left() { echo $(( BUDGET - SECONDS )); }

# Each PASSED/FAILED line gives the step's wall seconds, to plan runs within a device call.
step() {
  nstep=$((nstep + 1))
  [ -n "${PK_JAX_SUITE_STEPS:-}" ] && [[ "$only" != *" $nstep "* ]] && return
  echo "=== [$nstep] $*"
  local limit=$LIMIT t0=$SECONDS
  if [ -n "$BUDGET" ]; then
    [ "$(left)" -lt 30 ] && { skipped+=("$*"); echo "SKIPPED (budget): $*"; return; }
    [ "$limit" -gt "$(left)" ] && limit=$(left)
  fi
  # timeout runs the step in a process group of its own and signals all of it when time is up
  local run=(timeout -k 10 "$limit")
  declare -F "$1" > /dev/null && run=()  # a shell function (launch) bounds itself (--timeout)
  # in the background, so that a signal to this script is handled at once (stop_step)
  "${run[@]}" "$@" &
  STEP_PID=$!
  if wait "$STEP_PID"; then passed=$((passed + 1)); echo "PASSED ($((SECONDS - t0)) s): $*"
  else failed+=("$*"); echo "FAILED ($((SECONDS - t0)) s): $*"; fi
  STEP_PID=
}

# timeout puts its step in a process group of its own, which a signal to this script's group
# does not reach: stopping the script (Ctrl-C, kill, a driver's deadline) stops the running
# step too (timeout passes the signal on to its group; a launch's subshell, to the launcher).
STEP_PID=
stop_step() {
  if [ -n "$STEP_PID" ]; then
    pkill -TERM -P "$STEP_PID" 2>/dev/null
    kill -TERM "$STEP_PID" 2>/dev/null
    wait "$STEP_PID" 2>/dev/null
  fi
  echo "=== stopped by a signal; summary so far: $passed passed, ${#failed[@]} failed"
  exit 130
}
trap stop_step INT TERM

# Every cross-rank op of tests/gpu/emu_short.py (emu_cases builds each).
EMU_ALL_OPS=all_reduce,all_gather,reduce_scatter,all_to_all,gemm_rs,ag_gemm,gemm_ar,\
moe_dispatch,moe_scatter,moe_combine,moe_gather,ring_attn,ring_attn_bwd,ulysses_attn,\
moe_dispatch_gemm,moe_gemm_combine

# What compute-sanitizer prints for a device-side error (host-side cuGetProcAddress probes,
# reported as CUDA_ERROR_INVALID_VALUE, are not among them), and the command of one step that
# runs tests/gpu/emu_short.py OPS WORLDS under `--tool TOOL` into LOG: it fails on any of them or
# on a wrong result. Usage: step bash -c "$(emu_sanitized TOOL OPS WORLDS LOG)".
SANITIZER_ERRORS='Invalid (__global__|__shared__|__local__)|Out of bounds|Misaligned|Barrier error|Race reported|Error: process didn'
# CUDA_DEVICE_MAX_CONNECTIONS=32: under the sanitizer, with the default 8 hardware work queues,
# ranks 4-7 of P = 8 never started (most likely queued behind ranks 0-3's kernels, which wait
# for them); with 32 every op passes at P = 8.
emu_sanitized() {
  local tool=$1 ops=$2 worlds=$3 log=$4
  echo "CUDA_DEVICE_MAX_CONNECTIONS=32 compute-sanitizer --tool $tool --print-limit 50 \
    $PY tests/gpu/emu_short.py $ops $worlds > $log 2>&1; tail -5 $log;
    ! grep -E '$SANITIZER_ERRORS' $log && grep -q 'emu_short: OK' $log"
}

# The package imports with its extension, outside the source tree, on a Hopper GPU.
section_install() {
  step bash -c "cd / && $PY -c 'import jax, pk_jax; assert pk_jax.HAS_CUDA, pk_jax._ffi.IMPORT_ERROR;
print(pk_jax.__file__, jax.devices()[0].device_kind)'"
}

# The kernels' SASS: bulk/TMA copies where data moves, no local memory (spills).
section_sass() {
  step "$PY" tests/gpu/sass_report.py
}

# P = 1 kernels in one process: the FFI wiring, the runtime's VMM paths, the GEMM engine.
section_unit() {
  step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" tests/test_ping.py \
    tests/test_runtime.py tests/test_api.py
  step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" tests/test_matmul.py \
    tests/test_fp8.py
}

# Symmetric memory across 2, 4 and 8 processes sharing the GPU (FD exchange, peer mappings).
section_runtime() {
  for n in $SIZES; do
    step launch "$n" --timeout 200 tests/gpu/test_runtime_mp.py
  done
}

# Collectives (issue 3): P = 1 in one process; then (collectives_mp) P = 2, 4, 8 processes
# sharing the GPU, and a rank that dies (the others must fail with the timeout error, not hang).
section_collectives() {
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_all_reduce.py \
    tests/test_all_gather.py tests/test_reduce_scatter.py tests/test_all_to_all.py
}

section_collectives_mp() {
  for n in $SIZES; do
    step launch "$n" --timeout 250 \
      tests/gpu/test_collectives_mp.py main
  done
  for n in ${SIZES%% *}; do
    PK_JAX_TIMEOUT_S=5 step launch "$n" --timeout 120 \
      tests/gpu/test_collectives_mp.py dead
  done
}

# Fused tensor-parallel GEMMs (issue 5): P = 1 in one process per op, and the fp8 forms
# (gemm_rs_fp8, gemm_ar_fp8: issue 40 section 2; all_gather_gemm's fp8 form) at P = 1; then
# (tp_mp) P = 2, 4, 8 processes sharing the GPU (tests/gpu/tp_mp.py: exact integer cases,
# stragglers, repeats; tests/gpu/tp_fp8_mp.py: the public ops with fp8 operands, exact).
section_tp() {
  for op in gemm_rs ag_gemm gemm_ar gemm_rs_fp8; do
    PK_JAX_TIMEOUT_S=20 step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" \
      "tests/test_$op.py"
  done
}

section_tp_mp() {
  for n in $SIZES; do
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 \
      tests/gpu/tp_mp.py
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/tp_fp8_mp.py
  done
}

# The grouped GEMM of MoE experts (issue 12, item 1): forward, dx and dw kernels at P = 1; the
# fp8 forward (issue 40 section 2).
section_grouped() {
  # Both schedules of the tiled kernel are tested here: more than the default step limit.
  LIMIT=600 step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" \
    tests/test_grouped_matmul.py
  step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" \
    tests/test_grouped_matmul_fp8.py
}

# Single-device flash attention (pk.attention): forward and gradients against float32.
section_attention() {
  # about 10 s per case (float32 references at S up to 2K, XLA's compiles): 22 cases
  LIMIT=600 step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and not large" tests/test_attention.py
  # ring and Ulysses attention over a 1-device axis: the pk.attention kernels (12 cases)
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_ring_attn.py tests/test_ulysses_attn.py
  # the masked kernels (issue 38 section 2) through attention._kernel_attention_masked: every
  # mask alone and combined at 4 shapes (44 cases), fp16 and MQA, and the skipped tiles' time
  LIMIT=900 step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_attention_masks.py
}

# The tensor-parallel MLP examples on the CUDA path, their losses against the reference's.
section_examples() {
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_examples
  mkdir -p "$log"
  for ex in "01_tp_mlp_flax.py" "02_tp_mlp_equinox.py --sequence-parallel"; do
    for backend in cuda reference; do
      PK_JAX_BACKEND=$backend step bash -c \
        "set -o pipefail; $PY examples/$ex --steps 10 | tee $log/${ex%%.py*}-$backend.log"
    done
    step "$PY" tests/gpu/compare_losses.py "$log/${ex%%.py*}-cuda.log" \
      "$log/${ex%%.py*}-reference.log"
  done
}

# Issue 13 on the GPU: the README's and docs' GPU-only blocks as written, several meshes and
# shutdown / init again at P = 1, and examples/03_transformer.py (kernels against the reference
# backend).
section_users() {
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_examples
  mkdir -p "$log"
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_packaging.py tests/test_state.py
  # auto: the kernels where they exist (the header names them); attention has none yet
  for backend in auto reference; do
    PK_JAX_BACKEND=$backend step bash -c "set -o pipefail;
      $PY examples/03_transformer.py --steps 12 --losses --experts 4 | tee $log/03-$backend.log"
  done
  step "$PY" tests/gpu/compare_losses.py --rtol 0.05 "$log/03-auto.log" "$log/03-reference.log"
}

# The rank emulator (issue 10): every cross-rank kernel with P ranks on disjoint SM partitions
# of this GPU, truly concurrent (tests/gpu/test_emulator.py; the fp8 TP GEMMs at P = 2, 4, 8 in
# tests/gpu/test_emulator_fp8.py); PK_JAX_EMU_CALLS sets the number of back-to-back calls per
# (op, P) (default 1000; a tenth of it for the fp8 GEMMs).
section_emulator() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator.py
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_fp8.py
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_link.py
}

# Per-executable communicator state (issue 10 item 4, ffi/comm_state.h): jitted functions
# across pk.shutdown / pk.init with other workspace sizes, an executable kept past the shutdown
# refused with the clear error, the instantiate stage under XLA's CPU client (~1 min).
section_state() {
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_reinit.py
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_state.py -k "shutdown or meshes"
  step "$PY" -m pytest -q -p no:cacheprovider tests/test_runtime.py -k "comm_table or instantiate"
}

# The scale model (issue 36): one call of every cross-rank op at P = 2, 4, 8 checked, the link
# throttle's tests (pacing, asynchrony, exactness of every op with the cap on), then every fused
# op against its serial form at the scale model (bench/bench_overlap.py, rows into
# bench/results/overlap.jsonl; PK_JAX_OVERLAP_ARGS, e.g. --quick). Not a default section:
# `tests/gpu/run_all.sh overlap`.
section_overlap() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" tests/gpu/emu_short.py "$EMU_ALL_OPS" 2,4,8
  step "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_emulator_link.py
  LIMIT=${PK_JAX_OVERLAP_LIMIT:-900} step "$PY" bench/bench_overlap.py ${PK_JAX_OVERLAP_ARGS:-}
}

# The emulator's link throttle (issue 10 item 7): pacing and exactness with the cap on
# (tests/gpu/test_emulator_link.py, ~1 min), then the quick emulated benchmark, unthrottled
# and at a real node's 1750 FLOP/B (~2.5 min; rows into bench/results/*.jsonl). Not a default
# section: `tests/gpu/run_all.sh link`.
section_link() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_emulator_link.py
  step "$PY" bench/bench_emulated.py --quick
}

# The emulator soak (issue 39, section 6; tests/gpu/soak.py): PK_JAX_SOAK_CALLS calls (default
# 100000) at P = 8 mixing every cross-rank op, each rank starting each call after a random
# delay, every result checked against its numpy reference, the World closed and made again
# every 5000 calls; stops with its summary at PK_JAX_SOAK_MINUTES (default 8). Not a default
# section: `tests/gpu/run_all.sh soak`.
section_soak() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  LIMIT=600 step "$PY" tests/gpu/soak.py --calls "${PK_JAX_SOAK_CALLS:-100000}" \
    --minutes "${PK_JAX_SOAK_MINUTES:-8}"
}

# The expert-parallel MoE kernels (issue 12): dispatch, its transpose, combine and its gather
# with P = 2, 3, 4, 8 emulated ranks (tests/gpu/test_emulator_moe.py; PK_JAX_EMU_MOE_CALLS sets
# the back-to-back calls per (op, P), default 400), then pk.moe_dispatch / pk.moe_combine through
# JAX with 2, 4 and 8 processes sharing the GPU (tests/gpu/moe_mp.py), then memcheck (P = 2, 4).
section_moe() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_moe.py
  for n in $SIZES; do  # through JAX: FFI handlers, lowering, VJPs (processes share the GPU)
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/moe_mp.py
  done
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_sanitize
  mkdir -p "$log"
  step bash -c "$(emu_sanitized memcheck moe_dispatch,moe_scatter,moe_combine,moe_gather 2,4 \
    "$log/moe_memcheck.log")"
}

# pk.moe_dispatch / pk.moe_combine through JAX alone, with PK_JAX_MOE_MP_SIZES processes sharing
# the GPU (default 4; section moe runs it at $SIZES after the emulator tests). About 1-2 minutes.
section_moe_mp() {
  for n in ${PK_JAX_MOE_MP_SIZES:-4}; do
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/moe_mp.py
  done
}

# The fused ring attention forward and backward (issue 11): P = 2, 4, 8 emulated ranks against
# the float32 reference (tests/gpu/test_emulator_attention.py, the backward's tests named
# test_backward_*; PK_JAX_EMU_RING_CALLS sets the back-to-back forward calls per P, default
# 100), pk.ring_attention's forward and gradients through JAX with 2 and 4 processes
# sharing the GPU (tests/gpu/ring_mp.py), the masked forward in the emulator
# (tests/gpu/test_emulator_ring_masks.py) and through JAX (tests/gpu/sp_masked_mp.py ring and
# ring-zigzag), then the emulated benchmark (fused vs unfused: all_gather of K/V, then
# pk.attention per block).
section_ring() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_attention.py
  # the masked forward (issue 38 section 3): P = 2, 4, 8 emulated, every mask, both layouts
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_ring_masks.py
  for n in 2 4; do  # through JAX: FFI handler, lowering (processes share the GPU)
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout "$(sp_bound "$n")" tests/gpu/ring_mp.py
    # the masked entry ring_attn._kernel_ring_masked through JAX, both layouts
    for layout in ring ring-zigzag; do
      PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/sp_masked_mp.py "$layout"
    done
  done
  # pk.ring_attention with masks as users call it (routed to the masked kernel)
  PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/sp_masked_mp.py ring-zigzag public
  step "$PY" bench/bench_ring_attn.py --quick
}

# The fused MoE kernels (PK_JAX_MOE_FUSED "auto", the default, fuses the combine only; "1"
# both): dispatch + first expert GEMM (cuda/kernels/moe_dispatch_gemm.cuh) and second expert
# GEMM + combine (cuda/kernels/moe_gemm_combine.cuh) in the rank emulator at P = 2, 4, 8
# (tests/gpu/test_emulator_moe_fused.py; PK_JAX_EMU_MOE_CALLS / 4 back-to-back calls per P and
# op, 25 by default here), through JAX with PK_JAX_MOE_FUSED_SIZES processes sharing the GPU
# (default 2; against the compositions), compute-sanitizer memcheck and synccheck over one fused
# dispatch + GEMM call at P = 2, 4 and 8, then bench_moe.py --quick (fused vs serial vs the
# reference's traffic + GEMM, emulated P = 8, DeepSeek-V3-like and Mixtral-like; rows into
# bench/results/moe.jsonl). About 4 minutes.
section_moe_fused() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  PK_JAX_EMU_MOE_CALLS=${PK_JAX_EMU_MOE_CALLS:-100} step "$PY" -m pytest -q -p no:cacheprovider \
    -m gpu tests/gpu/test_emulator_moe_fused.py
  for n in ${PK_JAX_MOE_FUSED_SIZES:-2}; do  # through JAX, fused_kernels(True/False) inside
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/moe_fused_mp.py
  done
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_sanitize
  mkdir -p "$log"
  for tool in memcheck synccheck; do
    step bash -c "$(emu_sanitized $tool moe_dispatch_gemm 2,4,8 "$log/moe_fused_$tool.log")"
  done
  step "$PY" bench/bench_moe.py --quick
}

# The fused Ulysses attention forward and the kernel-backed backward (issue 11): P = 2, 4, 8
# emulated ranks against the float32 reference (tests/gpu/test_emulator_ulysses.py, the
# backward's tests named test_backward_*; PK_JAX_EMU_ULYSSES_CALLS sets the back-to-back calls
# per P, default 100), pk.ulysses_attention's forward and gradients through JAX with 2 and 4
# processes sharing the GPU (tests/gpu/ulysses_mp.py: the default composed kernels; then with 2
# processes and PK_JAX_ULYSSES_FUSED=1, the fused forward, and PK_JAX_ULYSSES_FUSED=bwd, the
# fused backward), the composed path with masks (tests/gpu/sp_masked_mp.py ulysses, 2 and 4
# processes), then the emulated benchmark (forward fused vs unfused: all_to_all of q, k, v,
# pk.attention, all_to_all back; backward composed vs the fused ring backward).
section_ulysses() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_ulysses.py
  for n in 2 4; do  # through JAX: FFI handler, lowering (processes share the GPU)
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout "$(sp_bound "$n")" tests/gpu/ulysses_mp.py
  done
  # the fused forward, forced: its forward cases and one gradient case
  PK_JAX_ULYSSES_FUSED=1 PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/ulysses_mp.py
  # the fused backward, forced: the forward cases and every gradient case (P = 4: sp_bound;
  # measured: bench/results/ulysses_attention_notes.md, "Measurements moved from code comments
  # (issue 37)")
  for n in 2 4; do
    PK_JAX_ULYSSES_FUSED=bwd PK_JAX_TIMEOUT_S=60 step launch "$n" --timeout "$(sp_bound "$n")" \
      tests/gpu/ulysses_mp.py
  done
  # the composed path with masks (private entry ulysses_attn._composed_masked, issue 38
  # section 3): the masked pk.attention kernels on the head groups, every mask, twice
  for n in 2 4; do
    PK_JAX_TIMEOUT_S=30 step launch "$n" --timeout 250 tests/gpu/sp_masked_mp.py ulysses
  done
  # pk.ulysses_attention with masks as users call it (routed to the masked composed kernels)
  PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/sp_masked_mp.py ulysses public
  step "$PY" bench/bench_ulysses_attn.py --quick
}

# The kernel-backed Ulysses backward alone (issue 11; a subset of section ulysses, ~3.5 min):
# the emulator's backward tests at P = 2, 4, 8 (pk all_to_all to head shards, the pk.attention
# backward, all_to_all back, against the float32 reference gradients), pk.ulysses_attention's
# forward and gradients through JAX with 2 processes sharing the GPU (default path, then
# PK_JAX_ULYSSES_FUSED=1, then PK_JAX_ULYSSES_FUSED=bwd: the fused backward), then the emulated
# benchmark (forward fused vs unfused; backward composed vs the fused ring backward).
section_ulysses_bwd() {
  export CUDA_MODULE_LOADING=EAGER  # pk_jax.testing.require_eager_loading says why
  step "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_ulysses.py -k backward
  PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/ulysses_mp.py
  PK_JAX_ULYSSES_FUSED=1 PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/ulysses_mp.py
  PK_JAX_ULYSSES_FUSED=bwd PK_JAX_TIMEOUT_S=30 step launch 2 --timeout 250 tests/gpu/ulysses_mp.py
  step "$PY" bench/bench_ulysses_attn.py --quick
  step "$PY" bench/plot_sp_attention.py  # bench/results/sp_attention.png (ring and Ulysses rows)
}

# compute-sanitizer over a short emulated run of every op (P = 2, 4, 8): device-side errors only
# (host-side cuGetProcAddress probes are reported as CUDA_ERROR_INVALID_VALUE: ignored).
# Every cross-rank op but the fused MoE kernels (one call each at P = 2, 4 and 8; P = 8 needs
# the hardware work queues that emu_sanitized sets).
SANITIZE_OPS=all_reduce,all_gather,reduce_scatter,all_to_all,gemm_rs,ag_gemm,gemm_ar,moe_dispatch,moe_combine,ring_attn,ring_attn:groups,ring_attn_bwd,ulysses_attn,ulysses_attn_bwd
section_sanitize() {
  export CUDA_MODULE_LOADING=EAGER  # the emulated attention step (pk_jax.testing needs it)
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_sanitize
  mkdir -p "$log"
  for tool in memcheck synccheck; do
    step bash -c "$(emu_sanitized $tool $SANITIZE_OPS 2,4,8 "$log/$tool.log")"
  done
  section_sanitize_scale
  section_racecheck
  # The one-pass attention backward (in the emulated composed Ulysses backward) under memcheck
  # (the fused backward is among SANITIZE_OPS above).
  PK_JAX_EMU_ULYSSES_CALLS=1 step bash -c "compute-sanitizer --tool memcheck --print-limit 50 \
    $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_emulator_ulysses.py \
    -k 'backward and 2 and not fused' > $log/attention.log 2>&1; rc=\$?;
    tail -5 $log/attention.log;
    n=\$(grep -c 'on CUDA API call to' $log/attention.log);
    g=\$(grep -c 'on CUDA API call to cuGetProcAddress' $log/attention.log);
    echo \"host API errors: \$n, of them cuGetProcAddress: \$g\";
    ! grep -E 'Invalid (__global__|__shared__|__local__)|Out of bounds|Misaligned' \
    $log/attention.log && [ \$rc = 0 ]"
}

# memcheck and synccheck over the ops whose stores the scale model paces (issue 36: the
# asynchronous link of cuda/include/pk/link.cuh, its drains and per-stage deadlines), one call
# each at P = 2, 4 and 8 in World(P, scale_model=True). Part of section sanitize.
SCALE_SANITIZE_OPS=gemm_rs,gemm_ar,ag_gemm,ring_attn,ring_attn:groups,ring_attn_bwd,ulysses_attn,ulysses_attn_bwd,moe_dispatch_gemm,moe_gemm_combine
section_sanitize_scale() {
  export CUDA_MODULE_LOADING=EAGER
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_sanitize
  mkdir -p "$log"
  for tool in memcheck synccheck; do
    PK_JAX_EMU_SCALE_MODEL=1 step bash -c "$(emu_sanitized $tool $SCALE_SANITIZE_OPS \
      ${PK_JAX_SCALE_SANITIZE_SIZES:-2,4,8} "$log/scale_$tool.log")"
  done
}

# racecheck (shared-memory hazards) over the fused backwards, whose steps share dS^T and stage
# dQ in shared memory: the ring's at P = 2 and 4, the fused Ulysses backward's test at P = 2.
# Part of section sanitize; a section of its own for a short run.
section_racecheck() {
  export CUDA_MODULE_LOADING=EAGER
  local log=${PK_JAX_LOG_DIR:-/tmp}/pk_jax_sanitize
  mkdir -p "$log"
  step bash -c "$(emu_sanitized racecheck ring_attn_bwd 2,4 "$log/racecheck.log")"
  step bash -c "compute-sanitizer --tool racecheck --print-limit 50 $PY -m pytest -q \
    -p no:cacheprovider -m gpu tests/gpu/test_emulator_ulysses.py \
    -k 'test_fused_backward_against_the_float32_reference and 2-' > $log/racecheck_uly.log 2>&1;
    rc=\$?; tail -3 $log/racecheck_uly.log; ! grep -E '$SANITIZER_ERRORS' $log/racecheck_uly.log &&
    grep -q '0 hazards displayed' $log/racecheck_uly.log && [ \$rc = 0 ]"
}

# Each hazard test of issue 10 fails on the extension built with its fix reverted
# (tests/gpu/hazards/*.patch, built by tests/gpu/hazards/build.sh into build/hazards/, carried
# here), then passes on the tree's own extension. Not in the default sections.
section_hazards() {
  local so=pk_jax/_pk_ffi.abi3.so keep=build/hazards/tree.so
  ls build/hazards/*.so.gz > /dev/null || { failed+=("hazards: no build/hazards/*.so.gz"); return; }
  cp "$so" "$keep"
  for patch in tests/gpu/hazards/*.patch; do
    local name test
    name=$(basename "$patch" .patch)
    test=$(sed -n 's/^Test that must fail with this patch applied: //p' "$patch")
    gunzip -c "build/hazards/$name.so.gz" > "$so"
    # pytest's status 1: the test ran and failed (not an import or collection error)
    step bash -c "$PY -m pytest -q -p no:cacheprovider -m gpu '$test'; [ \$? = 1 ]"
    cp "$keep" "$so"
    step "$PY" -m pytest -q -p no:cacheprovider -m gpu "$test"
  done
}

# The large parametrisations (pytest's `large` marker, which pyproject's addopts deselects):
# section large runs the GPU ones (square matmuls up to 16K and transformer shapes, the TP
# GEMMs at P = 1 on random and exact inputs, 8 processes sharing the GPU); section large_cpu the
# CPU references' (about 900 cases: every world size, dtype and mesh type of the collectives,
# the TP GEMMs, ring and Ulysses attention on 8 host devices; not a default section, and it
# needs no GPU: any machine runs it).
section_large() {
  # one step per file (180 cases in all), each limited to a device call's 10 minutes
  for f in matmul gemm_rs ag_gemm gemm_ar; do
    LIMIT=600 PK_JAX_TIMEOUT_S=20 step "$PY" -m pytest -q -p no:cacheprovider \
      -m "gpu and large" "tests/test_$f.py"
  done
  LIMIT=600 step "$PY" -m pytest -q -p no:cacheprovider -m "gpu and large" \
    tests/gpu/test_runtime_mp.py
}

section_large_cpu() {
  LIMIT=3600 step "$PY" -m pytest -q -p no:cacheprovider -m "large and not gpu" tests
}

# Benchmarks (correctness first, XLA baseline in the same run); JSON lines in bench/results/.
section_bench() {
  step "$PY" bench/bench_ping.py
  step "$PY" bench/bench_matmul.py
  step "$PY" bench/bench_fp8.py
  step "$PY" bench/bench_gemm_rs_fp8.py
  step "$PY" bench/bench_tp.py --quick
  step "$PY" bench/bench_emulated.py
  step "$PY" bench/bench_grouped_matmul.py --vjp
  step "$PY" bench/bench_grouped_matmul.py --specs
  # The two schedules side by side at the judging cases of pingpong_width (bench/check_pingpong.py)
  step "$PY" bench/bench_grouped_matmul.py --schedules --quick \
    --cases bench/results/grouped_schedule_cases_2.json --tag schedule-judge-2
  step "$PY" bench/bench_grouped_matmul_fp8.py
  step "$PY" bench/bench_attention.py
  step "$PY" bench/bench_attention_masks.py
  CUDA_MODULE_LOADING=EAGER step "$PY" bench/bench_moe.py
}

# Which build and GPU ran: passes on one build may be combined across runs only by this md5.
echo "=== extension md5 $(md5sum pk_jax/_pk_ffi.abi3.so 2>/dev/null | cut -c1-32) on \
$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(install sass unit runtime collectives collectives_mp tp tp_mp \
  grouped attention emulator moe ring ulysses sanitize examples users state large)
for s in "${sections[@]}"; do "section_$s"; done
echo "=== summary: $passed passed, ${#failed[@]} failed, ${#skipped[@]} skipped (budget)"
for f in "${failed[@]}"; do echo "failed: $f"; done
for f in "${skipped[@]}"; do echo "skipped: $f"; done
[ ${#failed[@]} -eq 0 ] && [ ${#skipped[@]} -eq 0 ]

#!/usr/bin/env bash
# Several tests/gpu/run_all.sh runs side by side in one device call, each within one budget:
#   tests/gpu/lanes.sh BUDGET_S "NAME:VAR=value VAR=value" ...
# e.g. tests/gpu/lanes.sh 555 "u1:PK_JAX_SUITE_STEPS=46 PK_JAX_TEST_SHARD=1/3" \
#        "u2:PK_JAX_SUITE_STEPS=46 PK_JAX_TEST_SHARD=2/3" "m:PK_JAX_SUITE_STEPS=27"
# Each lane is one run_all.sh with its settings, PK_JAX_SUITE_BUDGET_S and PK_JAX_STEP_TIMEOUT
# set to BUDGET_S (so no step outlives the call), its output in $LANES_DIR/NAME.log ($OUT where
# the device machine sets it, else a new temporary folder). Processes on one GPU time-slice it:
# lanes overlap their CPU work (compiles, references) and share the GPU's time, so a step takes
# longer in a lane than alone (bench/results/gpu_suite_notes.md). Prints each lane's step lines
# and summary; exits non-zero if any lane failed.
set -u
cd "$(dirname "$0")/../.."
usage() {
  echo "lanes.sh: $1; usage: tests/gpu/lanes.sh BUDGET_S 'NAME:VAR=value ...' ..." >&2
  exit 2
}
[ $# -ge 2 ] && [[ "$1" =~ ^[0-9]+$ ]] || usage "a budget in seconds and one lane or more"
budget=$1; shift
dir=${LANES_DIR:-${OUT:-$(mktemp -d)}}
mkdir -p "$dir"
# every lane checked before any starts, so that a bad one leaves nothing running
for spec in "$@"; do
  name=${spec%%:*} settings=${spec#*:}
  [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] && [ "$name" != "$spec" ] || usage "lane '$spec'"
  for s in $settings; do
    [[ "$s" =~ ^[A-Z_][A-Z0-9_]*=.*$ ]] || usage "lane $name: '$s' is not VAR=value"
  done
done
names=() pids=()
# a signal stops every lane started (run_all.sh stops the step it runs)
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM
for spec in "$@"; do
  name=${spec%%:*} settings=${spec#*:}
  # shellcheck disable=SC2086  # the settings are words VAR=value, checked above
  env $settings PK_JAX_SUITE_BUDGET_S="$budget" PK_JAX_STEP_TIMEOUT="$budget" \
    bash tests/gpu/run_all.sh > "$dir/$name.log" 2>&1 &
  names+=("$name") pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || rc=1
done
for name in "${names[@]}"; do
  echo "##### lane $name ($dir/$name.log)"
  grep -E "^(=== extension|PASSED|FAILED|SKIPPED|=== summary|failed:|skipped:)" "$dir/$name.log"
done
exit $rc

#!/usr/bin/env bash
# Builds the extension once per hazard patch (tests/gpu/hazards/*.patch: each reverts one fix of
# issue 10's hazards) into build/hazards/<patch>.so.gz, for `tests/gpu/run_all.sh hazards` on the
# GPU machine (carry build/hazards there). Needs nvcc and the dev environment (make install);
# the first build takes about as long as the extension's, later ones recompile what a patch
# touches. Each patch is applied to the working tree and reverted right after its build (also
# on failure or Ctrl-C); cuda/ and ffi/ must have no uncommitted changes.
set -eu
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-$PWD/.venv/bin/python}
export PATH="$PWD/.venv/bin:$PATH"  # cmake and ninja from the dev environment
BUILD=build/hazards/cmake
OUT=build/hazards
if ! git diff --quiet -- cuda ffi; then
  echo "hazards/build.sh: cuda/ or ffi/ has uncommitted changes; commit or stash them first" >&2
  exit 1
fi
mkdir -p "$OUT/module"
[ -f "$BUILD/build.ninja" ] || cmake -S . -B "$BUILD" -G Ninja -DPython_EXECUTABLE="$PY" \
  -DPK_JAX_MODULE_DIR="$PWD/$OUT/module" > "$OUT/configure.log"
applied=""
trap '[ -n "$applied" ] && git apply -R "$applied"' EXIT
for patch in tests/gpu/hazards/*.patch; do
  name=$(basename "$patch" .patch)
  git apply "$patch"
  applied=$patch
  echo "hazards/build.sh: $name"
  cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" > "$OUT/$name.log" 2>&1 \
    || { echo "hazards/build.sh: $name failed to build, see $OUT/$name.log" >&2; exit 1; }
  gzip -c "$OUT/module/_pk_ffi.abi3.so" > "$OUT/$name.so.gz"
  git apply -R "$patch"
  applied=""
done
echo "hazards/build.sh: $(ls "$OUT"/*.so.gz | wc -l) variants in $OUT"

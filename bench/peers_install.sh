#!/usr/bin/env bash
# Installs the attention peers that bench/bench_attention.py compares pk.attention with
# (FlashAttention-3 from the flash-attn3-jax wheel, tokamax's Mosaic GPU attention) from the
# wheels carried in .peers/wheels/, on a machine without network (the H200 machine).
#
#   bash bench/peers_install.sh [DIR]      (from the repository root; DIR defaults to /tmp/peers)
#
# Fetch the wheels on a machine with network first (see bench/bench_attention.py's docstring:
# `pip download --no-deps` of flash-attn3-jax, tokamax and their small dependencies into
# .peers/wheels/, which git ignores), and carry `.peers` with the tree.
#
# Every wheel goes in with `pip install --no-deps --no-index --target DIR`, except those whose
# distribution this python already has at a version that the carried wheels' requirements
# accept: those stay the machine's, so that nothing it already runs (jax, flax, protobuf ...)
# is shadowed without need. xprof (tokamax's profiler, 32 MB) is not carried:
# bench/peers_stub/xprof stands in for it, put on sys.path by the benchmark itself.
# The last line printed is the PYTHONPATH to use, e.g.
#   PYTHONPATH=$PWD:/tmp/peers python3 bench/bench_attention.py
set -euo pipefail
DIR=${1:-/tmp/peers}
PY=${PYTHON:-python3}
WHEELS=${PEERS_WHEELS:-.peers/wheels}
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "peers_install: no wheels in $WHEELS (run from the repository root, with .peers carried)" >&2
  exit 1
fi
mkdir -p "$DIR"
mapfile -t PICK < <("$PY" - "$WHEELS" <<'PYEOF'
"""Prints the wheels to install: the roots (flash-attn3-jax, tokamax) and, to a fixed point,
every carried dependency the machine lacks or has at a version a selected wheel refuses."""
import importlib.metadata as md
import pathlib
import re
import sys
import zipfile

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:
    try:
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    except ImportError:
        Requirement = Version = None

ROOTS = {"flash-attn3-jax", "tokamax"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
wheels = {}
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = w.name.split("-")[:2]
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    wheels[norm(name)] = (w, version, reqs)


def have(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if Requirement is None:  # no way to compare versions: install everything carried
    print("peers_install: no 'packaging' module; installing every carried wheel",
          file=sys.stderr)
    for w, _, _ in wheels.values():
        print(w)
    sys.exit(0)

chosen = {n for n in wheels if n in ROOTS or have(n) is None}
while True:
    specs, by = {}, {}
    for n in chosen:
        for r in wheels[n][2]:
            req = Requirement(r)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            specs.setdefault(norm(req.name), []).append(req.specifier)
            by.setdefault(norm(req.name), set()).add(n)
    more = set()
    for n, sp in specs.items():
        if n in chosen:
            continue
        v = have(n)
        ok = v is not None and all(s.contains(Version(v), prereleases=True) for s in sp)
        if ok:
            continue
        if n in wheels:
            more.add(n)
        elif n != "xprof":
            print(f"peers_install: note: {', '.join(sorted(by[n]))} require(s) {n}"
                  f"{','.join(str(s) for s in sp if str(s))}, neither carried nor installed "
                  f"here ({v or 'missing'}); fine unless an import fails", file=sys.stderr)
    if not more:
        break
    chosen |= more
for n in sorted(wheels):
    w, version, _ = wheels[n]
    if n in chosen:
        print(w)
    else:
        print(f"peers_install: keeping the machine's {n} {have(n)} (carried {version})",
              file=sys.stderr)
PYEOF
)
echo "peers_install: installing ${#PICK[@]} wheels into $DIR" >&2
if "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --no-deps --no-index --no-compile --disable-pip-version-check \
    --upgrade --target "$DIR" "${PICK[@]}" >&2
else  # no pip: these wheels hold no .data folders, so unpacking them is installing them
  echo "peers_install: no pip for $PY; unpacking the wheels" >&2
  "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
    "$DIR" "${PICK[@]}"
fi
echo "PYTHONPATH=$PWD:$DIR"

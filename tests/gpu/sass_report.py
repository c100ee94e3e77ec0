"""What the compiled kernels do in SASS: per kernel, the data-movement instructions that matter.

    python tests/gpu/sass_report.py [MODULE]      # default: pk_jax's extension

Runs `cuobjdump -sass` on the module and prints, for every kernel, the counts of bulk/TMA copies
(UBLKCP, UTMALDG, UTMASTG, UTMAREDG), tensor-core MMAs (HGMMA; QGMMA: fp8), 16-byte global loads
and stores, and local-memory accesses (LDL/STL: spills or stack arrays). Fails when a kernel uses
local memory, or when a collective kernel of the 16-byte path (every engine kernel whose vector
is 16 bytes) has no bulk copy.
"""

import collections
import re
import subprocess
import sys

import pk_jax

OPS = ("UBLKCP", "UTMALDG", "UTMASTG", "UTMAREDG", "HGMMA", "QGMMA", "LDG.E.128", "STG.E.128",
       "LDL", "STL")


def kernels(module: str) -> dict[str, collections.Counter]:
    sass = subprocess.run(["cuobjdump", "-sass", module], check=True, capture_output=True,
                          text=True).stdout
    out = {}
    for block in re.split(r"\n\s+Function : ", sass)[1:]:
        name, body = block.split("\n", 1)
        ops = collections.Counter()
        for line in body.splitlines():
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
            if m:
                for op in OPS:
                    if m[1] == op or m[1].startswith(op + "."):
                        ops[op] += 1
        out[name.strip()] = ops
    return out


def bulk_collective(name: str) -> bool:
    """pk::coll::kernel<T, VEC, KIND> with VEC * sizeof(T) == 16 (mangled names)."""
    m = re.match(r"_ZN2pk4coll6kernelI(\w+?)Li(\d+)ELi\d+E", name)
    if not m:
        return False
    size = {"f": 4, "j": 4, "t": 2, "6__half": 2, "13__nv_bfloat16": 2}.get(m[1], 0)
    return size * int(m[2]) == 16


def main() -> int:
    module = sys.argv[1] if len(sys.argv) > 1 else pk_jax._ffi._pk_ffi.__file__
    problems = []
    print(f"{'kernel':<60} " + " ".join(f"{op:>9}" for op in OPS))
    for name, ops in sorted(kernels(module).items()):
        print(f"{name[:60]:<60} " + " ".join(f"{ops[op]:>9}" for op in OPS))
        if ops["LDL"] or ops["STL"]:
            problems.append(f"{name}: local memory (LDL {ops['LDL']}, STL {ops['STL']})")
        if bulk_collective(name) and not ops["UBLKCP"]:
            problems.append(f"{name}: a 16-byte collective kernel without bulk copies")
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

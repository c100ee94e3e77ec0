"""Checks that an example's losses on the CUDA path match the reference backend's.

    python tests/gpu/compare_losses.py CUDA_LOG REFERENCE_LOG [--rtol 0.03]

Each log is an example's stdout: a header naming the backends, then "step N  loss X" lines. The
CUDA log must name the cuda backend for every op, both logs must have the same steps, each loss
must be finite and within rtol of the reference's, and training must lower the loss.
"""

import argparse
import math
import re
import sys


def read(path: str) -> tuple[str, dict[int, float]]:
    with open(path) as f:
        text = f.read()
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"step\s+(\d+)\s+loss\s+(\S+)", text)}
    header = next((line for line in text.splitlines() if "backends:" in line), "")
    return header, losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cuda_log")
    ap.add_argument("reference_log")
    ap.add_argument("--rtol", type=float, default=0.03)
    args = ap.parse_args()
    header, cuda = read(args.cuda_log)
    _, ref = read(args.reference_log)
    backends = re.findall(r"(\w+)=(\w+)", header.split("backends:")[-1])
    problems = []
    if not backends or any(b != "cuda" for _, b in backends):
        problems.append(f"the CUDA run did not use the kernels: {header!r}")
    if not cuda or sorted(cuda) != sorted(ref):
        problems.append(f"steps differ: {sorted(cuda)} vs {sorted(ref)}")
    for step in sorted(set(cuda) & set(ref)):
        a, b = cuda[step], ref[step]
        ok = math.isfinite(a) and abs(a - b) <= args.rtol * abs(b)
        print(f"step {step:3d}  cuda {a:.5f}  reference {b:.5f}  {'ok' if ok else 'MISMATCH'}")
        if not ok:
            problems.append(f"step {step}: {a} vs {b}")
    if cuda and cuda[max(cuda)] >= cuda[min(cuda)]:
        problems.append("the loss did not go down")
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The fp8 GEMM kernel (pk_matmul_fp8, through its private entry matmul._fp8_kernel) against
XLA's fp8 dot (cuBLASLt) and against our bf16 pk.matmul, per-tensor and blockwise scaling.

For each shape and scaling: a correctness check first (the kernel against the dequantized
product in float32 on the device, within pk_jax.fp8.error_bound), then the median
time of >= 20 batches of back-to-back calls (rotating over 3 input sets), every variant of the
shape timed in turn (common.time_us_interleaved). One line per comparison ending in "x vs
<baseline>", geometric means against the issue's targets at the end (issue 40, section 4):

  per tensor  ours vs XLA's fp8 dot (lax.dot_general on float8 operands, float32 accumulation,
              scaled, rounded to bf16; w [K, N] as the caller has it)   target >= 1.0
              ours vs our bf16 pk.matmul on the same shape               target >= 1.6
  blockwise   ours blockwise vs ours per tensor                          target >= 0.9
              (and vs XLA's fp8 dot per tensor, and vs our bf16, for the record)

Our kernel is timed as pk.matmul would call it, transposing w to [N, K] in XLA on every call
(w_layout "kn"), and also with w given as [N, K] (w_layout "nk": the transpose's cost).

Rows go to bench/results/matmul_fp8.jsonl with "dtype" (float8_e4m3fn), "scaling" ("tensor" or
"block"), "baseline", "ratio" = baseline time / ours, "w_layout", "out_dtype".

Run on the GPU machine: python bench/bench_fp8.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import common
import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax import _backend, fp8
from pk_jax.ops import matmul as mm

SHAPES = [  # (M, N, K), bench_matmul.py's grid
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 16384, 16384),
    (8192, 28672, 8192),
    (16384, 8192, 3584),
]
E4M3 = jnp.float8_e4m3fn
DIMS = (((1,), (0,)), ((), ()))


def _inputs(m, n, k, scaling, sets=3):
    """`sets` tuples (x, w, x_scale, w_scale, x_bf16, w_bf16): the fp8 operands quantized by
    current scaling from normal data, and the bf16 data they came from."""
    out = []
    for i in range(sets):
        kx, kw = jax.random.split(jax.random.key(1000 * i + 7))
        xb = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        wb = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        xq, sx = fp8.quantize(xb, role="x", scaling=scaling)
        wq, sw = fp8.quantize(wb, role="w", scaling=scaling)
        out.append((xq, wq, sx, sw, xb, wb))
    return jax.block_until_ready(out)


def _check(ours, xq, wq, sx, sw, scaling) -> float:
    ref = mm.fp8_reference(xq, wq, sx, sw, jnp.float32)
    y = ours(xq, wq, sx, sw).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
    tol = fp8.error_bound(xq.shape[1], scaling)
    if not (math.isfinite(err) and err <= tol):
        raise SystemExit(f"matmul_fp8 is wrong at {xq.shape} @ {wq.shape} ({scaling}): relative "
                         f"max error {err:.4g} > {tol:.4g}")
    return err


def _iters(m, n, k) -> int:
    est_s = 2 * m * n * k / 1300e12  # aim at ~40 ms per timed batch
    return max(5, min(200, int(0.04 / est_s)))


def _shapes(text: str) -> list[tuple[int, int, int]]:
    """--shapes: "MxNxK,..." as (M, N, K) tuples; argparse reports anything else."""
    out = []
    for item in text.split(","):
        dims = item.split("x")
        if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise argparse.ArgumentTypeError(f"{item!r} is not MxNxK (positive integers)")
        out.append(tuple(int(d) for d in dims))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--shapes", type=_shapes, default=SHAPES,
                    help="comma-separated MxNxK to run instead of the grid, e.g. 4096x4096x4096")
    args = ap.parse_args()
    reps = 7 if args.quick else 21
    shapes = args.shapes

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    pk.init(mesh)
    if not _backend.use_kernel(mm.FP8_STEM) or pk.backend_name("matmul") != "cuda":
        raise SystemExit("no sm_90 GPU, or an extension without pk_matmul_fp8")

    ours_kn = jax.jit(lambda x, w, a, b: mm._fp8_kernel(x, w, a, b, jnp.bfloat16))
    ours_nk = jax.jit(lambda x, wt, a, b: mm._fp8_kernel(x, wt, a, b, jnp.bfloat16,
                                                         w_layout="nk"))
    xla_fp8 = jax.jit(lambda x, w, a, b: (jax.lax.dot_general(
        x, w, DIMS, preferred_element_type=jnp.float32) * (a * b)).astype(jnp.bfloat16))
    bf16 = jax.jit(pk.matmul)

    ratios: dict[str, list[float]] = {}

    def row(m, n, k, scaling, name, t_ours, baseline, t_base, **extra):
        flop = 2.0 * m * n * k
        r = common.record(op="matmul_fp8", shape={"m": m, "n": n, "k": k},
                          dtype="float8_e4m3fn", world=1, processes=1, median_us=t_ours,
                          tflops=flop / t_ours / 1e6, baseline=baseline,
                          baseline_median_us=t_base,
                          baseline_tflops=round(flop / t_base / 1e6, 2), scaling=scaling,
                          out_dtype="bfloat16", iters=iters, reps=reps, **extra)
        ratios.setdefault(name, []).append(r["ratio"])
        print(f"{f'{m} x {n} x {k}':>22} {scaling:>6} {flop / t_ours / 1e6:9.1f} TFLOP/s "
              f"{r['ratio']:.3f}x vs {baseline}", flush=True)

    times: dict[tuple, dict] = {}
    for m, n, k in shapes:
        iters = _iters(m, n, k)
        for scaling in ("tensor", "block"):
            sets = _inputs(m, n, k, scaling)
            xq, wq, sx, sw, _, _ = sets[0]
            err = _check(ours_kn, xq, wq, sx, sw, scaling)
            fns = {
                "ours": (ours_kn, [(s[0], s[1], s[2], s[3]) for s in sets]),
                "ours_nk": (ours_nk, [(s[0], s[1].T, s[2], s[3]) for s in sets]),
                "bf16": (bf16, [(s[4], s[5]) for s in sets]),
            }
            if scaling == "tensor":
                fns["xla_fp8"] = (xla_fp8, [(s[0], s[1], s[2], s[3]) for s in sets])
            # Transposed copies are made once, outside the timing.
            fns = {name: (fn, jax.block_until_ready(a)) for name, (fn, a) in fns.items()}
            # Interleaved: each rep times every variant in turn.
            measured = common.time_us_interleaved(
                {name: common.Rotating(fn, arg_sets) for name, (fn, arg_sets) in fns.items()},
                [()], iters=iters, reps=reps)
            t = {name: v[0] for name, v in measured.items()}
            times[(m, n, k, scaling)] = t
            extra = {"max_err": err, "w_layout": "kn"}
            if scaling == "tensor":
                row(m, n, k, scaling, "tensor_vs_xla", t["ours"], "XLA fp8 dot (cuBLASLt)",
                    t["xla_fp8"], **extra)
            row(m, n, k, scaling, f"{scaling}_vs_bf16", t["ours"], "pk.matmul bf16", t["bf16"],
                **extra)
            row(m, n, k, scaling, f"{scaling}_nk_vs_kn", t["ours_nk"],
                "pk matmul_fp8, w [K, N] (transposed in XLA)", t["ours"], max_err=err,
                w_layout="nk")
            if scaling == "block":
                per_tensor = times[(m, n, k, "tensor")]
                row(m, n, k, scaling, "block_vs_tensor", t["ours"],
                    "pk matmul_fp8 per tensor", per_tensor["ours"], **extra)
                row(m, n, k, scaling, "block_vs_xla", t["ours"],
                    "XLA fp8 dot (cuBLASLt), per tensor", per_tensor["xla_fp8"], **extra)
            del sets, fns

    targets = {"tensor_vs_xla": 1.0, "tensor_vs_bf16": 1.6, "block_vs_tensor": 0.9}
    for name, values in sorted(ratios.items()):
        goal = f" (target >= {targets[name]})" if name in targets else ""
        print(f"geometric mean {name}: {common.geomean(values):.3f}x{goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fused fp8 TP GEMMs forced at P = 1 (pk_gemm_rs_fp8 and pk_gemm_ar_fp8 through their
private entries gemm_rs._fp8_kernel / gemm_ar._fp8_kernel, over a 1-device axis: the kernels'
direct mode) against the fp8 GEMM alone (matmul._fp8_kernel) with the same scaling (per tensor,
then blockwise), w [K, N] transposed in XLA by both: what the fused protocol costs where there
is nothing to overlap.

For each shape and scaling: a correctness check first (each op against the float32 product of
the dequantized operands on the device, relative max error within pk_jax.fp8.error_bound),
then the median time of >= 20 batches of back-to-back calls (rotating over 3 input sets), the
variants interleaved (common.time_us_interleaved). One line per op and shape ending in "x vs
pk matmul_fp8", the geometric mean against the issue's target at the end (issue 40, section
4: >= 0.92).

Rows go to bench/results/gemm_rs_fp8.jsonl and gemm_ar_fp8.jsonl with "dtype"
(float8_e4m3fn), "scaling" ("tensor" or "block"), "baseline", "ratio" = baseline time / ours.

Run on the GPU machine: python bench/bench_gemm_rs_fp8.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import bench_fp8
import common
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax import _backend, fp8
from pk_jax.ops import gemm_ar, gemm_rs
from pk_jax.ops import matmul as mm

SHAPES = bench_fp8.SHAPES
OPS = {"gemm_rs_fp8": gemm_rs, "gemm_ar_fp8": gemm_ar}


def make_mesh():
    """One device, axis "tp" with Auto typing: the operands enter shard_map unsharded."""
    return jax.make_mesh((1,), ("tp",), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _over_axis(mesh, mod, fn):
    """fn(x, w, x_scale, w_scale, "tp") of op module `mod` over the 1-device axis "tp"; scalar
    scales pass as [1] arrays, blocks as they are (x's [M, KB], w's [KB, NB])."""
    def call(x, w, a, b):
        blocks = a.ndim == 2
        scale_specs = (P(None, "tp"), P("tp", None)) if blocks else (P("tp"), P("tp"))
        body = jax.shard_map(
            lambda x, w, a, b: fn(x, w, a if blocks else a.reshape(()),
                                  b if blocks else b.reshape(()), "tp"),
            mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), *scale_specs),
            out_specs=P("tp", None) if mod is gemm_rs else P(None, None))
        return body(x, w, a if blocks else a.reshape(1), b if blocks else b.reshape(1))
    return jax.jit(call)


def _fused(mesh, mod):
    return _over_axis(mesh, mod, mod._fp8_kernel)


def _check(name, ours, ref, scaling, xq, wq, sx, sw) -> float:
    """ours against the float32 product: at P = 1 both ops are the local product (their own
    references round it to bf16, and a second rounding would let a one-ulp flip, up to 2^-7
    of max |y|, past error_bound, as the first run of this check did)."""
    want = ref(xq, wq, sx, sw)
    y = ours(xq, wq, sx, sw).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want)))
    tol = fp8.error_bound(xq.shape[1], scaling)
    if not (math.isfinite(err) and err <= tol):
        raise SystemExit(f"{name} is wrong at {xq.shape} @ {wq.shape}: relative max error "
                         f"{err:.4g} > {tol:.4g}")
    return err


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = ap.parse_args()
    reps = 7 if args.quick else 21

    mesh = make_mesh()
    # The fused kernels accumulate [M, N] in bf16 in the workspace (P = 1: the whole output).
    pk.init(mesh, workspace_bytes=max(m * n for m, n, _ in SHAPES) * 2)
    if not all(_backend.use_kernel(s, "tp") for s in OPS) or not _backend.use_kernel(
            mm.FP8_STEM):
        raise SystemExit("no sm_90 GPU, or an extension without the fp8 kernels")

    matmul = jax.jit(lambda x, w, a, b: mm._fp8_kernel(x, w, a, b, jnp.bfloat16))
    fused = {name: _fused(mesh, mod) for name, mod in OPS.items()}
    ref = jax.jit(lambda x, w, a, b: mm.fp8_reference(x, w, a, b, jnp.float32))
    ratios: dict[str, list[float]] = {}
    for (m, n, k), scaling in itertools.product(SHAPES, ("tensor", "block")):
        iters = bench_fp8._iters(m, n, k)
        sets = [s[:4] for s in bench_fp8._inputs(m, n, k, scaling)]
        errs = {name: _check(name, fused[name], ref, scaling, *sets[0]) for name in OPS}
        fns = {"matmul_fp8": common.Rotating(matmul, sets),
               **{name: common.Rotating(fn, sets) for name, fn in fused.items()}}
        t = {name: v[0] for name, v in
             common.time_us_interleaved(fns, [()], iters=iters, reps=reps).items()}
        flop = 2.0 * m * n * k
        for name in OPS:
            r = common.record(op=name, shape={"m": m, "n": n, "k": k}, dtype="float8_e4m3fn",
                              world=1, processes=1, median_us=t[name],
                              tflops=flop / t[name] / 1e6, baseline="pk matmul_fp8",
                              baseline_median_us=t["matmul_fp8"], scaling=scaling,
                              out_dtype="bfloat16", max_err=errs[name], iters=iters,
                              reps=reps)
            ratios.setdefault(f"{name} {scaling}", []).append(r["ratio"])
            print(f"{name:>12} {f'{m} x {n} x {k}':>22} {scaling:>6} "
                  f"{flop / t[name] / 1e6:9.1f} TFLOP/s {r['ratio']:.3f}x vs pk matmul_fp8",
                  flush=True)
        del sets, fns
    for name, values in sorted(ratios.items()):
        print(f"geometric mean {name} vs matmul_fp8: {common.geomean(values):.3f}x "
              "(target >= 0.92)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

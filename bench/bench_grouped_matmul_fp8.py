"""The fp8 grouped GEMM (pk_grouped_matmul_fp8, through its private entry
grouped_matmul._fp8_kernel: the MoE experts' forward in fp8) against our bf16 pk.grouped_matmul,
and the fp8 dense GEMM of equal FLOPs (our matmul_fp8), per-tensor and blockwise scaling (issue
40, sections 2 and 4). XLA's fp8 path (grouped_matmul.fp8_reference: dequantize, then ragged_dot
in float32) is the correctness reference only: timed on the H100 at the DeepSeek-V3-like shape it
was 566x slower than ours and needed 28 GiB (bench/results/fp8_notes.md).

For each MoE shape (bench_grouped_matmul.py's, uniform and Zipf group sizes) and scaling: a
correctness check first (the kernel against the float32 reference on the device, within
pk_jax.fp8.error_bound), then the median time of >= 11 batches of back-to-back
calls (rotating over 3 input sets), every variant timed in turn (common.time_us_interleaved):

  ours            the experts' w [E, K, N] transposed to [E, N, K] in XLA on every call
  ours_enk        w given as [E, N, K] (the transpose's cost)
  bf16            pk.grouped_matmul on the bf16 data the fp8 operands came from   target >= 1.6
  dense           our fp8 matmul of [M, K] x [K, N] (per tensor; blockwise its blockwise)
                                                                                 target >= 0.9
  dense_nk        the same with w given as [N, K] (no transpose in XLA): ours_enk's baseline,
                  both in the layout the kernels read (ours_enk also against bf16)
  block vs tensor ours blockwise against ours per tensor                         target >= 0.9

Rows go to bench/results/grouped_matmul_fp8.jsonl with "dtype" (float8_e4m3fn), "scaling"
("tensor" or "block"), "baseline", "ratio" = baseline time / ours, "w_layout", "out_dtype".

Run on the GPU machine: python bench/bench_grouped_matmul_fp8.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys

import bench_grouped_matmul as bgm
import common
import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax import _backend, fp8
from pk_jax.ops import grouped_matmul as gm
from pk_jax.ops import matmul as mm


def _inputs(m, e, k, n, scaling, sets=3):
    """`sets` tuples (x, w, x_scale, w_scale, x_bf16, w_bf16, wd, wd_scale): fp8 operands
    quantized by current scaling (w per expert) from normal bf16 data, that data, and a dense
    [K, N] fp8 weight for the equal-FLOPs GEMM."""
    out = []
    for i in range(sets):
        kx, kw = jax.random.split(jax.random.key(1000 * i + 11))
        xb = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
        wb = (jax.random.normal(kw, (e, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        xq, sx = fp8.quantize(xb, role="x", scaling=scaling)
        pairs = [fp8.quantize(wb[j], role="w", scaling=scaling) for j in range(e)]
        wq = jnp.stack([q for q, _ in pairs])
        sw = jnp.stack([s for _, s in pairs])
        out.append((xq, wq, sx, sw, xb, wb, wq[0], sw[0]))
    return jax.block_until_ready(out)


def _check(ours, xq, wq, gs, sx, sw, scaling, name) -> float:
    ref = gm.fp8_reference(xq, wq, gs, sx, sw, jnp.float32)
    y = ours(xq, wq, gs, sx, sw).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
    tol = fp8.error_bound(xq.shape[1], scaling)
    if not (math.isfinite(err) and err <= tol):
        raise SystemExit(f"grouped_matmul_fp8 is wrong at {name} ({scaling}): relative max error "
                         f"{err:.4g} > {tol:.4g}")
    return err


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = ap.parse_args()
    reps = 5 if args.quick else 11

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    pk.init(mesh)
    if not _backend.use_kernel(gm.FP8_STEM) or pk.backend_name(gm.STEM) != "cuda":
        raise SystemExit("no sm_90 GPU, or an extension without pk_grouped_matmul_fp8")

    ours = jax.jit(lambda x, w, g, a, b: gm._fp8_kernel(x, w, g, a, b, jnp.bfloat16))
    ours_enk = jax.jit(lambda x, wt, g, a, b: gm._fp8_kernel(x, wt, g, a, b, jnp.bfloat16,
                                                             w_layout="enk"))
    bf16 = jax.jit(pk.grouped_matmul)
    dense = jax.jit(lambda x, w, a, b: mm._fp8_kernel(x, w, a, b, jnp.bfloat16))
    dense_nk = jax.jit(lambda x, wt, a, b: mm._fp8_kernel(x, wt, a, b, jnp.bfloat16,
                                                          w_layout="nk"))

    ratios: dict[str, list[float]] = {}

    def row(shape, scaling, name, t_ours, baseline, t_base, flop, **extra):
        r = common.record(op="grouped_matmul_fp8", shape=shape, dtype="float8_e4m3fn", world=1,
                          processes=1, median_us=t_ours, tflops=flop / t_ours / 1e6,
                          baseline=baseline, baseline_median_us=t_base,
                          baseline_tflops=round(flop / t_base / 1e6, 2), scaling=scaling,
                          out_dtype="bfloat16", reps=reps, **extra)
        ratios.setdefault(name, []).append(r["ratio"])
        print(f"{shape['name']:>16} {shape['dist']:>8} {scaling:>6} {flop / t_ours / 1e6:9.1f} "
              f"TFLOP/s {r['ratio']:.3f}x vs {baseline}", flush=True)

    for name, m, e, k, n in bgm.SHAPES:
        flop = 2.0 * m * k * n
        iters = max(2, min(200, int(0.04 / (flop / 1100e12))))
        per_tensor = {}
        for scaling in ("tensor", "block"):
            sets = _inputs(m, e, k, n, scaling)
            for dist in bgm.DISTS:
                gs = jnp.asarray(bgm.sizes(dist, m, e))
                xq, wq, sx, sw = sets[0][:4]
                err = _check(ours, xq, wq, gs, sx, sw, scaling, f"{name}/{dist}")
                fns = {
                    "ours": (ours, [(s[0], s[1], gs, s[2], s[3]) for s in sets]),
                    "ours_enk": (ours_enk, [(s[0], jnp.swapaxes(s[1], 1, 2), gs, s[2], s[3])
                                            for s in sets]),
                    "bf16": (bf16, [(s[4], s[5], gs) for s in sets]),
                    "dense": (dense, [(s[0], s[6], s[2], s[7]) for s in sets]),
                    "dense_nk": (dense_nk, [(s[0], s[6].T, s[2], s[7]) for s in sets]),
                }
                fns = {k_: (fn, jax.block_until_ready(a)) for k_, (fn, a) in fns.items()}
                measured = common.time_us_interleaved(
                    {k_: common.Rotating(fn, a) for k_, (fn, a) in fns.items()}, [()], iters=iters,
                    reps=reps)
                t = {k_: v[0] for k_, v in measured.items()}
                shape = {"tokens": m, "experts": e, "k": k, "n": n, "dist": dist, "name": name}
                extra = {"max_err": err, "w_layout": "ekn", "iters": iters,
                         "group_sizes_max": int(gs.max())}
                row(shape, scaling, f"{scaling}_vs_bf16", t["ours"],
                    "pk.grouped_matmul bf16", t["bf16"], flop, **extra)
                row(shape, scaling, f"{scaling}_vs_dense", t["ours"],
                    f"pk matmul_fp8 dense [M, K] x [K, N], {scaling}", t["dense"], flop, **extra)
                row(shape, scaling, f"{scaling}_enk_vs_ekn", t["ours_enk"],
                    "pk grouped_matmul_fp8, w [E, K, N] (transposed in XLA)", t["ours"], flop,
                    **{**extra, "w_layout": "enk"})
                row(shape, scaling, f"{scaling}_enk_vs_bf16", t["ours_enk"],
                    "pk.grouped_matmul bf16", t["bf16"], flop, **{**extra, "w_layout": "enk"})
                row(shape, scaling, f"{scaling}_enk_vs_dense_nk", t["ours_enk"],
                    f"pk matmul_fp8 dense [M, K] x [K, N] given as [N, K], {scaling}",
                    t["dense_nk"], flop, **{**extra, "w_layout": "enk"})
                if scaling == "tensor":
                    per_tensor[dist] = t["ours"]
                else:
                    row(shape, scaling, "block_vs_tensor", t["ours"],
                        "pk grouped_matmul_fp8 per tensor", per_tensor[dist], flop, **extra)
                del fns
            del sets

    targets = {"tensor_vs_bf16": 1.6, "tensor_vs_dense": 0.9, "block_vs_tensor": 0.9}
    for name, values in sorted(ratios.items()):
        goal = f" (target >= {targets[name]})" if name in targets else ""
        print(f"geometric mean {name}: {common.geomean(values):.3f}x{goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

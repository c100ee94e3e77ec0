"""pk.grouped_matmul against `jax.lax.ragged_dot` (bf16) on one GPU, with a dense GEMM of the
same FLOPs (`x @ w`, cuBLAS) measured in the same run as the ceiling.

For each MoE shape (tokens x experts x K -> N) and group-size distribution (uniform, Zipf):
a correctness check against a float32 ragged_dot (error within 2x of ragged_dot's own bf16
error), then the median time of batches of back-to-back jitted calls rotating over 3 input
sets, for ours, ragged_dot and the dense GEMM; one line per shape ending in "x vs ragged_dot",
the geometric means at the end. With --vjp the forward+backward (dx and dw) is timed as well
against ragged_dot's. Results go to bench/results/grouped_matmul.jsonl; the plot
(bench/results/grouped_matmul.png) is drawn by bench/plot_grouped_matmul.py when matplotlib is
there.

Run on the GPU machine: python bench/bench_grouped_matmul.py [--quick] [--vjp]
"""

from __future__ import annotations

import argparse
import math
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np

import pk_jax as pk
from pk_jax.ops import grouped_matmul as gm

SHAPES = [  # (name, rows = tokens x top-k, experts, K, N)
    ("dsv3-like", 32768, 32, 7168, 2048),
    ("8x4096->14336", 16384, 8, 4096, 14336),
    ("64x2048->1408", 8192, 64, 2048, 1408),
    ("mixtral-top2", 2 * 4096, 8, 4096, 14336),
]
DISTS = ("uniform", "zipf")


def sizes(dist: str, m: int, e: int) -> np.ndarray:
    if dist == "uniform":
        s = np.full(e, m // e)
        s[: m - s.sum()] += 1
    else:  # Zipf with exponent 1.2, experts in a fixed shuffled order
        p = 1.0 / np.arange(1, e + 1) ** 1.2
        s = np.floor(p / p.sum() * m).astype(np.int64)
        s[0] += m - s.sum()
        s = np.random.default_rng(0).permutation(s)
    return s.astype(np.int32)


def _inputs(m, e, k, n, dtype, sets=3):
    out = []
    for i in range(sets):
        kx, kw, kd = jax.random.split(jax.random.key(1000 * i + 7), 3)
        out.append((jax.random.normal(kx, (m, k), jnp.float32).astype(dtype),
                    (jax.random.normal(kw, (e, k, n), jnp.float32) / math.sqrt(k)).astype(dtype),
                    jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)))
    return jax.block_until_ready(out)


def _check(name, y, y_xla, x, w, gs):
    ref = jax.jit(lambda a, b, g: jax.lax.ragged_dot(
        a.astype(jnp.float32), b.astype(jnp.float32), g,
        precision=jax.lax.Precision.HIGHEST))(x, w, gs)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
    err_xla = float(jnp.max(jnp.abs(y_xla.astype(jnp.float32) - ref)))
    if not (math.isfinite(err) and err <= 2 * err_xla + 1e-3):
        raise SystemExit(f"pk.grouped_matmul is wrong at {name}: max error {err:.4g} vs "
                         f"ragged_dot's {err_xla:.4g}")
    return err, err_xla


def _iters(seconds_per_call: float) -> int:
    return max(2, min(200, int(0.04 / seconds_per_call)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--vjp", action="store_true", help="also time forward + backward")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    reps = 5 if args.quick else 11

    if pk.backend_name(gm.STEM) != "cuda":
        raise SystemExit("pk.grouped_matmul would run its reference here: no sm_90 GPU or no "
                         "extension")
    ours = jax.jit(pk.grouped_matmul)
    base = jax.jit(jax.lax.ragged_dot)  # what a JAX user writes (bf16 out)
    dense = jax.jit(lambda x, w: x @ w)

    def vjp_of(fn):
        def f(x, w, gs, dy):
            _, pull = jax.vjp(lambda a, b: fn(a, b, gs), x, w)
            return pull(dy)
        return jax.jit(f)

    ours_vjp, base_vjp = vjp_of(pk.grouped_matmul), vjp_of(jax.lax.ragged_dot)

    ratios, dense_ratios, vjp_ratios = [], [], []
    print(f"{'shape':>16} {'dist':>8} {'pk TFLOP/s':>11} {'dense':>7} {'ragged_dot':>11}  "
          f"ratios")
    for name, m, e, k, n in SHAPES:
        sets = _inputs(m, e, k, n, dtype)
        wd = jax.random.normal(jax.random.key(5), (k, n), jnp.float32).astype(dtype)
        dense_sets = [(x, wd) for x, _, _ in sets]
        flop = 2.0 * m * k * n
        t_dense = common.time_us(dense, dense_sets, iters=_iters(flop / 650e12), reps=reps)
        for dist in DISTS:
            gs = jnp.asarray(sizes(dist, m, e))
            args_sets = [(x, w, gs) for x, w, _ in sets]
            x, w, _ = sets[0]
            err, err_xla = _check(f"{name}/{dist}", ours(x, w, gs), base(x, w, gs), x, w, gs)
            t_ours = common.time_us(ours, args_sets, iters=_iters(flop / 600e12), reps=reps)
            t_base = common.time_us(base, args_sets, iters=_iters(flop / 50e12),
                                    reps=max(3, reps // 2), warmup=1)
            shape = {"tokens": m, "experts": e, "k": k, "n": n, "dist": dist, "name": name}
            row = common.record(
                op="grouped_matmul", shape=shape, dtype=dtype.name, world=1, processes=1,
                median_us=t_ours, tflops=flop / t_ours / 1e6, baseline="jax.lax.ragged_dot",
                baseline_median_us=t_base, baseline_tflops=round(flop / t_base / 1e6, 2),
                dense_median_us=round(t_dense, 3), dense_tflops=round(flop / t_dense / 1e6, 2),
                vs_dense=round(t_dense / t_ours, 4), direction="fwd", max_err=err,
                baseline_max_err=err_xla, group_sizes_max=int(gs.max()), reps=reps)
            ratios.append(row["ratio"])
            dense_ratios.append(t_dense / t_ours)
            print(f"{name:>16} {dist:>8} {flop / t_ours / 1e6:11.1f} {flop / t_dense / 1e6:7.1f} "
                  f"{flop / t_base / 1e6:11.1f}  {row['ratio']:.2f}x vs ragged_dot, "
                  f"{t_dense / t_ours:.3f}x of dense", flush=True)
            if args.vjp:
                vsets = [(x, w, gs, d) for x, w, d in sets]
                dx, dw = ours_vjp(*vsets[0])
                rx, rw = base_vjp(*vsets[0])
                for a, b, what in ((dx, rx, "dx"), (dw, rw, "dw")):
                    scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
                    diff = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                    if not diff <= 3e-2 * scale:
                        raise SystemExit(f"pk.grouped_matmul's {what} is wrong at {name}/{dist}: "
                                         f"{diff:.4g} vs scale {scale:.4g}")
                t_v = common.time_us(ours_vjp, vsets, iters=_iters(2 * flop / 500e12), reps=reps)
                t_vb = common.time_us(base_vjp, vsets, iters=_iters(2 * flop / 30e12),
                                      reps=max(3, reps // 2), warmup=1)
                vrow = common.record(
                    op="grouped_matmul", shape=shape, dtype=dtype.name, world=1, processes=1,
                    median_us=t_v, tflops=2 * flop / t_v / 1e6,
                    baseline="jax.lax.ragged_dot", baseline_median_us=t_vb,
                    baseline_tflops=round(2 * flop / t_vb / 1e6, 2), direction="bwd (dx+dw)",
                    dense_tflops=round(flop / t_dense / 1e6, 2), reps=reps)
                vjp_ratios.append(vrow["ratio"])
                print(f"{'':>16} {'bwd':>8} {2 * flop / t_v / 1e6:11.1f} {'':>7} "
                      f"{2 * flop / t_vb / 1e6:11.1f}  {vrow['ratio']:.2f}x vs ragged_dot "
                      "(dx + dw)", flush=True)
        del sets, dense_sets
    print(f"geometric mean: {common.geomean(ratios):.2f}x vs ragged_dot (min {min(ratios):.2f}x, "
          f"target >= 5), {common.geomean(dense_ratios):.3f}x of dense (min "
          f"{min(dense_ratios):.3f}x, target >= 0.85)")
    if vjp_ratios:
        print(f"backward: {common.geomean(vjp_ratios):.2f}x vs ragged_dot's")
    try:
        import plot_grouped_matmul
        plot_grouped_matmul.main()
    except ImportError as e:
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

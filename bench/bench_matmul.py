"""pk.matmul against XLA's cuBLAS path (plain `x @ w`, bf16 in and out) on one GPU.

For each shape: a correctness check against a float32 reference, then the median time of >= 20
batches of back-to-back calls (rotating over 3 random input sets) for both, measured in the same
run; one line per shape ending in "x vs cuBLAS", the geometric mean at the end. Results go to
bench/results/matmul.jsonl. With --configs, every tile configuration is also timed on every
shape (the evidence for the selection table in pk_jax/ops/matmul.py), into
bench/results/matmul_configs.jsonl.

Run on the GPU machine: python bench/bench_matmul.py [--configs] [--quick]
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
from pk_jax import _ffi
from pk_jax.ops import matmul as matmul_op

SHAPES = [  # (M, N, K)
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 16384, 16384),
    (8192, 28672, 8192),
    (16384, 8192, 3584),
]
TARGET_SHAPES = SHAPES[1:]  # the geomean target: 4096..16384 square + transformer
CONFIG_NAMES = {matmul_op._TILE_128x256: "128x256", matmul_op._TILE_128x128: "128x128",
                matmul_op._TILE_128x256_S3: "128x256s3"}
# (config, group_m) variants timed with --configs.
VARIANTS = [(matmul_op._TILE_128x256, 16), (matmul_op._TILE_128x128, 16),
            (matmul_op._TILE_128x256_S3, 8), (matmul_op._TILE_128x256_S3, 32)]


def _inputs(m, n, k, dtype, sets=3):
    out = []
    for i in range(sets):
        kx, kw = jax.random.split(jax.random.key(1000 * i + 7))
        out.append((jax.random.normal(kx, (m, k), jnp.float32).astype(dtype),
                    jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)))
    return jax.block_until_ready(out)


def _check(y, x, w, y_xla) -> tuple[float, float]:
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
    err_xla = float(jnp.max(jnp.abs(y_xla.astype(jnp.float32) - ref)))
    if not (math.isfinite(err) and err <= 2 * err_xla + 1e-3 * math.sqrt(x.shape[1])):
        raise SystemExit(f"pk.matmul is wrong at {x.shape} @ {w.shape}: max error {err:.4g} "
                         f"vs jnp.dot's {err_xla:.4g}")
    return err, err_xla


def _iters(m, n, k) -> int:
    est_s = 2 * m * n * k / 650e12  # aim at ~40 ms per timed batch
    return max(5, min(200, int(0.04 / est_s)))


def _fixed_config(config: int, group_m: int):
    def f(x, w):
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
        return _ffi.call("pk_matmul", out, x, w, config=np.int64(config),
                         group_m=np.int64(group_m))
    return jax.jit(f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", action="store_true", help="also time every tile config")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    reps = 7 if args.quick else 21

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    pk.init(mesh)
    if pk.backend_name("matmul") != "cuda":
        raise SystemExit("pk.matmul would run its reference here: no sm_90 GPU or no extension")
    ours = jax.jit(pk.matmul)
    base = jax.jit(lambda x, w: x @ w)

    ratios = {}
    print(f"{'M x N x K':>22} {'config':>8} {'pk TFLOP/s':>11} {'cuBLAS TFLOP/s':>15}  ratio")
    for m, n, k in SHAPES:
        sets = _inputs(m, n, k, dtype)
        x, w = sets[0]
        err, err_xla = _check(ours(x, w), x, w, base(x, w))
        iters = _iters(m, n, k)
        flop = 2.0 * m * n * k
        t_base = common.time_us(base, sets, iters=iters, reps=reps)
        t_ours = common.time_us(ours, sets, iters=iters, reps=reps)
        cfg = CONFIG_NAMES[matmul_op.tile_config(m, n)]
        row = common.record(op="matmul", shape={"m": m, "n": n, "k": k}, dtype=dtype.name,
                            world=1, processes=1, median_us=t_ours,
                            tflops=flop / t_ours / 1e6, baseline="jnp.dot (cuBLAS)",
                            baseline_median_us=t_base,
                            baseline_tflops=round(flop / t_base / 1e6, 2),
                            config=cfg, max_err=err, baseline_max_err=err_xla,
                            iters=iters, reps=reps)
        ratios[(m, n, k)] = row["ratio"]
        print(f"{f'{m} x {n} x {k}':>22} {cfg:>8} {flop / t_ours / 1e6:11.1f} "
              f"{flop / t_base / 1e6:15.1f}  {row['ratio']:.3f}x vs cuBLAS", flush=True)
        if args.configs:
            for cid, group_m in VARIANTS:
                name = f"{CONFIG_NAMES[cid]}/g{group_m}"
                t = common.time_us(_fixed_config(cid, group_m), sets, iters=iters,
                                   reps=max(7, reps // 2))
                common.record(op="matmul", shape={"m": m, "n": n, "k": k}, dtype=dtype.name,
                              world=1, processes=1, median_us=t, tflops=flop / t / 1e6,
                              baseline="jnp.dot (cuBLAS)", baseline_median_us=t_base,
                              config=CONFIG_NAMES[cid], group_m=group_m,
                              path=common.RESULTS / "matmul_configs.jsonl")
                print(f"{'':>22} {name:>12} {flop / t / 1e6:7.1f} {'':>15}  "
                      f"{t_base / t:.3f}x (variant {name})", flush=True)
        del sets, x, w
    g_all = common.geomean(list(ratios.values()))
    g_target = common.geomean([ratios[s] for s in TARGET_SHAPES if s in ratios])
    print(f"geometric mean: {g_all:.3f}x vs cuBLAS over all shapes, {g_target:.3f}x over "
          f"4096-16384 square + transformer shapes (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

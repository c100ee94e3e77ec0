"""pk.attention against cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) and XLA
(`implementation="xla"`) on one GPU, forward and forward+backward, in the same run.

For each shape [B, S, H, D] (Hkv K/V heads), causal and not: a correctness check first (ours
and cuDNN on one K/V head group against a float32 reference: our error within twice cuDNN's
plus a small tolerance, else the run stops), then the median time of batches of back-to-back
jitted calls rotating over 3 input sets. TFLOP/s count 4 B S^2 H D for the forward (half when
causal) and 3.5 times that for forward+backward. One line per shape ending in "x vs cuDNN"
(cuDNN time / ours), the geometric means at the end. Rows go to bench/results/attention.jsonl
with baseline "cudnn"; the plot (bench/results/attention.png) is drawn by
bench/plot_attention.py when matplotlib is there. XLA is timed where its materialised scores
fit (B H S^2 floats up to 8 GiB).

Run on the GPU machine: python bench/bench_attention.py [--quick] [--no-bwd]
"""

from __future__ import annotations

import argparse
import math
import sys

import common
import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax.ops import attention as att

SHAPES = [  # (B, S, H, Hkv, D)
    (1, 4096, 32, 32, 128),
    (1, 8192, 16, 16, 128),
    (1, 16384, 16, 16, 128),
    (1, 32768, 16, 16, 128),
    (1, 8192, 32, 32, 64),
    (1, 32768, 16, 16, 64),
    (1, 16384, 32, 4, 128),  # GQA 8:1
    (1, 32768, 32, 4, 64),   # GQA 8:1
]
QUICK = [SHAPES[0], SHAPES[1], SHAPES[4], SHAPES[6]]
XLA_LIMIT = 8 << 30  # bytes of float32 scores


def _inputs(b, s, h, hkv, d, dtype, sets=3):
    out = []
    for i in range(sets):
        kq, kk, kv, kd = jax.random.split(jax.random.key(1000 * i + s + h + d), 4)
        mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
        out.append((mk(kq, h), mk(kk, hkv), mk(kv, hkv), mk(kd, h)))
    return jax.block_until_ready(out)


def _fns(causal):
    ours = lambda q, k, v: pk.attention(q, k, v, causal=causal)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation="cudnn")
    xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation="xla")
    return ours, cudnn, xla


def _vjp(fn):
    def f(q, k, v, do):
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(do)
    return jax.jit(f)


def _check(name, causal, q, k, v, do):
    """Ours and cuDNN on the first K/V head group against a float32 reference, forward and
    gradients; returns our and cuDNN's forward errors."""
    g = q.shape[2] // k.shape[2]
    q, k, v, do = q[:, :, :g], k[:, :, :1], v[:, :, :1], do[:, :, :g]
    ours, cudnn, _ = _fns(causal)
    ref = lambda a, b, c: att.reference(a, b, c, causal=causal, scale=1 / math.sqrt(q.shape[-1]))
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want_o, want_g = _vjp(ref)(*f32)
    errs = []
    for what, got, base in zip(("out", "dq", "dk", "dv"),
                               (_vjp(ours)(q, k, v, do)[0],) + tuple(_vjp(ours)(q, k, v, do)[1]),
                               (_vjp(cudnn)(q, k, v, do)[0],) + tuple(_vjp(cudnn)(q, k, v, do)[1])):
        want = want_o if what == "out" else want_g["qkv".index(what[1])]
        scale = float(jnp.max(jnp.abs(want)))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
        err_b = float(jnp.max(jnp.abs(base.astype(jnp.float32) - want)))
        if not (math.isfinite(err) and err <= 2 * err_b + 2e-3 * scale + 1e-3):
            raise SystemExit(f"pk.attention is wrong at {name}: {what} max error {err:.4g} vs "
                             f"cuDNN's {err_b:.4g} (scale {scale:.4g})")
        errs.append((err, err_b))
    return errs[0]


def _iters(seconds_per_call: float) -> int:
    return max(2, min(100, int(0.05 / seconds_per_call)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="four shapes, fewer repetitions")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    reps = 5 if args.quick else 9
    if pk.backend_name(att.NAME) != "cuda":
        raise SystemExit("pk.attention would run its reference here: no sm_90 GPU or no "
                         "extension")
    fwd_ratios, bwd_ratios = [], []
    print(f"{'B x S x H/Hkv x D':>22} {'causal':>6} {'dir':>7} {'pk':>7} {'cuDNN':>7} "
          f"{'XLA':>7}  TFLOP/s")
    for b, s, h, hkv, d in (QUICK if args.quick else SHAPES):
        sets = _inputs(b, s, h, hkv, d, dtype)
        for causal in (False, True):
            name = f"{b}x{s}x{h}/{hkv}x{d}" + (" causal" if causal else "")
            err, err_b = _check(name, causal, *sets[0])
            ours, cudnn, xla = _fns(causal)
            flop = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
            with_xla = b * h * s * s * 4 <= XLA_LIMIT
            shape = {"b": b, "s": s, "h": h, "hkv": hkv, "d": d, "causal": causal}
            dirs = [("fwd", 1.0)] + ([] if args.no_bwd else [("fwd+bwd", 3.5)])
            for direction, mult in dirs:
                if direction == "fwd":
                    fo, fc, fx = (jax.jit(f) for f in (ours, cudnn, xla))
                    arg_sets = [x[:3] for x in sets]
                else:
                    fo, fc, fx = (_vjp(f) for f in (ours, cudnn, xla))
                    arg_sets = sets
                work = flop * mult
                t_o = common.time_us(fo, arg_sets, iters=_iters(work / 500e12), reps=reps)
                t_c = common.time_us(fc, arg_sets, iters=_iters(work / 500e12), reps=reps)
                t_x = (common.time_us(fx, arg_sets, iters=_iters(work / 80e12),
                                      reps=max(3, reps // 2), warmup=1) if with_xla else None)
                tf = lambda t, work=work: work / t / 1e6
                row = common.record(
                    op="attention", shape=shape, dtype=dtype.name, world=1, processes=1,
                    median_us=t_o, tflops=tf(t_o), baseline="cudnn", baseline_median_us=t_c,
                    baseline_tflops=round(tf(t_c), 2), direction=direction,
                    xla_median_us=None if t_x is None else round(t_x, 3),
                    xla_tflops=None if t_x is None else round(tf(t_x), 2),
                    max_err=err, baseline_max_err=err_b, reps=reps)
                (fwd_ratios if direction == "fwd" else bwd_ratios).append(row["ratio"])
                xs = f"{tf(t_x):7.1f}" if t_x is not None else f"{'-':>7}"
                print(f"{f'{b}x{s}x{h}/{hkv}x{d}':>22} {causal!s:>6} {direction:>7} "
                      f"{tf(t_o):7.1f} {tf(t_c):7.1f} {xs}  {row['ratio']:.3f}x vs cuDNN",
                      flush=True)
        del sets
    print(f"forward: geometric mean {common.geomean(fwd_ratios):.3f}x vs cuDNN (min "
          f"{min(fwd_ratios):.3f}x; goal >= 1.0, floor 0.85)")
    if bwd_ratios:
        print(f"forward+backward: geometric mean {common.geomean(bwd_ratios):.3f}x vs cuDNN "
              f"(min {min(bwd_ratios):.3f}x; goal >= 0.9, floor 0.75)")
    try:
        import plot_attention
        plot_attention.main()
    except ImportError as e:
        print(f"no plot: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

With --specs it runs instead the shapes of tokamax's ragged_dot benchmark specs (MaxText
DeepSeek-V3 and gpt-oss MoE layers, Mixtral 8x7B, and its compute- and memory-bound cases),
each checked first, then timed interleaved: pk.grouped_matmul, its few-rows kernel where the
call has at most FEW_MAX_ROWS rows (decode), the dense GEMM of equal FLOPs, ragged_dot (where it
fits in memory), and the HBM floor: the bytes the call must move (x, the w of every nonempty
group, y) at the rate of a device copy measured in the same run (issue 40 section 5).

With --schedules the tiled kernel's two schedules (cooperative 128 x 256 tiles, FWD / DX;
ping-pong 128 x 128 tiles, FWD_PP / DX_PP) of the forward and of dx are each checked, then timed
interleaved, with the dense GEMM of equal FLOPs after them, at the spec shapes of more than
FEW_MAX_ROWS rows, or at the cases of --cases FILE (a JSON list of [name, rows, experts, K, N],
uniform sizes), tagged for bench/check_pingpong.py, which scores grouped_matmul's choice of
schedule (pingpong_width) on them.

Run on the GPU machine:
python bench/bench_grouped_matmul.py [--quick] [--vjp] [--specs] [--schedules [--cases FILE]]
"""

from __future__ import annotations

import argparse
import functools
import json
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

# tokamax's ragged_dot benchmark specs (tokamax/_src/ops/ragged_dot/arg_specs.py): (name, rows,
# experts, K, N, group sizes or None for rows // experts each).
SPECS = [
    ("deepseek-v3", 131072, 256, 7168, 1024, None),
    ("deepseek-v3", 131072, 256, 1024, 7168, None),
    ("deepseek-v3", 131072, 256, 7168, 512, None),
    ("deepseek-v3", 131072, 256, 512, 7168, None),
    ("deepseek-v3", 262144, 256, 7168, 512, None),
    ("deepseek-v3", 262144, 256, 256, 7168, None),
    ("deepseek-v3", 262144, 256, 1024, 7168, None),
    ("deepseek-v3", 262144, 256, 7168, 1024, None),
    ("deepseek-v3", 262144, 256, 7168, 2048, None),
    ("gpt-oss", 327680, 128, 2880, 2880, None),
    ("compute_bound", 4096, 8, 4096, 4096, [4096] + [0] * 7),
    ("memory_bound", 8, 8, 4096, 4096, [1] * 8),
    ("mixtral-8x7b", 8192, 8, 4096, 14336, None),
]


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


def _check_groups(name, y, x, w, gs_np):
    """Checks y on four nonempty groups (the first, the last, two at random) against their dense
    products in float32 (HIGHEST) within 2x of XLA's same-dtype dense product's error, and the
    rows past sum(sizes) for zeros: shapes where a float32 ragged_dot of the whole call does
    not fit in memory."""
    ends = np.cumsum(np.maximum(gs_np, 0))
    nz = np.flatnonzero(gs_np > 0)
    pick = {int(nz[0]), int(nz[-1])} | set(np.random.default_rng(0).choice(nz, 2).tolist())
    hi32 = jax.jit(lambda a, b: jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                        precision=jax.lax.Precision.HIGHEST))
    same = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    for g in sorted(pick):
        lo, hi = int(ends[g] - gs_np[g]), int(ends[g])
        ref = hi32(x[lo:hi], w[g])
        err = float(jnp.max(jnp.abs(y[lo:hi].astype(jnp.float32) - ref)))
        err_xla = float(jnp.max(jnp.abs(same(x[lo:hi], w[g]).astype(jnp.float32) - ref)))
        if not (math.isfinite(err) and err <= 2 * err_xla + 1e-3):
            raise SystemExit(f"pk.grouped_matmul is wrong at {name}, group {g}: max error "
                             f"{err:.4g} vs XLA's {err_xla:.4g}")
    if bool(jnp.any(y[int(ends[-1]):] != 0)):
        raise SystemExit(f"pk.grouped_matmul at {name}: rows past sum(group_sizes) not zero")


def _iters(seconds_per_call: float) -> int:
    return max(2, min(200, int(0.04 / seconds_per_call)))


def _copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device copy (read + write), the HBM rate a streaming kernel
    can reach here."""
    a = jnp.ones((1 << 30,), jnp.bfloat16)
    t = common.time_us(jax.jit(lambda v: v + 1), [(a,)], iters=10, reps=5)
    return 2 * a.nbytes / (t * 1e-6)


def run_specs(dtype, reps: int) -> int:
    """The tokamax spec shapes (SPECS): see the module docstring."""
    bw = _copy_bandwidth()
    print(f"device copy: {bw / 1e12:.2f} TB/s (the HBM floor's rate)")
    ours = jax.jit(pk.grouped_matmul)
    few = jax.jit(gm.few_rows_forward)
    base = jax.jit(jax.lax.ragged_dot)
    dense = jax.jit(lambda x, w: x @ w)
    vs_dense, vs_floor = [], []
    for name, m, e, k, n, gsz in SPECS:
        gs_np = np.asarray(gsz if gsz is not None else sizes("uniform", m, e), np.int32)
        gs = jnp.asarray(gs_np)
        big = (m * k + e * k * n) * dtype.itemsize > 2**30
        sets = _inputs(m, e, k, n, dtype, sets=1 if big else 3)
        args_sets = [(x, w, gs) for x, w, _ in sets]
        x, w, _ = sets[0]
        flop = 2.0 * m * k * n
        nonempty = int(np.count_nonzero(gs_np))
        floor_us = (m * k + nonempty * k * n + m * n) * dtype.itemsize / bw * 1e6
        try:  # XLA's ragged_dot asks for 100+ GB at some of these shapes
            jax.block_until_ready(base(x, w, gs))
            base_ok = True
        except jax.errors.JaxRuntimeError as err:  # RESOURCE_EXHAUSTED
            print(f"{name} {m}x{k}->{n}: ragged_dot failed ({type(err).__name__}: "
                  f"{str(err)[:120]})")
            base_ok = False
        fns = {"ours": ours}
        _check_groups(name, ours(x, w, gs), x, w, gs_np)
        if m <= gm.FEW_MAX_ROWS:
            _check_groups(name + " (few rows)", few(x, w, gs), x, w, gs_np)
            fns["few"] = few
        wd = jax.random.normal(jax.random.key(5), (k, n), jnp.float32).astype(dtype)
        t = common.time_us_interleaved(fns, args_sets, iters=_iters(max(flop / 600e12, 2e-5)),
                                       reps=reps)
        t_dense = common.time_us_interleaved({"dense": dense}, [(a, wd) for a, _, _ in args_sets],
                                             iters=_iters(max(flop / 650e12, 2e-5)),
                                             reps=reps)["dense"][0]
        t_base = None
        if base_ok:
            t_base = common.time_us(base, args_sets, iters=_iters(max(flop / 50e12, 2e-5)),
                                    reps=max(3, reps // 2), warmup=1)
        best = min(v[0] for v in t.values())
        shape = {"tokens": m, "experts": e, "k": k, "n": n, "name": name, "spec": "tokamax",
                 "nonempty_groups": nonempty}
        for impl, (us, _) in t.items():
            common.record(
                op="grouped_matmul", shape=shape, dtype=dtype.name, world=1, processes=1,
                median_us=us, tflops=flop / us / 1e6, baseline="dense", baseline_median_us=t_dense,
                kernel="few_rows" if impl == "few" else "tiled", hbm_floor_us=round(floor_us, 2),
                vs_floor=round(floor_us / us, 4),
                ragged_dot_us=None if t_base is None else round(t_base, 3), reps=reps)
        vs_dense.append(t_dense / best)
        vs_floor.append(floor_us / best)
        parts = "  ".join(f"{impl} {us:9.1f} us" for impl, (us, _) in t.items())
        rd = "OOM" if t_base is None else f"{t_base:9.1f} us"
        print(f"{name:>14} {m:>7}x{k:<5}->{n:<6} E {e:<4} {parts}  dense {t_dense:9.1f} us  "
              f"ragged_dot {rd}  floor {floor_us:7.1f} us: {t_dense / best:.3f}x of dense, "
              f"{floor_us / best:.3f} of the floor", flush=True)
        del sets, args_sets, x, w, wd
    print(f"geometric mean: {common.geomean(vs_dense):.3f}x of dense, "
          f"{common.geomean(vs_floor):.3f} of the HBM floor (targets: >= 0.9x dense at K >= 512, within 1.2x of the floor at "
          "decode sizes)")
    return 0


def run_schedules(dtype, reps: int, cases, tag: str) -> int:
    """The cooperative and ping-pong schedules of the forward (contraction K) and of dx
    (contraction N) at `cases` (name, rows, experts, K, N): see the module docstring."""
    fns = {}
    for pp in (False, True):
        fwd = functools.partial(gm.tiled_forward, pingpong=pp)
        dx = functools.partial(gm._dx, pingpong=pp)
        sched = "pingpong" if pp else "cooperative"
        fns[f"fwd {sched}"] = jax.jit(lambda x, w, gs, dy, f=fwd: f(x, w, gs))
        fns[f"dx {sched}"] = jax.jit(lambda x, w, gs, dy, f=dx: f(dy, w, gs))
    dense = jax.jit(lambda x, w: x @ w)
    ratios = {"fwd": [], "dx": []}
    for name, m, e, k, n in cases:
        gs_np = sizes("uniform", m, e)
        gs = jnp.asarray(gs_np)
        sets = _inputs(m, e, k, n, dtype, sets=1 if (m * k + e * k * n) * 2 > 2**30 else 3)
        args_sets = [(x, w, gs, dy) for x, w, dy in sets]
        x, w, dy = sets[0]
        wt = jnp.swapaxes(w, 1, 2)  # dx's product per group: dy_e @ w[e]^T
        for impl, fn in fns.items():
            a, b = (x, w) if impl.startswith("fwd") else (dy, wt)
            _check_groups(f"{name} ({impl})", fn(*args_sets[0]), a, b, gs_np)
        del wt
        flop = 2.0 * m * k * n
        t = common.time_us_interleaved(fns, args_sets, iters=_iters(max(flop / 600e12, 2e-5)),
                                       reps=reps)
        wd = jax.random.normal(jax.random.key(5), (k, n), jnp.float32).astype(dtype)
        t_dense = common.time_us_interleaved({"dense": dense}, [(a, wd) for a, _, _ in sets],
                                             iters=_iters(max(flop / 650e12, 2e-5)),
                                             reps=reps)["dense"][0]
        line = []
        for mode in ("fwd", "dx"):
            shape = {"tokens": m, "experts": e, "k": k, "n": n, "name": name, "dist": "uniform"}
            coop, pp = t[f"{mode} cooperative"][0], t[f"{mode} pingpong"][0]
            for sched, us in (("cooperative", coop), ("pingpong", pp)):
                common.record(
                    op="grouped_matmul", shape=shape, dtype=dtype.name, world=1, processes=1,
                    median_us=us, tflops=flop / us / 1e6, baseline="dense",
                    baseline_median_us=t_dense, direction=mode,
                    kernel="tiled_pingpong" if sched == "pingpong" else "tiled",
                    contraction=k if mode == "fwd" else n, tag=tag,
                    pingpong_vs_cooperative=round(coop / pp, 4), reps=reps)
            ratios[mode].append(coop / pp)
            line.append(f"{mode} {coop:8.1f} / {pp:8.1f} us = {coop / pp:.3f}x "
                        f"({t_dense / coop:.3f} -> {t_dense / pp:.3f} of dense)")
        print(f"{name:>14} {m:>7}x{k:<5}->{n:<6} E {e:<4} cooperative / pingpong: "
              f"{'; '.join(line)}; dense {t_dense:.1f} us", flush=True)
        del sets, args_sets, x, w, dy
    print(f"geometric mean, pingpong over cooperative: fwd {common.geomean(ratios['fwd']):.3f}x, "
          f"dx {common.geomean(ratios['dx']):.3f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    ap.add_argument("--vjp", action="store_true", help="also time forward + backward")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--specs", action="store_true",
                    help="tokamax's ragged_dot spec shapes, with the few-rows kernel and the "
                         "HBM floor")
    ap.add_argument("--schedules", action="store_true",
                    help="the tiled forward's cooperative and ping-pong schedules, side by side")
    ap.add_argument("--cases", default=None,
                    help="--schedules: a JSON list of [name, rows, experts, K, N] (default: "
                         "the spec shapes of more than FEW_MAX_ROWS rows)")
    ap.add_argument("--tag", default=None,
                    help="--schedules: the rows' tag (default: schedule-fit for the spec "
                         "shapes, schedule-judge for --cases; bench/check_pingpong.py)")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    reps = 5 if args.quick else 11

    if pk.backend_name(gm.STEM) != "cuda":
        raise SystemExit("pk.grouped_matmul would run its reference here: no sm_90 GPU or no "
                         "extension")
    if args.specs:
        return run_specs(dtype, reps)
    if args.schedules:
        if args.cases:
            with open(args.cases) as f:
                cases = [tuple(c) for c in json.load(f)]
        else:
            cases = [(name, m, e, k, n) for name, m, e, k, n, gsz in SPECS
                     if gsz is None and m > gm.FEW_MAX_ROWS]
        tag = args.tag or ("schedule-judge" if args.cases else "schedule-fit")
        return run_schedules(dtype, reps, cases, tag)
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

"""The tensor-parallel GEMM ops with fp8 operands across P processes, as a user calls them:
pk.gemm_reduce_scatter and pk.gemm_all_reduce (the fused fp8 kernels and the serial form, the
fp8 GEMM then the pk collective, each forced with pk_jax.cost_model.override) and
pk.all_gather_gemm (its fused fp8 kernel and its serial form, the pk all_gather of the fp8 rows
and their scales, then the fp8 GEMM; forced the same way).

    python -m pk_jax.launch -n 2 --share-gpu tests/gpu/tp_fp8_mp.py

Every rank builds every rank's fp8 shards and float32 scales from one seed, runs the op under
jit(shard_map) on a 1-D mesh over all processes, and compares its own shard bit for bit with a
float64 model on the host (each rank's operands dequantized with its own scales; gemm_rs /
gemm_ar: each rank's product rounded to bf16, summed, rounded again; all_gather_gemm: the
gathered rows times this rank's w, rounded to bf16 once). The inputs make every product and
sum exact in bf16 in any order: values in {-1, 0, 1}, power-of-two scales, sums below 256
(per tensor: x's and w's scale products 1 or 2 per rank; blockwise: x nonzero in two columns
of each 128-column block, K / 128 * P <= 16). Per tensor and blockwise, both fp8 formats,
rows and columns that are not multiples of the tile, two calls in a row.

On a machine without a GPU the same script runs on CPU processes, where the ops fall back to
their references: a check of the script itself.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_mp import Harness


def main() -> None:
    t = Harness("gemm_rs", axis="x")
    jax, np, pk, P = t.jax, t.np, t.pk, t.P
    import ml_dtypes

    from pk_jax import cost_model

    me, n, mesh = t.me, t.n, t.mesh
    e4m3, e5m2 = jax.numpy.float8_e4m3fn, jax.numpy.float8_e5m2
    bf16 = ml_dtypes.bfloat16

    def inputs(rng, rows: int, k: int, cols: int, fx, fw, blockwise: bool, tied: bool):
        """Every rank's x [rows, k], w [k, cols] and scales. tied (gemm_rs / gemm_ar): each
        rank's x and w scale product is 1 or 2; else x's scales in {1/2, 1, 2}, w's {1, 2}."""
        xs = [rng.integers(-1, 2, (rows, k)).astype(np.float32) for _ in range(n)]
        ws = [rng.integers(-1, 2, (k, cols)).astype(np.float32) for _ in range(n)]
        kb, nb = -(-k // 128), -(-cols // 128)
        if blockwise:
            keep = np.isin(np.arange(k) % 128, (5, 100))
            xs = [np.where(keep, x, 0) for x in xs]
            sx = [(2.0 ** rng.integers(-1, 2, (rows, kb))).astype(np.float32) for _ in range(n)]
            sw = [(2.0 ** rng.integers(0, 2, (kb, nb))).astype(np.float32) for _ in range(n)]
        elif tied:
            a, b = rng.integers(-1, 2, n), rng.integers(0, 2, n)
            sx = [np.float32(2.0 ** int(v)) for v in a]
            sw = [np.float32(2.0 ** int(bv - av)) for av, bv in zip(a, b)]
        else:
            sx = [np.float32(2.0 ** int(v)) for v in rng.integers(-1, 2, n)]
            sw = [np.float32(2.0 ** int(v)) for v in rng.integers(0, 2, n)]
        return [x.astype(fx) for x in xs], [w.astype(fw) for w in ws], sx, sw

    def dequantized(a, s, role: str) -> np.ndarray:
        a, s = np.asarray(a, np.float64), np.asarray(s, np.float64)
        if s.ndim == 0:
            return a * s
        if role == "x":  # [rows, KB]: 128 columns each
            return a * np.repeat(s, 128, axis=1)[:, :a.shape[1]]
        return a * np.kron(s, np.ones((128, 128)))[:a.shape[0], :a.shape[1]]

    def bf16_round(a) -> np.ndarray:
        return np.asarray(np.asarray(a, np.float32).astype(bf16), np.float64)

    def scale_global(s: list, axis: int):
        """Per-tensor scales as [P] (sharded), blockwise ones concatenated along `axis`."""
        if np.ndim(s[0]) == 0:
            return np.asarray(s, np.float32), P("x")
        return np.concatenate(s, axis=axis), P("x", None) if axis == 0 else P(None, "x")

    def scalar(s):
        return s.reshape(()) if s.ndim == 1 else s

    def run(op: str, xs, ws, sx, sw, mode: str | None):
        if op == "all_gather_gemm":
            x, x_spec, w, w_spec = np.concatenate(xs), P("x", None), np.concatenate(ws, 1), \
                P(None, "x")
            (gsx, sx_spec), (gsw, sw_spec) = scale_global(sx, 0), scale_global(sw, 1)
            out_spec, fn = P(None, "x"), pk.all_gather_gemm
        else:
            x, x_spec, w, w_spec = np.concatenate(xs, 1), P(None, "x"), np.concatenate(ws), \
                P("x", None)
            (gsx, sx_spec), (gsw, sw_spec) = scale_global(sx, 1), scale_global(sw, 0)
            out_spec = P("x", None) if op == "gemm_reduce_scatter" else P()
            fn = getattr(pk, op)
        body = lambda a, b, c, d: fn(a, b, "x", x_scale=scalar(c), w_scale=scalar(d))
        with cost_model.override(mode=mode):
            f = jax.jit(jax.shard_map(body, mesh=mesh,
                                      in_specs=(x_spec, w_spec, sx_spec, sw_spec),
                                      out_specs=out_spec))
            args = [t.place(x, x_spec), t.place(w, w_spec), t.place(gsx, sx_spec),
                    t.place(gsw, sw_spec)]
            return f(*args)

    def model(op: str, xs, ws, sx, sw) -> np.ndarray:
        """This rank's result (see the module docstring)."""
        if op == "all_gather_gemm":
            x_full = np.concatenate([dequantized(x, s, "x") for x, s in zip(xs, sx)])
            return bf16_round(x_full @ dequantized(ws[me], sw[me], "w"))
        parts = [bf16_round(dequantized(x, a, "x") @ dequantized(w, b, "w"))
                 for x, w, a, b in zip(xs, ws, sx, sw)]
        total = bf16_round(np.sum(parts, axis=0))
        if op == "gemm_all_reduce":
            return total
        rows = total.shape[0] // n
        return total[me * rows:(me + 1) * rows]

    count = 0

    def case(op: str, rows: int, k: int, cols: int, fx, fw, blockwise: bool, seed: int,
             mode: str | None = None):
        nonlocal count
        rng = np.random.default_rng(seed)
        for call in range(2):  # a second call with new inputs finds the first one's epoch
            xs, ws, sx, sw = inputs(rng, rows, k, cols, fx, fw, blockwise,
                                    tied=op != "all_gather_gemm")
            got = t.local(run(op, xs, ws, sx, sw, mode)).astype(np.float64)
            want = model(op, xs, ws, sx, sw)
            what = (f"{op} {'block' if blockwise else 'tensor'} mode={mode} rows={rows} k={k} "
                    f"cols={cols} call {call}")
            if got.shape != want.shape:
                raise AssertionError(f"rank {me}: {what}: shape {got.shape} vs {want.shape}")
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                raise AssertionError(f"rank {me}: {what}: {len(bad)} of {got.size} differ, "
                                     f"first {bad[:3].tolist()} got {got[tuple(bad[0])]} want "
                                     f"{want[tuple(bad[0])]}")
        count += 1

    t0 = time.time()
    k_tensor = 128 // n  # per-rank K of gemm_rs / gemm_ar: sums below 2 K P = 256
    k_block = 128 * max(1, 16 // (2 * n)) - 16  # K / 128 * P <= 16, the last block partial
    for op in ("gemm_reduce_scatter", "gemm_all_reduce"):
        rows = 100 * n if op == "gemm_reduce_scatter" else 75
        for mode in ("fused", "serial"):
            case(op, rows, max(16, k_tensor), 72, e4m3, e5m2, False, 1, mode)
            case(op, rows, k_block, 136, e5m2, e4m3, True, 2, mode)
    for mode in ("fused", "serial"):
        case("all_gather_gemm", 100, 128, 136, e4m3, e4m3, False, 3, mode)
        case("all_gather_gemm", 37, 64, 40, e5m2, e4m3, False, 4, mode)
        case("all_gather_gemm", 100, 400, 136, e4m3, e5m2, True, 5, mode)
    print(f"tp_fp8_mp OK: P={n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

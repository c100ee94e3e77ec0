"""pk_jax's cross-rank ops in the rank emulator: the launcher fields of one call, its inputs on
the device, its outputs poisoned before the call, and the numpy reference it must equal.

A `Case` is the host side of one call (per-rank numpy inputs, the launcher's parameters, the
expected per-rank outputs); `Call` puts it on a `World`'s device, queues it and checks it.
The parameters mirror what the ops' Python lowerings pass to their FFI handlers
(pk_jax/ops/*.py), so a case runs the launcher exactly as XLA would for the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pk_jax import _op_table
from pk_jax._backend import COLLECTIVES
from pk_jax._backend import TP_GEMMS as GEMMS
from pk_jax.testing.emulator import DTYPES, DeviceBuffer, World, np_dtype

OPS = COLLECTIVES + GEMMS
# Expert-parallel MoE: dispatch, its per-slot form (the combine's VJP), combine, and the
# combine's unsummed gather (its weights' VJP). Their launcher fields are named in the cases.
MOE = ("moe_dispatch", "moe_scatter", "moe_combine", "moe_gather")
# Sequence parallelism: the fused ring attention forward and backward and the fused Ulysses
# forward (launcher fields named in the cases).
ATTENTION = ("ring_attn", "ring_attn_bwd", "ulysses_attn")
# Dispatch fused with the first expert GEMM, and the second expert GEMM fused with the combine
# (not in MOE: their cases come from tests/gpu/emu_cases.py's fused_case and gemm_combine_case,
# their suites are tests/gpu/test_emulator_moe_fused.py).
FUSED_MOE = ("moe_dispatch_gemm", "moe_gemm_combine")
# The fused TP GEMMs in fp8 (per-tensor or blockwise scales; their cases: gemm_rs_fp8 /
# gemm_ar_fp8 / ag_gemm_fp8 below, their suite tests/gpu/test_emulator_fp8.py).
FP8_GEMMS = ("gemm_rs_fp8", "gemm_ar_fp8", "ag_gemm_fp8")
# The tile configs the fused GEMMs take (ffi/op_table.h Tile); the fp8 ones take 128x256 (4
# stages, matmul_fp8's) or 128x128.
TILE_128x128, TILE_128x256_S3 = _op_table.TILES["128x128"], _op_table.TILES["128x256_s3"]
TILE_128x256 = _op_table.TILES["128x256"]


@dataclass
class Case:
    """One call of `op` on every rank: inputs[r] and expected[r] map buffer names to arrays."""

    op: str
    dtype: str
    inputs: list[dict[str, np.ndarray]]
    expected: list[dict[str, np.ndarray]]
    params: dict = field(default_factory=dict)
    exact: bool = True
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def world(self) -> int:
        return len(self.inputs)


def _cast(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(a, np.float64).astype(np.float32).astype(np_dtype(dtype))


def integers(rng: np.random.Generator, shape, lo: int = -3, hi: int = 4) -> np.ndarray:
    return rng.integers(lo, hi, size=shape).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Collectives (flattened views; the runs are what the ops' lowerings pass)

def all_reduce(xs: list[np.ndarray], dtype: str, *, algo: int = 0, exact: bool = True) -> Case:
    """y = sum over ranks (fp32 in the kernel: exact for integers in the type's range)."""
    total = np.sum([np.asarray(x, np.float64) for x in xs], axis=0)
    y = _cast(total, dtype)
    return Case("all_reduce", dtype, [{"x": _cast(x, dtype)} for x in xs],
                [{"y": y} for _ in xs], {"p0": algo}, exact, 1e-2, 1e-2)


def all_gather(xs: list[np.ndarray], dtype: str) -> Case:
    """y = the ranks' x back to back (axis 0)."""
    xs = [x.astype(np_dtype(dtype)) if dtype == "int32" else _cast(x, dtype) for x in xs]
    y = np.concatenate([x.reshape(-1) for x in xs])
    return Case("all_gather", dtype, [{"x": x} for x in xs], [{"y": y} for _ in xs],
                {"p0": max(1, xs[0].size)})


def reduce_scatter(xs: list[np.ndarray], dtype: str, *, exact: bool = True) -> Case:
    """y_r = slice r (axis 0, n / P elements) of the sum over ranks."""
    p = len(xs)
    total = np.sum([np.asarray(x, np.float64).reshape(-1) for x in xs], axis=0)
    n = total.size
    ys = [_cast(total[r * n // p:(r + 1) * n // p], dtype) for r in range(p)]
    return Case("reduce_scatter", dtype, [{"x": _cast(x, dtype)} for x in xs],
                [{"y": y} for y in ys], {"p0": max(1, n // p)}, exact, 1e-2, 1e-2)


def all_to_all(xs: list[np.ndarray], dtype: str, split_axis: int, concat_axis: int) -> Case:
    """lax.all_to_all(x, split_axis, concat_axis, tiled=True) of every rank."""
    p = len(xs)
    xs = [x.astype(np_dtype(dtype)) if dtype == "int32" else _cast(x, dtype) for x in xs]
    ys = [np.concatenate([np.split(x, p, axis=split_axis)[r] for x in xs], axis=concat_axis)
          for r in range(p)]
    block = list(xs[0].shape)
    block[split_axis] //= p
    split_run = max(1, int(np.prod(block[split_axis:])))
    concat_run = max(1, int(np.prod(block[concat_axis:])))
    return Case("all_to_all", dtype, [{"x": x} for x in xs], [{"y": y} for y in ys],
                {"p0": split_run, "p1": concat_run})


# ---------------------------------------------------------------------------------------------
# Fused tensor-parallel GEMMs

def _gemm_params(m: int, n: int, config: int | None) -> dict:
    if config is None:
        config = TILE_128x256_S3 if m * n >= 4096 * 4096 else TILE_128x128
    return {"config": config, "group_m": 8}


def gemm_rs(xs, ws, dtype: str, *, config: int | None = None, exact: bool = True) -> Case:
    """y_r = rows [r M/P, (r+1) M/P) of sum_p x_p @ w_p (x_p [M, K], w_p [K, N])."""
    p = len(xs)
    total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws))
    m, n = total.shape
    ys = [_cast(total[r * m // p:(r + 1) * m // p], dtype) for r in range(p)]
    return Case("gemm_rs", dtype,
                [{"x": _cast(x, dtype), "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y} for y in ys], _gemm_params(m, n, config), exact, 2e-2, 2e-2)


def gemm_ar(xs, ws, dtype: str, *, config: int | None = None, exact: bool = True) -> Case:
    """y = sum_p x_p @ w_p on every rank."""
    total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws))
    y = _cast(total, dtype)
    return Case("gemm_ar", dtype,
                [{"x": _cast(x, dtype), "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y} for _ in xs], _gemm_params(*total.shape, config), exact, 2e-2, 2e-2)


def ag_gemm(xs, ws, dtype: str, *, num_comm_sms: int = 2, config: int | None = None,
            exact: bool = True) -> Case:
    """y_r = concat_p(x_p) @ w_r and x_full = concat_p(x_p) (x_p [Mp, K], w_r [K, N])."""
    xs = [_cast(x, dtype) for x in xs]
    full = np.concatenate(xs)
    ys = [_cast(full.astype(np.float64) @ np.asarray(w, np.float64), dtype) for w in ws]
    params = _gemm_params(full.shape[0], ys[0].shape[1], config)
    params["num_comm_sms"] = num_comm_sms
    return Case("ag_gemm", dtype, [{"x": x, "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y, "x_full": full} for y in ys], params, exact, 2e-2, 2e-2)


# ---------------------------------------------------------------------------------------------
# The fused TP GEMMs in fp8: x_p [M, K] and wt_p [N, K] (w transposed) in fp8 with rank p's own
# scalar scales; y bf16.

def fp8_values(a: np.ndarray, fmt: str) -> np.ndarray:
    """`a` rounded to fp8 format `fmt` (float8_e4m3fn or float8_e5m2), as that dtype."""
    import ml_dtypes

    return np.asarray(a, np.float32).astype(getattr(ml_dtypes, fmt))


def fp8_rank_partials(xs, wts, x_scales, w_scales) -> list[np.ndarray]:
    """What each rank adds into the owners' buffers: its fp32-accumulated product of the fp8
    values (float64 here: exact for the sizes the tests use) dequantized by its own scales
    (scalars, or blocks: x's [M, KB] per row and 128 columns, w's [KB, NB] per 128 x 128 block
    of w [K, N]), rounded to bf16 once (the kernel's epilogue)."""
    import ml_dtypes

    out = []
    for x, wt, sx, sw in zip(xs, wts, x_scales, w_scales):
        x, wt = np.asarray(x, np.float64), np.asarray(wt, np.float64)
        sx = np.asarray(sx, np.float32).astype(np.float64)
        sw = np.asarray(sw, np.float32).astype(np.float64)
        k = x.shape[1]
        if sx.ndim == 2:
            x = x * np.repeat(sx, 128, axis=1)[:, :k]
            sx = 1.0
        if sw.ndim == 2:
            wt = wt * np.kron(sw, np.ones((128, 128)))[:k, :wt.shape[0]].T
            sw = 1.0
        scaled = (x @ wt.T * sx * sw).astype(np.float32)
        out.append(scaled.astype(ml_dtypes.bfloat16).astype(np.float64))
    return out


def _round_up(v: int, to: int) -> int:
    return -(-v // to) * to


def _fp8_scale_inputs(sx, sw, m: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's scales as the kernel reads them (pk_jax.ops.matmul.fp8_operands): one float
    each, or x's blocks transposed to [KB, M] and w's [KB, NB], rows zero-padded to 4 floats."""
    sx, sw = np.asarray(sx, np.float32), np.asarray(sw, np.float32)
    if sx.ndim == 0:
        return np.full((1,), sx, np.float32), np.full((1,), sw, np.float32)
    xs = np.zeros((sx.shape[1], _round_up(m, 4)), np.float32)
    xs[:, :m] = sx.T
    ws = np.zeros((sw.shape[0], _round_up(sw.shape[1], 4)), np.float32)
    ws[:, :sw.shape[1]] = sw
    return xs, ws


def fp8_gemm_fields(m: int, k: int, n: int, x_scales, w_scales, w_format: str, y_rows: int,
                    config: int | None = None) -> tuple[dict, list]:
    """The fields of an fp8 GEMM call (matmul_fp8, gemm_rs_fp8, gemm_ar_fp8) but its buffers
    and x's format, and every rank's scales as the kernel reads them (`_fp8_scale_inputs`):
    x [m, k], wt [n, k], y [y_rows, n] bf16; the tile config by size unless given (blockwise:
    128x128, the only one)."""
    scales = [_fp8_scale_inputs(sx, sw, m) for sx, sw in zip(x_scales, w_scales)]
    blockwise = scales[0][0].ndim == 2
    if config is None and not blockwise:
        config = TILE_128x256 if m * n >= 4096 * 4096 else TILE_128x128
    (xs_rows, xs_cols), (ws_rows, ws_cols) = ((s.shape if s.ndim == 2 else (1, 1))
                                              for s in scales[0])
    params = {"w_dtype": DTYPES[w_format], "y_dtype": DTYPES["bfloat16"],
              "blockwise": blockwise, "xs_rows": xs_rows, "xs_cols": xs_cols,
              "ws_rows": ws_rows, "ws_cols": ws_cols, "m": m, "k": k, "n": n,
              "y_rows": y_rows, "y_cols": n,
              "config": TILE_128x128 if blockwise else config, "group_m": 8}
    return params, scales


def _gemm_fp8(op: str, xs, wts, x_scales, w_scales, x_format: str, w_format: str,
              config: int | None, exact: bool) -> Case:
    p = len(xs)
    xs = [fp8_values(x, x_format) for x in xs]
    wts = [fp8_values(w, w_format) for w in wts]
    partials = fp8_rank_partials(xs, wts, x_scales, w_scales)
    total = np.sum(partials, axis=0)
    m, k = xs[0].shape
    n = wts[0].shape[0]
    if op == "gemm_rs_fp8":
        ys = [_cast(total[r * m // p:(r + 1) * m // p], "bfloat16") for r in range(p)]
    else:
        ys = [_cast(total, "bfloat16") for _ in range(p)]
    params, scales = fp8_gemm_fields(m, k, n, x_scales, w_scales, w_format, ys[0].shape[0],
                                     config)
    inputs = [{"x": x, "w": wt, "x_scale": a, "w_scale": b}
              for x, wt, (a, b) in zip(xs, wts, scales)]
    # Not exact: bf16 partials summed in bf16 in a varying order, against one rounding of the
    # float64 sum. Every running sum is at most P times the largest partial and each of the
    # P adds rounds by half a bf16 ulp (2^-9 relative) of it: P 2^-8 of the largest partial
    # bounds the difference, with room, and stays far below a typical partial (a dropped,
    # doubled or misplaced one shows in most elements).
    big = max(float(np.max(np.abs(q))) for q in partials) if total.size else 0.0
    return Case(op, x_format, inputs, [{"y": y} for y in ys], params, exact,
                p * big * 2.0 ** -8, 2.0 ** -7)


def gemm_rs_fp8(xs, wts, x_scales, w_scales, *, x_format: str = "float8_e4m3fn",
                w_format: str = "float8_e4m3fn", config: int | None = None,
                exact: bool = True) -> Case:
    """y_r = rows [r M/P, (r+1) M/P) of sum_p bf16(xs_p ws_p x_p @ wt_p^T) (x_p [M, K] and
    wt_p [N, K] rounded to the formats; x_scales, w_scales: per rank one float each, or blocks
    x [M, ceil(K / 128)] and w [ceil(K / 128), ceil(N / 128)] (fp8_rank_partials))."""
    return _gemm_fp8("gemm_rs_fp8", xs, wts, x_scales, w_scales, x_format, w_format, config,
                     exact)


def gemm_ar_fp8(xs, wts, x_scales, w_scales, *, x_format: str = "float8_e4m3fn",
                w_format: str = "float8_e4m3fn", config: int | None = None,
                exact: bool = True) -> Case:
    """y = sum_p bf16(xs_p ws_p x_p @ wt_p^T) on every rank (as gemm_rs_fp8, all M rows)."""
    return _gemm_fp8("gemm_ar_fp8", xs, wts, x_scales, w_scales, x_format, w_format, config,
                     exact)


def ag_gemm_fp8(xs, wts, x_scales, w_scales, *, x_format: str = "float8_e4m3fn",
                w_format: str = "float8_e4m3fn", num_comm_sms: int = 2,
                config: int | None = None, exact: bool = True) -> Case:
    """y_r = concat_p(xs_p x_p) @ (ws_r wt_r)^T in bf16, x_full = concat_p(x_p) and xs_full =
    the gathered x scales (per tensor [P]; blockwise [KB, P Mp], each rank's [Mp, KB]
    transposed): x_p [Mp, K] and wt_p [N, K] rounded to the formats, each rank's own scales
    (fp8_rank_partials). The model rounds each element to bf16 once, as the kernel does (no
    cross-rank sum): exact on exactly representable data; else within one bf16 rounding of the
    largest element (the fp32 sums' order may move an element across a rounding boundary)."""
    p = len(xs)
    xs = [fp8_values(x, x_format) for x in xs]
    wts = [fp8_values(w, w_format) for w in wts]
    mp, k = xs[0].shape
    n = wts[0].shape[0]
    ys = [np.concatenate(fp8_rank_partials(xs, [wt] * p, x_scales, [sw] * p))
          for wt, sw in zip(wts, w_scales)]
    params, scales = fp8_gemm_fields(mp, k, n, x_scales, w_scales, w_format, mp * p, config)
    params["num_comm_sms"] = num_comm_sms
    if params["blockwise"]:
        xs_full = np.concatenate([s[0][:, :mp] for s in scales], axis=1)
    else:
        xs_full = np.concatenate([s[0] for s in scales])
    inputs = [{"x": x, "w": wt, "x_scale": a, "w_scale": b}
              for x, wt, (a, b) in zip(xs, wts, scales)]
    outputs = [{"y": _cast(y, "bfloat16"), "x_full": np.concatenate(xs), "xs_full": xs_full}
               for y in ys]
    big = max(float(np.max(np.abs(y))) for y in ys) if ys[0].size else 0.0
    return Case("ag_gemm_fp8", x_format, inputs, outputs, params, exact, big * 2.0 ** -8,
                2.0 ** -7)


# ---------------------------------------------------------------------------------------------
# Expert-parallel MoE (pk_jax/ops/moe.py; rows ordered by expert, then (source rank, token, slot))

def moe_routing(ids: np.ndarray, num_experts: int, capacity: int):
    """ids [P, T, k] -> (dest [P, T, k], pos [P, T, k] (-1 dropped), group_sizes [P, E / P])."""
    p = ids.shape[0]
    el = num_experts // p
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_experts)
    starts = np.cumsum(counts) - counts
    within = np.empty(flat.size, np.int64)
    within[order] = np.arange(flat.size) - starts[flat[order]]
    block = counts.reshape(p, el)
    offs = (np.cumsum(block, axis=1) - block).reshape(-1)
    pos = offs[flat] + within
    pos = np.where(pos < capacity, pos, -1)
    sizes = np.clip(capacity - offs.reshape(p, el), 0, block)
    return ((flat // el).reshape(ids.shape).astype(np.int32),
            pos.reshape(ids.shape).astype(np.int32), sizes.astype(np.int32))


def _moe_params(t: int, k: int, h: int, num_experts: int, capacity: int) -> dict:
    return {"t": t, "k": k, "h": h, "num_experts": num_experts, "capacity": capacity}


def _place(rows_of, dest, pos, capacity: int, h: int, dtype: str) -> list[np.ndarray]:
    """Every rank's [capacity, h] buffer with rows_of(s, t, j) (already of `dtype`) at pos
    where dest is the rank, zeros elsewhere."""
    p = dest.shape[0]
    bufs = [np.zeros((capacity, h), np_dtype(dtype)) for _ in range(p)]
    for s, tt, j in zip(*np.nonzero(pos >= 0)):
        bufs[dest[s, tt, j]][pos[s, tt, j]] = rows_of(s, tt, j)
    return bufs


def moe_dispatch(xs: list[np.ndarray], ids: np.ndarray, dtype: str, *, num_experts: int,
                 capacity: int) -> Case:
    """tokens, group_sizes and the handle of every rank (xs[r] [T, H], ids [P, T, k])."""
    p, t, k = ids.shape
    h = xs[0].shape[1]
    xs = [_cast(x, dtype) for x in xs]
    dest, pos, sizes = moe_routing(ids, num_experts, capacity)
    tokens = _place(lambda s, tt, j: xs[s][tt], dest, pos, capacity, h, dtype)
    received = [np.count_nonzero((dest == r) & (pos < 0)) for r in range(p)]
    i32 = np.int32
    return Case("moe_dispatch", dtype,
                [{"x": xs[r], "ids": ids[r].astype(i32)} for r in range(p)],
                [{"tokens": tokens[r], "group_sizes": sizes[r], "dest": dest[r],
                  "pos": pos[r], "dropped": np.array([np.count_nonzero(pos[r] < 0)], i32),
                  "recv_dropped": np.array([received[r]], i32)} for r in range(p)],
                _moe_params(t, k, h, num_experts, capacity))


def moe_dispatch_gemm(xs: list[np.ndarray], ids: np.ndarray, ws: list[np.ndarray], dtype: str,
                      *, num_experts: int, capacity: int, num_comm_sms: int = 0) -> Case:
    """moe_dispatch, then y = grouped GEMM of every rank's tokens with its experts' ws[r]
    [E / P, H, N] (rows past the kept ones zero); order and order_off are the kernel's scratch
    (inputs here, so they are neither poisoned nor checked)."""
    d = moe_dispatch(xs, ids, dtype, num_experts=num_experts, capacity=capacity)
    p, t, k = ids.shape
    n = ws[0].shape[2]
    ws = [_cast(w, dtype) for w in ws]
    expected = []
    for r in range(p):
        tokens = d.expected[r]["tokens"].astype(np.float64)
        sizes = d.expected[r]["group_sizes"]
        y = np.zeros((capacity, n))
        off = 0
        for e, size in enumerate(sizes):
            y[off:off + size] = tokens[off:off + size] @ ws[r][e].astype(np.float64)
            off += size
        out = {k2: v for k2, v in d.expected[r].items() if k2 != "tokens"}
        out["y"] = _cast(y, dtype)
        expected.append(out)
    inputs = [{**d.inputs[r], "w": ws[r], "order": np.zeros(t * k, np.int32),
               "order_off": np.zeros(num_experts + 1, np.int32)} for r in range(p)]
    params = {**d.params, "n": n, "num_comm_sms": num_comm_sms}
    return Case("moe_dispatch_gemm", dtype, inputs, expected, params)


def moe_gemm_combine(hs: list[np.ndarray], ws: list[np.ndarray], weights: np.ndarray,
                     ids: np.ndarray, dtype: str, *, num_experts: int, capacity: int) -> Case:
    """y_r = grouped GEMM of hs[r] [capacity, F] with ws[r] [E / P, F, H] over rank r's group
    sizes (rounded to `dtype`), then moe_combine(y, weights) on every rank: out [T, H]. Rows of
    hs past the kept ones are never read (give them anything)."""
    p, t, k = ids.shape
    f, n = ws[0].shape[1], ws[0].shape[2]
    hs = [_cast(h, dtype) for h in hs]
    ws = [_cast(w, dtype) for w in ws]
    dest, pos, sizes = moe_routing(ids, num_experts, capacity)
    ys = []
    for r in range(p):
        y = np.zeros((capacity, n))
        off = 0
        for e, size in enumerate(sizes[r]):
            y[off:off + size] = hs[r][off:off + size].astype(np.float64) @ ws[r][e].astype(
                np.float64)
            off += size
        ys.append(_cast(y, dtype))
    comb = moe_combine(ys, weights, ids, dtype, num_experts=num_experts)
    inputs = [{"h": hs[r], "w": ws[r], "weights": weights[r].astype(np.float32),
               "dest": dest[r], "pos": pos[r], "group_sizes": sizes[r]} for r in range(p)]
    params = {"t": t, "k": k, "f": f, "n": n, "groups": num_experts // p, "capacity": capacity}
    return Case("moe_gemm_combine", dtype, inputs, comb.expected, params)


def moe_scatter(rows: list[np.ndarray], ids: np.ndarray, dtype: str, *, num_experts: int,
                capacity: int) -> Case:
    """The combine's transpose: rows[r] [T k, H], one per slot, to the slots' rows."""
    p, t, k = ids.shape
    h = rows[0].shape[1]
    rows = [_cast(x, dtype) for x in rows]
    dest, pos, sizes = moe_routing(ids, num_experts, capacity)
    tokens = _place(lambda s, tt, j: rows[s][tt * k + j], dest, pos, capacity, h, dtype)
    return Case("moe_scatter", dtype,
                [{"x": rows[r], "dest": dest[r], "pos": pos[r], "group_sizes": sizes[r]}
                 for r in range(p)],
                [{"tokens": tokens[r]} for r in range(p)],
                _moe_params(t, k, h, num_experts, capacity))


def moe_combine(ys: list[np.ndarray], weights: np.ndarray, ids: np.ndarray, dtype: str, *,
                num_experts: int, gather: bool = False) -> Case:
    """out[t] = sum_j w[t, j] y_dest[pos] on every rank (ys[r] [C, H], weights [P, T, k]), or
    with gather the k rows of each token unsummed ([T k, H], zero where dropped)."""
    p, t, k = ids.shape
    capacity, h = ys[0].shape
    ys = [_cast(y, dtype) for y in ys]
    dest, pos, _ = moe_routing(ids, num_experts, capacity)
    outs = []
    stacked = np.stack(ys)  # [P, C, H] in the dtype
    for r in range(p):
        rows = stacked[dest[r], np.maximum(pos[r], 0)].astype(np.float64)  # [T, k, H]
        rows[pos[r] < 0] = 0.0
        if gather:
            outs.append(_cast(rows.reshape(t * k, h), dtype))
        else:
            w = weights[r].astype(np.float32).astype(np.float64)
            outs.append(_cast(np.einsum("tk,tkh->th", w, rows), dtype))
    return Case("moe_gather" if gather else "moe_combine", dtype,
                [{"y": ys[r], "weights": weights[r].astype(np.float32), "dest": dest[r],
                  "pos": pos[r]} for r in range(p)],
                [{"out": o} for o in outs], {"t": t, "k": k, "h": h, "capacity": capacity})


# ---------------------------------------------------------------------------------------------
# Sequence-parallel attention (pk_jax/ops/ring_attn.py)

def seq_positions(p: int, rank: int, s_local: int, zigzag: bool) -> np.ndarray:
    """Global positions of rank `rank`'s S/P local rows (contiguous, or zigzag: chunks rank and
    2P-1-rank of S/(2P) positions)."""
    if not zigzag:
        return rank * s_local + np.arange(s_local)
    c = s_local // 2
    return np.concatenate([rank * c + np.arange(c), (2 * p - 1 - rank) * c + np.arange(c)])


def ring_attn(qs, ks, vs, dtype: str, *, causal: bool, zigzag: bool = False,
              scale: float | None = None, num_comm_sms: int = 2) -> Case:
    """o_r = softmax(scale q_r K^T) V over all ranks' keys (float32 reference over the whole
    sequence, causal on global positions) and lse_r [B, H, S/P]; qs[r] [B, S/P, H, D], ks[r]
    and vs[r] [B, S/P, Hkv, D]. Compared with bf16/fp16 tolerances."""
    p = len(qs)
    b, sl, h, d = qs[0].shape
    hkv = ks[0].shape[2]
    scale = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    zig = bool(causal and zigzag)
    qs, ks, vs = ([_cast(x, dtype) for x in xs] for xs in (qs, ks, vs))
    pos = [seq_positions(p, r, sl, zig) for r in range(p)]
    k_all = np.concatenate([k.astype(np.float32) for k in ks], axis=1)  # [B, S, Hkv, D]
    v_all = np.concatenate([v.astype(np.float32) for v in vs], axis=1)
    k_pos = np.concatenate(pos)
    group = h // hkv
    expected = []
    for r in range(p):
        q = qs[r].astype(np.float32)
        o = np.zeros((b, sl, h, d), np.float32)
        lse = np.zeros((b, h, sl), np.float32)
        for hh in range(h):
            kk, vv = k_all[:, :, hh // group], v_all[:, :, hh // group]  # [B, S, D]
            sc = q[:, :, hh] @ kk.transpose(0, 2, 1) * scale
            if causal:
                sc = np.where(k_pos[None, None, :] > pos[r][None, :, None], -np.inf, sc)
            mx = sc.max(axis=-1, keepdims=True)
            e = np.exp(sc - mx)
            den = e.sum(axis=-1, keepdims=True)
            o[:, :, hh] = (e / den) @ vv
            lse[:, hh] = (mx + np.log(den))[..., 0]
        expected.append({"o": _cast(o, dtype), "lse": lse})
    params = {"b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": scale,
              "causal": int(causal), "zigzag": int(zig), "num_comm_sms": num_comm_sms}
    return Case("ring_attn", dtype,
                [{"q": qs[r], "k": ks[r], "v": vs[r]} for r in range(p)], expected, params,
                exact=False, atol=2e-2, rtol=2e-2)


def segment_operands(ids: np.ndarray):
    """The masked kernels' segment operands of whole-sequence ids [B, S] (int32): (q_seg,
    kv_seg [B, SP], q_info, kv_info [B, SP / 64, 4]), SP = S rounded up to 128, as the ops
    pass them (pk_jax.ops.attention.segment_info, the same ids for queries and keys)."""
    import jax.numpy as jnp

    from pk_jax.ops.attention import segment_info

    ids = jnp.asarray(np.asarray(ids, np.int32))
    return tuple(np.asarray(x, np.int32) for x in segment_info(ids, ids))


def masked_visible(q_pos, k_pos, *, b: int, causal: bool, window=None, ids=None, q_len=None,
                   kv_len=None) -> np.ndarray:
    """bool [B, len(q_pos), len(k_pos)]: whether query row i (global position q_pos[i]) sees
    key j (k_pos[j]) under every mask (pk_jax/ops/_attention.py's definitions): causal, the
    window (left, right), segment ids of the whole sequence [B, S], and the lengths [B]."""
    qp, kp = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
    vis = np.ones((b, qp.shape[0], kp.shape[1]), bool)
    if causal:
        vis &= kp <= qp
    if window is not None:
        vis &= (kp >= qp - window[0]) & (kp <= qp + window[1])
    if ids is not None:
        ids = np.asarray(ids)
        vis &= ids[:, q_pos][:, :, None] == ids[:, k_pos][:, None, :]
    if q_len is not None:
        vis &= qp[None] < np.asarray(q_len)[:, None, None]
    if kv_len is not None:
        vis &= kp[None] < np.asarray(kv_len)[:, None, None]
    return vis


def ring_attn_masked(qs, ks, vs, dtype: str, *, causal: bool, zigzag: bool = False,
                     window=None, softcap: float | None = None, ids=None, q_len=None,
                     kv_len=None, scale: float | None = None, num_comm_sms: int = 2) -> Case:
    """The masked fused ring forward (pk_ring_attn with masked = 1): o_r and lse_r of every
    rank's rows over the whole sequence, every mask on global positions (the zigzag layout's
    with zigzag), float32; rows that see no key give o = 0 and lse = +inf. ids: the whole
    sequence's segment ids [B, S] in global order (or None); q_len, kv_len: [B] (None: S);
    window (left, right) or None; softcap c or None. Inputs per rank: q, k, v and the mask
    operands (the same on every rank: the lengths, and with ids their padded copies and chunk
    ranges, `segment_operands`)."""
    p = len(qs)
    b, sl, h, d = qs[0].shape
    hkv = ks[0].shape[2]
    s = sl * p
    scale = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    qs, ks, vs = ([_cast(x, dtype) for x in xs] for xs in (qs, ks, vs))
    pos = [seq_positions(p, r, sl, zigzag) for r in range(p)]
    k_all = np.concatenate([k.astype(np.float32) for k in ks], axis=1)  # [B, S, Hkv, D]
    v_all = np.concatenate([v.astype(np.float32) for v in vs], axis=1)
    k_pos = np.concatenate(pos)
    group = h // hkv
    lens = {"q_len": np.full(b, s, np.int32) if q_len is None else np.asarray(q_len, np.int32),
            "kv_len": np.full(b, s, np.int32) if kv_len is None else np.asarray(kv_len, np.int32)}
    operands = dict(lens)
    if ids is not None:
        operands.update(zip(("q_seg", "kv_seg", "q_info", "kv_info"), segment_operands(ids)))
    expected = []
    for r in range(p):
        vis = masked_visible(pos[r], k_pos, b=b, causal=causal, window=window, ids=ids,
                             q_len=lens["q_len"], kv_len=lens["kv_len"])
        q = qs[r].astype(np.float32)
        o = np.zeros((b, sl, h, d), np.float32)
        lse = np.full((b, h, sl), np.inf, np.float32)
        for hh in range(h):
            kk, vv = k_all[:, :, hh // group], v_all[:, :, hh // group]
            sc = q[:, :, hh] @ kk.transpose(0, 2, 1) * scale
            if softcap is not None:
                sc = softcap * np.tanh(sc / softcap)
            sc = np.where(vis, sc, -np.inf)
            mx = sc.max(axis=-1, keepdims=True)
            live = np.isfinite(mx)
            e = np.where(vis, np.exp(sc - np.where(live, mx, 0)), 0)
            den = e.sum(axis=-1, keepdims=True)
            o[:, :, hh] = (e / np.where(den > 0, den, 1)) @ vv
            lse[:, hh] = np.where(live, mx + np.log(np.where(den > 0, den, 1)), np.inf)[..., 0]
        expected.append({"o": _cast(o, dtype), "lse": lse})
    left, right = (s, s) if window is None else (min(window[0], s), min(window[1], s))
    params = {"b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": scale,
              "causal": int(causal), "zigzag": int(zigzag), "num_comm_sms": num_comm_sms,
              "masked": 1, "window_left": left, "window_right": right,
              "soft_cap": 0.0 if softcap is None else float(softcap),
              "segments": int(ids is not None)}
    return Case("ring_attn", dtype,
                [{"q": qs[r], "k": ks[r], "v": vs[r], **operands} for r in range(p)], expected,
                params, exact=False, atol=2e-2, rtol=2e-2)


def ulysses_attn(qs, ks, vs, dtype: str, *, causal: bool, scale: float | None = None,
                 num_comm_sms: int = 2) -> Case:
    """o_r = softmax(scale q_r K^T) V over all ranks' keys, with the contiguous layout (rank r
    holds positions [r S/P, (r+1) S/P)), and lse_r [B, H, S/P]: the same float32 reference over
    the whole sequence as `ring_attn` (Ulysses changes how the work is split, not the result);
    qs[r] [B, S/P, H, D], ks[r] and vs[r] [B, S/P, Hkv, D] with P dividing H and Hkv."""
    ring = ring_attn(qs, ks, vs, dtype, causal=causal, zigzag=False, scale=scale,
                     num_comm_sms=num_comm_sms)
    params = {k: v for k, v in ring.params.items() if k != "zigzag"}
    return Case("ulysses_attn", dtype, ring.inputs, ring.expected, params, exact=False,
                atol=ring.atol, rtol=ring.rtol)


def ring_attn_bwd(qs, ks, vs, dos, dtype: str, *, causal: bool, zigzag: bool = False,
                  scale: float | None = None, num_comm_sms: int = 2) -> Case:
    """The backward of `ring_attn`: dq_r, dk_r, dv_r of sum_r <o_r, do_r> (float32 reference
    over the whole sequence, causal on global positions). Inputs: q, k, v, do in `dtype`, and
    the float32 reference lse and delta = rowsum(do * o), [B, H, SP] (SP = S/P rounded up to
    128; lse = +inf and delta = 0 past S/P), as the kernel takes them."""
    p = len(qs)
    b, sl, h, d = qs[0].shape
    hkv = ks[0].shape[2]
    scale = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    zig = bool(causal and zigzag)
    qs, ks, vs, dos = ([_cast(x, dtype) for x in xs] for xs in (qs, ks, vs, dos))
    pos = [seq_positions(p, r, sl, zig) for r in range(p)]
    k_all = np.concatenate([k.astype(np.float32) for k in ks], axis=1)  # [B, S, Hkv, D]
    v_all = np.concatenate([v.astype(np.float32) for v in vs], axis=1)
    k_pos = np.concatenate(pos)
    group = h // hkv
    sp = -(-sl // 128) * 128
    dk_all = np.zeros_like(k_all)
    dv_all = np.zeros_like(v_all)
    inputs, dqs = [], []
    for r in range(p):
        q = qs[r].astype(np.float32)
        do = dos[r].astype(np.float32)
        dq = np.zeros((b, sl, h, d), np.float32)
        lse = np.full((b, h, sp), np.inf, np.float32)
        delta = np.zeros((b, h, sp), np.float32)
        for hh in range(h):
            kv = hh // group
            kk, vv = k_all[:, :, kv], v_all[:, :, kv]  # [B, S, D]
            sc = q[:, :, hh] @ kk.transpose(0, 2, 1) * scale
            if causal:
                sc = np.where(k_pos[None, None, :] > pos[r][None, :, None], -np.inf, sc)
            mx = sc.max(axis=-1, keepdims=True)
            e = np.exp(sc - mx)
            den = e.sum(axis=-1, keepdims=True)
            pr = e / den
            o = pr @ vv
            dl = np.sum(do[:, :, hh] * o, axis=-1)  # [B, Sl]
            dp = do[:, :, hh] @ vv.transpose(0, 2, 1)
            ds = pr * (dp - dl[..., None])
            dq[:, :, hh] = scale * (ds @ kk)
            dk_all[:, :, kv] += scale * (ds.transpose(0, 2, 1) @ q[:, :, hh])
            dv_all[:, :, kv] += pr.transpose(0, 2, 1) @ do[:, :, hh]
            lse[:, hh, :sl] = (mx + np.log(den))[..., 0]
            delta[:, hh, :sl] = dl
        inputs.append({"q": qs[r], "k": ks[r], "v": vs[r], "do": dos[r], "lse": lse,
                       "delta": delta})
        dqs.append(dq)
    expected = [{"dq": _cast(dqs[r], dtype),
                 "dk": _cast(dk_all[:, r * sl:(r + 1) * sl], dtype),
                 "dv": _cast(dv_all[:, r * sl:(r + 1) * sl], dtype)} for r in range(p)]
    # bf16/fp16 P and dS feed the tensor cores: the tolerance follows the gradients' size
    # (numpy with bf16-rounded P and dS: 0.2-0.4% of the largest gradient, S 3072, GQA 4:1).
    big = max(1.0, max(float(np.abs(x.astype(np.float32)).max()) for e in expected
                       for x in e.values()))
    params = {"b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": scale,
              "causal": int(causal), "zigzag": int(zig), "num_comm_sms": num_comm_sms}
    return Case("ring_attn_bwd", dtype, inputs, expected, params, exact=False,
                atol=1.5e-2 * big, rtol=1.5e-2)


# ---------------------------------------------------------------------------------------------

class Call:
    """A Case on a World's device: inputs copied in, outputs poisoned, ready to queue."""

    def __init__(self, world: World, case: Case, *, poison: int = 0xFF):
        if case.world != world.world:
            raise ValueError(f"Call: a case for P={case.world} on a world of {world.world}.")
        self.world, self.case = world, case
        self.buffers: list[dict[str, DeviceBuffer]] = []
        self.args: list[dict] = []
        for r in range(world.world):
            bufs = {k: DeviceBuffer.from_array(v) for k, v in case.inputs[r].items()}
            for k, v in case.expected[r].items():
                bufs[k] = DeviceBuffer(v.nbytes)
                bufs[k].fill(poison)
            self.buffers.append(bufs)
            self.args.append(self._fields(r, bufs))

    def _fields(self, r: int, bufs: dict[str, DeviceBuffer]) -> dict:
        c = self.case
        fields = {"dtype": DTYPES[c.dtype], **c.params}
        fields.update({k: b for k, b in bufs.items()})
        # sizes in the params, buffers by their names
        if c.op in MOE + ATTENTION + FUSED_MOE + FP8_GEMMS + ("ulysses_attn_bwd",):
            return fields
        x = c.inputs[r]["x"]
        if c.op in COLLECTIVES:
            fields["n"] = x.size
            fields["n_out"] = c.expected[r]["y"].size
        else:
            y = c.expected[r]["y"]
            fields.update(m=x.shape[0], k=x.shape[1], n=c.inputs[r]["w"].shape[1],
                          y_rows=y.shape[0], y_cols=y.shape[1])
        return fields

    def launch(self, *, delays_ns: list[int] | None = None, skip: tuple[int, ...] = ()) -> None:
        self.world.call(self.case.op, self.args, delays_ns=delays_ns, skip=skip)

    def outputs(self, rank: int) -> dict[str, np.ndarray]:
        return {k: self.buffers[rank][k].read(v.dtype, v.shape)
                for k, v in self.case.expected[rank].items()}

    def check(self, ranks=None) -> list[str]:
        """Mismatches of every rank's outputs against the case (empty when all match)."""
        c = self.case
        problems = []
        for r in (range(c.world) if ranks is None else ranks):
            for k, got in self.outputs(r).items():
                want = c.expected[r][k]
                if c.exact:  # by value (-0 == 0; the NaN poison never equals)
                    ok = np.array_equal(got.astype(np.float64), want.astype(np.float64))
                else:
                    g, w = got.astype(np.float64), want.astype(np.float64)
                    # finite, but for expected infinities (the lse of rows no key is
                    # visible to), which must be met exactly
                    ok = (bool(np.all(np.isfinite(g) | (np.isinf(w) & (g == w))))
                          and np.allclose(g, w, rtol=c.rtol, atol=c.atol))
                if not ok:
                    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
                    close = np.isclose(g, w, rtol=c.rtol, atol=c.atol)
                    bad = np.flatnonzero(~close | ~np.isfinite(g))
                    i = int(bad[0]) if bad.size else 0
                    problems.append(f"{c.op} rank {r} {k}{list(want.shape)}: {bad.size} "
                                    f"elements differ, first at {i}: got {g[i]} want {w[i]}")
        return problems

    def free(self) -> None:
        for bufs in self.buffers:
            for b in bufs.values():
                b.free()
        self.buffers = []

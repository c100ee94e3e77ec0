"""grouped_matmul: the grouped (ragged) GEMM of MoE experts (reference: `jax.lax.ragged_dot`).

Rows of `x` are split into consecutive groups by `group_sizes`; group e is multiplied by
`w[e]`. The kernel (cuda/kernels/grouped_matmul.cuh) reads `group_sizes` on the device, so the
sizes are traced values: changing them never recompiles and never syncs with the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax import fp8 as _fp8
from pk_jax.ops import _vjp

__all__ = ["grouped_matmul"]  # exported by pk_jax/__init__.py

STEM = "grouped_matmul"

# Kernel modes (cuda/kernels/grouped_matmul.cuh, enum mode_id). _FEW: the forward of calls of
# at most FEW_MAX_ROWS rows (decode) by the few-rows kernel. _FWD_PP, _DX_PP: the forward and
# dx by the tiled kernel's ping-pong schedule (128 x 128 tiles; one consumer stores while the
# other computes).
_FWD, _DX, _DW, _FEW, _FWD_PP, _DX_PP = 0, 1, 2, 3, 4, 5
# Output widths (the forward's N, dx's K) that take the ping-pong schedule's 128-wide tiles:
# those where 256-wide tiles compute more than PINGPONG_WASTE of the width in extra padding
# columns (1408: 128 of them, 9%), which is where the ping-pong runs won; elsewhere its
# 128 x 128 tiles lose to the 128 x 256 ones (bench/results/grouped_matmul_notes.md). Chosen on
# those rows, in sample; judged on bench/results/grouped_schedule_cases_2.json (the notes).
PINGPONG_WASTE = 0.08
FEW_MAX_ROWS = _op_table.GROUPED_FEW_MAX_ROWS
# Most groups one kernel call takes (the op table's); more run the reference.
MAX_GROUPS = _op_table.MAX_GROUPS
# Block-rows per band of the persistent tile order (as matmul's).
_GROUP_M = 16


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
                   out_dtype=None, w_layout: str = "ekn") -> jax.Array:
    """Multiplies each group of rows of `x` by its own matrix `w[e]`, fp32 accumulation.

    Group e is rows [sum(group_sizes[:e]), sum(group_sizes[:e + 1])) of `x`; rows past
    sum(group_sizes) are zero in the result. Works inside and outside `shard_map` (a purely
    local product) and under `jit`; `group_sizes` may change between calls without a recompile.

    Sizes outside the contract follow the kernel's rule (the sizes are traced, so they are not
    checked): a negative size counts as 0 (an empty group that moves no later group), and the
    groups' ranges, from the cumulative sums of those clamped sizes, are cut at M (rows past M
    do not exist; groups that start at or past M are empty).

    With fp8 operands (`pk_jax.fp8`: float8_e4m3fn or float8_e5m2, each with its float32
    dequantization scale) the product is of the dequantized operands, in `out_dtype`: on Hopper
    GPUs by the fp8 kernel (pk_grouped_matmul_fp8), elsewhere by its reference (dequantize,
    then `ragged_dot` in float32). Its gradient is the reference's. The fp8 kernel reads each
    expert's weight transposed, [N, K]: weights kept that way (`w_layout="enk"`, w [E, N, K])
    save the transpose of all of w on every call, which measured 1.2-2.5x of the kernel's time
    (bench/results/fp8_notes.md).

    Args:
        x: [M, K], bf16 or fp16, K a multiple of 8; or fp8, K a multiple of 16.
        w: [E, K, N], same dtype as `x` (fp8: either format).
        group_sizes: [E] int32, non-negative, summing to at most M (otherwise as above).
        x_scale: fp8 only: float32, a scalar or [M, ceil(K / 128)] (per row and 128 columns).
        w_scale: fp8 only: float32, a scalar, [E] (per expert) or [E, ceil(K / 128),
            ceil(N / 128)] (each expert's 128 x 128 blocks).
        out_dtype: fp8 only: bfloat16 (the default) or float32.
        w_layout: fp8 only: "ekn" (w [E, K, N], the default) or "enk" (each expert's w
            transposed, [E, N, K]; w_scale's blocks still those of w[e] as [K, N]).

    Returns:
        [M, N] in the dtype of `x` (fp8: `out_dtype`), equal to
        `jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)` cast to
        that dtype (fp8: of the dequantized operands, w taken in `w_layout`).

    Raises:
        ValueError: `x` not rank 2, `w` not rank 3, K of `x` and `w` that differ, K not a
            multiple of 8 (fp8: 16), `group_sizes` not of shape [E], scales of the wrong shape.
        TypeError: an unsupported dtype, `x` and `w` of different dtypes (16-bit),
            `group_sizes` not int32, scales missing or not float32 for fp8 operands or given
            for others.
    """
    if _fp8.is_fp8(x.dtype) or _fp8.is_fp8(w.dtype):
        check_fp8(x, w, group_sizes, x_scale, w_scale, out_dtype, w_layout=w_layout)
        out_dtype = np.dtype(out_dtype or jnp.bfloat16)
        reference = functools.partial(fp8_reference, out_dtype=out_dtype, w_layout=w_layout)
        supported = _fp8_refusal(x, w, w_layout) is None
        if _backend.route(FP8_STEM, supported=supported).path == "kernel":
            return _vjp.with_reference_grad(
                functools.partial(_fp8_kernel, out_dtype=out_dtype, w_layout=w_layout),
                reference, x, w, group_sizes, x_scale, w_scale)
        return reference(x, w, group_sizes, x_scale, w_scale)
    if (x_scale is not None or w_scale is not None or out_dtype is not None
            or w_layout != "ekn"):
        raise TypeError(
            f"pk.{STEM}: x_scale, w_scale, out_dtype and w_layout are for fp8 operands "
            f"(pk_jax.fp8), and x is {x.dtype}; leave them out (the product comes out in x's "
            "dtype, w is [E, K, N]).")
    check(x, w, group_sizes)
    return _grouped(x, w, group_sizes)


def check(x, w, group_sizes) -> None:
    """The trace-time checks of `grouped_matmul` (shapes, dtypes, TMA alignment)."""
    op = STEM
    _checks.ndim_is(op, "x", x, 2)
    if w.ndim != 3:
        raise ValueError(f"pk.{op}: w must be [E, K, N] (one [K, N] matrix per group), got shape "
                         f"{w.shape}.")
    _checks.dtype_in(op, "x", x, _checks.MATMUL_DTYPES)
    _checks.same_dtype(op, "x", x, "w", w)
    if x.shape[1] != w.shape[1]:
        raise ValueError(
            f"pk.{op}: contraction dimensions differ: x has shape {x.shape} (K={x.shape[1]}) and "
            f"w has shape {w.shape} (K={w.shape[1]}). w must be [E, K, N] for x [M, K].")
    _checks.divisible(op, "K (x.shape[1])", x.shape[1], 8,
                      "Pad K to a multiple of 8 (zero columns of x and zero rows of w do not "
                      "change the product).")
    if np.dtype(group_sizes.dtype) != np.dtype(np.int32):
        raise TypeError(f"pk.{op}: group_sizes must be int32, got "
                        f"{np.dtype(group_sizes.dtype).name}. Cast it with "
                        "group_sizes.astype(jnp.int32).")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"pk.{op}: group_sizes must have shape [E] = ({w.shape[0]},) to match w "
                         f"{w.shape}, got {group_sizes.shape}.")


def reference(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The jax.lax reference of `grouped_matmul` (no checks), with the kernel's rule for
    negative sizes: each clamped to 0 first (ragged_dot would start the next group earlier,
    and rows would fall in two groups). ragged_dot itself cuts the ranges at M."""
    return jax.lax.ragged_dot(x, w, jnp.maximum(group_sizes, 0),
                              preferred_element_type=jnp.float32).astype(x.dtype)


def _kernel_applies(x: jax.Array, w: jax.Array) -> bool:
    return (x.dtype == w.dtype and x.dtype in _checks.MATMUL_DTYPES_NP
            and x.shape[1] % 8 == 0 and 1 <= w.shape[0] <= MAX_GROUPS
            and not _split(x) and not _split(w))


def _split(a: jax.Array) -> bool:
    """Whether `a` is split over non-manual mesh axes (an FFI call has no sharding rule)."""
    s = jax.typeof(a).sharding
    return not s.mesh.empty and any(p is not None for p in s.spec)


def _pad_cols(a: jax.Array, n_pad: int) -> jax.Array:
    n = a.shape[-1]
    if n == n_pad:
        return a
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, n_pad - n)])


def _call(mode: int, a, b, group_sizes, out_shape, dtype):
    return _ffi.call("pk_grouped_matmul", jax.ShapeDtypeStruct(out_shape, dtype), a, b,
                     group_sizes, mode=np.int64(mode), group_m=np.int64(_GROUP_M))


def _forward(x, w, group_sizes, mode=_FWD):
    m, n = x.shape[0], w.shape[2]
    # NOTES: TMA needs 16-byte row strides: N is padded to a multiple of 8 (zero columns of w)
    # and the extra output columns are sliced off (the few-rows kernel's 16-byte loads too).
    n_pad = -(-n // 8) * 8
    y = _call(mode, x, _pad_cols(w, n_pad), group_sizes, (m, n_pad), x.dtype)
    return y[:, :n] if n_pad != n else y


def pingpong_width(width: int) -> bool:
    """Whether a tiled product of `width` output columns takes the ping-pong schedule (128-wide
    tiles): where 256-wide ones pad it by more than PINGPONG_WASTE of it beyond what 128-wide
    ones do."""
    w8 = -(-width // 8) * 8
    pad = -(-w8 // 256) * 256 - -(-w8 // 128) * 128
    return pad > PINGPONG_WASTE * w8


def forward_mode(x: jax.Array, w: jax.Array) -> int:
    """The forward kernel of a call the kernels take: the few-rows kernel (FEW) at decode
    sizes, at most one row per expert on average (M <= E) and at most FEW_MAX_ROWS rows, where
    it streams each expert's w once (the tiled kernel's 128-row tiles are mostly padding
    there; bench/results/grouped_matmul_notes.md); else the tiled one, by its ping-pong
    schedule (FWD_PP) at the widths of `pingpong_width`, by its cooperative one (FWD) at the
    rest."""
    if x.shape[0] <= min(FEW_MAX_ROWS, w.shape[0]):
        return _FEW
    return _FWD_PP if pingpong_width(w.shape[2]) else _FWD


def _forced_forward(x, w, group_sizes, mode: int, kernel: str) -> jax.Array:
    check(x, w, group_sizes)
    if not _kernel_applies(x, w):
        raise ValueError(f"pk.{STEM}: the kernels do not take these operands (x {x.shape} "
                         f"{x.dtype}, w {w.shape} {w.dtype}).")
    _backend.require_kernel(STEM, f"pk.{STEM}: {kernel} (pk_{STEM})")
    return _forward(x, w, group_sizes, mode)


def few_rows_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The forward of `grouped_matmul` by the few-rows kernel (mode FEW), for calls of at most
    FEW_MAX_ROWS rows, whatever `forward_mode` would pick (the GPU tests' and
    bench/bench_grouped_matmul.py --specs' entry)."""
    if x.shape[0] > FEW_MAX_ROWS:
        raise ValueError(f"pk.{STEM}: the few-rows kernel takes at most {FEW_MAX_ROWS} rows, got "
                         f"x of shape {x.shape}.")
    return _forced_forward(x, w, group_sizes, _FEW, "the few-rows kernel")


def tiled_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                  pingpong: bool) -> jax.Array:
    """The forward of `grouped_matmul` by the tiled kernel, by its ping-pong schedule (mode
    FWD_PP) or its cooperative one (FWD), whatever `forward_mode` would pick (the GPU tests'
    and bench/bench_grouped_matmul.py's entry)."""
    return _forced_forward(x, w, group_sizes, _FWD_PP if pingpong else _FWD,
                           "the tiled kernel")


def _dx(dy, w, group_sizes, pingpong: bool | None = None):
    """dx [M, K] = dy_e @ w[e]^T per group; zero past sum(group_sizes). `pingpong`: the
    schedule (None: `pingpong_width` of K; the tests and the benchmark force either)."""
    m, k, n = dy.shape[0], w.shape[1], w.shape[2]
    n_pad = -(-n // 8) * 8
    if pingpong is None:
        pingpong = pingpong_width(k)
    return _call(_DX_PP if pingpong else _DX, _pad_cols(dy, n_pad), _pad_cols(w, n_pad),
                 group_sizes, (m, k), dy.dtype)


def _dw(x, dy, group_sizes, e):
    """dw [E, K, N] = x_e^T @ dy_e per group (zeros for empty groups)."""
    k, n = x.shape[1], dy.shape[1]
    n_pad = -(-n // 8) * 8
    dw = _call(_DW, x, _pad_cols(dy, n_pad), group_sizes, (e, k, n_pad), x.dtype)
    return dw[:, :, :n] if n_pad != n else dw


def _grouped(x, w, group_sizes):
    if _backend.route(STEM, supported=_kernel_applies(x, w)).path != "kernel":
        return reference(x, w, group_sizes)
    return _grouped_kernel(x, w, group_sizes)


@jax.custom_vjp
def _grouped_kernel(x, w, group_sizes):
    return _forward(x, w, group_sizes, forward_mode(x, w))


def _fwd(x, w, group_sizes):
    return _forward(x, w, group_sizes, forward_mode(x, w)), (x, w, group_sizes)


def _bwd(res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = _dx(dy, w, group_sizes)
    dw = _dw(x, dy, group_sizes, w.shape[0])
    dgs = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return _vjp.fit(dx, x), _vjp.fit(dw, w), dgs


_grouped_kernel.defvjp(_fwd, _bwd)


# ---------------------------------------------------------------------------------------------
# The fp8 forward (pk_grouped_matmul_fp8, cuda/kernels/grouped_matmul_fp8.cuh), the MoE experts
# in fp8: grouped_matmul's fp8 path where the router picks it. fp8_reference is
# its jax.lax reference; _fp8_kernel lays the operands out in XLA (fp8_grouped_operands) and
# calls the kernel (also the entry of the tests and benchmarks, whatever the route).

FP8_STEM = "grouped_matmul_fp8"
_FP8_TILE_128x256 = _op_table.TILES["128x256"]  # the fp8 kernel's tile shapes (its own stages)
_FP8_TILE_128x128 = _op_table.TILES["128x128"]  # also the only one of blockwise scaling


def _round_up(v: int, to: int) -> int:
    return -(-v // to) * to


def _w_kn(w, w_layout: str) -> tuple[int, int, int]:
    """(E, K, N) of the experts' weights in either layout ("ekn": [E, K, N]; "enk": [E, N, K])."""
    if w_layout not in ("ekn", "enk"):
        raise ValueError(f"pk.{STEM}: w_layout must be 'ekn' (w [E, K, N]) or 'enk' (each "
                         f"expert's w transposed, [E, N, K]), got {w_layout!r}.")
    e, a, b = w.shape
    return (e, a, b) if w_layout == "ekn" else (e, b, a)


def w_scale_block_shape(e: int, k: int, n: int) -> tuple[int, int, int]:
    """The experts' blockwise w scales: [E, ceil(K / 128), ceil(N / 128)] (each w[e] [K, N] per
    128 x 128 block, as pk_jax.fp8 scales one weight)."""
    return (e, *_fp8.block_shape("w", (k, n)))


def check_fp8(x, w, group_sizes, x_scale, w_scale, out_dtype=None, *,
              w_layout: str = "ekn") -> None:
    """The trace-time checks of the fp8 grouped product: x [M, K] and w [E, K, N] (or [E, N, K]
    for w_layout "enk") in fp8 (pk_jax.fp8.FORMATS, either on either side), K a multiple of 16,
    group_sizes int32 [E]; x_scale float32, a scalar or [M, ceil(K / 128)]; w_scale float32, a
    scalar, [E] (per expert) or [E, ceil(K / 128), ceil(N / 128)]; out_dtype bf16 or f32."""
    op = STEM
    formats = ", ".join(np.dtype(d).name for d in _fp8.FORMATS)
    _checks.ndim_is(op, "x", x, 2)
    if w.ndim != 3:
        raise ValueError(f"pk.{op}: w must be [E, K, N] (one [K, N] matrix per group), got shape "
                         f"{w.shape}.")
    for name, a in (("x", x), ("w", w)):
        if not _fp8.is_fp8(a.dtype):
            raise TypeError(f"pk.{op}: the fp8 product takes fp8 operands ({formats}); {name} is "
                            f"{np.dtype(a.dtype).name}. Quantize it with pk_jax.fp8.quantize.")
    e, k, n = _w_kn(w, w_layout)
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(
            f"pk.{op}: contraction dimensions differ: x has shape {x.shape} (K={x.shape[1]}) and "
            f"w has shape {w.shape} (K={k} with w_layout {w_layout!r}).")
    _checks.divisible(op, "K (x.shape[1])", k, 16,
                      "fp8 rows need 16-byte strides: pad K with zeros in x and w.")
    if np.dtype(group_sizes.dtype) != np.dtype(np.int32):
        raise TypeError(f"pk.{op}: group_sizes must be int32, got "
                        f"{np.dtype(group_sizes.dtype).name}. Cast it with "
                        "group_sizes.astype(jnp.int32).")
    if group_sizes.shape != (e,):
        raise ValueError(f"pk.{op}: group_sizes must have shape [E] = ({e},) to match w "
                         f"{w.shape}, got {group_sizes.shape}.")
    x_block = _fp8.block_shape("x", (m, k))
    w_block = w_scale_block_shape(e, k, n)
    for name, scale, shapes in (("x_scale", x_scale, ((), x_block)),
                                ("w_scale", w_scale, ((), (e,), w_block))):
        listed = " or ".join("a scalar" if s == () else str(list(s)) for s in shapes)
        if scale is None:
            raise TypeError(f"pk.{op}: fp8 operands need {name}: {listed} (float32).")
        if getattr(scale, "dtype", None) != jnp.float32:
            raise TypeError(f"pk.{op}: {name} must be float32, got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)}.")
        if tuple(scale.shape) not in shapes:
            raise ValueError(f"pk.{op}: {name} must be {listed} for x {list(x.shape)} and w "
                             f"{list(w.shape)} ({w_layout}), got shape {list(scale.shape)}.")
    if out_dtype is not None and np.dtype(out_dtype) not in (np.dtype(jnp.bfloat16),
                                                             np.dtype(jnp.float32)):
        raise TypeError(f"pk.{op}: out_dtype must be bfloat16 or float32 for fp8 operands, got "
                        f"{np.dtype(out_dtype).name}.")


def _w_dequantized(w, w_scale, w_layout: str) -> jax.Array:
    """float32 experts' weights [E, K, N] with their scales (a scalar, [E] or blockwise)."""
    w = w if w_layout == "ekn" else jnp.swapaxes(w, 1, 2)
    w_scale = jnp.asarray(w_scale, jnp.float32)
    if w_scale.ndim <= 1:
        return w.astype(jnp.float32) * jnp.reshape(w_scale, (-1, 1, 1))
    return jax.vmap(lambda we, se: _fp8.dequantize(we, se, "w"))(w, w_scale)


def fp8_reference(x, w, group_sizes, x_scale, w_scale, out_dtype=jnp.bfloat16, *,
                  w_layout: str = "ekn") -> jax.Array:
    """The fp8 grouped product's reference (no checks): both operands dequantized to float32,
    then ragged_dot in float32, with the kernel's rule for negative sizes (clamped to 0)."""
    xf = _fp8.dequantize(x, jnp.asarray(x_scale, jnp.float32), "x")
    return jax.lax.ragged_dot(xf, _w_dequantized(w, w_scale, w_layout),
                              jnp.maximum(group_sizes, 0), precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32).astype(out_dtype)


def fp8_grouped_operands(x, w, x_scale, w_scale, *, w_layout: str = "ekn") -> tuple:
    """The fp8 grouped product's operands as pk_grouped_matmul_fp8 takes them, laid out in XLA.

    - w transposed per expert to wt [E, N, K] (fp8 wgmma reads B K-major): one copy of w's bytes
      per call; weights kept as [E, N, K] (`w_layout="enk"`) skip it. Zero rows pad N to a
      multiple of 8 (y's 16-byte TMA rows); the caller slices the extra columns off.
    - Per tensor (x_scale a scalar, w_scale a scalar or [E]): x_scale as it is, w_scale as [E].
    - Blockwise (either scale blockwise; the other broadcast to its blocks): x_scale transposed
      to [KB, M] (a row tile's 128 row scales of one k-block are one contiguous TMA box from any
      first row), w_scale [E, KB, NB] seen as [E * KB, NB] (expert e's k-block kb is row e KB +
      kb); each row zero-padded to a multiple of 4 floats (TMA's 16-byte strides).

    Returns:
        (x, wt [E, N8, K], xs, ws, blockwise, n): N8 = N rounded up to 8, n = N.
    """
    e, k, n = _w_kn(w, w_layout)
    wt = jnp.swapaxes(w, 1, 2) if w_layout == "ekn" else w
    n8 = _round_up(n, 8)
    if n8 != n:
        wt = jnp.pad(wt, ((0, 0), (0, n8 - n), (0, 0)))
    x_scale = jnp.asarray(x_scale, jnp.float32)
    w_scale = jnp.asarray(w_scale, jnp.float32)
    if x_scale.ndim == 0 and w_scale.ndim <= 1:
        return x, wt, x_scale, jnp.broadcast_to(w_scale, (e,)), False, n
    m = x.shape[0]
    kb, nb = _fp8.block_shape("w", (k, n))
    xs = jnp.broadcast_to(x_scale, (m, kb)).T
    xs = jnp.pad(xs, ((0, 0), (0, _round_up(m, 4) - m)))
    ws = w_scale if w_scale.ndim == 3 else jnp.reshape(w_scale, (-1, 1, 1))
    ws = jnp.broadcast_to(ws, (e, kb, nb))
    ws = jnp.pad(ws, ((0, 0), (0, 0), (0, _round_up(nb, 4) - nb))).reshape(e * kb, -1)
    return x, wt, xs, ws, True, n


def fp8_tile_config(n8: int, blockwise: bool) -> int:
    """The fp8 grouped kernel's tile: 128x128 for blockwise scaling (its two accumulators fit in
    registers only there) and for outputs of at most 128 columns (a 256-wide tile would be half
    padding), else 128x256 (the fewest bytes loaded per FLOP)."""
    return _FP8_TILE_128x128 if blockwise or n8 <= 128 else _FP8_TILE_128x256


def _fp8_refusal(x, w, w_layout: str) -> str | None:
    """Why the fp8 kernel does not take these (checked) operands, or None where it does."""
    e, k, n = _w_kn(w, w_layout)
    if e > MAX_GROUPS:
        return f"the fp8 kernel takes at most {MAX_GROUPS} groups, got w of shape {w.shape}."
    if max(x.shape[0], _round_up(n, 8), k, e * -(-k // _fp8.BLOCK)) > _op_table.MAX_DIM:
        return (f"the fp8 kernel indexes sizes in int32; M, N and K must be at most "
                f"{_op_table.MAX_DIM}.")
    if _split(x) or _split(w):
        return ("the fp8 kernel takes local operands (inside shard_map or unsplit); x or w is "
                "split over mesh axes here.")
    return None


def _fp8_kernel(x, w, group_sizes, x_scale, w_scale, out_dtype=None, *,
                w_layout: str = "ekn") -> jax.Array:
    """The fp8 grouped product by pk_grouped_matmul_fp8, whatever the router would pick
    (the tests' and the benchmark's entry, and grouped_matmul's kernel path).

    Args and checks as check_fp8; `w_layout="enk"`: each expert's w is given transposed, [E, N,
    K] (weights stored that way save the transpose in XLA).

    Returns:
        [M, N] in out_dtype (bf16 by default): fp8_reference's product.

    Raises:
        ValueError, TypeError: as check_fp8; more groups than the kernel takes, or sizes past
            its int32 indexing.
        RuntimeError: the kernel cannot run here (no sm_90 GPU, or no extension with it).
    """
    check_fp8(x, w, group_sizes, x_scale, w_scale, out_dtype, w_layout=w_layout)
    refusal = _fp8_refusal(x, w, w_layout)
    if refusal is not None:
        raise ValueError(f"pk.{STEM}: {refusal}")
    _backend.require_kernel(FP8_STEM, f"pk.{STEM}: the fp8 kernel (pk_{FP8_STEM})")
    x, wt, xs, ws, blockwise, n = fp8_grouped_operands(x, w, x_scale, w_scale,
                                                       w_layout=w_layout)
    m, n8 = x.shape[0], wt.shape[1]
    out = jax.ShapeDtypeStruct((m, n8), np.dtype(out_dtype or jnp.bfloat16))
    y = _ffi.call("pk_grouped_matmul_fp8", out, x, wt, xs, ws, group_sizes,
                  config=np.int64(fp8_tile_config(n8, blockwise)), group_m=np.int64(_GROUP_M))
    return y[:, :n] if n8 != n else y

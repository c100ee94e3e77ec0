"""matmul: y = x @ w on one device, fp32 accumulation (reference: `jnp.dot`).

The local GEMM engine that the fused ops build on; also the backward pass of every GEMM op.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax import fp8 as _fp8
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["matmul"]  # exported by pk_jax/__init__.py

STEM = "matmul"


def matmul(x: jax.Array, w: jax.Array, *, x_scale: jax.Array | None = None,
           w_scale: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """Multiplies `x` [M, K] by `w` [K, N] with fp32 accumulation.

    Works inside and outside `shard_map`; inside, it is a purely local product.

    With fp8 operands (`pk_jax.fp8`: float8_e4m3fn or float8_e5m2, each with its float32
    dequantization scale, per tensor or blockwise) the product is of the dequantized operands,
    accumulated in fp32, in `out_dtype`: on Hopper GPUs by the fp8 kernel (pk_matmul_fp8,
    e4m3/e5m2 wgmma, blockwise scales promoted per 128 of K), elsewhere by its reference
    (`pk_jax.fp8` dequantizes both operands, then a float32 dot). Its gradient is the
    reference's (float32 products of the dequantized operands); `pk_jax.nn.fp8_matmul` is the
    training recipe.

    Args:
        x: [M, K], bf16 or fp16, K a multiple of 8; or fp8, K a multiple of 16.
        w: [K, N], same dtype as `x` (fp8: either format).
        x_scale: fp8 only: float32, a scalar or [M, ceil(K / 128)] (per row and 128 columns).
        w_scale: fp8 only: float32, a scalar or [ceil(K / 128), ceil(N / 128)] (128 x 128
            blocks).
        out_dtype: fp8 only: bfloat16 (the default) or float32.

    Returns:
        [M, N] in the dtype of `x` (fp8: `out_dtype`), equal to
        `jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)` (fp8: of
        `pk_jax.fp8.dequantize(x, x_scale, "x")` and `dequantize(w, w_scale, "w")`).

    Raises:
        ValueError: operands not rank 2, contraction dimensions that differ, K not a multiple
            of 8 (fp8: 16), scales of the wrong shape.
        TypeError: an unsupported dtype, `x` and `w` of different dtypes (16-bit), scales
            missing or not float32 for fp8 operands or given for others.
    """
    if _fp8.is_fp8(x.dtype) or _fp8.is_fp8(w.dtype):
        _check_fp8(x, w, x_scale, w_scale, out_dtype)
        out_dtype = np.dtype(out_dtype or jnp.bfloat16)
        supported = (fp8_kernel_supports(x, w, x_scale, w_scale)
                     and not _split(x) and not _split(w))
        if _backend.route(FP8_STEM, supported=supported).path == "kernel":
            return _vjp.with_reference_grad(
                functools.partial(_fp8_kernel, out_dtype=out_dtype),
                functools.partial(fp8_reference, out_dtype=out_dtype), x, w, x_scale, w_scale)
        return fp8_reference(x, w, x_scale, w_scale, out_dtype)
    if x_scale is not None or w_scale is not None or out_dtype is not None:
        raise TypeError(
            f"pk.{STEM}: x_scale, w_scale and out_dtype are for fp8 operands (pk_jax.fp8), and "
            f"x is {x.dtype}; leave them out (the product comes out in x's dtype).")
    _checks.matmul_operands(STEM, x, w)
    return _matmul(x, w)


def _check_fp8(x, w, x_scale, w_scale, out_dtype) -> None:
    formats = ", ".join(np.dtype(d).name for d in _fp8.FORMATS)
    _checks.ndim_is(STEM, "x", x, 2)
    _checks.ndim_is(STEM, "w", w, 2)
    for name, a in (("x", x), ("w", w)):
        if not _fp8.is_fp8(a.dtype):
            raise TypeError(f"pk.{STEM}: with an fp8 operand both must be fp8 ({formats}); "
                            f"{name} is {a.dtype}. Quantize it with pk_jax.fp8.quantize.")
    if x.shape[1] != w.shape[0]:
        raise ValueError(
            f"pk.{STEM}: contraction dimensions differ: x has shape {x.shape} and w has shape "
            f"{w.shape}. w must be [K, N] for x [M, K].")
    _checks.divisible(STEM, "K (x.shape[1])", x.shape[1], 16,
                      "fp8 rows need 16-byte strides: pad K with zeros in x and w.")
    for name, scale, role, a in (("x_scale", x_scale, "x", x), ("w_scale", w_scale, "w", w)):
        block = _fp8.block_shape(role, a.shape)
        if scale is None:
            raise TypeError(f"pk.{STEM}: fp8 operands need {name}: a float32 scalar, or "
                            f"{list(block)} for blockwise scaling (pk_jax.fp8.quantize makes it).")
        if getattr(scale, "dtype", None) != jnp.float32:
            raise TypeError(f"pk.{STEM}: {name} must be float32, got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)}.")
        if scale.shape not in ((), block):
            raise ValueError(f"pk.{STEM}: {name} must be a scalar or {list(block)} for "
                             f"{role} of shape {list(a.shape)}, got shape {list(scale.shape)}.")
    if out_dtype is not None and np.dtype(out_dtype) not in (np.dtype(jnp.bfloat16),
                                                             np.dtype(jnp.float32)):
        raise TypeError(f"pk.{STEM}: out_dtype must be bfloat16 or float32 for fp8 operands, "
                        f"got {np.dtype(out_dtype).name}.")


def fp8_reference(x, w, x_scale, w_scale, out_dtype) -> jax.Array:
    """The fp8 product's reference: both operands dequantized to float32, a float32 dot."""
    return jnp.dot(_fp8.dequantize(x, x_scale, "x"), _fp8.dequantize(w, w_scale, "w"),
                   precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).astype(out_dtype)


# ---------------------------------------------------------------------------------------------
# The fp8 kernel (pk_matmul_fp8, cuda/kernels/matmul_fp8.cuh): pk.matmul's fp8 path where the
# router picks it; _fp8_kernel takes pk.matmul's operands, lays them out for the
# kernel in XLA, and calls it (also the entry of the tests and benchmarks, whatever the route).

FP8_STEM = "matmul_fp8"
_FP8_TILE_128x256 = _op_table.TILES["128x256"]  # the fp8 kernel's tile shapes (its own stages)
_FP8_TILE_128x128 = _op_table.TILES["128x128"]  # also the only one of blockwise scaling


def _round_up(v: int, to: int) -> int:
    return -(-v // to) * to


def fp8_operands(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array, *,
                 w_layout: str = "kn") -> tuple:
    """pk.matmul's fp8 operands as pk_matmul_fp8 takes them, laid out in XLA.

    - w transposed to wt [N, K] (fp8 wgmma reads B K-major): one copy of w's K * N bytes, read
      and written, on every call; a weight kept as [N, K] (`w_layout="nk"`) skips it. Rows of
      zeros pad N to a multiple of 8 (y's 16-byte TMA rows); the caller slices them off.
    - Per tensor (both scales scalars): the scalars, as they are.
    - Blockwise (either scale blockwise; a scalar one is broadcast to its blocks): x_scale
      transposed to [KB, M] (a tile's 128 row scales of one k-block are then one contiguous TMA
      box) and w_scale [KB, NB] as it is, each row zero-padded to a multiple of 4 floats (TMA's
      16-byte strides). KB = ceil(K / 128), NB = ceil(N / 128).

    Args:
        x: [M, K] fp8. w: [K, N] fp8 ("kn"), or wt [N, K] ("nk").
        x_scale, w_scale: as pk.matmul takes them (w_scale of the [K, N] weight either way).
        w_layout: "kn" or "nk".

    Returns:
        (x, wt [N8, K], xs, ws, blockwise, n): N8 = N rounded up to 8, n = N.
    """
    wt = w.T if w_layout == "kn" else w
    n, k = wt.shape
    n8 = _round_up(n, 8)
    if n8 != n:
        wt = jnp.pad(wt, ((0, n8 - n), (0, 0)))
    x_scale = jnp.asarray(x_scale, jnp.float32)
    w_scale = jnp.asarray(w_scale, jnp.float32)
    blockwise = x_scale.ndim == 2 or w_scale.ndim == 2
    if not blockwise:
        return x, wt, x_scale, w_scale, False, n
    m = x.shape[0]
    xs = jnp.broadcast_to(x_scale, _fp8.block_shape("x", (m, k))).T
    ws = jnp.broadcast_to(w_scale, _fp8.block_shape("w", (k, n)))
    xs = jnp.pad(xs, ((0, 0), (0, _round_up(m, 4) - m)))
    ws = jnp.pad(ws, ((0, 0), (0, _round_up(ws.shape[1], 4) - ws.shape[1])))
    return x, wt, xs, ws, True, n


def fp8_tile_config(m: int, n: int, blockwise: bool) -> int:
    """The fp8 kernel's tile for an [m, n] output: 128x128 for blockwise scaling (its two
    accumulators fit in registers only there), else as the bf16 kernel picks (tile_config)."""
    if blockwise:
        return _FP8_TILE_128x128
    return _FP8_TILE_128x128 if tile_config(m, n) == _TILE_128x128 else _FP8_TILE_128x256


def _logical_w(w: jax.Array, w_layout: str):
    """w as pk.matmul's checks see it, [K, N], whatever its layout (shape and dtype only)."""
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"pk.{STEM}: w_layout must be 'kn' (w [K, N]) or 'nk' (w transposed, "
                         f"[N, K]), got {w_layout!r}.")
    if w_layout == "kn" or w.ndim != 2:
        return w
    return jax.ShapeDtypeStruct((w.shape[1], w.shape[0]), w.dtype)


def fp8_kernel_supports(x, w, x_scale, w_scale, *, w_layout: str = "kn") -> bool:
    """Whether pk_matmul_fp8 takes these (checked) pk.matmul operands: sizes the kernel indexes
    in int32 (the checks already hold K to a multiple of 16)."""
    m, k = x.shape
    n = w.shape[1] if w_layout == "kn" else w.shape[0]
    return max(m, _round_up(n, 8), k) <= _op_table.MAX_DIM


def _fp8_kernel(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                out_dtype=None, *, w_layout: str = "kn") -> jax.Array:
    """pk.matmul's fp8 product by the fp8 kernel, whatever the router would pick (the GPU
    tests' and the benchmark's entry, and pk.matmul's kernel path).

    Args and checks as pk.matmul's fp8 path; `w_layout="nk"`: w is given transposed, [N, K]
    (a weight stored that way saves the kernel's transpose of w in XLA).

    Raises:
        ValueError, TypeError: as pk.matmul; an unknown `w_layout`.
        RuntimeError: the kernel cannot run here (no sm_90 GPU, or no extension with
            pk_matmul_fp8).
    """
    _check_fp8(x, _logical_w(w, w_layout), x_scale, w_scale, out_dtype)
    if not fp8_kernel_supports(x, w, x_scale, w_scale, w_layout=w_layout):
        raise ValueError(f"pk.{STEM}: the fp8 kernel indexes sizes in int32; M, N and K must "
                         f"be at most {_op_table.MAX_DIM}.")
    _backend.require_kernel(FP8_STEM, f"pk.{STEM}: the fp8 kernel (pk_{FP8_STEM})")
    x, wt, xs, ws, blockwise, n = fp8_operands(x, w, x_scale, w_scale, w_layout=w_layout)
    m, n8 = x.shape[0], wt.shape[0]
    out = jax.ShapeDtypeStruct((m, n8), np.dtype(out_dtype or jnp.bfloat16))
    y = _ffi.call("pk_matmul_fp8", out, x, wt, xs, ws,
                  config=np.int64(fp8_tile_config(m, n8, blockwise)),
                  group_m=np.int64(_GROUP_M))
    return y[:, :n] if n8 != n else y


def reference(x: jax.Array, w: jax.Array, *, out_sharding=None) -> jax.Array:
    return jnp.dot(x, w, preferred_element_type=jnp.float32,
                   out_sharding=out_sharding).astype(x.dtype)


def _sharding_of(a: jax.Array):
    """`a`'s sharding-in-types, or None when it is on no mesh."""
    s = jax.typeof(a).sharding
    return None if s.mesh.empty else s


def _split(a: jax.Array) -> bool:
    """Whether `a` is split over devices along mesh axes that are not manual here (a global
    array outside shard_map): an FFI call has no sharding rule for it."""
    s = jax.typeof(a).sharding
    return not s.mesh.empty and any(p is not None for p in s.spec)


def kernel_supports(x: jax.Array, w: jax.Array) -> bool:
    """Whether the CUDA kernel takes these operands (internal callers may pass others, e.g. the
    transposed operands of a backward pass, which then run the reference)."""
    return (x.ndim == 2 and w.ndim == 2 and x.dtype == w.dtype
            and x.dtype in _checks.MATMUL_DTYPES_NP and x.shape[1] % 8 == 0)


def matmul_impl(x: jax.Array, w: jax.Array, *, like: jax.Array | None = None) -> jax.Array:
    """x @ w by the kernel when it applies, else the reference; no user-facing checks.

    Used by the VJPs of every GEMM op, so it accepts any float dtype and any K.

    Args:
        like: the array whose sharding the result takes (a cotangent's primal), as JAX's own
            transpose of dot_general does: with explicitly sharded operands outside shard_map,
            a product whose contracted dimension is sharded is otherwise ambiguous.
    """
    supported = kernel_supports(x, w) and not _split(x) and not _split(w)
    if _backend.route(STEM, supported=supported).path == "kernel":
        return cuda_matmul(x, w)
    return reference(x, w, out_sharding=None if like is None else _sharding_of(like))


# Tile configurations of the kernel (cuda/kernels/matmul.cuh, enum config_id): BM x BN blocks.
_TILE_128x256 = 0     # 4 stages, stores staged in two 128-column rounds (benchmark table only)
_TILE_128x128 = 1     # 6 stages: small outputs
_TILE_128x256_S3 = 2  # 3 stages, whole-tile store staging: the default for large outputs
# Block-rows per band of the persistent tile order: 16 x 128 rows of x stay in L2 while the
# band's tiles sweep N.
_GROUP_M = 16
# NOTES: measured on the H200 (bench/results/matmul_notes.md): the 128x128 tiles run at about
# 0.9 of the 128x256 tiles' speed per tile-FLOP, so they win only when they need fewer waves;
# of the 128x256 rows, 3 stages with a store-free epilogue beat 4 stages with a two-round
# epilogue at every large shape.
_SPEED_128x128 = 0.9


def _num_sms() -> int:
    mesh = state.mesh_or_none()
    device = next(iter(mesh.devices.flat)) if mesh is not None else jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132)


def tile_config(m: int, n: int) -> int:
    """The kernel's tile configuration for an [m, n] output.

    128x256 tiles (3 stages) load the fewest bytes per FLOP; 128x128 tiles are picked when
    their waves (tiles / SMs, rounded up) times their cost beat the 128x256 tiles' waves, i.e.
    when the output is too small to give every SM a 128x256 tile.
    """
    sms = _num_sms()
    rows = -(-m // 128)
    waves_256 = -(-(rows * -(-n // 256)) // sms)
    waves_128 = -(-(rows * -(-n // 128)) // sms)
    return _TILE_128x256_S3 if waves_256 * 2 * _SPEED_128x128 <= waves_128 else _TILE_128x128


def cuda_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    m, n = x.shape[0], w.shape[1]
    # NOTES: TMA needs 16-byte row strides, so N is padded to a multiple of 8 here (zero
    # columns of w) and the extra output columns are sliced off.
    n_pad = -(-n // 8) * 8
    if n_pad != n:
        w = jnp.pad(w, ((0, 0), (0, n_pad - n)))
    out = jax.ShapeDtypeStruct((m, n_pad), x.dtype)
    y = _ffi.call("pk_matmul", out, x, w, config=np.int64(tile_config(m, n_pad)),
                  group_m=np.int64(_GROUP_M))
    return y[:, :n] if n_pad != n else y


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return matmul_impl(x, w)


def _matmul_fwd(x, w):
    return matmul_impl(x, w), (x, w)


def _matmul_bwd(res, dy):
    x, w = res
    dx = matmul_impl(dy, w.T, like=x)
    dw = matmul_impl(x.T, dy, like=w)
    return _vjp.fit(dx, x), _vjp.fit(dw, w)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)

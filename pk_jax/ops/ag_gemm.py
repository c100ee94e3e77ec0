"""ag_gemm: all-gather + GEMM, the column-parallel linear layer on row-sharded activations
(reference: `lax.all_gather(x, axis_name, axis=0, tiled=True) @ w`).

Its transpose is GEMM+RS (ops/gemm_rs.py) and the VJP is written with it, so the fused kernels
serve the backward pass too.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax import fp8 as _fp8
from pk_jax.ops import _tp, _vjp
from pk_jax.ops import all_gather as _ag
from pk_jax.ops import matmul as _mm
from pk_jax.runtime import state

__all__ = ["all_gather_gemm"]  # exported by pk_jax/__init__.py

STEM = "ag_gemm"
NAME = "all_gather_gemm"  # the public name, used in error messages


def all_gather_gemm(x: jax.Array, w: jax.Array, axis_name: str, *,
                    x_scale: jax.Array | None = None,
                    w_scale: jax.Array | None = None) -> jax.Array:
    """Gathers the row shards of `x` over `axis_name` (in rank order) and multiplies by `w`.

    With fp8 operands (`pk_jax.fp8`: float8_e4m3fn or float8_e5m2, each device's shards with
    their own float32 scales) the product is of the dequantized gathered rows, in bf16: on
    Hopper GPUs the fp8 rows (half the bytes of bf16) and their scales move, either in the
    fused fp8 kernel (the gather under the GEMM) or by the pk all_gather before the fp8 GEMM,
    as the cost model picks; elsewhere the reference (`fp8_reference`), whose gradient it has.

    Args:
        x: [M/P, K], bf16 or fp16, K a multiple of 8 (fp8: 16).
        w: [K, N], same dtype as `x` (typically this device's column shard of a weight; fp8:
            either format).
        axis_name: one axis of the mesh given to `pk.init`.
        x_scale: fp8 only: float32, a scalar or [M/P, ceil(K / 128)] (this device's rows).
        w_scale: fp8 only: float32, a scalar or [ceil(K / 128), ceil(N / 128)].

    Returns:
        [M, N] in the dtype of `x` (fp8: bf16), equal to
        `lax.all_gather(x, axis_name, axis=0, tiled=True) @ w` (fp32 accumulation).

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name`, not inside shard_map, operands not
            rank 2, contraction dimensions that differ, K not a multiple of 8 (fp8: 16), scales
            of the wrong shape.
        TypeError: an unsupported dtype, `x` and `w` of different dtypes (16-bit), scales
            missing or not float32 for fp8 operands or given for others.
    """
    p = _checks.axis_size(NAME, axis_name)
    if _fp8.is_fp8(x.dtype) or _fp8.is_fp8(w.dtype):
        mp, _, _ = _tp.check_fp8(NAME, x, w, x_scale, w_scale, "kn", rows="M/P", depth="K")
        if mp * p > _op_table.MAX_DIM:
            raise ValueError(f"pk.{NAME}: the fp8 kernels index sizes in int32; the gathered "
                             f"rows M = {mp * p} must be at most {_op_table.MAX_DIM}.")
        return _fp8_op(x, w, x_scale, w_scale, axis_name)
    _tp.no_scales(NAME, x, x_scale, w_scale)
    _checks.matmul_operands(NAME, x, w)
    return _ag_gemm(x, w, axis_name)


def reference(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return _mm.reference(jax.lax.all_gather(x, axis_name, axis=0, tiled=True), w)


def kernel_supports(x: jax.Array, w: jax.Array) -> bool:
    return _mm.kernel_supports(x, w)


def ag_gemm_impl(x: jax.Array, w: jax.Array, axis_name: str, *, return_gathered: bool = False):
    """The call as `_backend.route` decides it; no user-facing checks (used by the VJP of
    gemm_reduce_scatter with transposed operands). Paths: the fused kernel (pk_ag_gemm); the
    pk.all_gather kernel then pk.matmul (serial); pk.matmul alone over a 1-device axis (local);
    or the reference.

    Args:
        return_gathered: also return the gathered x [M, K] (the kernel writes it anyway), which
            the backward passes reuse instead of gathering twice.

    Returns:
        y, or (y, gathered x) when `return_gathered`.
    """
    p = jax.lax.axis_size(axis_name)
    mp, k, n = x.shape[0], x.shape[1], w.shape[1]
    r = _backend.route(STEM, axis_name, supported=kernel_supports(x, w),
                       gemm=(mp * p, n, k, x.dtype))
    if r.path == "reference":
        x_full = jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
        y = _mm.reference(x_full, w)
    elif r.path == "local" or mp == 0 or n == 0:
        x_full = x if p == 1 else jax.lax.all_gather(x, axis_name, axis=0, tiled=True)
        y = _mm.cuda_matmul(x_full, w)
    elif r.path == "serial":
        from pk_jax.ops import all_gather as ag

        x_full = ag.kernel(x, axis_name, 0)
        y = _mm.cuda_matmul(x_full, w)
    else:
        y, x_full = _fused(x, w, axis_name, r.num_comm_sms)
    return (y, x_full) if return_gathered else y


def _fused(x: jax.Array, w: jax.Array, axis_name: str, num_comm_sms: int):
    """The fused kernel pk_ag_gemm, returning (y, gathered x)."""
    p = jax.lax.axis_size(axis_name)
    mp, k, n = x.shape[0], x.shape[1], w.shape[1]
    w, n_pad = _tp.pad_n(w)
    _tp.check_workspace(NAME, _ffi.workspace_need("ag_gemm", p, m=mp, k=k),
                        f"staging its [{mp}, {k}] shard")
    # NOTES: the results vary along axis_name and every axis x or w varies along, which is
    # _ffi.call's default out_vma once the rank operand (varying along axis_name) is passed.
    y, x_full = _ffi.call(
        "pk_ag_gemm", (jax.ShapeDtypeStruct((mp * p, n_pad), x.dtype),
                       jax.ShapeDtypeStruct((mp * p, k), x.dtype)),
        x, w, _backend.rank_operand(axis_name), comm_id=np.int64(state.comm_id(axis_name)),
        config=np.int64(_mm.tile_config(mp * p, n_pad)), group_m=np.int64(_mm._GROUP_M),
        num_comm_sms=np.int64(num_comm_sms))
    return (y[:, :n] if n_pad != n else y), x_full


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ag_gemm(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return ag_gemm_impl(x, w, axis_name)


def _ag_gemm_fwd(x, w, axis_name):
    y, x_full = ag_gemm_impl(x, w, axis_name, return_gathered=True)
    return y, (x, x_full, w)


def _ag_gemm_bwd(axis_name, res, dy):
    # y = AG(x) @ w  =>  dx = RS(dy @ w^T) (a GEMM+RS), dw = AG(x)^T @ dy with the saved gather.
    from pk_jax.ops.gemm_rs import gemm_rs_impl

    x, x_full, w = res
    dx = gemm_rs_impl(dy, w.T, axis_name)
    dw = _mm.matmul_impl(x_full.T, dy)
    return _vjp.fit(dx, x), _vjp.fit(dw, w)


_ag_gemm.defvjp(_ag_gemm_fwd, _ag_gemm_bwd)


# ---------------------------------------------------------------------------------------------
# fp8: the reference, and the forms on GPUs (`_backend.route` gives "local", "serial" or
# "fused": pk_ag_gemm_fp8, cuda/kernels/ag_gemm_fp8.cuh).

FP8_STEM = _backend.GATHER_GEMM_FP8


def fp8_reference(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                  axis_name: str) -> jax.Array:
    """The fp8 form's reference: each device's rows dequantized with its own scales and
    gathered, a float32 dot with the dequantized w, then bf16."""
    x_full = jax.lax.all_gather(_fp8.dequantize(x, x_scale, "x"), axis_name, axis=0, tiled=True)
    return jnp.dot(x_full, _fp8.dequantize(w, w_scale, "w"), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _fp8_op(x, w, x_scale, w_scale, axis_name: str) -> jax.Array:
    p, (mp, k), n = jax.lax.axis_size(axis_name), x.shape, w.shape[1]
    scaling = "block" if x_scale.ndim == 2 or w_scale.ndim == 2 else "tensor"
    # Sizes checked: the fp8 GEMM takes them. The fused kernel moves blockwise x scales in
    # 16-byte units of a device's columns of [KB, M] (M/P a multiple of 4).
    fusable = mp > 0 and n > 0 and (scaling == "tensor" or mp % 4 == 0)
    r = _backend.route(FP8_STEM, axis_name, supported=fusable, gemm=(mp * p, n, k, None),
                       fp8=scaling)
    if r.path == "reference":
        return fp8_reference(x, w, x_scale, w_scale, axis_name)
    # The kernels' result varies along every axis an operand varies along (and along axis_name
    # after the pk all_gather); the reference's gathered rows do not vary along axis_name, so
    # the gradient's reference is cast to the kernels' type (the cast's transpose sums dy).
    axes = _ffi.vma(x) | _ffi.vma(w) | _ffi.vma(x_scale) | _ffi.vma(w_scale)
    if r.path in ("serial", "fused"):
        axes |= {axis_name}
    forward = partial(_fp8_forward, path=r.path, num_comm_sms=r.num_comm_sms,
                      axis_name=axis_name, axes=axes)
    ref = partial(_fp8_reference_varying, axis_name=axis_name, axes=axes)
    return _vjp.with_reference_grad(forward, ref, x, w, x_scale, w_scale)


def _fp8_reference_varying(x, w, x_scale, w_scale, *, axis_name: str, axes: frozenset):
    return _vjp.vary(fp8_reference(x, w, x_scale, w_scale, axis_name), axes)


def _gather_rows(a: jax.Array, axis_name: str) -> jax.Array:
    """The pk all_gather of `a` by rows; fp8 rows travel as bf16 pairs (the kernel moves bytes
    and takes 16-bit types; K is a multiple of 16, so no pair straddles two rows)."""
    if a.dtype.itemsize != 1:
        return _ag.kernel(a, axis_name, 0)
    pairs = jax.lax.bitcast_convert_type(a.reshape(a.shape[0], -1, 2), jnp.bfloat16)
    full = _ag.kernel(pairs, axis_name, 0)
    return jax.lax.bitcast_convert_type(full, a.dtype).reshape(-1, a.shape[1])


def _fused_fp8(x, w, x_scale, w_scale, axis_name: str, num_comm_sms: int):
    """The fused fp8 kernel pk_ag_gemm_fp8 on checked operands (w [K, N]): returns (y [M, N]
    bf16, x_full [M, K] in x's format, xs_full: the gathered x scales, [P] per tensor or
    [ceil(K / 128), M] blockwise, transposed as the kernel reads them)."""
    p, mp = jax.lax.axis_size(axis_name), x.shape[0]
    x, wt, xs, ws, blockwise, n = _mm.fp8_operands(x, w, x_scale, w_scale)
    k, n8 = x.shape[1], wt.shape[0]
    _tp.check_workspace(NAME, _ffi.workspace_need(FP8_STEM, p, m=mp, k=k, blockwise=blockwise),
                        f"staging its [{mp}, {k}] fp8 shard and its scales")
    scales = (-(-k // 128), mp * p) if blockwise else (p,)
    y, x_full, xs_full = _ffi.call(
        "pk_ag_gemm_fp8", (jax.ShapeDtypeStruct((mp * p, n8), jnp.bfloat16),
                           jax.ShapeDtypeStruct((mp * p, k), x.dtype),
                           jax.ShapeDtypeStruct(scales, jnp.float32)),
        x, wt, xs, ws, _backend.rank_operand(axis_name),
        comm_id=np.int64(state.comm_id(axis_name)),
        config=np.int64(_mm.fp8_tile_config(mp * p, n8, blockwise)),
        group_m=np.int64(_mm._GROUP_M), num_comm_sms=np.int64(num_comm_sms))
    return (y[:, :n] if n8 != n else y), x_full, xs_full


def _fp8_forward(x, w, x_scale, w_scale, *, path: str, num_comm_sms: int, axis_name: str,
                 axes: frozenset) -> jax.Array:
    """"fused": pk_ag_gemm_fp8. "local" (P = 1): the fp8 GEMM. "serial": the pk all_gather of
    the fp8 rows and of their x scales, then the fp8 GEMM of the gathered rows. A blockwise
    scale gives every gathered row its own x scales ([M, KB]; a device's scalar broadcast to its
    rows' blocks). With both scales per tensor the devices' x scales differ by rows, which the
    per-tensor kernel's one scale cannot express: it runs with x's scale 1 into float32, and
    each device's rows are scaled by its x scale in the rounding to bf16 (one elementwise pass
    over y in XLA)."""
    if path == "fused":
        return _vjp.vary(_fused_fp8(x, w, x_scale, w_scale, axis_name, num_comm_sms)[0], axes)
    if path == "local":
        return _vjp.vary(_mm._fp8_kernel(x, w, x_scale, w_scale, jnp.bfloat16), axes)
    p, mp, kb = jax.lax.axis_size(axis_name), x.shape[0], -(-x.shape[1] // 128)
    x_full = _gather_rows(x, axis_name)
    if x_scale.ndim == 2 or w_scale.ndim == 2:
        if x_scale.ndim == 0:
            x_scale = jnp.broadcast_to(x_scale, (mp, kb))
        y = _mm._fp8_kernel(x_full, w, _gather_rows(x_scale, axis_name), w_scale, jnp.bfloat16)
        return _vjp.vary(y, axes)
    # device p's x scale at [4 p] (16 bytes a device: the collectives' unit)
    scales = _gather_rows(jnp.broadcast_to(x_scale, (4,)), axis_name)[::4]
    y = _mm._fp8_kernel(x_full, w, jnp.float32(1.0), w_scale, jnp.float32)
    n = y.shape[1]
    y = (y.reshape(p, mp, n) * scales[:, None, None]).reshape(p * mp, n).astype(jnp.bfloat16)
    return _vjp.vary(y, axes)

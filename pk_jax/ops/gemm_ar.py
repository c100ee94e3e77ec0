"""gemm_ar: GEMM + all-reduce, the row-parallel linear layer with replicated output
(reference: `lax.psum(x @ w, axis_name)`)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax import fp8 as _fp8
from pk_jax.ops import _tp, _vjp
from pk_jax.ops import matmul as _mm
from pk_jax.runtime import state

__all__ = ["gemm_all_reduce"]  # exported by pk_jax/__init__.py

STEM = "gemm_ar"
NAME = "gemm_all_reduce"  # the public name, used in error messages


def gemm_all_reduce(x: jax.Array, w: jax.Array, axis_name: str, *,
                    x_scale: jax.Array | None = None,
                    w_scale: jax.Array | None = None) -> jax.Array:
    """Multiplies the local shards and sums the product over `axis_name` on every device.

    With fp8 operands (`pk_jax.fp8`: float8_e4m3fn or float8_e5m2, each device's shards with
    their own float32 scales) the product is of the dequantized shards, in bf16: on Hopper GPUs
    the fp8 GEMM then the pk all-reduce, or the fused fp8 kernels, as the cost model picks;
    elsewhere the reference (`fp8_reference`), whose gradient it has.

    Args:
        x: [M, K/P], bf16 or fp16, K/P a multiple of 8 (fp8: 16).
        w: [K/P, N], same dtype as `x` (fp8: either format).
        axis_name: one axis of the mesh given to `pk.init`.
        x_scale: fp8 only: float32, a scalar or [M, ceil(K/P / 128)] (this device's shard).
        w_scale: fp8 only: float32, a scalar or [ceil(K/P / 128), ceil(N / 128)].

    Returns:
        [M, N] in the dtype of `x` (fp8: bf16), equal to `lax.psum(x @ w, axis_name)` (fp32
        accumulation within a device).

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name`, not inside shard_map, operands not
            rank 2, contraction dimensions that differ, K/P not a multiple of 8 (fp8: 16),
            scales of the wrong shape.
        TypeError: an unsupported dtype, `x` and `w` of different dtypes (16-bit), scales
            missing or not float32 for fp8 operands or given for others.
    """
    _checks.axis_size(NAME, axis_name)
    if _fp8.is_fp8(x.dtype) or _fp8.is_fp8(w.dtype):
        _tp.check_fp8(NAME, x, w, x_scale, w_scale, "kn")
        return _tp.fp8_op(NAME, FP8_STEM, fp8_reference, x, w, x_scale, w_scale, axis_name)
    _tp.no_scales(NAME, x, x_scale, w_scale)
    _checks.matmul_operands(NAME, x, w, k_local=True)
    return _gemm_ar(x, w, axis_name)


def reference(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.psum(_mm.reference(x, w), axis_name)


def kernel_supports(x: jax.Array, w: jax.Array) -> bool:
    return _mm.kernel_supports(x, w)


def gemm_ar_impl(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """The call as `_backend.route` decides it; no user-facing checks.

    Paths: the fused kernels (pk_gemm_ar); pk.matmul then the pk.all_reduce kernel (serial,
    where the cost model predicts that fusion does not pay); pk.matmul alone over a 1-device
    axis (local); or the reference.
    """
    p = jax.lax.axis_size(axis_name)
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    r = _backend.route(STEM, axis_name, supported=kernel_supports(x, w), gemm=(m, n, k, x.dtype))
    if r.path == "reference":
        return reference(x, w, axis_name)
    if r.path == "local":  # the all-reduce over one device: XLA's no-op, the reference's type
        return jax.lax.psum(_mm.cuda_matmul(x, w), axis_name)
    if r.path == "serial":
        from pk_jax.ops import all_reduce as ar

        return ar.kernel(_mm.cuda_matmul(x, w), axis_name, 0)
    w, n_pad = _tp.pad_n(w)
    mp = -(-m // p)
    _tp.check_workspace(NAME, _ffi.workspace_need("gemm_ar", p, m=m, n=n_pad),
                        f"its [{mp}, {n_pad}] accumulation buffer")
    # NOTES: like psum, the result is invariant along axis_name.
    y = _ffi.call("pk_gemm_ar", jax.ShapeDtypeStruct((m, n_pad), x.dtype), x, w,
                  _backend.rank_operand(axis_name),
                  out_vma=(_ffi.vma(x) | _ffi.vma(w)) - {axis_name},
                  comm_id=np.int64(state.comm_id(axis_name)),
                  config=np.int64(_mm.tile_config(m, n_pad)), group_m=np.int64(_mm._GROUP_M))
    return y[:, :n] if n_pad != n else y


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm_ar(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return gemm_ar_impl(x, w, axis_name)


def _gemm_ar_fwd(x, w, axis_name):
    return gemm_ar_impl(x, w, axis_name), (x, w)


def _gemm_ar_bwd(axis_name, res, dy):
    # y = psum(z), z = x @ w. The transpose of psum is JAX's own (a cast to varying with
    # check_vma=True, a psum with check_vma=False); then dx = dz @ w^T, dw = x^T @ dz.
    x, w = res
    z_axes = _ffi.vma(x) | _ffi.vma(w)
    dz = _vjp.transpose_psum(dy, (x.shape[0], w.shape[1]), dy.dtype, z_axes, axis_name)
    dx = _mm.matmul_impl(dz, w.T)
    dw = _mm.matmul_impl(x.T, dz)
    return _vjp.fit(dx, x), _vjp.fit(dw, w)


_gemm_ar.defvjp(_gemm_ar_fwd, _gemm_ar_bwd)


# ---------------------------------------------------------------------------------------------
# fp8: the reference, and the entry of the fused kernels (pk_gemm_ar_fp8: gemm_rs_fp8's,
# cuda/kernels/gemm_rs_fp8.cuh, and gemm_ar's gather) whatever the route (gemm_all_reduce's fp8
# path: _tp.fp8_op).

FP8_STEM = "gemm_ar_fp8"


def fp8_reference(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                  axis_name: str) -> jax.Array:
    """The fp8 form's reference: each device's operands dequantized with its own scales, a
    float32 dot, the float32 sum over the axis, then bf16 (the kernel sums bf16 partials)."""
    y = _mm.fp8_reference(x, w, x_scale, w_scale, jnp.float32)
    return jax.lax.psum(y, axis_name).astype(jnp.bfloat16)


def _fp8_kernel(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                axis_name: str, *, w_layout: str = "kn") -> jax.Array:
    """gemm_all_reduce of fp8 operands by the fused fp8 kernels (pk_gemm_ar_fp8), whatever the
    router would pick (the GPU tests' and the benchmark's entry). Forward only.

    Args:
        x: [M, K/P] fp8 (float8_e4m3fn or float8_e5m2); K/P a multiple of 16, any M.
        w: [K/P, N] fp8 (either format), or given transposed, [N, K/P], with w_layout="nk".
        x_scale, w_scale: float32, this device's scales of its shards: scalars (per tensor)
            or pk.matmul's blockwise shapes ([M, ceil(K/P / 128)], [ceil(K/P / 128),
            ceil(N / 128)]; 128 x 128 blocks of w as [K/P, N] either way).
        axis_name: one axis of the mesh given to `pk.init`.
        w_layout: "kn" or "nk".

    Returns:
        [M, N] bf16, the same on every device: the sum over devices of
        (x * x_scale) @ (w * w_scale) (`fp8_reference`).

    Raises:
        ValueError: as gemm_all_reduce; K/P not a multiple of 16; scales of the wrong
            shape; too little symmetric workspace.
        TypeError: operands not fp8, scales not float32.
        RuntimeError: the kernels cannot run here (no sm_90 GPU, or no extension with them).
    """
    p = _checks.axis_size(NAME, axis_name)
    m, _, _ = _tp.check_fp8(NAME, x, w, x_scale, w_scale, w_layout)
    return _tp.fp8_call(NAME, "pk_gemm_ar_fp8", x, w, x_scale, w_scale, axis_name, p, m,
                        w_layout)

"""gemm_rs: GEMM + reduce-scatter, the row-parallel linear layer (reference:
`lax.psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`).

Its transpose is AG+GEMM (ops/ag_gemm.py) and the VJP is written with it, so the fused kernels
serve the backward pass too.
"""

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

__all__ = ["gemm_reduce_scatter"]  # exported by pk_jax/__init__.py

STEM = "gemm_rs"
NAME = "gemm_reduce_scatter"  # the public name, used in error messages


def gemm_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str, *,
                        x_scale: jax.Array | None = None,
                        w_scale: jax.Array | None = None) -> jax.Array:
    """Multiplies the local shards and reduce-scatters the sum by rows over `axis_name`.

    With K sharded over the axis, `x @ w` summed over the devices is the full product; rank r
    keeps rows [r*M/P, (r+1)*M/P) of it.

    With fp8 operands (`pk_jax.fp8`: float8_e4m3fn or float8_e5m2, each device's shards with
    their own float32 scales) the product is of the dequantized shards, in bf16: on Hopper GPUs
    the fp8 GEMM then the pk reduce-scatter, or the fused fp8 kernel, as the cost model picks;
    elsewhere the reference (`fp8_reference`), whose gradient it has.

    Args:
        x: [M, K/P], bf16 or fp16; M divisible by P, K/P a multiple of 8 (fp8: 16).
        w: [K/P, N], same dtype as `x` (fp8: either format).
        axis_name: one axis of the mesh given to `pk.init`.
        x_scale: fp8 only: float32, a scalar or [M, ceil(K/P / 128)] (this device's shard).
        w_scale: fp8 only: float32, a scalar or [ceil(K/P / 128), ceil(N / 128)].

    Returns:
        [M/P, N] in the dtype of `x` (fp8: bf16), equal to
        `lax.psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)` (fp32
        accumulation within a device).

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name`, not inside shard_map, operands not
            rank 2, contraction dimensions that differ, M not divisible by P, K/P not a
            multiple of 8 (fp8: 16), scales of the wrong shape.
        TypeError: an unsupported dtype, `x` and `w` of different dtypes (16-bit), scales
            missing or not float32 for fp8 operands or given for others.
    """
    p = _checks.axis_size(NAME, axis_name)
    fp8 = _fp8.is_fp8(x.dtype) or _fp8.is_fp8(w.dtype)
    if fp8:
        _tp.check_fp8(NAME, x, w, x_scale, w_scale, "kn")
    else:
        _tp.no_scales(NAME, x, x_scale, w_scale)
        _checks.matmul_operands(NAME, x, w, k_local=True)
    _checks.divisible(NAME, "M (x.shape[0])", x.shape[0], p,
                      f"Pad the rows of x to a multiple of the size of axis {axis_name!r} ({p}).")
    if fp8:
        return _tp.fp8_op(NAME, FP8_STEM, fp8_reference, x, w, x_scale, w_scale, axis_name)
    return _gemm_rs(x, w, axis_name)


def reference(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.psum_scatter(_mm.reference(x, w), axis_name, scatter_dimension=0, tiled=True)


def kernel_supports(x: jax.Array, w: jax.Array, p: int) -> bool:
    return _mm.kernel_supports(x, w) and x.shape[0] % p == 0


def gemm_rs_impl(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """The call as `_backend.route` decides it; no user-facing checks (used by the VJP of
    all_gather_gemm with transposed operands).

    Paths: the fused kernel (pk_gemm_rs); pk.matmul then the pk.reduce_scatter kernel (serial,
    where the cost model predicts that overlap does not pay); pk.matmul alone over a 1-device
    axis (local); or the reference.
    """
    p = jax.lax.axis_size(axis_name)
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    r = _backend.route(STEM, axis_name, supported=kernel_supports(x, w, p),
                       gemm=(m, n, k, x.dtype))
    if r.path == "reference":
        return reference(x, w, axis_name)
    if r.path == "local":  # the reduce-scatter over one device: XLA's no-op, the reference's type
        return jax.lax.psum_scatter(_mm.cuda_matmul(x, w), axis_name, scatter_dimension=0,
                                    tiled=True)
    if r.path == "serial":
        from pk_jax.ops import reduce_scatter as rs

        return rs.kernel(_mm.cuda_matmul(x, w), axis_name, 0)
    w, n_pad = _tp.pad_n(w)
    _tp.check_workspace(NAME, _ffi.workspace_need("gemm_rs", p, m=m, n=n_pad),
                        f"its [{m // p}, {n_pad}] accumulation buffer")
    # NOTES: the result varies along axis_name and every axis x or w varies along, which is
    # _ffi.call's default out_vma once the rank operand (varying along axis_name) is passed.
    y = _ffi.call("pk_gemm_rs", jax.ShapeDtypeStruct((m // p, n_pad), x.dtype), x, w,
                  _backend.rank_operand(axis_name), comm_id=np.int64(state.comm_id(axis_name)),
                  config=np.int64(_mm.tile_config(m, n_pad)), group_m=np.int64(_mm._GROUP_M))
    return y[:, :n] if n_pad != n else y


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gemm_rs(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    return gemm_rs_impl(x, w, axis_name)


def _gemm_rs_fwd(x, w, axis_name):
    return gemm_rs_impl(x, w, axis_name), (x, w)


def _gemm_rs_bwd(axis_name, res, dy):
    # y = RS(x @ w)  =>  dx = AG(dy) @ w^T (an AG+GEMM), dw = x^T @ AG(dy) reusing the gather.
    from pk_jax.ops.ag_gemm import ag_gemm_impl

    x, w = res
    dx, dy_full = ag_gemm_impl(dy, w.T, axis_name, return_gathered=True)
    dw = _mm.matmul_impl(x.T, dy_full)
    return _vjp.fit(dx, x), _vjp.fit(dw, w)


_gemm_rs.defvjp(_gemm_rs_fwd, _gemm_rs_bwd)


# ---------------------------------------------------------------------------------------------
# fp8: the reference, and the entry of the fused kernel (pk_gemm_rs_fp8,
# cuda/kernels/gemm_rs_fp8.cuh) whatever the route (gemm_reduce_scatter's fp8 path: _tp.fp8_op).

FP8_STEM = "gemm_rs_fp8"


def fp8_reference(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                  axis_name: str) -> jax.Array:
    """The fp8 form's reference: each device's operands dequantized with its own scales, a
    float32 dot, the float32 sum reduce-scattered by rows, then bf16 (the kernel rounds each
    device's partial to bf16 and sums in bf16: within a few bf16 ulps of this)."""
    y = _mm.fp8_reference(x, w, x_scale, w_scale, jnp.float32)
    return jax.lax.psum_scatter(y, axis_name, scatter_dimension=0,
                                tiled=True).astype(jnp.bfloat16)


def _fp8_kernel(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                axis_name: str, *, w_layout: str = "kn") -> jax.Array:
    """gemm_reduce_scatter of fp8 operands by the fused fp8 kernel (pk_gemm_rs_fp8), whatever
    the router would pick (the GPU tests' and the benchmark's entry). Forward only.

    Args:
        x: [M, K/P] fp8 (float8_e4m3fn or float8_e5m2); M divisible by P, K/P a multiple of 16.
        w: [K/P, N] fp8 (either format), or given transposed, [N, K/P], with w_layout="nk".
        x_scale, w_scale: float32, this device's scales of its shards: scalars (per tensor)
            or pk.matmul's blockwise shapes ([M, ceil(K/P / 128)], [ceil(K/P / 128),
            ceil(N / 128)]; 128 x 128 blocks of w as [K/P, N] either way).
        axis_name: one axis of the mesh given to `pk.init`.
        w_layout: "kn" or "nk".

    Returns:
        [M/P, N] bf16: rows [r M/P, (r+1) M/P) of the sum over devices of
        (x * x_scale) @ (w * w_scale) (`fp8_reference`).

    Raises:
        ValueError: as gemm_reduce_scatter; K/P not a multiple of 16; scales of the wrong
            shape; too little symmetric workspace.
        TypeError: operands not fp8, scales not float32.
        RuntimeError: the kernel cannot run here (no sm_90 GPU, or no extension with it).
    """
    p = _checks.axis_size(NAME, axis_name)
    m, _, _ = _tp.check_fp8(NAME, x, w, x_scale, w_scale, w_layout)
    _checks.divisible(NAME, "M (x.shape[0])", m, p,
                      f"Pad the rows of x to a multiple of the size of axis {axis_name!r} ({p}).")
    return _tp.fp8_call(NAME, "pk_gemm_rs_fp8", x, w, x_scale, w_scale, axis_name, p, m // p,
                        w_layout)

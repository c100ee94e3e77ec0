"""ag_gemm: all-gather + GEMM, the column-parallel linear layer on row-sharded activations
(reference: `lax.all_gather(x, axis_name, axis=0, tiled=True) @ w`).

Its transpose is GEMM+RS (ops/gemm_rs.py) and the VJP is written with it, so the fused kernels
serve the backward pass too.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _tp, _vjp
from pk_jax.ops import matmul as _mm
from pk_jax.runtime import state

__all__ = ["all_gather_gemm"]  # exported by pk_jax/__init__.py

STEM = "ag_gemm"
NAME = "all_gather_gemm"  # the public name, used in error messages


def all_gather_gemm(x: jax.Array, w: jax.Array, axis_name: str) -> jax.Array:
    """Gathers the row shards of `x` over `axis_name` (in rank order) and multiplies by `w`.

    Args:
        x: [M/P, K], bf16 or fp16, K a multiple of 8.
        w: [K, N], same dtype as `x` (typically this device's column shard of a weight).
        axis_name: one axis of the mesh given to `pk.init`.

    Returns:
        [M, N] in the dtype of `x`, equal to
        `lax.all_gather(x, axis_name, axis=0, tiled=True) @ w` (fp32 accumulation).

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name`, not inside shard_map, operands not
            rank 2, contraction dimensions that differ, K not a multiple of 8.
        TypeError: an unsupported dtype, or `x` and `w` of different dtypes.
    """
    _checks.axis_size(NAME, axis_name)
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

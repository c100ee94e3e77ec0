"""matmul: y = x @ w on one device, fp32 accumulation (reference: `jnp.dot`).

The local GEMM engine that the fused ops build on; also the backward pass of every GEMM op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["matmul"]  # exported by pk_jax/__init__.py

STEM = "matmul"


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """Multiplies `x` [M, K] by `w` [K, N] with fp32 accumulation.

    Works inside and outside `shard_map`; inside, it is a purely local product.

    Args:
        x: [M, K], bf16 or fp16, K a multiple of 8.
        w: [K, N], same dtype as `x`.

    Returns:
        [M, N] in the dtype of `x`, equal to
        `jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)`.

    Raises:
        ValueError: operands not rank 2, contraction dimensions that differ, K not a multiple
            of 8.
        TypeError: an unsupported dtype, or `x` and `w` of different dtypes.
    """
    _checks.matmul_operands(STEM, x, w)
    return _matmul(x, w)


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

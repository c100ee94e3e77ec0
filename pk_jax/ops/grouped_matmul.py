"""grouped_matmul: the grouped (ragged) GEMM of MoE experts (reference: `jax.lax.ragged_dot`).

Rows of `x` are split into consecutive groups by `group_sizes`; group e is multiplied by
`w[e]`. The kernel (cuda/kernels/grouped_matmul.cuh) reads `group_sizes` on the device, so the
sizes are traced values: changing them never recompiles and never syncs with the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax.ops import _vjp

__all__ = ["grouped_matmul"]  # exported by pk_jax/__init__.py

STEM = "grouped_matmul"

# Kernel modes (cuda/kernels/grouped_matmul.cuh, enum mode_id). _FEW: the forward of calls of
# at most FEW_MAX_ROWS rows (decode) by the few-rows kernel.
_FWD, _DX, _DW, _FEW = 0, 1, 2, 3
FEW_MAX_ROWS = _op_table.GROUPED_FEW_MAX_ROWS
# Most groups one kernel call takes (the op table's); more run the reference.
MAX_GROUPS = _op_table.MAX_GROUPS
# Block-rows per band of the persistent tile order (as matmul's).
_GROUP_M = 16


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Multiplies each group of rows of `x` by its own matrix `w[e]`, fp32 accumulation.

    Group e is rows [sum(group_sizes[:e]), sum(group_sizes[:e + 1])) of `x`; rows past
    sum(group_sizes) are zero in the result. Works inside and outside `shard_map` (a purely
    local product) and under `jit`; `group_sizes` may change between calls without a recompile.

    Sizes outside the contract follow the kernel's rule (the sizes are traced, so they are not
    checked): a negative size counts as 0 (an empty group that moves no later group), and the
    groups' ranges, from the cumulative sums of those clamped sizes, are cut at M (rows past M
    do not exist; groups that start at or past M are empty).

    Args:
        x: [M, K], bf16 or fp16, K a multiple of 8.
        w: [E, K, N], same dtype as `x`.
        group_sizes: [E] int32, non-negative, summing to at most M (otherwise as above).

    Returns:
        [M, N] in the dtype of `x`, equal to
        `jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)` cast to
        the dtype of `x`.

    Raises:
        ValueError: `x` not rank 2, `w` not rank 3, K of `x` and `w` that differ, K not a
            multiple of 8, `group_sizes` not of shape [E].
        TypeError: an unsupported dtype, `x` and `w` of different dtypes, `group_sizes` not
            int32.
    """
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


def few_rows_forward(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The forward of `grouped_matmul` by the few-rows kernel (mode FEW), for calls of at most
    FEW_MAX_ROWS rows: not yet routed to by `grouped_matmul` (it waits for its GPU tests,
    tests/test_grouped_matmul.py); the GPU tests and bench/bench_grouped_matmul.py --specs call
    it directly."""
    check(x, w, group_sizes)
    if x.shape[0] > FEW_MAX_ROWS:
        raise ValueError(f"pk.{STEM}: the few-rows kernel takes at most {FEW_MAX_ROWS} rows, got "
                         f"x of shape {x.shape}.")
    if not _kernel_applies(x, w):
        raise ValueError(f"pk.{STEM}: the kernels do not take these operands (x {x.shape} "
                         f"{x.dtype}, w {w.shape} {w.dtype}).")
    return _forward(x, w, group_sizes, _FEW)


def _dx(dy, w, group_sizes):
    """dx [M, K] = dy_e @ w[e]^T per group; zero past sum(group_sizes)."""
    m, k, n = dy.shape[0], w.shape[1], w.shape[2]
    n_pad = -(-n // 8) * 8
    return _call(_DX, _pad_cols(dy, n_pad), _pad_cols(w, n_pad), group_sizes, (m, k), dy.dtype)


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
    return _forward(x, w, group_sizes)


def _fwd(x, w, group_sizes):
    return _forward(x, w, group_sizes), (x, w, group_sizes)


def _bwd(res, dy):
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    dx = _dx(dy, w, group_sizes)
    dw = _dw(x, dy, group_sizes, w.shape[0])
    dgs = np.zeros(group_sizes.shape, jax.dtypes.float0)
    return _vjp.fit(dx, x), _vjp.fit(dw, w), dgs


_grouped_kernel.defvjp(_fwd, _bwd)

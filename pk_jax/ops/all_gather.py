"""all_gather: the concatenation of every device's x along `axis` (reference:
`lax.all_gather(..., tiled=True)`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["all_gather"]  # exported by pk_jax/__init__.py

STEM = "all_gather"


def all_gather(x: jax.Array, axis_name: str, *, axis: int = 0) -> jax.Array:
    """Concatenates the shards of `x` held by the devices of `axis_name`, in rank order.

    Args:
        x: any shape of rank >= 1; bf16, fp16, fp32 or int32.
        axis_name: one axis of the mesh given to `pk.init`.
        axis: the dimension to concatenate along (negative counts from the end).

    Returns:
        `x` with dimension `axis` P times larger, equal to
        `lax.all_gather(x, axis_name, axis=axis, tiled=True)`.

    On the CUDA path a peer that never arrives within pk.init's timeout_s stops the kernel: the
    error naming the op, this rank and the missing peer is printed at once, and the next pk
    call (or `pk_jax.check_errors()`) raises it as a RuntimeError.

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name` or `axis`.
        TypeError: an unsupported dtype.
    """
    _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.MOVE_DTYPES)
    _checks.ndim_at_least(STEM, "x", x, 1)
    axis = _checks.axis_index(STEM, "axis", axis, x.ndim)
    if _backend.route(STEM, axis_name).path == "kernel":
        return kernel(x, axis_name, axis)
    return reference(x, axis_name, axis=axis)


def _call(x: jax.Array, axis_name: str, axis: int) -> jax.Array:
    p = jax.lax.axis_size(axis_name)
    shape = x.shape[:axis] + (x.shape[axis] * p,) + x.shape[axis + 1:]
    run = max(1, math.prod(x.shape[axis:]))  # y[a, p, :] = x_p[a, :] with rows of `run`
    return _ffi.call(f"pk_{STEM}", jax.ShapeDtypeStruct(shape, x.dtype), x,
                     _backend.rank_operand(axis_name), out_vma=_ffi.vma(x) | {axis_name},
                     comm_id=np.int64(state.comm_id(axis_name)), run=np.int64(run))


def kernel(x: jax.Array, axis_name: str, axis: int) -> jax.Array:
    """The CUDA kernel; its VJP is the reduce-scatter kernel along the same axis."""
    from pk_jax.ops import reduce_scatter as rs

    if x.dtype == np.int32:  # data movement only; integers have no cotangent
        return _call(x, axis_name, axis)

    @jax.custom_vjp
    def f(x):
        return _call(x, axis_name, axis)

    def fwd(x):
        return _call(x, axis_name, axis), _vjp.like((0,), x.dtype, _ffi.vma(x))

    def bwd(x0, dy):
        return (_vjp.fit(rs.kernel(dy, axis_name, axis), x0),)

    f.defvjp(fwd, bwd)
    return f(x)


def reference(x: jax.Array, axis_name: str, *, axis: int = 0) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)

"""reduce_scatter: each device gets its 1/P slice of the sum over a mesh axis (reference:
`lax.psum_scatter(..., tiled=True)`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["reduce_scatter"]  # exported by pk_jax/__init__.py

STEM = "reduce_scatter"


def reduce_scatter(x: jax.Array, axis_name: str, *, scatter_dimension: int = 0) -> jax.Array:
    """Sums `x` over `axis_name` and leaves slice `rank` of `scatter_dimension` on each device.

    Args:
        x: rank >= 1, dimension `scatter_dimension` divisible by P; bf16, fp16 or fp32.
        axis_name: one axis of the mesh given to `pk.init`.
        scatter_dimension: the dimension that is split (negative counts from the end).

    Returns:
        `x` with dimension `scatter_dimension` P times smaller, equal to
        `lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`.

    On the CUDA path a peer that never arrives within pk.init's timeout_s stops the kernel: the
    error naming the op, this rank and the missing peer is printed at once, and the next pk
    call (or `pk_jax.check_errors()`) raises it as a RuntimeError.

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name`, or a dimension not divisible by P.
        TypeError: an unsupported dtype.
    """
    p = _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.FLOAT_DTYPES)
    _checks.ndim_at_least(STEM, "x", x, 1)
    dim = _checks.axis_index(STEM, "scatter_dimension", scatter_dimension, x.ndim)
    _checks.divisible(STEM, f"x.shape[{dim}] (the scatter dimension)", x.shape[dim], p,
                      f"Pad it to a multiple of the size of axis {axis_name!r}.")
    if _backend.route(STEM, axis_name).path == "kernel":
        return kernel(x, axis_name, dim)
    return reference(x, axis_name, scatter_dimension=dim)


def _call(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
    p = jax.lax.axis_size(axis_name)
    shape = x.shape[:dim] + (x.shape[dim] // p,) + x.shape[dim + 1:]
    run = max(1, math.prod(shape[dim:]))  # x viewed as [A, P, run], y as [A, run]
    return _ffi.call(f"pk_{STEM}", jax.ShapeDtypeStruct(shape, x.dtype), x,
                     _backend.rank_operand(axis_name), out_vma=_ffi.vma(x) | {axis_name},
                     comm_id=np.int64(state.comm_id(axis_name)), run=np.int64(run))


def kernel(x: jax.Array, axis_name: str, dim: int) -> jax.Array:
    """The CUDA kernel; its VJP is the all-gather kernel along the same dimension."""
    from pk_jax.ops import all_gather as ag

    @jax.custom_vjp
    def f(x):
        return _call(x, axis_name, dim)

    def fwd(x):
        return _call(x, axis_name, dim), _vjp.like((0,), x.dtype, _ffi.vma(x))

    def bwd(x0, dy):
        return (_vjp.fit(ag.kernel(dy, axis_name, dim), x0),)

    f.defvjp(fwd, bwd)
    return f(x)


def reference(x: jax.Array, axis_name: str, *, scatter_dimension: int = 0) -> jax.Array:
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)

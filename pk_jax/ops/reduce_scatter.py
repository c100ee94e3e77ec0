"""reduce_scatter: each device gets its 1/P slice of the sum over a mesh axis (reference:
`lax.psum_scatter(..., tiled=True)`)."""

from __future__ import annotations

import jax

from pk_jax import _checks

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
    return reference(x, axis_name, scatter_dimension=dim)


def reference(x: jax.Array, axis_name: str, *, scatter_dimension: int = 0) -> jax.Array:
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=scatter_dimension, tiled=True)

"""all_gather: the concatenation of every device's x along `axis` (reference:
`lax.all_gather(..., tiled=True)`)."""

from __future__ import annotations

import jax

from pk_jax import _checks

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

    Raises:
        ValueError: `pk.init` not called, a bad `axis_name` or `axis`.
        TypeError: an unsupported dtype.
    """
    _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.MOVE_DTYPES)
    _checks.ndim_at_least(STEM, "x", x, 1)
    axis = _checks.axis_index(STEM, "axis", axis, x.ndim)
    return reference(x, axis_name, axis=axis)


def reference(x: jax.Array, axis_name: str, *, axis: int = 0) -> jax.Array:
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)

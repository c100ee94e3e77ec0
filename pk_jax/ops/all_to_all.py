"""all_to_all: block j of x's `split_axis` goes to device j, and the received blocks are
concatenated along `concat_axis` (reference: `lax.all_to_all(..., tiled=True)`)."""

from __future__ import annotations

import jax

from pk_jax import _checks

STEM = "all_to_all"


def all_to_all(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    """Exchanges blocks of `x` between every pair of devices of `axis_name`.

    Args:
        x: rank >= 1, dimension `split_axis` divisible by P; bf16, fp16, fp32 or int32.
        axis_name: one axis of the mesh given to `pk.init`.
        split_axis: the dimension cut into P blocks, block j sent to rank j.
        concat_axis: the dimension along which received blocks are concatenated in rank order.

    Returns:
        Equal to `lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)`.

    Raises:
        ValueError: `pk.init` not called, a bad axis, or `split_axis` not divisible by P.
        TypeError: an unsupported dtype.
    """
    p = _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.MOVE_DTYPES)
    _checks.ndim_at_least(STEM, "x", x, 1)
    split_axis = _checks.axis_index(STEM, "split_axis", split_axis, x.ndim)
    concat_axis = _checks.axis_index(STEM, "concat_axis", concat_axis, x.ndim)
    _checks.divisible(STEM, f"x.shape[{split_axis}] (the split axis)", x.shape[split_axis], p,
                      f"Pad it to a multiple of the size of axis {axis_name!r}.")
    return reference(x, axis_name, split_axis, concat_axis)


def reference(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)

"""all_reduce: the sum of x over a mesh axis (reference: `lax.psum`)."""

from __future__ import annotations

import jax

from pk_jax import _checks

STEM = "all_reduce"


def all_reduce(x: jax.Array, axis_name: str) -> jax.Array:
    """Sums `x` over the devices of `axis_name`; every device gets the sum.

    Args:
        x: any shape; bf16, fp16 or fp32.
        axis_name: one axis of the mesh given to `pk.init`.

    Returns:
        An array like `x` holding the sum, equal to `lax.psum(x, axis_name)`.

    Raises:
        ValueError: `pk.init` not called, or `axis_name` not an axis of its mesh.
        TypeError: an unsupported dtype.
    """
    _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.FLOAT_DTYPES)
    return reference(x, axis_name)


def reference(x: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.psum(x, axis_name)

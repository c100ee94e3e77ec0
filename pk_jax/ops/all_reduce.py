"""all_reduce: the sum of x over a mesh axis (reference: `lax.psum`)."""

from __future__ import annotations

import jax
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["all_reduce"]  # exported by pk_jax/__init__.py

STEM = "all_reduce"
ALGORITHMS = {"auto": 0, "one_shot": 1, "two_shot": 2}


def all_reduce(x: jax.Array, axis_name: str, *, algorithm: str | None = None) -> jax.Array:
    """Sums `x` over the devices of `axis_name`; every device gets the sum.

    Args:
        x: any shape; bf16, fp16 or fp32.
        axis_name: one axis of the mesh given to `pk.init`.
        algorithm: the CUDA kernel's schedule: "one_shot" (every rank reads every peer's x),
            "two_shot" (reduce-scatter then all-gather) or "auto" (by size, the default; also
            set with PK_JAX_ALL_REDUCE_ALGORITHM). Ignored by the reference.

    Returns:
        An array like `x` holding the sum, equal to `lax.psum(x, axis_name)`.

    On the CUDA path a peer that never arrives within pk.init's timeout_s stops the kernel: the
    error naming the op, this rank and the missing peer is printed at once, and the next pk
    call (or `pk_jax.check_errors()`) raises it as a RuntimeError.

    Raises:
        ValueError: `pk.init` not called, or `axis_name` not an axis of its mesh.
        TypeError: an unsupported dtype.
    """
    _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, _checks.FLOAT_DTYPES)
    algo = _algorithm(algorithm)
    if _backend.route(STEM, axis_name).path == "kernel":
        return kernel(x, axis_name, algo)
    return reference(x, axis_name)


def _algorithm(algorithm: str | None) -> int:
    name = algorithm or state.settings().all_reduce_algorithm
    if name not in ALGORITHMS:
        raise ValueError(f"pk.{STEM}: algorithm={name!r} is not one of {', '.join(ALGORITHMS)} "
                         "(argument `algorithm` or PK_JAX_ALL_REDUCE_ALGORITHM).")
    return ALGORITHMS[name]


def _call(x: jax.Array, axis_name: str, algo: int) -> jax.Array:
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _ffi.call(f"pk_{STEM}", out, x, _backend.rank_operand(axis_name),
                     out_vma=_ffi.vma(x) - {axis_name},
                     comm_id=np.int64(state.comm_id(axis_name)), algo=np.int64(algo))


def kernel(x: jax.Array, axis_name: str, algo: int) -> jax.Array:
    """The CUDA kernel with the VJP of `lax.psum`: with check_vma the cotangent of an invariant
    sum is a cast to varying (no communication); without it, another all-reduce."""
    x_shape, x_dtype, x_vma = x.shape, x.dtype, _ffi.vma(x)

    @jax.custom_vjp
    def f(x):
        return _call(x, axis_name, algo)

    def fwd(x):
        return _call(x, axis_name, algo), None

    def bwd(_, dy):
        if axis_name in _ffi.vma(_backend.rank_operand(axis_name)):  # check_vma=True
            return (_vjp.transpose_psum(dy, x_shape, x_dtype, x_vma, axis_name),)
        return (kernel(dy, axis_name, algo),)

    f.defvjp(fwd, bwd)
    return f(x)


def reference(x: jax.Array, axis_name: str) -> jax.Array:
    return jax.lax.psum(x, axis_name)

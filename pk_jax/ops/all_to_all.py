"""all_to_all: block j of x's `split_axis` goes to device j, and the received blocks are
concatenated along `concat_axis` (reference: `lax.all_to_all(..., tiled=True)`)."""

from __future__ import annotations

import math

import jax
import numpy as np

from pk_jax import _backend, _checks, _ffi
from pk_jax.ops import _vjp
from pk_jax.runtime import state

__all__ = ["all_to_all"]  # exported by pk_jax/__init__.py

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

    On the CUDA path a peer that never arrives within pk.init's timeout_s stops the kernel: the
    error naming the op, this rank and the missing peer is printed at once, and the next pk
    call (or `pk_jax.check_errors()`) raises it as a RuntimeError.

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
    if _backend.route(STEM, axis_name).path == "kernel":
        return kernel(x, axis_name, split_axis, concat_axis)
    return reference(x, axis_name, split_axis, concat_axis)


def _call(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    p = jax.lax.axis_size(axis_name)
    block = list(x.shape)
    block[split_axis] //= p  # the block each rank receives from each peer
    shape = list(block)
    shape[concat_axis] *= p
    split_run = max(1, math.prod(block[split_axis:]))   # x viewed as [A1, P, split_run]
    concat_run = max(1, math.prod(block[concat_axis:]))  # y viewed as [A2, P, concat_run]
    return _ffi.call(f"pk_{STEM}", jax.ShapeDtypeStruct(tuple(shape), x.dtype), x,
                     _backend.rank_operand(axis_name), out_vma=_ffi.vma(x) | {axis_name},
                     comm_id=np.int64(state.comm_id(axis_name)),
                     split_run=np.int64(split_run), concat_run=np.int64(concat_run))


def kernel(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    """The CUDA kernel; its VJP is the kernel with split and concat axes swapped."""

    if x.dtype == np.int32:  # data movement only; integers have no cotangent
        return _call(x, axis_name, split_axis, concat_axis)

    @jax.custom_vjp
    def f(x):
        return _call(x, axis_name, split_axis, concat_axis)

    def fwd(x):
        return _call(x, axis_name, split_axis, concat_axis), _vjp.like((0,), x.dtype,
                                                                         _ffi.vma(x))

    def bwd(x0, dy):
        return (_vjp.fit(kernel(dy, axis_name, concat_axis, split_axis), x0),)

    f.defvjp(fwd, bwd)
    return f(x)


def reference(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)

"""Helpers for the ops' custom VJPs inside shard_map: typing cotangents like JAX's own AD.

Inside `shard_map(..., check_vma=True)` every value carries the set of mesh axes along which it
varies (its vma). When an op mixes an input that is invariant along an axis with one that
varies, JAX casts the invariant one to varying, and the transpose of that cast is a `psum`. A
hand-written backward pass computes cotangents that vary wherever the output cotangent varies,
so `fit` sums them over the axes their primal does not vary along, and casts them to varying
where the primal varies and they do not. With `check_vma=False` every vma is empty and `fit`
does nothing, as JAX's AD does not sum there either.
"""

from __future__ import annotations

import functools

import jax

from pk_jax import _ffi


def vary(x: jax.Array, axes) -> jax.Array:
    """`x` cast to varying along `axes` (those it does not already vary along)."""
    missing = tuple(sorted(frozenset(axes) - _ffi.vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def fit(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Gives cotangent `ct` the vma of `primal`: psum over extra axes, cast for missing ones."""
    want = _ffi.vma(primal)
    extra = tuple(sorted(_ffi.vma(ct) - want))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return vary(ct, want)


def like(shape, dtype, axes) -> jax.Array:
    """Zeros of `shape`/`dtype` varying along `axes`: a primal point for `jax.vjp` of a linear
    collective, whose transpose JAX then chooses (it depends on check_vma)."""
    return vary(jax.numpy.zeros(shape, dtype), axes)


def transpose_psum(dy: jax.Array, z_shape, z_dtype, z_axes, axis_name: str) -> jax.Array:
    """The cotangent of `z` in `y = lax.psum(z, axis_name)`, exactly as JAX's AD computes it
    (a cast to varying with check_vma=True, a psum with check_vma=False)."""
    _, pullback = jax.vjp(lambda z: jax.lax.psum(z, axis_name), like(z_shape, z_dtype, z_axes))
    (dz,) = pullback(dy)
    return dz


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def with_reference_grad(forward, reference, *args):
    """`forward(*args)` (a kernel without a backward of its own), differentiated as
    `reference(*args)` is: the fp8 products, whose gradient is their reference's. `forward` and
    `reference` are hashable callables of `args` alone (functools.partial over static
    arguments); an integer argument (group sizes) gets JAX's float0 cotangent."""
    return forward(*args)


def _reference_grad_fwd(forward, reference, *args):
    return forward(*args), args


def _reference_grad_bwd(forward, reference, args, dy):
    # The reference's forward product is dead code here: XLA drops it.
    _, pullback = jax.vjp(reference, *args)
    return pullback(dy)


with_reference_grad.defvjp(_reference_grad_fwd, _reference_grad_bwd)

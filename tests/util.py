"""Helpers shared by the tests: meshes of host devices and running a function under
jit(shard_map(...))."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk

WORLD_SIZES = (1, 2, 3, 4, 8)
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MATMUL_DTYPES = (jnp.bfloat16, jnp.float16)


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...], *, explicit: bool = True):
    """A mesh of host devices; explicit axes (jax.make_mesh's default) or Auto axes."""
    n = int(np.prod(shape))
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:n], axis_types=types)


def run(fn, mesh, in_specs, out_specs, *args, check_vma: bool = True, init: bool = True):
    """Runs fn under jit(shard_map) on `mesh`, placing the args with their in_specs first."""
    if init:
        pk.init(mesh)
    in_specs = tuple(in_specs)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=check_vma)
    return jax.jit(f)(*placed)


def rand(key, shape, dtype, *, integer: bool = False):
    """Random normal values, or small integers (exact sums) when `integer`."""
    if integer:
        return jax.random.randint(key, shape, -4, 5).astype(dtype)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def tol(dtype) -> dict:
    """assert_allclose tolerances for a result computed in `dtype`."""
    return {jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=2e-2),
            jnp.dtype(jnp.float16): dict(rtol=2e-3, atol=2e-3),
            jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-5)}.get(jnp.dtype(dtype),
                                                                   dict(rtol=0, atol=0))


def assert_close(actual, expected, dtype=None):
    dtype = dtype or actual.dtype
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               **tol(dtype))


def product(*axes):
    return list(itertools.product(*axes))


__all__ = ["P", "cpu_mesh", "run", "rand", "tol", "assert_close", "product", "WORLD_SIZES",
           "FLOAT_DTYPES", "MATMUL_DTYPES"]

"""ping: y = x + rank through the FFI (CUDA or CPU handler).

It proves the wiring from `jax.ffi.ffi_call` to a handler inside `jit(shard_map(...))`, and its
benchmark measures the cost of one FFI call plus launch. Not part of the public API.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pk_jax import _backend, _checks, _ffi

STEM = "ping"


def ping(x: jax.Array, axis_name: str) -> jax.Array:
    """Returns x + rank (fp32) computed by the FFI handler for the mesh's platform.

    Raises:
        RuntimeError: the extension is not built.
    """
    _checks.axis_size(STEM, axis_name)
    _checks.dtype_in(STEM, "x", x, (jnp.float32,))
    if not _ffi.HAS_CUDA:
        raise RuntimeError(f"pk_jax.ops.ping needs the compiled extension: {_ffi.IMPORT_ERROR}")
    _ffi.register("cpu")
    _ffi.register("CUDA")
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return _ffi.call("pk_ping", out, x, _backend.rank_operand(axis_name))


def reference(x: jax.Array, axis_name: str) -> jax.Array:
    return x + jax.lax.axis_index(axis_name).astype(x.dtype)

"""Trace-time argument checks shared by all ops. Each error names the op, the argument, the
value and the fix."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax.runtime import state

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MOVE_DTYPES = FLOAT_DTYPES + (jnp.int32,)
MATMUL_DTYPES = (jnp.bfloat16, jnp.float16)
MATMUL_DTYPES_NP = tuple(np.dtype(d) for d in MATMUL_DTYPES)


def _names(dtypes: Sequence) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


def axis_size(op: str, axis_name) -> int:
    """Checks `axis_name` against the mesh given to `pk.init` and the enclosing shard_map.

    Returns:
        P, the size of the axis.
    """
    from pk_jax.runtime import errors

    errors.check_pending()
    if not state.meshes():
        raise ValueError(
            f"pk.{op}: pk.init(mesh) has not been called. Call pk.init(mesh) once, outside jit, "
            "on every process, with the mesh your shard_map uses."
        )
    if not isinstance(axis_name, str):
        raise TypeError(
            f"pk.{op}: axis_name must be one mesh axis name (a str), got {axis_name!r}. "
            f"The meshes given to pk.init have {state.describe_meshes()}."
        )
    mesh = state.mesh_for(axis_name)
    if mesh is None:
        raise ValueError(
            f"pk.{op}: the mesh of this shard_map is not one given to pk.init (pk.init has "
            f"{state.describe_meshes()}). Call pk.init with the mesh your shard_map uses; "
            "pk.init may be called once per mesh."
        )
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"pk.{op}: axis_name={axis_name!r} is not an axis of the mesh given to pk.init, "
            f"which has axes {tuple(mesh.axis_names)}. Pass one of those names, or call "
            "pk.init with the mesh your shard_map uses."
        )
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"pk.{op}: axis {axis_name!r} is not bound here. Call pk.{op} inside "
            f"jax.shard_map(..., mesh=mesh) over a mesh with the axis {axis_name!r}."
        ) from e
    if size != mesh.shape[axis_name]:
        raise ValueError(
            f"pk.{op}: axis {axis_name!r} has size {size} in this shard_map but "
            f"{mesh.shape[axis_name]} in the mesh given to pk.init. Call pk.init with the mesh "
            "your shard_map uses."
        )
    return int(size)


def dtype_in(op: str, arg: str, x, allowed: Sequence) -> None:
    if x.dtype not in [np.dtype(d) for d in allowed]:
        raise TypeError(
            f"pk.{op}: {arg} has dtype {np.dtype(x.dtype).name}; supported: {_names(allowed)}. "
            f"Cast it with {arg}.astype(...) first."
        )


def ndim_at_least(op: str, arg: str, x, ndim: int) -> None:
    if x.ndim < ndim:
        raise ValueError(f"pk.{op}: {arg} must have at least {ndim} dimensions, got shape "
                         f"{x.shape}.")


def ndim_is(op: str, arg: str, x, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"pk.{op}: {arg} must have {ndim} dimensions, got shape {x.shape}.")


def axis_index(op: str, arg: str, value: int, ndim: int) -> int:
    """Normalises a possibly negative dimension index and checks it is in range."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"pk.{op}: {arg} must be an int, got {value!r}.")
    if not -ndim <= value < ndim:
        raise ValueError(f"pk.{op}: {arg}={value} is out of range for an array of rank {ndim}.")
    return int(value) % ndim


def divisible(op: str, what: str, value: int, by: int, fix: str) -> None:
    if value % by:
        raise ValueError(f"pk.{op}: {what} = {value} is not divisible by {by}. {fix}")


def same_dtype(op: str, a: str, x, b: str, y) -> None:
    if x.dtype != y.dtype:
        raise TypeError(
            f"pk.{op}: {a} and {b} must have the same dtype, got {np.dtype(x.dtype).name} and "
            f"{np.dtype(y.dtype).name}. Cast one of them."
        )


def matmul_operands(op: str, x, w, *, p: int = 1, k_local: bool = False) -> None:
    """Checks a GEMM's [M, K] @ [K, N] operands: rank 2, matching K, dtype, TMA alignment."""
    ndim_is(op, "x", x, 2)
    ndim_is(op, "w", w, 2)
    dtype_in(op, "x", x, MATMUL_DTYPES)
    same_dtype(op, "x", x, "w", w)
    if x.shape[1] != w.shape[0]:
        raise ValueError(
            f"pk.{op}: contraction dimensions differ: x has shape {x.shape} (K={x.shape[1]}) and "
            f"w has shape {w.shape} (K={w.shape[0]}). w must be [K, N] for x [M, K]."
        )
    k = x.shape[1]
    # NOTES: TMA needs 16-byte row strides, i.e. K a multiple of 8 bf16/fp16 elements. Checked on
    # every backend so that a model that runs on CPU also runs on the GPU.
    kname = "K/P (the local K)" if k_local else "K"
    divisible(op, f"{kname} (x.shape[1])", k, 8,
              "Pad K to a multiple of 8 (zeros in x and w do not change x @ w).")


def attention_operands(op: str, q, k, v) -> None:
    """Checks attention's q [B, S_local, H, D] and k, v [B, S_local, Hkv, D] (Hkv dividing H:
    grouped-query attention), one float dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(
                f"pk.{op}: {name} must have rank 4, [batch, seq_local, heads, head_dim], got "
                f"shape {x.shape}. Reshape it (e.g. {name}[None] for a missing batch axis)."
            )
    dtype_in(op, "q", q, FLOAT_DTYPES)
    same_dtype(op, "q", q, "k", k)
    same_dtype(op, "q", q, "v", v)
    for name, x in (("k", k), ("v", v)):
        if x.shape[:2] != q.shape[:2] or x.shape[3] != q.shape[3] or x.shape != k.shape:
            raise ValueError(
                f"pk.{op}: k and v must be [batch, seq_local, kv_heads, head_dim] with q's "
                f"batch, seq_local and head_dim, got q {q.shape} and {name} {x.shape}. Shard "
                "q, k, v alike along the sequence."
            )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"pk.{op}: the {k.shape[2]} K/V heads must divide the {q.shape[2]} query heads "
            "(grouped-query attention).")


def is_bool(op: str, arg: str, value) -> bool:
    """Checks a static flag is a bool (not an array), and returns it as one."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"pk.{op}: {arg} must be a Python bool, got {value!r} "
                        f"({type(value).__name__}). Pass {arg}=True or {arg}=False.")
    return bool(value)


def positive_float(op: str, arg: str, value, *, example: str = "0.125",
                   none_means: str = "1/sqrt(head_dim)") -> float:
    """Checks a static scalar is a finite positive number (not an array), and returns it.
    `example` and `none_means` (what leaving the argument None gives) go into the messages."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"pk.{op}: {arg} must be a positive Python float (static, not a jax "
                        f"array), got {value!r} ({type(value).__name__}). Pass e.g. "
                        f"{arg}={example}, or float(...) of a concrete value.")
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"pk.{op}: {arg} must be a finite positive number, got {value!r}. "
                         f"Leave it None for {none_means}.")
    return float(value)

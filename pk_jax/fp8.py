"""FP8 operands for `pk.matmul`: the two Hopper formats, their scales, and current scaling.

An fp8 operand travels with its dequantization scale: the real value is `a.astype(float32) *
scale`, with the scale in float32 and of one of two layouts:

- per tensor: a scalar (shape `()`), as TransformerEngine scales;
- blockwise, as DeepSeek-V3 scales: activations (`x` [M, K]) per row and block of 128 columns
  of K, `x_scale` [M, ceil(K / 128)]; weights (`w` [K, N]) per 128 x 128 block, `w_scale`
  [ceil(K / 128), ceil(N / 128)].

`quantize` makes such a pair by current scaling: each tensor's or block's amax is taken now (no
history), and the scale maps it to the format's largest finite value.

`pk.matmul(x, w, x_scale=..., w_scale=...)` takes fp8 operands: on Hopper GPUs its fp8 kernel
(pk_matmul_fp8) multiplies them, elsewhere its reference dequantizes both operands to float32
and multiplies them in float32. `error_bound` says how far the kernel's product may be from the
reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BLOCK", "FORMATS", "dequantize", "error_bound", "quantize"]

# The Hopper fp8 formats: e4m3 (finite-only, max 448) for values, e5m2 (max 57344) for gradients.
FORMATS = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_FORMATS_NP = tuple(np.dtype(d) for d in FORMATS)
# The side of a scaling block (1 x BLOCK for activations, BLOCK x BLOCK for weights).
BLOCK = 128
# Where amax is zero (an all-zero tensor or block) the scale is 1: the codes are then all zero.
_TINY = np.float32(np.finfo(np.float32).tiny)


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in _FORMATS_NP


def error_bound(k: int, scaling: str, out_dtype=jnp.bfloat16) -> float:
    """The largest |y - exact| / max |exact| that pk_jax's fp8 kernels are held to (their GPU
    tests and benchmarks check it), for a product over K = `k` of operands scaled per
    "tensor" or by "block", with `out_dtype` (bfloat16 or float32) results.

    Hopper's fp8 tensor cores accumulate with about 14 bits (DeepSeek-V3, section 3.3.2): about
    2^-11 of the running sum per 128 of K, growing linearly with K (truncation has a sign) per
    tensor, where the kernels keep the whole sum in the tensor cores' accumulator; blockwise,
    the kernels promote each 128 of K into float32, so 2^-11 whatever K. bf16 results add their
    rounding (2^-9, doubled). Measured errors: bench/results/fp8_notes.md.
    """
    acc = 2.0**-11 * max(1, k // BLOCK) if scaling == "tensor" else 2.0**-11
    return acc + (2.0**-8 if np.dtype(out_dtype) == np.dtype(jnp.bfloat16) else 0.0)


def _max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def block_shape(role: str, shape: tuple[int, int]) -> tuple[int, int]:
    """The blockwise scale's shape of an operand of `shape`: role "x" (activations, [M, K]) is
    scaled per row and 128 columns, role "w" (weights, [K, N]) per 128 x 128 block."""
    r, c = shape
    if role == "x":
        return (r, -(-c // BLOCK))
    return (-(-r // BLOCK), -(-c // BLOCK))


def _expand(scale: jax.Array, role: str, shape: tuple[int, int]) -> jax.Array:
    """The scale of every element of an operand of `shape`: a scalar, or its blocks repeated."""
    if scale.ndim == 0:
        return scale
    r, c = shape
    rows = scale if role == "x" else jnp.repeat(scale, BLOCK, axis=0)[:r]
    return jnp.repeat(rows, BLOCK, axis=1)[:, :c]


def dequantize(a: jax.Array, scale: jax.Array, role: str) -> jax.Array:
    """float32 values of the fp8 operand `a` ("x": activations [M, K]; "w": weights [K, N])
    with its per-tensor or blockwise scale."""
    return a.astype(jnp.float32) * _expand(scale.astype(jnp.float32), role, a.shape)


def quantize(a: jax.Array, *, role: str = "x", dtype=jnp.float8_e4m3fn,
             scaling: str = "tensor") -> tuple[jax.Array, jax.Array]:
    """Current scaling: `a` ([M, K] activations for role "x", [K, N] weights for role "w") in
    fp8 `dtype` with its float32 dequantization scale.

    The scale is amax / the format's largest value, per tensor (`scaling="tensor"`, a scalar)
    or per block (`"block"`: 1 x 128 for "x", 128 x 128 for "w"); the codes are a / scale,
    rounded to nearest and saturated. `dequantize(*quantize(a), role)` is `a` within the
    format's relative precision (2^-4 for e4m3, 2^-3 for e5m2) of each block's amax.

    Raises:
        ValueError: `a` not rank 2, an unknown role or scaling.
        TypeError: `dtype` not an fp8 format, or `a` not a float.
    """
    if role not in ("x", "w"):
        raise ValueError(f"pk.fp8.quantize: role must be 'x' (activations) or 'w' (weights), "
                         f"got {role!r}.")
    if scaling not in ("tensor", "block"):
        raise ValueError(f"pk.fp8.quantize: scaling must be 'tensor' or 'block', got "
                         f"{scaling!r}.")
    if not is_fp8(dtype):
        raise TypeError(f"pk.fp8.quantize: dtype must be one of "
                        f"{', '.join(d.name for d in _FORMATS_NP)}, got {np.dtype(dtype).name}.")
    if a.ndim != 2:
        raise ValueError(f"pk.fp8.quantize: a must have rank 2, got shape {a.shape}.")
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"pk.fp8.quantize: a must be a float array, got {a.dtype}.")
    x = a.astype(jnp.float32)
    top = _max(dtype)
    if scaling == "tensor":
        amax = jnp.max(jnp.abs(x))
    else:
        r, c = x.shape
        br, bc = block_shape(role, x.shape)
        tr = 1 if role == "x" else BLOCK
        padded = jnp.pad(jnp.abs(x), ((0, br * tr - r), (0, bc * BLOCK - c)))
        amax = padded.reshape(br, tr, bc, BLOCK).max(axis=(1, 3))
    scale = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    scale = jnp.maximum(scale, _TINY)
    codes = jnp.clip(x / _expand(scale, role, x.shape), -top, top).astype(dtype)
    return codes, scale

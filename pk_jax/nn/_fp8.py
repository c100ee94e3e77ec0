"""The fp8 training recipe for a local GEMM: current scaling, fp8 forward, bf16 backward."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pk_jax import fp8
from pk_jax.ops import _vjp
from pk_jax.ops import matmul as _mm


def fp8_matmul(x: jax.Array, w: jax.Array, *, scaling: str = "tensor") -> jax.Array:
    """`x @ w` for training in fp8 (current scaling): the forward quantizes `x` and `w` to
    float8_e4m3fn with scales from this step's amax (`pk_jax.fp8.quantize`: per tensor, or
    with `scaling="block"` per 1 x 128 block of `x` and 128 x 128 block of `w`) and multiplies
    them with `pk.matmul`; the backward computes dgrad and wgrad in `x`'s dtype from the
    unquantized `x` and `w` (`pk.matmul`, fp32 accumulation), so only the forward GEMM is fp8.

    Args:
        x: [M, K] activations, bf16 (or fp16, fp32), K a multiple of 16.
        w: [K, N] weights, `x`'s dtype.
        scaling: "tensor" or "block".

    Returns:
        [M, N] in `x`'s dtype (fp32 `x`: float32 output).

    Raises:
        ValueError, TypeError: as `pk_jax.fp8.quantize` and `pk.matmul` raise them, or `w` of
            another dtype than `x`.
    """
    if x.dtype != w.dtype:
        raise TypeError(f"pk.nn.fp8_matmul: x and w must share a dtype, got {x.dtype} and "
                        f"{w.dtype}.")
    if scaling not in ("tensor", "block"):
        raise ValueError(f"pk.nn.fp8_matmul: scaling must be 'tensor' or 'block', got "
                         f"{scaling!r}.")
    return _fp8_matmul(x, w, scaling)


def _forward(x, w, scaling):
    xq, sx = fp8.quantize(x, role="x", scaling=scaling)
    wq, sw = fp8.quantize(w, role="w", scaling=scaling)
    out = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    return _mm.matmul(xq, wq, x_scale=sx, w_scale=sw, out_dtype=out).astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_matmul(x, w, scaling):
    return _forward(x, w, scaling)


def _fwd(x, w, scaling):
    return _forward(x, w, scaling), (x, w)


def _bwd(scaling, res, dy):
    x, w = res
    dy = dy.astype(x.dtype)
    dx, dw = _mm.matmul_impl(dy, w.T, like=x), _mm.matmul_impl(x.T, dy, like=w)
    return _vjp.fit(dx, x), _vjp.fit(dw, w)


_fp8_matmul.defvjp(_fwd, _bwd)

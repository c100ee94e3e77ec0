"""The fp8 training recipe: current scaling, fp8 forward, bf16 backward, for a local GEMM
(`fp8_matmul`), the row-parallel TP GEMMs (`fp8_gemm_reduce_scatter`, `fp8_gemm_all_reduce`)
and the sequence-parallel column GEMM (`fp8_all_gather_gemm`); each device quantizes its own
shards."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from pk_jax import fp8
from pk_jax.ops import _vjp, ag_gemm, gemm_ar, gemm_rs
from pk_jax.ops import all_gather as _all_gather
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
    _check("fp8_matmul", x, w, scaling)
    return _fp8_matmul(x, w, scaling)


def _check(name: str, x, w, scaling) -> None:
    if x.dtype != w.dtype:
        raise TypeError(f"pk.nn.{name}: x and w must share a dtype, got {x.dtype} and "
                        f"{w.dtype}.")
    if scaling not in ("tensor", "block"):
        raise ValueError(f"pk.nn.{name}: scaling must be 'tensor' or 'block', got "
                         f"{scaling!r}.")


def _quantized(x, w, scaling):
    xq, sx = fp8.quantize(x, role="x", scaling=scaling)
    wq, sw = fp8.quantize(w, role="w", scaling=scaling)
    return xq, wq, {"x_scale": sx, "w_scale": sw}


def _forward(x, w, scaling):
    xq, wq, scales = _quantized(x, w, scaling)
    out = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    return _mm.matmul(xq, wq, **scales, out_dtype=out).astype(x.dtype)


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


def fp8_gemm_reduce_scatter(x: jax.Array, w: jax.Array, axis_name: str, *,
                            scaling: str = "tensor") -> jax.Array:
    """`pk.gemm_reduce_scatter(x, w, axis_name)` for training in fp8 (call inside shard_map):
    the forward quantizes this device's shards x [M, K/P] and w [K/P, N] (current scaling, as
    `fp8_matmul`) and runs gemm_reduce_scatter's fp8 form (the fp8 GEMM and the reduce-scatter,
    fused where the cost model picks it); the backward is the 16-bit op's, on the unquantized
    shards in `x`'s dtype (dgrad an all-gather + GEMM, wgrad x^T times the gathered dy).

    Args:
        x: [M, K/P], bf16 or fp16, M divisible by P, K/P a multiple of 16.
        w: [K/P, N], `x`'s dtype.
        axis_name: the tensor-parallel mesh axis.
        scaling: "tensor" or "block".

    Returns:
        [M/P, N] in `x`'s dtype.

    Raises:
        ValueError, TypeError: as `pk_jax.fp8.quantize` and `pk.gemm_reduce_scatter` raise
            them, or `w` of another dtype than `x`.
    """
    _check("fp8_gemm_reduce_scatter", x, w, scaling)
    return _fp8_tp(x, w, axis_name, scaling, gemm_rs.gemm_reduce_scatter, gemm_rs._gemm_rs_bwd)


def fp8_gemm_all_reduce(x: jax.Array, w: jax.Array, axis_name: str, *,
                        scaling: str = "tensor") -> jax.Array:
    """`pk.gemm_all_reduce(x, w, axis_name)` for training in fp8, as `fp8_gemm_reduce_scatter`
    (the backward the 16-bit op's: dgrad and wgrad from dy, which every device holds).

    Returns:
        [M, N] in `x`'s dtype, the same on every device.
    """
    _check("fp8_gemm_all_reduce", x, w, scaling)
    return _fp8_tp(x, w, axis_name, scaling, gemm_ar.gemm_all_reduce, gemm_ar._gemm_ar_bwd)


def fp8_all_gather_gemm(x: jax.Array, w: jax.Array, axis_name: str, *,
                        scaling: str = "tensor") -> jax.Array:
    """`pk.all_gather_gemm(x, w, axis_name)` for training in fp8 (call inside shard_map): the
    forward quantizes this device's row shard x [M/P, K] and w [K, N] (current scaling, as
    `fp8_matmul`) and runs all_gather_gemm's fp8 form, so the gathered rows and their scales
    move as fp8 (half the bytes of a bf16 gather). The backward is the 16-bit op's on the
    unquantized operands in `x`'s dtype (dgrad a GEMM + reduce-scatter, wgrad the gathered x^T
    times dy); it gathers x again in that dtype (`pk.all_gather`) rather than keep the gathered
    rows from the forward, so only the shard is saved.

    Args:
        x: [M/P, K], bf16 or fp16, K a multiple of 16.
        w: [K, N], `x`'s dtype.
        axis_name: the tensor-parallel mesh axis.
        scaling: "tensor" or "block".

    Returns:
        [M, N] in `x`'s dtype.

    Raises:
        ValueError, TypeError: as `pk_jax.fp8.quantize` and `pk.all_gather_gemm` raise them, or
            `w` of another dtype than `x`.
    """
    _check("fp8_all_gather_gemm", x, w, scaling)
    return _fp8_tp(x, w, axis_name, scaling, ag_gemm.all_gather_gemm, _ag_gemm_backward)


def _ag_gemm_backward(axis_name, res, dy):
    x, w = res
    x_full = _all_gather.all_gather(x, axis_name)
    return ag_gemm._ag_gemm_bwd(axis_name, (x, x_full, w), dy)


# op: the public TP op (its fp8 form runs the forward); backward: its 16-bit custom VJP's
# backward, run on the unquantized shards.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_tp(x, w, axis_name, scaling, op, backward):
    xq, wq, scales = _quantized(x, w, scaling)
    return op(xq, wq, axis_name, **scales).astype(x.dtype)


def _tp_fwd(x, w, axis_name, scaling, op, backward):
    return _fp8_tp(x, w, axis_name, scaling, op, backward), (x, w)


def _tp_bwd(axis_name, scaling, op, backward, res, dy):
    return backward(axis_name, res, dy.astype(res[0].dtype))


_fp8_tp.defvjp(_tp_fwd, _tp_bwd)

"""The expert-parallel MoE block shared by the Flax and Equinox layers (`MoE` in
`pk_jax.nn.flax` and `pk_jax.nn.equinox`): a top-k softmax router, `pk.moe_dispatch`, an expert
MLP on `pk.grouped_matmul`, `pk.moe_combine`, and the Switch Transformer load-balancing loss."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax import _checks

# Expert weights are initialised per expert: fan-in over the middle axis, not the expert axis.
expert_init = jax.nn.initializers.lecun_normal(batch_axis=0)


def capacity(tokens: int, top_k: int, capacity_factor: float) -> int:
    """Rows of each rank's dispatched buffer: capacity_factor x the (token, slot)s a rank
    receives on average (its own T k)."""
    return max(1, math.ceil(capacity_factor * tokens * top_k))


def check_sizes(layer: str, features: int, hidden: int, num_experts: int, top_k: int,
                axis_name: str) -> None:
    """A MoE block's arguments, checked when it is built: the grouped GEMMs' K a multiple of 8,
    the experts divisible by the axis size where it is known then."""
    from pk_jax import nn

    if not 1 <= top_k <= num_experts:
        raise ValueError(f"pk_jax.nn.{layer}: top_k={top_k} must be in 1..num_experts "
                         f"({num_experts}).")
    nn.check_split(layer, "features", features, None, None, unit=8, what="the first GEMM's K")
    nn.check_split(layer, "hidden", hidden, None, None, unit=8, what="the second GEMM's K")
    nn.check_split(layer, "num_experts", num_experts, axis_name, nn.known_axis_size(axis_name),
                   what="experts, split over the axis")


def check_experts(layer: str, w: jax.Array, full: tuple[int, int, int], axis_name: str) -> int:
    """Checks that `w` is this device's block of experts of a [E, K, N] weight; returns P."""
    p = _checks.axis_size(f"nn.{layer}", axis_name)
    e = full[0]
    if e % p:
        raise ValueError(f"pk.nn.{layer}: num_experts={e} is not divisible by the size {p} of "
                         f"axis {axis_name!r}; pick a multiple of {p}.")
    want = (e // p, *full[1:])
    if tuple(w.shape) != want:
        raise ValueError(
            f"pk.nn.{layer}: inside shard_map the expert weights should be this device's "
            f"{e // p} experts, shape {want} (full {full}), but have shape {tuple(w.shape)}. "
            "Pass the model's partition specs as the shard_map in_specs of the parameters.")
    return p


def moe_mlp(x: jax.Array, router: jax.Array, w1: jax.Array, w2: jax.Array, *, axis_name: str,
            num_experts: int, top_k: int, capacity_factor: float,
            activation: Callable[[jax.Array], jax.Array], dtype) -> tuple[jax.Array, jax.Array]:
    """One MoE MLP inside shard_map over `axis_name` (tokens and experts split over it).

    Args:
        x: [..., H] this device's tokens.
        router: [H, E] (replicated).
        w1: [E/P, H, F] and w2: [E/P, F, H], this device's experts.

    Returns:
        (y [..., H] in x's dtype, the load-balancing loss: E * sum_e f_e p_e over all ranks'
        tokens, f_e the share of (token, slot)s routed to expert e, p_e its mean router
        probability; 1.0 when perfectly balanced).
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    t = xt.shape[0]
    probs = jax.nn.softmax(xt.astype(jnp.float32) @ router.astype(jnp.float32), axis=-1)
    top_p, ids = jax.lax.top_k(probs, top_k)
    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    tokens, sizes, handle = pk.moe_dispatch(xt.astype(dtype), ids.astype(jnp.int32), axis_name,
                                            num_experts=num_experts,
                                            capacity=capacity(t, top_k, capacity_factor))
    h = activation(pk.grouped_matmul(tokens, w1.astype(dtype), sizes))
    y = pk.grouped_matmul(h.astype(dtype), w2.astype(dtype), sizes)
    out = pk.moe_combine(y, weights, handle, axis_name)
    share = jnp.sum(jax.nn.one_hot(ids, num_experts, dtype=jnp.float32), axis=(0, 1)) / (t * top_k)
    aux = num_experts * jnp.sum(jax.lax.pmean(share, axis_name) *
                                jax.lax.pmean(jnp.mean(probs, axis=0), axis_name))
    return out.reshape(shape).astype(x.dtype), aux


def reference_moe(x: jax.Array, router: jax.Array, w1: jax.Array, w2: jax.Array, *,
                  top_k: int, activation: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The same block on one device with the full weights and no capacity limit (float32)."""
    xt = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    probs = jax.nn.softmax(xt @ router.astype(jnp.float32), axis=-1)
    top_p, ids = jax.lax.top_k(probs, top_k)
    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    h = activation(jnp.einsum("th,tkhf->tkf", xt, w1.astype(jnp.float32)[ids]))
    y = jnp.einsum("tkf,tkfh->tkh", h, w2.astype(jnp.float32)[ids])
    return jnp.einsum("tk,tkh->th", weights, y).reshape(x.shape)

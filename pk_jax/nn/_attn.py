"""The attention block shared by the Flax and Equinox layers (`ParallelAttention` in
`pk_jax.nn.flax` and `pk_jax.nn.equinox`): Q, K, V and output projections tensor-parallel over
one axis (heads split), attention sequence-parallel over another (ring or Ulysses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax import _checks

KINDS = ("ring", "ulysses")


def check_heads(layer: str, features: int, num_heads: int, num_kv_heads: int,
                kind: str, *, axis_name: str | None = None, seq_axis: str | None = None,
                tp: int | None = None, sp: int | None = None) -> int:
    """Checks the block's head layout; returns the head dimension.

    Args:
        layer: the layer, e.g. "flax.ParallelAttention".
        features, num_heads, num_kv_heads, kind: the block's arguments.
        axis_name, seq_axis: the tensor- and sequence-parallel axes.
        tp, sp: their sizes; None: the sizes known when the block is built
            (`pk_jax.nn.known_axis_size`), if any.

    Raises:
        ValueError: a layout that does not split; the message names the argument.
    """
    from pk_jax import nn

    if kind not in KINDS:
        raise ValueError(f"pk_jax.nn.{layer}: attention={kind!r} is not one of {KINDS}.")
    if num_heads <= 0 or features % num_heads:
        divisors = [h for h in range(1, min(features, 64) + 1) if features % h == 0]
        raise ValueError(f"pk_jax.nn.{layer}: num_heads={num_heads} must divide "
                         f"features={features} (e.g. {', '.join(map(str, divisors[-4:]))}).")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"pk_jax.nn.{layer}: num_kv_heads={num_kv_heads} must divide "
                         f"num_heads={num_heads} (grouped-query attention).")
    if axis_name is not None:
        tp = tp if tp is not None else nn.known_axis_size(axis_name)
        nn.check_split(layer, "num_heads", num_heads, axis_name, tp,
                       what="query heads, split over the axis")
        nn.check_split(layer, "num_kv_heads", num_kv_heads, axis_name, tp,
                       what="K/V heads, split over the axis")
        nn.check_split(layer, "features", features, axis_name, tp, unit=8,
                       what="the output projection's K, split over the axis")
        sp = sp if sp is not None or seq_axis is None else nn.known_axis_size(seq_axis)
        if kind == "ulysses" and tp and sp and (num_heads // tp) % sp:
            raise ValueError(
                f"pk_jax.nn.{layer}: num_heads={num_heads} gives each device {num_heads // tp} "
                f"heads over {axis_name!r} of size {tp}, which Ulysses attention splits again "
                f"over {seq_axis!r} of size {sp}: num_heads must be a multiple of {tp * sp}. "
                "Pick such a num_heads, or attention='ring'.")
    return features // num_heads


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axis: str, kind: str,
           causal: bool, layout: str) -> jax.Array:
    """Sequence-parallel attention of this device's heads: q [B, S/P, h, D], k, v
    [B, S/P, hkv, D] (K/V heads repeated for grouped-query attention)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    if kind == "ring":
        return pk.ring_attention(q, k, v, seq_axis, causal=causal, layout=layout)
    return pk.ulysses_attention(q, k, v, seq_axis, causal=causal)


def forward(block, x: jax.Array) -> jax.Array:
    """A ParallelAttention's forward (Flax or Equinox): its q, k, v, o layers and options."""
    layer = f"{type(block).__module__.rsplit('.', 1)[-1]}.{type(block).__name__}"
    axis_name = block.q.axis_name
    heads, kv = block.q.out_features // block.head_dim, block.k.out_features // block.head_dim
    check_heads(layer, block.q.in_features, heads, kv, block.kind, axis_name=axis_name,
                seq_axis=block.seq_axis, tp=_checks.axis_size(f"nn.{layer}", axis_name),
                sp=_checks.axis_size(f"nn.{layer}", block.seq_axis))
    q, k, v = (split_heads(layer(x), block.head_dim) for layer in (block.q, block.k, block.v))
    att = attend(q, k, v, seq_axis=block.seq_axis, kind=block.kind, causal=block.causal,
                 layout=block.layout)
    return block.o(att.reshape(*att.shape[:-2], -1))


def split_heads(x: jax.Array, head_dim: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def reference_block(x: jax.Array, wq, wk, wv, wo, *, num_heads: int, num_kv_heads: int,
                    causal: bool) -> jax.Array:
    """The same block on one device with the full weights (float32, no biases):
    [B, S, features] -> [B, S, features]."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    x = f32(x)
    hd = x.shape[-1] // num_heads
    q = split_heads(x @ f32(wq), hd)
    k = split_heads(x @ f32(wk), hd)
    v = split_heads(x @ f32(wv), hd)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    return o.reshape(*x.shape[:-1], -1) @ f32(wo)

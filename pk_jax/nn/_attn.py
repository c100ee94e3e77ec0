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


def check_masks(layer: str, local_window_size, logits_soft_cap):
    """Checks a block's static masks when it is built (as the attention ops do at trace time);
    returns (window as a (left, right) tuple or None, soft cap as a float or None).

    Raises:
        TypeError, ValueError: as `pk.attention` for these arguments, naming the layer.
    """
    from pk_jax.ops import _attention

    window = _attention._window(f"nn.{layer}", local_window_size, 2**30)
    return window, _attention._soft_cap(f"nn.{layer}", logits_soft_cap)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, *, seq_axis: str, kind: str,
           causal: bool, layout: str, **masks) -> jax.Array:
    """Sequence-parallel attention of this device's heads: q [B, S/P, h, D], k, v
    [B, S/P, hkv, D] (K/V heads repeated for grouped-query attention); `masks`: the mask
    arguments of pk.ring_attention / pk.ulysses_attention (segment_ids, local_window_size,
    logits_soft_cap, query_seq_lengths, key_value_seq_lengths), None ones left out."""
    masks = {name: x for name, x in masks.items() if x is not None}
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    if kind == "ring":
        return pk.ring_attention(q, k, v, seq_axis, causal=causal, layout=layout, **masks)
    return pk.ulysses_attention(q, k, v, seq_axis, causal=causal, **masks)


def forward(block, x: jax.Array, *, segment_ids=None, query_seq_lengths=None,
            key_value_seq_lengths=None) -> jax.Array:
    """A ParallelAttention's forward (Flax or Equinox): its q, k, v, o layers and options, and
    the call's masks (this device's segment ids [B, S/P], laid out like x; lengths [B])."""
    layer = f"{type(block).__module__.rsplit('.', 1)[-1]}.{type(block).__name__}"
    axis_name = block.q.axis_name
    heads, kv = block.q.out_features // block.head_dim, block.k.out_features // block.head_dim
    check_heads(layer, block.q.in_features, heads, kv, block.kind, axis_name=axis_name,
                seq_axis=block.seq_axis, tp=_checks.axis_size(f"nn.{layer}", axis_name),
                sp=_checks.axis_size(f"nn.{layer}", block.seq_axis))
    q, k, v = (split_heads(layer(x), block.head_dim) for layer in (block.q, block.k, block.v))
    att = attend(q, k, v, seq_axis=block.seq_axis, kind=block.kind, causal=block.causal,
                 layout=block.layout, local_window_size=block.local_window_size,
                 logits_soft_cap=block.logits_soft_cap, segment_ids=segment_ids,
                 query_seq_lengths=query_seq_lengths,
                 key_value_seq_lengths=key_value_seq_lengths)
    return block.o(att.reshape(*att.shape[:-2], -1))


def split_heads(x: jax.Array, head_dim: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def reference_block(x: jax.Array, wq, wk, wv, wo, *, num_heads: int, num_kv_heads: int,
                    causal: bool, segment_ids=None, local_window_size=None,
                    logits_soft_cap=None, query_seq_lengths=None,
                    key_value_seq_lengths=None) -> jax.Array:
    """The same block on one device with the full weights (float32, no biases, dense
    attention): [B, S, features] -> [B, S, features]; the masks over the whole sequence
    (segment_ids [B, S], the same for queries and keys), a row that sees no key giving 0."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    x = f32(x)
    b, s, _ = x.shape
    hd = x.shape[-1] // num_heads
    q = split_heads(x @ f32(wq), hd)
    k = jnp.repeat(split_heads(x @ f32(wk), hd), num_heads // num_kv_heads, axis=2)
    v = jnp.repeat(split_heads(x @ f32(wv), hd), num_heads // num_kv_heads, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / jnp.sqrt(hd)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
    i, j = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    visible = jnp.ones((b, s, s), bool)
    if causal:
        visible &= j <= i
    if local_window_size is not None:
        left, right = ((local_window_size,) * 2 if isinstance(local_window_size, int)
                       else local_window_size)
        visible &= (j >= i - left) & (j <= i + right)
    if segment_ids is not None:
        visible &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if query_seq_lengths is not None:
        visible &= i[None] < query_seq_lengths[:, None, None]
    if key_value_seq_lengths is not None:
        visible &= j[None] < key_value_seq_lengths[:, None, None]
    visible = visible[:, None]
    p = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    p = jnp.where(visible, p, 0.0)  # rows that see no key: 0, not NaN
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
    return o.reshape(*x.shape[:-1], -1) @ f32(wo)

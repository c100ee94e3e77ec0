"""attention: softmax attention on one device (reference: `jax.nn.dot_product_attention`).

The reference here is the blockwise online-softmax attention of `pk_jax.ops._attention`
(memory O(S), so S = 32K runs where XLA's materialised attention cannot), with its blockwise
custom VJP; grouped-query attention repeats each K/V head for its H / Hkv query heads. The
Hopper kernel (issue 11: TMA, wgmma, warp-specialised, online softmax in registers) plugs in
behind `_backend.use_kernel("attention")` once the extension registers pk_attention.
"""

from __future__ import annotations

import jax

from pk_jax import _checks
from pk_jax.ops import _attention

NAME = "attention"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              scale: float | None = None) -> jax.Array:
    """softmax(scale q k^T) v per head, over one device's whole sequence.

    Args:
        q: [B, S, H, D]; bf16, fp16 or fp32.
        k: [B, S, Hkv, D] with Hkv dividing H (grouped-query / multi-query attention).
        v: like k.
        causal: query i sees keys 0..i only.
        scale: multiplies q . k; default 1/sqrt(D).

    Returns:
        [B, S, H, D] in q's dtype, float32 statistics and accumulation; equal to
        `jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale)`.

    Raises:
        ValueError: operands not rank 4, shapes that do not match, H not divisible by Hkv, a
            scale that is not positive.
        TypeError: an unsupported or mismatched dtype, a non-bool causal, a non-number scale.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"pk.{NAME}: {name} must be [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.shape)}.")
    _checks.dtype_in(NAME, "q", q, _checks.FLOAT_DTYPES)
    _checks.same_dtype(NAME, "q", q, "k", k)
    _checks.same_dtype(NAME, "q", q, "v", v)
    b, s, h, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != d:
        raise ValueError(f"pk.{NAME}: k and v must be [batch, seq, kv_heads, head_dim] = "
                         f"[{b}, {s}, Hkv, {d}] alike, got k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)}.")
    if h % k.shape[2]:
        raise ValueError(f"pk.{NAME}: the {k.shape[2]} K/V heads must divide the {h} query "
                         "heads (grouped-query attention).")
    causal = _checks.is_bool(NAME, "causal", causal)
    scale = (_attention.default_scale(d) if scale is None
             else _checks.positive_float(NAME, "scale", scale))
    return reference(q, k, v, causal=causal, scale=scale)


def reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
              scale: float) -> jax.Array:
    """Blockwise attention with K/V heads repeated for grouped-query attention."""
    k, v = _attention.repeat_kv(q, k, v)
    return _attention.attention(q, k, v, scale=scale, causal=causal)

"""ulysses_attention: softmax attention over a sequence sharded along a mesh axis, by trading
the sequence split for a head split (reference: `pk.all_to_all` around local blockwise
attention).

Shardings (per device, P = axis size, rank r): q, k, v, out: [B, S/P, H, D], H divisible by P.

Schedule:
    1. all_to_all q, k, v: split heads, gather sequence -> [B, S, H/P, D]; rank r now holds
       heads r*H/P ... (r+1)*H/P - 1 for the whole sequence, in global order.
    2. attention over the full sequence for those heads, in tiles of queries by keys with an
       online softmax (no S x S score matrix; causally hidden tiles skipped), and a blockwise
       custom VJP that saves only the output and the log-sum-exp.
    3. all_to_all back: split sequence, gather heads -> [B, S/P, H, D].

The exchanges go through `pk.all_to_all`, so they use its CUDA kernel where one runs.
"""

from __future__ import annotations

import jax

from pk_jax import _backend, _checks
from pk_jax.ops import _attention
from pk_jax.ops.all_to_all import all_to_all

STEM = "ulysses_attn"
NAME = "ulysses_attention"  # the public name, used in error messages


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *,
                      causal: bool = False, scale: float | None = None) -> jax.Array:
    """Attention of the local queries over the whole (sharded) sequence, by head all-to-all.

    Call inside `jax.shard_map` with q, k, v sharded alike along the sequence dimension over
    `axis_name`.

    Args:
        q: [B, S/P, H, D], this device's contiguous slice of the sequence, H divisible by P;
            bf16, fp16 or fp32.
        k: [B, S/P, Hkv, D], Hkv dividing H (grouped-query attention); else like q.
        v: like k.
        axis_name: the mesh axis the sequence is sharded over (an axis of the mesh given to
            `pk.init`).
        causal: mask keys at later global positions than the query.
        scale: multiplies q . k before the softmax; default 1/sqrt(D).

    Returns:
        [B, S/P, H, D] in q's dtype: softmax(scale * q k^T) v over all S keys for the local
        queries, computed with float32 statistics and accumulation.

    Raises:
        ValueError: `pk.init` not called, a bad axis, q/k/v not rank 4 or of mismatched
            shapes, Hkv not dividing H,
            H not divisible by P, a scale that is not positive.
        TypeError: an unsupported or mismatched dtype, a non-bool causal, a non-number scale.
    """
    p = _checks.axis_size(NAME, axis_name)
    _checks.attention_operands(NAME, q, k, v)
    _checks.divisible(NAME, "the number of heads H (q.shape[2])", q.shape[2], p,
                      f"Ulysses attention gives each of the {p} devices of axis {axis_name!r} "
                      "H/P whole heads: use a head count divisible by the axis size, or "
                      "pk.ring_attention, which has no such constraint.")
    causal = _checks.is_bool(NAME, "causal", causal)
    scale = (_attention.default_scale(q.shape[-1]) if scale is None
             else _checks.positive_float(NAME, "scale", scale))
    k, v = _attention.repeat_kv(q, k, v)  # grouped-query attention (a no-op at H = Hkv)
    if _backend.route(STEM, axis_name).path == "kernel":
        return _cuda_ulysses_attn(q, k, v, axis_name, causal=causal, scale=scale)
    return reference(q, k, v, axis_name, causal=causal, scale=scale)


def _cuda_ulysses_attn(q, k, v, axis_name, **options):
    # A fused kernel's FFI lowering (target pk_ulysses_attn) plugs in here. Unreachable until
    # the extension registers pk_ulysses_attn, because _backend.route checks the target.
    raise NotImplementedError("pk_jax: the CUDA ulysses_attn kernel is not wired yet.")


def reference(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *, causal: bool,
              scale: float) -> jax.Array:
    """all_to_all to head shards, blockwise attention over the whole sequence, all_to_all back."""
    # [B, S/P, H, D] -> [B, S, H/P, D]: split heads (dim 2), gather the sequence (dim 1).
    qh, kh, vh = (all_to_all(x, axis_name, 2, 1) for x in (q, k, v))
    out = _attention.attention(qh, kh, vh, scale=scale, causal=causal)
    return all_to_all(out, axis_name, 1, 2)

"""attention: softmax attention on one device (reference: `jax.nn.dot_product_attention`).

On Hopper GPUs, bf16/fp16 operands with head_dim 64 or 128 run the flash-attention kernels
of cuda/kernels/attention.cuh (TMA loads through an mbarrier ring, wgmma for Q K^T and P V,
online softmax in registers, causal tiles above the diagonal skipped), with a custom VJP whose
backward is one kernel pass (dK and dV in registers, dQ's parts summed into a float32 scratch
with atomic adds, so dq is not bitwise reproducible); grouped-query attention reads each K/V
head in place. Everything else (fp32, other head dims, CPU, and any call with a mask argument:
segment_ids, local_window_size, logits_soft_cap, query_seq_lengths, key_value_seq_lengths,
which the kernels do not take yet) runs the reference: the blockwise online-softmax attention
of `pk_jax.ops._attention` (memory O(S), so S = 32K runs where XLA's materialised attention
cannot), with its blockwise custom VJP and the masks' fully hidden tiles skipped; grouped-query
attention repeats each K/V head for its H / Hkv query heads there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax.ops import _attention, _vjp
from pk_jax.ops._attention import SegmentIds

__all__ = ["SegmentIds", "attention"]  # exported by pk_jax/__init__.py

NAME = "attention"


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False,
              scale: float | None = None, segment_ids: jax.Array | SegmentIds | None = None,
              local_window_size: int | tuple[int, int] | None = None,
              logits_soft_cap: float | None = None,
              query_seq_lengths: jax.Array | None = None,
              key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
    """softmax(scale q k^T) v per head, over one device's whole sequence, with optional masks.

    Args:
        q: [B, S, H, D]; bf16, fp16 or fp32.
        k: [B, S, Hkv, D] with Hkv dividing H (grouped-query / multi-query attention).
        v: like k.
        causal: query i sees keys 0..i only.
        scale: multiplies q . k; default 1/sqrt(D).
        segment_ids: packed sequences: int32 [B, S], the document of each position; a query
            sees only keys with its own id (combined with the other masks, e.g. causal).
            `pk.SegmentIds(q=..., kv=...)` gives the queries' and the keys' ids separately.
        local_window_size: (left, right) or an int w for (w, w), static ints >= 0: query i sees
            keys i - left ... i + right only (`jax.nn.dot_product_attention`'s argument; with
            causal=True, (left, 0) is a sliding window of left + 1 keys).
        logits_soft_cap: a static float c > 0: each logit x = scale * q . k becomes
            c * tanh(x / c) before the masks and the softmax.
        query_seq_lengths: int32 [B]: query rows at positions >= query_seq_lengths[b] are
            padding; their output (and gradient) is 0.
        key_value_seq_lengths: int32 [B]: keys at positions >= key_value_seq_lengths[b] are
            padding, hidden from every query.

    Returns:
        [B, S, H, D] in q's dtype, float32 statistics and accumulation; equal to
        `jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale,
        local_window_size=..., query_seq_lengths=..., key_value_seq_lengths=...)` (segment ids
        as its boolean `mask`), except in rows that no key is visible to (e.g. a
        key_value_seq_lengths of 0, or a query segment id that no key has): those give 0 here,
        as in FlashAttention and cuDNN, where jax's "xla" implementation gives the mean of all
        of v.

    Any mask argument runs the jax.lax reference (blockwise, fully masked tiles skipped: a
    window of W keys costs O(S W)), on GPUs too: the CUDA kernels do not take masks yet.

    Raises:
        ValueError: operands not rank 4, shapes that do not match, H not divisible by Hkv, a
            sequence, head count or head_dim of 0, a scale that is not positive; segment ids
            not [B, S], lengths not [B], a negative window, a soft cap that is not positive.
        TypeError: an unsupported or mismatched dtype, a non-bool causal, a non-number scale;
            segment ids or lengths that are not integer arrays, a window that is not an int
            or a pair of ints, a soft cap that is not a Python number.
    """
    _attention.check_nonempty(NAME, q, k)
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
    mask_args = {"segment_ids": segment_ids, "local_window_size": local_window_size,
                 "logits_soft_cap": logits_soft_cap, "query_seq_lengths": query_seq_lengths,
                 "key_value_seq_lengths": key_value_seq_lengths}
    masks, window, softcap = _attention.check_masks(NAME, q, seq_total=s, **mask_args)
    masked = _attention.mask_arguments_given(**mask_args)
    if forward_path(q, k, v, masked=masked) == "kernel":
        return _kernel_attention(q, k, v, float(scale), bool(causal))
    return reference(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                     masks=masks)


def forward_path(q: jax.Array, k: jax.Array, v: jax.Array, *, masked: bool = False) -> str:
    """How the call runs, decided once at trace time: "kernel" (the CUDA kernels, forward and
    backward) where they take the (already checked) operands and no mask is given, else
    "reference"."""
    supported = kernel_supports(q, k, v) and not masked
    return _backend.route(NAME, supported=supported).path


def reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, scale: float,
              window: tuple[int, int] | None = None, softcap: float | None = None,
              masks: _attention.Masks | None = None) -> jax.Array:
    """Blockwise attention with K/V heads repeated for grouped-query attention; the masks as
    `_attention.blockwise` takes them (checked: `_attention.check_masks`)."""
    k, v = _attention.repeat_kv(q, k, v)
    return _attention.attention(q, k, v, scale=scale, causal=causal, window=window,
                                softcap=softcap, masks=masks)


# Head dims the kernels are compiled for, and the padding of lse and delta for the backward
# (the kernels read them in tiles of up to 128 rows).
HEAD_DIMS = (64, 128)
_PAD = 128


def _split(a: jax.Array) -> bool:
    """Whether `a` is split over devices outside shard_map (an FFI call has no sharding rule)."""
    sh = jax.typeof(a).sharding
    return not sh.mesh.empty and any(p is not None for p in sh.spec)


def kernel_supports(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether the CUDA kernels take these (already checked) operands."""
    return (q.dtype in _checks.MATMUL_DTYPES_NP and q.shape[3] in HEAD_DIMS
            and q.shape[0] <= _op_table.MAX_GRID_Y and q.shape[2] <= _op_table.MAX_GRID_Y
            and q.shape[1] * q.shape[2] * q.shape[3] <= _op_table.MAX_DIM
            and not any(_split(x) for x in (q, k, v)))


def p1_path(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *,
            masked: bool = False) -> str:
    """How ring and Ulysses attention run over a 1-device axis, where the rank holds the whole
    sequence and every head: "local" (this module's kernels on q, k, v as given, forward and
    backward) where they take the operands and no mask is given (`masked`), else
    "reference"."""
    route = _backend.route(NAME, axis_name, supported=kernel_supports(q, k, v) and not masked)
    return "local" if route.path == "kernel" else "reference"


def _forward_call(q, k, v, scale, causal):
    b, s, h, _ = q.shape
    o, lse = _ffi.call("pk_attention", [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                        jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
                       q, k, v, scale=np.float32(scale), causal=np.int64(causal),
                       backward=np.int64(0))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_attention(q, k, v, scale, causal):
    return _forward_call(q, k, v, scale, causal)[0]


def _kernel_fwd(q, k, v, scale, causal):
    o, lse = _forward_call(q, k, v, scale, causal)
    return o, (q, k, v, o, lse)


def backward_call(q, k, v, do, lse, delta, scale, causal):
    """dq, dk, dv from the pk_attention backward kernel (one pass; dq summed in a float32
    scratch, the call's fourth result); lse and delta float32 [B, H, S], padded here to a
    multiple of the kernel's tiles (lse = +inf there, so padded rows get P = 0)."""
    pad = ((0, 0), (0, 0), (0, -q.shape[1] % _PAD))
    dq, dk, dv, _ = _ffi.call("pk_attention", [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                               for x in (q, k, v)]
                              + [jax.ShapeDtypeStruct(q.shape, jnp.float32)],
                              q, k, v, do, jnp.pad(lse, pad, constant_values=jnp.inf),
                              jnp.pad(delta, pad), scale=np.float32(scale),
                              causal=np.int64(causal), backward=np.int64(1))
    return dq, dk, dv


def _kernel_bwd(scale, causal, res, do):
    q, k, v, o, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O) per query row and head, [B, H, S].
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq, dk, dv = backward_call(q, k, v, do, lse, delta, scale, causal)
    return _vjp.fit(dq, q), _vjp.fit(dk, k), _vjp.fit(dv, v)


_kernel_attention.defvjp(_kernel_fwd, _kernel_bwd)

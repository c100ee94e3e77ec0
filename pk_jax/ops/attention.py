"""attention: softmax attention on one device (reference: `jax.nn.dot_product_attention`).

On Hopper GPUs, bf16/fp16 operands with head_dim 64 or 128 run the flash-attention kernels
of cuda/kernels/attention.cuh (TMA loads through an mbarrier ring, wgmma for Q K^T and P V,
online softmax in registers, causal tiles above the diagonal skipped), with a custom VJP whose
backward is one kernel pass (dK and dV in registers, dQ's parts summed into a float32 scratch
with atomic adds, so dq is not bitwise reproducible); grouped-query attention reads each K/V
head in place. Calls with masks (segment_ids, local_window_size, logits_soft_cap,
query_seq_lengths, key_value_seq_lengths) run the masked kernels (cuda/kernels/attention.cuh
fwd_masked_kernel, bwd_masked_kernel: fully hidden tiles skipped, element masks only on tiles
the masks cut). Everything else (fp32, other head dims, CPU) runs the reference: the blockwise
online-softmax attention of `pk_jax.ops._attention` (memory O(S), so S = 32K runs where XLA's
materialised attention cannot), with its blockwise custom VJP and the masks' fully hidden tiles
skipped; grouped-query attention repeats each K/V head for its H / Hkv query heads there.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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

    Masked calls skip fully masked tiles, on the GPU kernels and in the reference alike: a
    window of W keys costs O(S W).

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
    if forward_path(q, k, v) == "kernel":
        return kernel_forward(q, k, v, scale, causal, masks, window, softcap)
    return reference(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap,
                     masks=masks)


def forward_path(q: jax.Array, k: jax.Array, v: jax.Array) -> str:
    """How the call runs, decided once at trace time: "kernel" (the CUDA kernels, forward and
    backward, masked or not) where they take the (already checked) operands, else
    "reference"."""
    return _backend.route(NAME, supported=kernel_supports(q, k, v)).path


def kernel_forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool,
                   masks: _attention.Masks | None = None,
                   window: tuple[int, int] | None = None,
                   softcap: float | None = None) -> jax.Array:
    """pk.attention on the kernels (custom VJP: their backward) for operands `forward_path`
    sends there, with the masks as `_attention.check_masks` returns them: the masked kernels
    where any mask is left, else the plain ones (a call whose masks hide nothing, such as a
    window of the whole sequence, pays nothing for them). The operands and masks are checked
    already, so the masked entry's own checks are not repeated here."""
    masks = _attention.NO_MASKS if masks is None else masks
    if all(x is None for x in masks) and window is None and softcap is None:
        return _kernel_attention(q, k, v, float(scale), bool(causal))
    km = kernel_masks(masks, *q.shape[:2])
    return _masked_kernel(q, k, v, km, float(scale), bool(causal), window, softcap)


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


def p1_path(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str) -> str:
    """How ring and Ulysses attention run over a 1-device axis, where the rank holds the whole
    sequence and every head: "local" (`kernel_forward` on q, k, v as given, masked or not)
    where the kernels take the operands, else "reference"."""
    route = _backend.route(NAME, axis_name, supported=kernel_supports(q, k, v))
    return "local" if route.path == "kernel" else "reference"


def _attributes(s: int, scale: float, causal: bool, backward: bool, *,
                window: tuple[int, int] | None = None, softcap: float | None = None,
                segments: bool = False, masked: bool = False) -> dict:
    """pk_attention's attributes (ffi/attention.cu's Bind(), ffi/launch.h AttnArgs): every call
    passes them all; the mask ones are read only when `masked` (a window of (S, S) and a cap
    of 0 mean none)."""
    return {"scale": np.float32(scale), "causal": np.int64(causal),
            "backward": np.int64(backward),
            **mask_attributes(s, window=window, softcap=softcap, segments=segments,
                              masked=masked)}


def mask_attributes(s: int, *, window: tuple[int, int] | None = None,
                    softcap: float | None = None, segments: bool = False,
                    masked: bool = False) -> dict:
    """The mask attributes of pk_attention and pk_ring_attn (ffi/launch.h VisitMaskFields) over
    a sequence of s positions (the ring's: the whole sequence): masked, the window clamped to s
    ((s, s): none), soft_cap (0: none) and segments."""
    left, right = (s, s) if window is None else window
    return {"masked": np.int64(masked), "window_left": np.int64(min(left, s)),
            "window_right": np.int64(min(right, s)),
            "soft_cap": np.float32(0.0 if softcap is None else softcap),
            "segments": np.int64(segments)}


def _forward_call(q, k, v, scale, causal, *, km: KernelMasks | None = None, window=None,
                  softcap=None):
    """o and lse [B, H, S] (+inf for rows that see no key) from the pk_attention forward; with
    `km` (kernel_masks) the masked kernels."""
    b, s, h, _ = q.shape
    extra = [] if km is None else km.operands()
    o, lse = _ffi.call("pk_attention", [jax.ShapeDtypeStruct(q.shape, q.dtype),
                                        jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
                       q, k, v, *extra,
                       **_attributes(s, scale, causal, False, window=window, softcap=softcap,
                                     segments=km is not None and km.segmented,
                                     masked=km is not None))
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel_attention(q, k, v, scale, causal):
    return _forward_call(q, k, v, scale, causal)[0]


def _kernel_fwd(q, k, v, scale, causal):
    o, lse = _forward_call(q, k, v, scale, causal)
    return o, (q, k, v, o, lse)


def backward_call(q, k, v, do, lse, delta, scale, causal, *, km: KernelMasks | None = None,
                  window=None, softcap=None):
    """dq, dk, dv from the pk_attention backward kernel (one pass; dq summed in a float32
    scratch, the call's fourth result); lse and delta float32 [B, H, S], padded here to a
    multiple of the kernel's tiles (lse = +inf there, so padded rows get P = 0); with `km` the
    masked kernel."""
    s = q.shape[1]
    pad = ((0, 0), (0, 0), (0, -s % _PAD))
    extra = [] if km is None else km.operands()
    dq, dk, dv, _ = _ffi.call("pk_attention", [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                               for x in (q, k, v)]
                              + [jax.ShapeDtypeStruct(q.shape, jnp.float32)],
                              q, k, v, do, jnp.pad(lse, pad, constant_values=jnp.inf),
                              jnp.pad(delta, pad), *extra,
                              **_attributes(s, scale, causal, True, window=window,
                                            softcap=softcap,
                                            segments=km is not None and km.segmented,
                                            masked=km is not None))
    return dq, dk, dv


def _kernel_bwd(scale, causal, res, do):
    q, k, v, o, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O) per query row and head, [B, H, S].
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq, dk, dv = backward_call(q, k, v, do, lse, delta, scale, causal)
    return _vjp.fit(dq, q), _vjp.fit(dk, k), _vjp.fit(dv, v)


_kernel_attention.defvjp(_kernel_fwd, _kernel_bwd)


# ---------------------------------------------------------------------------------------------
# The masked kernels (segment ids, window, soft cap, lengths).

_CHUNK = 64  # the segment ids' chunks (cuda/include/pk/attn/masks.cuh CHUNK)


class KernelMasks(NamedTuple):
    """The masked kernels' int32 operands (ffi/launch.h AttnArgs), from `kernel_masks`.

    q_len, kv_len: [B], the lengths (S where not given). seg: None, or (q_seg, kv_seg [B, SP],
    q_info, kv_info [B, SP / 64, 4]) from `segment_info`, SP = S rounded up to 128.
    """

    q_len: jax.Array
    kv_len: jax.Array
    seg: tuple | None = None

    @property
    def segmented(self) -> bool:
        return self.seg is not None

    def operands(self) -> list:
        return [self.q_len, self.kv_len, *(self.seg or ())]


def segment_info(q_seg: jax.Array, kv_seg: jax.Array):
    """The segment operands of the masked kernels from ids [B, S] (int32).

    Returns:
        (q_seg, kv_seg, q_info, kv_info): the ids padded to SP = S rounded up to 128 (with the
        last id, so a chunk's range does not grow), and per chunk of 64 positions int32
        (min id, max id, first, end): [first, end) is the hull of the other side's chunks whose
        id ranges intersect this one's ([0, 0): none). Chunks whose ranges do not intersect
        share no id, so the kernels skip tiles outside the hull for any ids; for packed
        documents (ids that do not decrease) the hull is exactly the chunks of the chunk's
        documents. An XLA op over [B, SP / 64, SP / 64] booleans.
    """
    s = q_seg.shape[1]
    sp = -(-s // _PAD) * _PAD
    pad = ((0, 0), (0, sp - s))
    q_seg, kv_seg = (jnp.pad(x.astype(jnp.int32), pad, mode="edge") for x in (q_seg, kv_seg))
    n = sp // _CHUNK
    ranges = [(x.reshape(x.shape[0], n, _CHUNK).min(-1), x.reshape(x.shape[0], n, _CHUNK).max(-1))
              for x in (q_seg, kv_seg)]
    (qmin, qmax), (kmin, kmax) = ranges
    meets = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])

    def info(lo, hi, m):  # m: [B, n, n], this side's chunks by the other's
        anyc = m.any(-1)
        first = jnp.argmax(m, axis=-1).astype(jnp.int32)
        end = (n - jnp.argmax(m[..., ::-1], axis=-1)).astype(jnp.int32)
        zero = jnp.zeros_like(first)
        return jnp.stack([lo, hi, jnp.where(anyc, first, zero), jnp.where(anyc, end, zero)], -1)

    return q_seg, kv_seg, info(qmin, qmax, meets), info(kmin, kmax, meets.transpose(0, 2, 1))


def kernel_masks(masks: _attention.Masks, b: int, s: int) -> KernelMasks:
    """The masked kernels' operands from the (checked) masks of `_attention.check_masks`."""
    full = jnp.full((b,), s, jnp.int32)
    q_len = full if masks.q_len is None else masks.q_len.astype(jnp.int32)
    kv_len = full if masks.kv_len is None else masks.kv_len.astype(jnp.int32)
    seg = None if masks.q_seg is None else segment_info(masks.q_seg, masks.k_seg)
    return KernelMasks(q_len, kv_len, seg)


def _kernel_attention_masked(q: jax.Array, k: jax.Array, v: jax.Array,
                             masks: _attention.Masks | None, scale: float, causal: bool,
                             window: tuple[int, int] | None = None,
                             softcap: float | None = None) -> jax.Array:
    """pk.attention with masks on the masked CUDA kernels, forward and backward (custom VJP),
    whatever the router would pick, with its own checks (the tests' and benchmarks' entry;
    pk.attention's masked calls reach the same kernels through `kernel_forward`). Arguments as
    `reference` takes them (the masks checked by `_attention.check_masks`, the window and cap
    as it returns them).

    Raises:
        ValueError: operands the kernels do not take (dtype other than bf16 / fp16, head_dim
            other than 64 or 128, sizes past the kernels' limits, arrays split over devices);
            masks whose shapes do not fit q; a negative window; a cap that is not positive.
    """
    op = f"{NAME} (masked kernels)"
    if not kernel_supports(q, k, v):
        raise ValueError(f"pk.{op}: the kernels take bf16 or fp16 q, k, v of head_dim "
                         f"{HEAD_DIMS} within the grid limits, not split over devices; got "
                         f"{q.dtype} q {tuple(q.shape)}, k {tuple(k.shape)}.")
    b, s = q.shape[:2]
    masks, window, softcap = check_kernel_masks(op, masks, b, s, window, softcap)
    km = kernel_masks(masks, b, s)
    return _masked_kernel(q, k, v, km, float(scale), bool(causal), window, softcap)


def check_kernel_masks(op: str, masks: _attention.Masks | None, b: int, s: int,
                       window: tuple[int, int] | None, softcap: float | None
                       ) -> tuple[_attention.Masks, tuple[int, int] | None, float | None]:
    """The private masked entries' trace-time checks (this module's, ring's and Ulysses'):
    segment ids int [B, s] (s: this device's rows), given for both sides or neither; lengths
    int [B]; a window (left, right) >= 0; a soft cap > 0.

    Returns:
        (masks, window, softcap): NO_MASKS for None, the window as a pair of ints, the cap a
        float.

    Raises:
        ValueError: any of the above not met (the message names `op`).
    """
    masks = _attention.NO_MASKS if masks is None else masks
    for name, x, shape in (("q_seg", masks.q_seg, (b, s)), ("k_seg", masks.k_seg, (b, s)),
                           ("q_len", masks.q_len, (b,)), ("kv_len", masks.kv_len, (b,))):
        if x is not None and (tuple(x.shape) != shape
                              or not jnp.issubdtype(x.dtype, jnp.integer)):
            raise ValueError(f"pk.{op}: masks.{name} must be an integer array of shape "
                             f"{shape}, got {x.dtype} {tuple(x.shape)}.")
    if (masks.q_seg is None) != (masks.k_seg is None):
        raise ValueError(f"pk.{op}: masks.q_seg and masks.k_seg are given together.")
    if window is not None:
        window = tuple(int(w) for w in window)
        if len(window) != 2 or min(window) < 0:
            raise ValueError(f"pk.{op}: window must be (left, right) >= 0, got {window}.")
    if softcap is not None:
        softcap = _checks.positive_float(op, "softcap", softcap, example="30.0",
                                         none_means="no cap")
    return masks, window, softcap


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _masked_kernel(q, k, v, km, scale, causal, window, softcap):
    return _forward_call(q, k, v, scale, causal, km=km, window=window, softcap=softcap)[0]


def _masked_kernel_fwd(q, k, v, km, scale, causal, window, softcap):
    o, lse = _forward_call(q, k, v, scale, causal, km=km, window=window, softcap=softcap)
    return o, (q, k, v, km, o, lse)


def _masked_kernel_bwd(scale, causal, window, softcap, res, do):
    q, k, v, km, o, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O): 0 on rows that see no key (O = 0 there, lse = +inf).
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq, dk, dv = backward_call(q, k, v, do, lse, delta, scale, causal, km=km, window=window,
                               softcap=softcap)
    return _vjp.fit(dq, q), _vjp.fit(dk, k), _vjp.fit(dv, v), None


_masked_kernel.defvjp(_masked_kernel_fwd, _masked_kernel_bwd)

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

On GPUs at P > 1 (bf16/fp16, head dim 64 or 128) the default forward is composed of kernels:
`pk.all_to_all` of q, k, v to head shards (K/V heads that P does not divide repeated only up to
lcm(Hkv, P) heads first), the pk.attention forward kernel (ping-pong schedule; GQA heads read
in place) over the whole sequence for the rank's head group, which also gives the lse, and
`pk.all_to_all` of the output back. Its custom VJP keeps the head-sharded q, k, v, output and
lse, so the backward exchanges only dO to head shards: delta = rowsum(dO * O) there, the
pk.attention backward kernel on the head group, and `pk.all_to_all` of dq, dk, dv
back to sequence shards; repeated K/V heads' gradients are summed in float32.

A fused forward (target pk_ulysses_attn, cuda/kernels/ulysses_attn.cuh: communication blocks of
the attention grid push every rank's head-group slices of q, k, v into the owner's symmetric
workspace, the attention blocks of a head group start on a source's rows as soon as those rows
have landed, and a tail kernel pulls each rank's output rows back) and a fused backward (target
pk_ulysses_attn_bwd, cuda/kernels/ulysses_attn_bwd.cuh: communication blocks push every rank's
head-group slices of dO and its delta rows into the owner's workspace, the one-pass attention
backward of the head group starts on a source's rows as they land, and a tail kernel pulls dq,
dk, dv back) run where the one decider (`cost_model.choose`, per pass and shape) picks them:
at the scale model the fused forward lost to the composed kernels everywhere measured, and the
fused backward won where the exchange is a large share (bench/results/overlap.md).
PK_JAX_ULYSSES_FUSED overrides it (fixed at the first `pk.init`): 0 the composed kernels, 1 the
fused forward, bwd the fused backward. The fused forward's backward is composed, on its
sequence-sharded out and lse (`pk.all_to_all` of q, dO, k, v and of (lse, delta) to head
shards, the pk.attention backward kernels, the gradients back). With the fused backward the
composed forward keeps the sequence-sharded output instead of the head-sharded one, for delta
on the local rows.

At P = 1 (a 1-device axis) the rank holds the whole sequence and every head, so where the
pk.attention kernels take the operands the call is exactly pk.attention (its forward kernel
and its kernel backward, no exchange). `ulysses_attention` takes its paths from
`_backend.route` at trace time: the forward's, and with the composed forward the backward's.

Masks (segment_ids, local_window_size, logits_soft_cap, query_seq_lengths,
key_value_seq_lengths; see `ulysses_attention`) run pk.attention's masked kernels at P = 1, and
at P > 1 the composed kernels with masks (`_composed_masked`: the masked pk.attention kernels
on the head groups) where those kernels take the operands, else the reference; the fused
kernels take no masks yet. They apply after the all-to-all, where each rank holds the whole
sequence of its head group in global order: the segment ids are all-gathered along the axis
([B, S/P] int32 per rank to [B, S]), positions are the global ones, and the masked kernels
(or the blockwise reference) skip the tiles that no mask lets through.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table, cost_model
from pk_jax.ops import _attention, _tp, _vjp
from pk_jax.ops import all_gather as _all_gather
from pk_jax.ops import attention as _attention_op
from pk_jax.ops.all_to_all import all_to_all
from pk_jax.runtime import state

__all__ = ["ulysses_attention"]  # exported by pk_jax/__init__.py

STEM = "ulysses_attn"
NAME = "ulysses_attention"  # the public name, used in error messages


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *,
                      causal: bool = False, scale: float | None = None,
                      segment_ids: jax.Array | _attention.SegmentIds | None = None,
                      local_window_size: int | tuple[int, int] | None = None,
                      logits_soft_cap: float | None = None,
                      query_seq_lengths: jax.Array | None = None,
                      key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
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
        segment_ids: packed sequences: int32 [B, S/P], this device's ids (contiguous shards);
            a query sees only keys with its own id, on any rank (segments may cross shard
            boundaries). `pk.SegmentIds(q=..., kv=...)` gives the queries' and the keys' ids
            separately (each [B, S/P]).
        local_window_size: (left, right) or an int w for (w, w), static ints >= 0, over global
            positions: query i sees keys i - left ... i + right only (as in
            `jax.nn.dot_product_attention`).
        logits_soft_cap: a static float c > 0: logits x become c * tanh(x / c).
        query_seq_lengths: int32 [B], the same on every device of the axis (replicated):
            query rows at global positions >= it are padding, with output and gradient 0.
        key_value_seq_lengths: int32 [B], replicated likewise: keys at global positions >= it
            are hidden.

    Returns:
        [B, S/P, H, D] in q's dtype: softmax(scale * q k^T) v over all S keys for the local
        queries, computed with float32 statistics and accumulation; with masks as
        `pk.attention` over the whole sequence (rows that no key is visible to give 0).

    With any mask argument: over a 1-device axis, pk.attention's masked kernels where they take
    the operands; at P > 1 the composed kernels with masks where the pk.attention kernels take
    the head group (pk.all_to_all, the masked kernels forward and backward, all_to_all back),
    else the reference (all_to_all, the blockwise jax.lax attention, all_to_all back).

    Raises:
        ValueError: `pk.init` not called, a bad axis, q/k/v not rank 4 or of mismatched
            shapes, Hkv not dividing H, H not divisible by P, a local sequence, head count or
            head_dim of 0, a scale that is not positive,
            PK_JAX_ULYSSES_FUSED other than 0, 1 or bwd, or a symmetric workspace too small
            for the fused kernel that runs (the forward with PK_JAX_ULYSSES_FUSED=1:
            `workspace_need`; the backward with PK_JAX_ULYSSES_FUSED=bwd:
            `fused_bwd_workspace_need`, checked when the forward is traced; the message names
            workspace_bytes); segment ids not [B, S/P], lengths not [B] or varying along the
            axis, a negative window, a soft cap that is not positive.
        TypeError: an unsupported or mismatched dtype, a non-bool causal, a non-number scale;
            segment ids or lengths that are not integer arrays, a window that is not an int
            or a pair of ints, a soft cap that is not a Python number.
    """
    p = _checks.axis_size(NAME, axis_name)
    _attention.check_nonempty(NAME, q, k, "seq_local")
    _checks.attention_operands(NAME, q, k, v)
    _checks.divisible(NAME, "the number of heads H (q.shape[2])", q.shape[2], p,
                      f"Ulysses attention gives each of the {p} devices of axis {axis_name!r} "
                      "H/P whole heads: use a head count divisible by the axis size, or "
                      "pk.ring_attention, which has no such constraint.")
    causal = _checks.is_bool(NAME, "causal", causal)
    scale = (_attention.default_scale(q.shape[-1]) if scale is None
             else _checks.positive_float(NAME, "scale", scale))
    mask_args = {"segment_ids": segment_ids, "local_window_size": local_window_size,
                 "logits_soft_cap": logits_soft_cap, "query_seq_lengths": query_seq_lengths,
                 "key_value_seq_lengths": key_value_seq_lengths}
    masks, window, softcap = _attention.check_masks(
        NAME, q, seq_total=q.shape[1] * p, axis_name=axis_name, seq="seq_local", **mask_args)
    masked = _attention.mask_arguments_given(**mask_args)
    decide = (overlap_shape(q, k, p, causal), q.dtype.itemsize)
    if p == 1:
        path = _attention_op.p1_path(q, k, v, axis_name)
    elif masked:  # the fused kernels take no masks: the composed kernels or the reference
        path = ("composed_masked" if _backend.route(
            _attention_op.NAME, supported=composed_supports(q, p)).path == "kernel"
            else "reference")
    elif _backend.route(STEM, axis_name, supported=kernel_supports(q, p),
                        overlap=decide).path == "fused":
        path = "fused"
    else:  # the serial form: composed where the pk.attention kernels take the head group
        path = ("composed" if _backend.route(_attention_op.NAME,
                                             supported=composed_supports(q, p)).path == "kernel"
                else "reference")
    if path == "local":
        # One rank holds the whole sequence and every head: plain attention, no exchange.
        return _attention_op.kernel_forward(q, k, v, scale, causal, masks, window, softcap)
    if path == "composed_masked":
        return _composed_masked(q, k, v, axis_name, masks, scale, causal, window, softcap)
    if path == "reference":
        k, v = _attention.repeat_kv(q, k, v)  # grouped-query attention (a no-op at H = Hkv)
        return reference(q, k, v, axis_name, causal=causal, scale=scale, window=window,
                         softcap=softcap, masks=masks)
    rep = kv_repeats(k.shape[2], p)
    kr = jax.ShapeDtypeStruct((*k.shape[:2], k.shape[2] * rep, k.shape[3]), k.dtype)
    if path == "composed":
        # The composed forward's backward: fused or composed, decided now (the forward keeps
        # the residuals that backward needs). The kernel indexes B S H/P D elements (= q.size)
        # of its head group in 32 bits.
        fused_bwd = _backend.route(
            "ulysses_attn_bwd", axis_name,
            supported=kernel_supports(q, p) and q.size <= _op_table.MAX_DIM,
            overlap=decide).path == "fused"
        if fused_bwd:  # here, so that a too small workspace raises before anything runs
            _tp.check_workspace(NAME, fused_bwd_workspace_need(q, kr, p),
                                f"the backward's head-group copies of dO {q.shape}, its delta, "
                                f"float32 dq and dk, dv {kr.shape}")
        return _composed_ulysses(q, k, v, axis_name, causal, float(scale), rep, fused_bwd)
    _tp.check_workspace(NAME, workspace_need(q, kr, p),
                        f"the head-group copies of q {q.shape}, k and v {kr.shape}, the output "
                        "and lse")
    # The fused forward's backward: the pk.attention backward kernel on head shards where
    # that kernel runs, else the reference's.
    backward = "kernel" if _backend.use_kernel(_attention_op.NAME) else "reference"
    return _kernel_ulysses(q, k, v, axis_name, causal, float(scale), rep, backward)


FUSED_ENV = "PK_JAX_ULYSSES_FUSED"  # state.Settings.ulysses_fused
# Its values, overrides of the decider (cost_model.ULYSSES_FUSED_MODES): "auto" (the default)
# the decider's choice (cost_model.choose, per pass and shape), "0" the composed kernels both
# ways, "1" the fused forward (pk_ulysses_attn), "bwd" the fused backward (pk_ulysses_attn_bwd)
# after the composed forward.
FUSED_MODES = cost_model.ULYSSES_FUSED_MODES


def overlap_shape(q: jax.Array, k: jax.Array, p: int, causal: bool) -> dict:
    """The decider's shape of one call (cost_model.overlap_parts) from per-device q, k."""
    b, sl, h, d = q.shape
    return {"b": b, "s": sl * p, "h": h, "hkv": k.shape[2], "d": d, "causal": bool(causal)}


def composed_supports(q: jax.Array, p: int) -> bool:
    """Whether the pk.attention kernels take the head group [B, S, H/P, D] of these operands
    (the composed path; P divides H)."""
    return (p > 1 and q.dtype in _checks.MATMUL_DTYPES_NP
            and q.shape[3] in _attention_op.HEAD_DIMS and q.shape[0] <= _op_table.MAX_GRID_Y
            and q.shape[2] // p <= _op_table.MAX_GRID_Y
            and q.shape[1] * q.shape[2] * q.shape[3] <= _op_table.MAX_DIM)


# ---------------------------------------------------------------------------------------------
# The default on GPUs: pk.all_to_all, the pk.attention kernels on the head group, all_to_all
# back; the custom VJP keeps the head-sharded operands, output and lse. With fused_bwd
# (where the route of ulysses_attn_bwd says "fused") the VJP is one pk_ulysses_attn_bwd call.

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _composed_ulysses(q, k, v, axis_name, causal, scale, rep, fused_bwd):
    return _composed_fwd(q, k, v, axis_name, causal, scale, rep, fused_bwd)[0]


def _composed_fwd(q, k, v, axis_name, causal, scale, rep, fused_bwd):
    # [B, S/P, H, D] -> [B, S, H/P, D]: split heads, gather the sequence in rank order.
    qh, kh, vh = (all_to_all(x, axis_name, 2, 1) for x in (q, _repeat(k, rep), _repeat(v, rep)))
    oh, lse = _attention_op._forward_call(qh, kh, vh, scale, causal)  # lse [B, H/P, S]
    # Empty slices of q, k, v carry their dtypes and varying axes to the backward.
    like = tuple(x[:0] for x in (q, k, v))
    o = all_to_all(oh, axis_name, 1, 2)
    # The fused backward takes delta on the local rows, so it keeps the sequence-sharded
    # output (the primal result) instead of the head-sharded one.
    return o, (qh, kh, vh, o if fused_bwd else oh, lse, like)


def _composed_ulysses_bwd(axis_name, causal, scale, rep, fused_bwd, res, do):
    if fused_bwd:
        return _fused_bwd(axis_name, causal, scale, rep, res, do)
    qh, kh, vh, oh, lse, (q, k, v) = res
    doh = all_to_all(do.astype(qh.dtype), axis_name, 2, 1)
    # delta = rowsum(dO * O) per query row and head of the group, [B, H/P, S] like lse.
    delta = jnp.sum(doh.astype(jnp.float32) * oh.astype(jnp.float32), axis=-1
                    ).transpose(0, 2, 1)
    dq, dkr, dvr = (all_to_all(g, axis_name, 1, 2)
                    for g in _head_group_bwd(scale, causal, qh, kh, vh, doh, lse, delta))
    dk, dv = _unrepeat(dkr, rep, k), _unrepeat(dvr, rep, v)
    return tuple(_vjp.fit(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))


def _fused_bwd(axis_name, causal, scale, rep, res, do):
    """dq, dk, dv from one pk_ulysses_attn_bwd call: it moves dO and delta to the head group's
    owner, runs the attention backward there and pulls the gradients back to sequence shards
    (K/V with the repeated heads; summed here)."""
    qh, kh, vh, o, lse, (q, k, v) = res
    do = do.astype(qh.dtype)
    # delta = rowsum(dO * O) on the local rows, [B, H, S/P]; lse [B, H/P, S] padded to whole
    # 128-row tiles with +inf (those rows get P = 0).
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    s = qh.shape[1]
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, -s % 128)), constant_values=jnp.inf)
    b, sl, _, d = do.shape
    kr_shape = (b, sl, k.shape[2] * rep, d)  # sequence shards of the repeated K/V heads
    dq, dkr, dvr = _ffi.call(
        "pk_ulysses_attn_bwd", [jax.ShapeDtypeStruct(do.shape, qh.dtype),
                                jax.ShapeDtypeStruct(kr_shape, kh.dtype),
                                jax.ShapeDtypeStruct(kr_shape, vh.dtype)],
        do, qh, kh, vh, lse, delta, _backend.rank_operand(axis_name),
        comm_id=np.int64(state.comm_id(axis_name)), scale=np.float32(scale),
        causal=np.int64(causal), num_comm_sms=np.int64(NUM_COMM_SMS))
    dk, dv = _unrepeat(dkr, rep, k), _unrepeat(dvr, rep, v)
    return tuple(_vjp.fit(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))


_composed_ulysses.defvjp(_composed_fwd, _composed_ulysses_bwd)


# ---------------------------------------------------------------------------------------------
# The composed path with masks (issue 38 section 3; its GPU test: tests/gpu/sp_masked_mp.py
# ulysses), ulysses_attention's path with masks at P > 1 where it takes the operands. After
# the all-to-all the rank holds the whole sequence of its head group in global order, so the
# masks are pk.attention's over [B, S]: the segment ids all-gathered along the axis, the
# lengths (replicated) and the window as given.

def _composed_masked(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str,
                     masks: _attention.Masks | None, scale: float, causal: bool,
                     window: tuple[int, int] | None = None,
                     softcap: float | None = None) -> jax.Array:
    """ulysses_attention with masks on the composed kernels: pk.all_to_all of q, k, v to head
    groups, the masked pk.attention forward kernel over the whole sequence, all_to_all back;
    its custom VJP runs the masked pk.attention backward kernel on the saved head shards.

    ulysses_attention's masked path at P > 1, and the GPU test's entry. Call inside shard_map
    over `axis_name` (P > 1) with q, k, v [B, S/P, H, D] and masks as
    `_attention.check_masks` returns them for ulysses_attention: segment ids [B, S/P] (this
    rank's contiguous rows), lengths [B] (the same on every rank) over global positions; the
    window over global positions.

    Raises:
        ValueError: operands the composed kernels do not take (`composed_supports`: P > 1,
            bf16 / fp16, head_dim 64 or 128, sizes within the grid limits); H not divisible by
            P; masks whose shapes do not fit q; a negative window; a cap that is not positive.
    """
    op = f"{NAME} (masked composed kernels)"
    p = _checks.axis_size(NAME, axis_name)
    if q.shape[2] % p or not composed_supports(q, p):
        raise ValueError(f"pk.{op}: the composed kernels take bf16 or fp16 q, k, v of head_dim "
                         f"{_attention_op.HEAD_DIMS} at P > 1 with P dividing H, within the grid "
                         f"limits; got {q.dtype} q {tuple(q.shape)} at P = {p}.")
    b, sl = q.shape[:2]
    masks, window, softcap = _attention_op.check_kernel_masks(op, masks, b, sl, window, softcap)
    km = _attention_op.kernel_masks(_gather_segments(masks, axis_name), b, sl * p)
    return _composed_masked_kernel(q, k, v, km, axis_name, float(scale), bool(causal),
                                   kv_repeats(k.shape[2], p), window, softcap)


def _gather_segments(masks: _attention.Masks, axis_name: str) -> _attention.Masks:
    """The segment ids of the whole sequence [B, S] from every rank's [B, S/P] (contiguous
    shards, rank order); one all-gather when the queries' and the keys' ids are one array."""
    if masks.q_seg is None:
        return masks
    # pk.all_gather: its kernel where it runs (no XLA collective there), else XLA's
    gather = lambda ids: _all_gather.all_gather(ids.astype(jnp.int32), axis_name, axis=1)
    q_seg = gather(masks.q_seg)
    k_seg = q_seg if masks.k_seg is masks.q_seg else gather(masks.k_seg)
    return masks._replace(q_seg=q_seg, k_seg=k_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _composed_masked_kernel(q, k, v, km, axis_name, scale, causal, rep, window, softcap):
    return _composed_masked_fwd(q, k, v, km, axis_name, scale, causal, rep, window, softcap)[0]


def _composed_masked_fwd(q, k, v, km, axis_name, scale, causal, rep, window, softcap):
    qh, kh, vh = (all_to_all(x, axis_name, 2, 1) for x in (q, _repeat(k, rep), _repeat(v, rep)))
    oh, lse = _attention_op._forward_call(qh, kh, vh, scale, causal, km=km, window=window,
                                          softcap=softcap)  # lse [B, H/P, S], +inf: no key
    like = tuple(x[:0] for x in (q, k, v))
    return all_to_all(oh, axis_name, 1, 2), (qh, kh, vh, oh, lse, km, like)


def _composed_masked_bwd(axis_name, scale, causal, rep, window, softcap, res, do):
    qh, kh, vh, oh, lse, km, (q, k, v) = res
    doh = all_to_all(do.astype(qh.dtype), axis_name, 2, 1)
    # delta = rowsum(dO * O): 0 on rows that see no key (O = 0 there).
    delta = jnp.sum(doh.astype(jnp.float32) * oh.astype(jnp.float32), axis=-1
                    ).transpose(0, 2, 1)
    dq, dkr, dvr = (all_to_all(g, axis_name, 1, 2) for g in _attention_op.backward_call(
        qh, kh, vh, doh, lse, delta, scale, causal, km=km, window=window, softcap=softcap))
    dk, dv = _unrepeat(dkr, rep, k), _unrepeat(dvr, rep, v)
    return (*(_vjp.fit(g, x) for g, x in ((dq, q), (dk, k), (dv, v))), None)


_composed_masked_kernel.defvjp(_composed_masked_fwd, _composed_masked_bwd)


def _head_group_bwd(scale, causal, qh, kh, vh, doh, lse, delta):
    """dq, dk, dv on head shards [B, S, ., D] from the pk_attention backward kernel; lse and
    delta float32 [B, H/P, S]."""
    return _attention_op.backward_call(qh, kh, vh, doh, lse, delta, scale, causal)


# ---------------------------------------------------------------------------------------------
# The fused kernel (target pk_ulysses_attn, cuda/kernels/ulysses_attn.cuh; PK_JAX_ULYSSES_FUSED=1):
# the forward in one call; the backward composed of pk.all_to_all and the pk.attention backward
# kernels. The fused backward's workspace (pk_ulysses_attn_bwd, PK_JAX_ULYSSES_FUSED=bwd) too.

HEAD_DIMS = (64, 128)
NUM_COMM_SMS = 2  # the fused backward's communication blocks (the same on every rank)
# The fused forward's: one block moves the q, k, v exchange slowly, and with 8 instead of 2
# the forward took far less time at emulated P = 2 and 4 (measured:
# bench/results/ulysses_attention_notes.md, "Measurements moved from code comments (issue 37)").
FWD_COMM_SMS = 8


def kernel_supports(q: jax.Array, p: int) -> bool:
    """Whether the fused forward takes these (already checked) operands; P divides H."""
    return (p > 1 and q.dtype in _checks.MATMUL_DTYPES_NP and q.shape[3] in HEAD_DIMS
            and q.shape[0] * p <= _op_table.MAX_GRID_Y and q.shape[2] <= _op_table.MAX_GRID_Y
            and q.shape[1] * q.shape[2] * q.shape[3] <= _op_table.MAX_DIM
            and q.shape[1] * p <= _op_table.MAX_DIM // 2)


def kv_repeats(hkv: int, p: int) -> int:
    """How many times the kernel path repeats each K/V head: the kernels split the K/V heads
    over the P ranks too, so Hkv is raised to lcm(Hkv, P) (which divides H, as Hkv and P do);
    1 when P divides Hkv."""
    return p // math.gcd(hkv, p)


def workspace_need(q: jax.Array, k: jax.Array, p: int) -> int:
    """Bytes of symmetric workspace the kernel uses (ulysses_attn::make_layout, through
    ffi/launch.h WorkspaceNeed): q's and the output's head-group copies (each the size of q),
    k's and v's (each the size of k, with the heads the kernel is given), and lse, each
    section rounded up to 1 KiB."""
    b, s, h, d = q.shape
    return _ffi.workspace_need("ulysses_attn", p, b=b, s=s, h=h, hkv=k.shape[2], d=d)


def fused_bwd_workspace_need(q: jax.Array, k: jax.Array, p: int) -> int:
    """Bytes of symmetric workspace the fused backward uses (ulysses_attn_bwd::make_layout,
    through ffi/launch.h WorkspaceNeed): the head group's dO (the size of q), its delta rows
    (float32 [B, H/P, S] padded to whole 128-row tiles), float32 dq (twice the size of q), dk
    and dv (each the size of k, with the heads the kernel is given), each section rounded up
    to 1 KiB."""
    b, s, h, d = q.shape
    return _ffi.workspace_need("ulysses_attn_bwd", p, b=b, s=s, h=h, hkv=k.shape[2], d=d)


def _repeat(x: jax.Array, rep: int) -> jax.Array:
    """Each K/V head repeated `rep` times, next to each other (as `_attention.repeat_kv`)."""
    return x if rep == 1 else jnp.repeat(x, rep, axis=2)


def _unrepeat(g: jax.Array, rep: int, like: jax.Array) -> jax.Array:
    """The VJP of `_repeat`: each head's `rep` gradients summed in float32."""
    if rep == 1:
        return g
    b, s, h, d = g.shape
    return jnp.sum(g.astype(jnp.float32).reshape(b, s, h // rep, rep, d), axis=3
                   ).astype(like.dtype)


def _kernel_call(q, k, v, axis_name, causal, scale):
    b, s, h, _ = q.shape
    o, lse = _ffi.call(
        "pk_ulysses_attn", [jax.ShapeDtypeStruct(q.shape, q.dtype),
                            jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        q, k, v, _backend.rank_operand(axis_name), comm_id=np.int64(state.comm_id(axis_name)),
        scale=np.float32(scale), causal=np.int64(causal), num_comm_sms=np.int64(FWD_COMM_SMS))
    return o, lse  # lse [B, H, S/P]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _kernel_ulysses(q, k, v, axis_name, causal, scale, rep, backward):
    return _kernel_call(q, _repeat(k, rep), _repeat(v, rep), axis_name, causal, scale)[0]


def _kernel_ulysses_fwd(q, k, v, axis_name, causal, scale, rep, backward):
    o, lse = _kernel_call(q, _repeat(k, rep), _repeat(v, rep), axis_name, causal, scale)
    return o, (q, k, v, o, lse)


def _kernel_ulysses_bwd(axis_name, causal, scale, rep, backward, res, do):
    q, k, v, o, lse = res
    if backward == "kernel":
        dq, dkr, dvr = _composed_bwd(axis_name, causal, scale,
                                     (q, _repeat(k, rep), _repeat(v, rep), o, lse), do)
        dk, dv = _unrepeat(dkr, rep, k), _unrepeat(dvr, rep, v)
    else:
        # The reference backward: everything to head shards (K/V heads repeated up to H, lse
        # as [B, S/P, H]), the blockwise attention backward over the whole sequence, the
        # gradients back to sequence shards.
        full = q.shape[2] // k.shape[2]
        heads = [all_to_all(x, axis_name, 2, 1) for x in
                 (q, _repeat(k, full), _repeat(v, full), o, lse.transpose(0, 2, 1), do)]
        dq, dkh, dvh = (all_to_all(g, axis_name, 1, 2) for g in
                        _attention._backward(scale, causal, tuple(heads[:5]), heads[5]))
        dk, dv = _unrepeat(dkh, full, k), _unrepeat(dvh, full, v)
    return tuple(_vjp.fit(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))


def _composed_bwd(axis_name, causal, scale, res, do):
    """dq, dk, dv in sequence shards from the pk_attention backward on head shards; k, v with
    the heads the forward kernel was given (P divides them)."""
    q, k, v, o, lse = res
    do = do.astype(q.dtype)
    # delta = rowsum(dO * O) on the local rows: [B, H, S/P] like lse, so the exchange moves
    # two float32 rows per query and head instead of O.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    # [B, S/P, H, D] -> [B, S, H/P, D]: split heads, gather the sequence in rank order;
    # [2, B, H, S/P] -> [2, B, H/P, S] likewise for (lse, delta).
    qh, doh, kh, vh = (all_to_all(x, axis_name, 2, 1) for x in (q, do, k, v))
    stats = all_to_all(jnp.stack([lse, delta]), axis_name, 2, 3)
    return tuple(all_to_all(g, axis_name, 1, 2)
                 for g in _head_group_bwd(scale, causal, qh, kh, vh, doh, stats[0], stats[1]))


_kernel_ulysses.defvjp(_kernel_ulysses_fwd, _kernel_ulysses_bwd)


def reference(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *, causal: bool,
              scale: float, window: tuple[int, int] | None = None,
              softcap: float | None = None,
              masks: _attention.Masks | None = None) -> jax.Array:
    """all_to_all to head shards, blockwise attention over the whole sequence, all_to_all back;
    the masks (`_attention.check_masks`) after the exchange: segment ids all-gathered to the
    whole sequence, positions global."""
    masks = _attention.NO_MASKS if masks is None else masks
    # [B, S/P, H, D] -> [B, S, H/P, D]: split heads (dim 2), gather the sequence (dim 1).
    qh, kh, vh = (all_to_all(x, axis_name, 2, 1) for x in (q, k, v))
    if masks.q_seg is not None:
        gather = lambda ids: jax.lax.all_gather(ids, axis_name, axis=1, tiled=True)
        q_seg = gather(masks.q_seg)
        k_seg = q_seg if masks.k_seg is masks.q_seg else gather(masks.k_seg)
        masks = masks._replace(q_seg=q_seg, k_seg=k_seg)
    out = _attention.attention(qh, kh, vh, scale=scale, causal=causal, window=window,
                               softcap=softcap, masks=masks)
    return all_to_all(out, axis_name, 1, 2)

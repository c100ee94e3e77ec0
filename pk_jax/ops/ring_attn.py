"""ring_attention: softmax attention over a sequence sharded along a mesh axis, with K/V blocks
passed around a ring (reference: a blockwise ring of `lax.ppermute` steps with an online
softmax; never an all-gather of K/V).

Shardings (per device, P = axis size, rank r): q, k, v, out: [B, S/P, H, D]; rank r holds
sequence positions r*S/P ... (r+1)*S/P - 1.

Schedule: P steps. At step t rank r holds the K/V block of rank j = (r - t) mod P, sends it on
to rank r+1 while it folds it into its running softmax state, and receives the next block
from rank r-1:

    step    rank 0   rank 1   rank 2   rank 3      (block held, by owner)
     0        0        1        2        3
     1        3        0        1        2
     2        2        3        0        1
     3        1        2        3        0

With causal=True, step 0 (the own block, j == r) is masked on the diagonal; at later steps
j != r, and the block is either fully visible (j < r) or fully hidden and skipped (j > r), a
lax.cond per rank.

Backward (a custom VJP; the forward saves only out and the per-row log-sum-exp): the same
ring once more. K/V travel as before and their gradient accumulators dK/dV travel right behind
them, each rank adding its queries' contribution to the block it holds; after the P-th step
one more send brings every dK/dV block home. dQ stays on its rank. Memory stays O(S/P).

On GPUs at P > 1 (bf16/fp16, head dim 64 or 128) the forward is one fused kernel per call
(target pk_ring_attn, cuda/kernels/ring_attn.cuh: the K/V blocks travel through P - 1 slots
of the symmetric workspace, pushed by communication blocks of the same grid), and so is the
backward (target pk_ring_attn_bwd, cuda/kernels/ring_attn_bwd.cuh: K/V travel as in the
forward, and each K/V block's fp32 dK/dV partial sums travel one hop behind it, home after
P steps; dQ is summed on its rank in an fp32 scratch of the workspace by TMA reductions), on
the kernel's out and lse. At P = 1 (a 1-device axis) the
rank holds the whole sequence (and zigzag is the identity permutation), so where the
pk.attention kernels take the operands (bf16/fp16, head dim 64 or 128) the call is exactly
pk.attention: its forward kernel and its kernel backward, no ring. `forward_path` is the one
place that decides.

Masks (segment_ids, local_window_size, logits_soft_cap, query_seq_lengths,
key_value_seq_lengths; see `ring_attention`) run pk.attention's masked kernels at P = 1, and
at P > 1 the fused forward's masked kernel (`_kernel_ring_masked`, below) where the fused
kernels take the operands, with the jax.lax ring's backward (the fused backward takes no masks
yet); elsewhere the jax.lax ring. There each rank's K/V block travels with its key segment ids
(one more ppermuted [B, S/P] int32 array); the block's global positions follow from its owner
rank and the layout, so every mask compares global positions and segments may cross chunk
and rank boundaries. A step's block, or a zigzag step's half-block pair, that no mask lets
through is skipped whole (lax.cond), and within a block `_attention.blockwise` skips the tiles
that no mask lets through.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax.ops import _attention, _tp, _vjp
from pk_jax.ops import all_gather as _all_gather
from pk_jax.ops import attention as _attention_op
from pk_jax.runtime import state

__all__ = ["ring_attention", "zigzag_indices"]  # exported by pk_jax/__init__.py

STEM = "ring_attn"
NAME = "ring_attention"  # the public name, used in error messages


LAYOUTS = ("contiguous", "zigzag")


def zigzag_indices(seq_len: int, world: int) -> np.ndarray:
    """The permutation that lays a sequence out for `layout="zigzag"` over `world` ranks.

    The sequence is cut into 2 P chunks of S / (2 P) positions; rank r holds chunks r and
    2P-1-r, so every rank has the same share of causal work. `x[:, zigzag_indices(S, P)]`
    sharded contiguously over the axis gives each rank its zigzag shard; `np.argsort` of it
    undoes the permutation.

    Args:
        seq_len: S, a positive int divisible by 2 P.
        world: P, a positive int.

    Returns:
        int32 [S]: the global positions in zigzag order.

    Raises:
        TypeError: S or P not an int (bools and floats included).
        ValueError: S or P not positive, S not divisible by 2 P.
    """
    for arg, value in (("seq_len", seq_len), ("world", world)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"pk.zigzag_indices: {arg} must be an int, got {value!r} "
                            f"({type(value).__name__}).")
        if value < 1:
            raise ValueError(f"pk.zigzag_indices: {arg} must be positive, got {value}.")
    if seq_len % (2 * world):
        raise ValueError(f"pk.zigzag_indices: the sequence length {seq_len} must be divisible "
                         f"by 2 P = {2 * world} (two chunks per rank); pad the sequence.")
    c = seq_len // (2 * world)
    chunks = [(r, 2 * world - 1 - r) for r in range(world)]
    return np.concatenate([np.arange(i * c, (i + 1) * c) for pair in chunks for i in pair]
                          ).astype(np.int32)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *,
                   causal: bool = False, scale: float | None = None,
                   layout: str = "contiguous",
                   segment_ids: jax.Array | _attention.SegmentIds | None = None,
                   local_window_size: int | tuple[int, int] | None = None,
                   logits_soft_cap: float | None = None,
                   query_seq_lengths: jax.Array | None = None,
                   key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
    """Attention of the local queries over the whole (sharded) sequence, by a ring of K/V.

    Call inside `jax.shard_map` with q, k, v sharded alike along the sequence dimension over
    `axis_name`. Each step holds the K/V block being used and the one arriving (S/P rows
    each), so memory for K/V stays O(S/P); K/V are never all-gathered.

    Args:
        q: [B, S/P, H, D], this device's contiguous slice of the sequence; bf16, fp16 or fp32.
        k: [B, S/P, Hkv, D], Hkv dividing H (grouped-query attention); else like q.
        v: like k.
        axis_name: the mesh axis the sequence is sharded over (an axis of the mesh given to
            `pk.init`).
        causal: mask keys at later global positions than the query.
        scale: multiplies q . k before the softmax; default 1/sqrt(D).
        layout: "contiguous" (rank r holds positions [r S/P, (r+1) S/P)) or "zigzag" (rank r
            holds chunks r and 2P-1-r of 2P, see `pk.zigzag_indices`: balanced causal work;
            S/P must be even).
        segment_ids: packed sequences: int32 [B, S/P], this device's ids, laid out like q (in
            the zigzag layout: permuted like q); a query sees only keys with its own id, in
            any rank's block (segments may cross shard boundaries). `pk.SegmentIds(q=...,
            kv=...)` gives the queries' and the keys' ids separately (each [B, S/P]).
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

    With any mask argument: over a 1-device axis, pk.attention's masked kernels where they
    take the operands; at P > 1 the fused forward's masked kernel where it takes them, with
    the jax.lax ring's backward; elsewhere the jax.lax ring.

    Raises:
        ValueError: `pk.init` not called, a bad axis, q/k/v not rank 4 or of mismatched
            shapes, Hkv not dividing H, a local sequence, head count or head_dim of 0,
            a scale that is not positive, an unknown layout, zigzag with an odd S/P; segment
            ids not [B, S/P], lengths not [B] or varying along the axis, a negative window, a
            soft cap that is not positive.
        TypeError: an unsupported or mismatched dtype, a non-bool causal, a non-number scale;
            segment ids or lengths that are not integer arrays, a window that is not an int
            or a pair of ints, a soft cap that is not a Python number.
    """
    p = _checks.axis_size(NAME, axis_name)
    _attention.check_nonempty(NAME, q, k, "seq_local")
    _checks.attention_operands(NAME, q, k, v)
    causal = _checks.is_bool(NAME, "causal", causal)
    scale = (_attention.default_scale(q.shape[-1]) if scale is None
             else _checks.positive_float(NAME, "scale", scale))
    if layout not in LAYOUTS:
        raise ValueError(f"pk.{NAME}: layout={layout!r} is not one of {LAYOUTS}.")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"pk.{NAME}: layout='zigzag' holds two equal chunks per rank, so the "
                         f"local sequence length must be even, got {q.shape[1]}; pad it.")
    mask_args = {"segment_ids": segment_ids, "local_window_size": local_window_size,
                 "logits_soft_cap": logits_soft_cap, "query_seq_lengths": query_seq_lengths,
                 "key_value_seq_lengths": key_value_seq_lengths}
    masks, window, softcap = _attention.check_masks(
        NAME, q, seq_total=q.shape[1] * p, axis_name=axis_name, seq="seq_local", **mask_args)
    masked = _attention.mask_arguments_given(**mask_args)
    # Without masks by position attention ignores positions: zigzag is the contiguous ring.
    positional = (causal or window is not None or masks.q_len is not None
                  or masks.kv_len is not None)
    zigzag = layout == "zigzag" and positional
    path = forward_path(q, k, v, p, axis_name, masked=masked)
    if path == "local":
        # One rank holds the whole sequence, and the zigzag layout at P = 1 (chunks 0 and 1 of
        # 2) is the identity: plain attention, forward and backward, its masks by position.
        return _attention_op.kernel_forward(q, k, v, scale, causal, masks, window, softcap)
    if path in ("fused", "fused_masked"):
        _tp.check_workspace(NAME, workspace_need(k, p), f"{p - 1} K/V blocks of {k.shape}")
    if path == "fused":
        return _kernel_ring(q, k, v, axis_name, causal, float(scale), p, zigzag)
    if path == "fused_masked":
        return _kernel_ring_masked(q, k, v, axis_name, masks, scale, causal, window, softcap,
                                   layout=layout)
    k, v = _attention.repeat_kv(q, k, v)  # grouped-query attention (a no-op at H = Hkv)
    return reference(q, k, v, axis_name, causal=causal, scale=scale, p=p, zigzag=zigzag,
                     window=window, softcap=softcap, masks=masks)


def forward_path(q: jax.Array, k: jax.Array, v: jax.Array, p: int, axis_name: str, *,
                 masked: bool = False) -> str:
    """How the call runs, forward and backward, decided once at trace time for (already
    checked) operands: "local" (P = 1: the pk.attention kernels, masked or not, forward and
    backward, on q, k, v as given), "fused" (P > 1: pk_ring_attn and pk_ring_attn_bwd),
    "fused_masked" (P > 1 with any mask argument, `masked`: pk_ring_attn's masked kernel, the
    jax.lax ring's backward) or "reference" (the jax.lax ring, wherever those kernels do not
    take the operands)."""
    if p == 1:
        return _attention_op.p1_path(q, k, v, axis_name)
    route = _backend.route(STEM, axis_name, supported=kernel_supports(q, k, p))
    if route.path != "kernel":
        return "reference"
    return "fused_masked" if masked else "fused"


# ---------------------------------------------------------------------------------------------
# The fused kernel (target pk_ring_attn, cuda/kernels/ring_attn.cuh): the forward in one launch
# per call, and the backward (pk_ring_attn_bwd, cuda/kernels/ring_attn_bwd.cuh) likewise.

HEAD_DIMS = (64, 128)
# Communication blocks of the fused forward and of the fused backward (the same on every rank;
# each moves 1/C of a K/V block): 8 beat 2 in both at emulated P = 2, 4, 8 (measured:
# bench/results/ring_attention_notes.md, "Measurements moved from code comments (issue 37)").
# The forward without any mask takes 16, faster than 8 on held-out shapes at the scale model
# (ring_attention_notes.md, "Step groups, measured"); the causal and the masked forward were
# not measured at 16 and keep 8.
FWD_COMM_SMS = 8
FWD_COMM_SMS_UNMASKED = 16
NUM_COMM_SMS = 8


def fwd_comm_sms(causal: bool, masked: bool) -> int:
    """Communication blocks of the fused forward on a GPU of the node."""
    return FWD_COMM_SMS if causal or masked else FWD_COMM_SMS_UNMASKED


def kernel_supports(q: jax.Array, k: jax.Array, p: int) -> bool:
    """Whether the fused forward takes these (already checked) operands."""
    return (p > 1 and q.dtype in _checks.MATMUL_DTYPES_NP and q.shape[3] in HEAD_DIMS
            and q.shape[0] <= _op_table.MAX_GRID_Y and q.shape[2] <= _op_table.MAX_GRID_Y
            and q.shape[1] * q.shape[2] * q.shape[3] <= _op_table.MAX_DIM
            and q.shape[1] * p <= _op_table.MAX_DIM // 2)


def workspace_need(k: jax.Array, p: int) -> int:
    """Bytes of symmetric workspace the kernel needs: P - 1 K blocks and P - 1 V blocks
    (ffi/launch.h WorkspaceNeed, which the launch function checks too). The non-causal forward
    without a mask at P >= 4 may also use about B S/P H D float32 more where the workspace has
    it (its step groups, cuda/kernels/ring_attn.cuh step_groups: more of the exchange under the
    attention), and runs without them where it does not."""
    b, s, hkv, d = k.shape
    return _ffi.workspace_need("ring_attn", p, b=b, s=s, hkv=hkv, d=d)


def workspace_need_bwd(q: jax.Array, k: jax.Array, p: int) -> int:
    """Bytes of symmetric workspace the fused backward uses: the forward's P - 1 K and V
    blocks, then P fp32 dK/dV blocks of ceil(S/P / 128) 128-row tiles per K/V head and batch,
    then an fp32 dQ of q's shape (ffi/launch.h WorkspaceNeed)."""
    b, s, hkv, d = k.shape
    return _ffi.workspace_need("ring_attn_bwd", p, b=b, s=s, h=q.shape[2], hkv=hkv, d=d)


def _kernel_call(q, k, v, axis_name, causal, scale, zigzag, *, p: int = 1,
                 km: _attention_op.KernelMasks | None = None, window=None, softcap=None):
    """o and lse [B, H, S/P] from one pk_ring_attn call; with `km` (the masks' operands over
    the whole sequence of S/P * p positions) the masked kernel."""
    b, s, h, _ = q.shape
    extra = [] if km is None else km.operands()
    o, lse = _ffi.call(
        "pk_ring_attn", [jax.ShapeDtypeStruct(q.shape, q.dtype),
                         jax.ShapeDtypeStruct((b, h, s), jnp.float32)],
        q, k, v, _backend.rank_operand(axis_name), *extra,
        comm_id=np.int64(state.comm_id(axis_name)),
        scale=np.float32(scale), causal=np.int64(causal), zigzag=np.int64(zigzag),
        num_comm_sms=np.int64(fwd_comm_sms(bool(causal), km is not None)),
        **_attention_op.mask_attributes(s * p, window=window, softcap=softcap,
                                        segments=km is not None and km.segmented,
                                        masked=km is not None))
    return o, lse  # lse [B, H, S/P]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _kernel_ring(q, k, v, axis_name, causal, scale, p, zigzag):
    return _kernel_call(q, k, v, axis_name, causal, scale, zigzag)[0]


def _kernel_ring_fwd(q, k, v, axis_name, causal, scale, p, zigzag):
    o, lse = _kernel_call(q, k, v, axis_name, causal, scale, zigzag)
    return o, (q, k, v, o, lse)


def _kernel_ring_bwd(axis_name, causal, scale, p, zigzag, res, do):
    # One pk_ring_attn_bwd call: delta = rowsum(dO * O) and the lse padded to whole 128-row
    # tiles (lse = +inf, delta = 0 past S/P: those rows get P = 0).
    q, k, v, o, lse = res
    _tp.check_workspace(NAME, workspace_need_bwd(q, k, p),
                        f"the backward's {p - 1} K/V blocks and {p} float32 dK/dV blocks of "
                        f"{k.shape}, and a float32 dQ of {q.shape}")
    s = q.shape[1]
    pad = ((0, 0), (0, 0), (0, -(-s // 128) * 128 - s))
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    delta = jnp.pad(delta.transpose(0, 2, 1), pad)
    lse = jnp.pad(lse, pad, constant_values=jnp.inf)
    dq, dk, dv = _ffi.call(
        "pk_ring_attn_bwd", [jax.ShapeDtypeStruct(q.shape, q.dtype),
                             jax.ShapeDtypeStruct(k.shape, k.dtype),
                             jax.ShapeDtypeStruct(v.shape, v.dtype)],
        q, k, v, do.astype(q.dtype), lse, delta, _backend.rank_operand(axis_name),
        comm_id=np.int64(state.comm_id(axis_name)), scale=np.float32(scale),
        causal=np.int64(causal), zigzag=np.int64(zigzag), num_comm_sms=np.int64(NUM_COMM_SMS))
    return tuple(_vjp.fit(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))


_kernel_ring.defvjp(_kernel_ring_fwd, _kernel_ring_bwd)


def reference(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str, *, causal: bool,
              scale: float, p: int, zigzag: bool = False,
              window: tuple[int, int] | None = None, softcap: float | None = None,
              masks: _attention.Masks | None = None) -> jax.Array:
    """The blockwise ring in `jax.lax`: P-1 ppermutes of K/V (and of the key segment ids), an
    online softmax across steps, and a ring-shaped custom VJP (module docstring). zigzag: the
    zigzag layout's positions (with causal or another mask by position); the masks as
    `_attention.blockwise` takes them, segment ids for this rank's rows and keys."""
    masks = _attention.NO_MASKS if masks is None else masks
    window = None if window is None else tuple(window)
    softcap = None if softcap is None else float(softcap)
    if zigzag:
        return _zigzag_attention(q, k, v, masks, axis_name, float(scale), int(p), bool(causal),
                                 window, softcap)
    return _ring_attention(q, k, v, masks, axis_name, bool(causal), float(scale), int(p), window,
                           softcap)


def _ring(axis_name: str, p: int, visit, acc, blocks: tuple, travelling: tuple):
    """Runs the P ring steps: `acc, travelling = visit(t, acc, blocks, travelling)` at step t.

    `blocks` (K/V and the key segment ids, read-only) go to rank+1 before each visit but the
    last, so the transfer can overlap the math; `travelling` (per-block accumulators) go after
    every visit, the last included, so after P steps they are back at the rank that owns the
    block.
    """
    if p == 1:
        return visit(0, acc, blocks, travelling)
    perm = [(i, (i + 1) % p) for i in range(p)]

    def send(xs):
        return tuple(lax.ppermute(x, axis_name, perm) for x in xs)

    def one(t, acc, blocks, travelling, *, last):
        following = () if last else send(blocks)
        acc, travelling = visit(t, acc, blocks, travelling)
        return acc, following, send(travelling)

    acc, blocks, travelling = one(0, acc, blocks, travelling, last=False)
    if p > 2:
        def body(carry, t):
            return one(t, *carry, last=False), None

        (acc, blocks, travelling), _ = lax.scan(body, (acc, blocks, travelling),
                                                jnp.arange(1, p - 1, dtype=jnp.int32))
    acc, _, travelling = one(p - 1, acc, blocks, travelling, last=True)
    return acc, travelling


def _blocks(k, v, masks):
    """What travels around the ring: K, V and, with segment ids, the keys' ids."""
    return (k, v) if masks.k_seg is None else (k, v, masks.k_seg)


def _held(blocks, masks):
    """(k, v, the masks with the held block's key segment ids) from a ring step's blocks."""
    kb, vb, *k_seg = blocks
    return kb, vb, masks._replace(k_seg=k_seg[0] if k_seg else None)


def _ring_out(axis_name, p, visit, state0, q, k, v, masks):
    """The forward ring of both layouts from the online-softmax state `state0`: (out, the
    residuals of the backward)."""
    state, _ = _ring(axis_name, p, visit, state0, _blocks(k, v, masks), ())
    out = _attention.finalize(state, q.dtype)
    return out, (q, k, v, out, _attention.log_sum_exp(state), masks)


def _ring_grads(axis_name, p, visit, zeros, q, k, v, masks):
    """The backward ring of both layouts: dq accumulates at home, dk and dv travel behind their
    blocks; the gradients in the operands' dtypes (and none for the masks)."""
    dq, (dk, dv) = _ring(axis_name, p, visit, zeros(q), _blocks(k, v, masks),
                         (zeros(k), zeros(v)))
    return (*(_vjp.fit(g.astype(x.dtype), x) for g, x in ((dq, q), (dk, k), (dv, v))), None)


def _ring_fwd(q, k, v, masks, axis_name, causal, scale, p, window, softcap):
    rank = lax.axis_index(axis_name)
    s_loc = q.shape[1]
    opts = {"causal": causal, "window": window}
    q_pos0 = rank * s_loc

    def visit(t, state, blocks, travelling):
        kb, vb, held = _held(blocks, masks)
        k_pos0 = ((rank - t) % p) * s_loc  # the block's owner's first position

        def fold(st):
            return _attention.blockwise(st, q, kb, vb, scale=scale, softcap=softcap,
                                        q_pos0=q_pos0, k_pos0=k_pos0, masks=held, **opts)

        pred = _attention.visible(q_pos0, s_loc, k_pos0, s_loc, masks=held, **opts)
        return _attention.when(pred, fold, lambda st: st, state), travelling

    # The state varies like everything it is made of (the rank's position too), so the skip
    # branch's and the fold's types agree.
    state0 = _attention.init_state(q, k, v, q_pos0, *masks)
    return _ring_out(axis_name, p, visit, state0, q, k, v, masks)


def _ring_bwd(axis_name, causal, scale, p, window, softcap, res, do):
    # The same ring again: K/V travel as in the forward pass, with their gradient accumulators
    # (dk, dv) right behind them; dq stays home.
    q, k, v, out, lse, masks = res
    rank = lax.axis_index(axis_name)
    s_loc = q.shape[1]
    opts = {"causal": causal, "window": window}
    q_pos0 = rank * s_loc
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)
    axes = _attention._axes(q, k, v, do, lse, q_pos0, *masks)
    zeros = lambda x: _vjp.vary(jnp.zeros(x.shape, jnp.float32), axes)

    def visit(t, dq, blocks, travelling):
        kb, vb, held = _held(blocks, masks)
        k_pos0 = ((rank - t) % p) * s_loc

        def grads(ops):
            gq, gk, gv = _attention.blockwise_grads(
                q, kb, vb, do, lse, delta, scale=scale, softcap=softcap, q_pos0=q_pos0,
                k_pos0=k_pos0, masks=held, **opts)
            return tuple(_vjp.vary(a + g, axes) for a, g in zip(ops, (gq, gk, gv)))

        pred = _attention.visible(q_pos0, s_loc, k_pos0, s_loc, masks=held, **opts)
        dq, dk, dv = _attention.when(pred, grads, lambda ops: ops, (dq, *travelling))
        return dq, (dk, dv)

    return _ring_grads(axis_name, p, visit, zeros, q, k, v, masks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _ring_attention(q, k, v, masks, axis_name, causal, scale, p, window, softcap):
    return _ring_fwd(q, k, v, masks, axis_name, causal, scale, p, window, softcap)[0]


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------
# The zigzag layout: rank r's rows are two chunks of c = S / (2P) positions, a (chunk r) and b
# (chunk 2P-1-r), and so is every K/V block. Each ring step folds the four (query half, key
# half) pairs with their global positions; a pair that no mask lets through is skipped (with
# causal: a vs a hidden when the owner j > r, a vs b always, b vs b when j < r), so every step
# does about the same work on every rank.

def _halves(x):
    c = x.shape[1] // 2
    return x[:, :c], x[:, c:]


def _halves_or_none(x):
    return (None, None) if x is None else _halves(x)


def _chunk_starts(rank, p: int, c: int):
    return rank * c, (2 * p - 1 - rank) * c


def _zigzag_fwd(q, k, v, masks, axis_name, scale, p, causal, window, softcap):
    rank = lax.axis_index(axis_name)
    c = q.shape[1] // 2
    opts = {"causal": causal, "window": window}
    qs, q_pos = _halves(q), _chunk_starts(rank, p, c)
    q_segs = _halves_or_none(masks.q_seg)

    def visit(t, state, blocks, travelling):
        kb, vb, held = _held(blocks, masks)
        k_pos = _chunk_starts((rank - t) % p, p, c)
        k_segs = _halves_or_none(held.k_seg)
        states = [_attention.State(*h) for h in zip(*(_halves(x) for x in state))]
        for i in range(2):
            for kh, vh, kp, ks in zip(_halves(kb), _halves(vb), k_pos, k_segs):
                pair = masks._replace(q_seg=q_segs[i], k_seg=ks)

                def fold(st, i=i, kh=kh, vh=vh, kp=kp, pair=pair):
                    return _attention.blockwise(st, qs[i], kh, vh, scale=scale,
                                                softcap=softcap, q_pos0=q_pos[i], k_pos0=kp,
                                                masks=pair, **opts)

                pred = _attention.visible(q_pos[i], c, kp, c, masks=pair, **opts)
                states[i] = _attention.when(pred, fold, lambda st: st, states[i])
        return _attention.State(*(jnp.concatenate(xs, axis=1) for xs in zip(*states))), ()

    state0 = _attention.init_state(q, k, v, rank, *masks)
    return _ring_out(axis_name, p, visit, state0, q, k, v, masks)


def _zigzag_bwd(axis_name, scale, p, causal, window, softcap, res, do):
    q, k, v, out, lse, masks = res
    rank = lax.axis_index(axis_name)
    c = q.shape[1] // 2
    opts = {"causal": causal, "window": window}
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)
    axes = _attention._axes(q, k, v, do, lse, rank, *masks)
    zeros = lambda x: _vjp.vary(jnp.zeros(x.shape, jnp.float32), axes)
    qs, dos, lses, deltas = (_halves(x) for x in (q, do, lse, delta))
    q_pos = _chunk_starts(rank, p, c)
    q_segs = _halves_or_none(masks.q_seg)

    def visit(t, dq, blocks, travelling):
        kb, vb, held = _held(blocks, masks)
        k_pos = _chunk_starts((rank - t) % p, p, c)
        k_segs = _halves_or_none(held.k_seg)
        dqs, dks, dvs = list(_halves(dq)), list(_halves(travelling[0])), \
            list(_halves(travelling[1]))
        for i in range(2):
            for j, (kh, vh, kp) in enumerate(zip(_halves(kb), _halves(vb), k_pos)):
                pair = masks._replace(q_seg=q_segs[i], k_seg=k_segs[j])

                def grads(ops, i=i, kh=kh, vh=vh, kp=kp, pair=pair):
                    gs = _attention.blockwise_grads(
                        qs[i], kh, vh, dos[i], lses[i], deltas[i], scale=scale,
                        softcap=softcap, q_pos0=q_pos[i], k_pos0=kp, masks=pair, **opts)
                    return tuple(_vjp.vary(a + g, axes) for a, g in zip(ops, gs))

                pred = _attention.visible(q_pos[i], c, kp, c, masks=pair, **opts)
                dqs[i], dks[j], dvs[j] = _attention.when(pred, grads, lambda ops: ops,
                                                         (dqs[i], dks[j], dvs[j]))
        cat = lambda xs: jnp.concatenate(xs, axis=1)
        return cat(dqs), (cat(dks), cat(dvs))

    return _ring_grads(axis_name, p, visit, zeros, q, k, v, masks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _zigzag_attention(q, k, v, masks, axis_name, scale, p, causal, window, softcap):
    return _zigzag_fwd(q, k, v, masks, axis_name, scale, p, causal, window, softcap)[0]


_zigzag_attention.defvjp(_zigzag_fwd, _zigzag_bwd)


# ---------------------------------------------------------------------------------------------
# The fused forward with masks (issue 38 section 3; its GPU tests:
# tests/gpu/test_emulator_ring_masks.py, sp_masked_mp.py ring / ring-zigzag). The kernel reads
# the masks by GLOBAL position: the segment
# ids of every rank are all-gathered along the axis ([B, S/P] int32 each, put in global order
# for the zigzag layout) into the whole sequence's ids and chunk ranges
# (attention.segment_info), so segments may cross chunk and rank boundaries; the lengths
# (replicated) and the window are global already.

def _kernel_ring_masked(q: jax.Array, k: jax.Array, v: jax.Array, axis_name: str,
                        masks: _attention.Masks | None, scale: float, causal: bool,
                        window: tuple[int, int] | None = None, softcap: float | None = None,
                        layout: str = "contiguous") -> jax.Array:
    """ring_attention with masks on the fused forward kernel (pk_ring_attn, masked); its
    custom VJP is the jax.lax ring's backward (`reference`'s) on the kernel's output and lse.

    ring_attention's path with masks at P > 1 (`forward_path`'s "fused_masked"), and the GPU
    tests' entry. Call inside shard_map over `axis_name` (P > 1) with q [B, S/P, H,
    D], k, v [B, S/P, Hkv, D] in `layout` and the masks as `_attention.check_masks` returns
    them for ring_attention: segment ids [B, S/P] laid out like q, lengths [B] (the same on
    every rank) over global positions; the window over global positions.

    Raises:
        ValueError: operands the fused kernel does not take (`kernel_supports`: P > 1, bf16 /
            fp16, head_dim 64 or 128, sizes within the grid limits); an unknown layout or
            zigzag with an odd S/P; masks whose shapes do not fit q; a negative window; a cap
            that is not positive.
    """
    op = f"{NAME} (masked kernels)"
    p = _checks.axis_size(NAME, axis_name)
    if not kernel_supports(q, k, p):
        raise ValueError(f"pk.{op}: the fused kernel takes bf16 or fp16 q, k, v of head_dim "
                         f"{HEAD_DIMS} at P > 1 within the grid limits; got {q.dtype} q "
                         f"{tuple(q.shape)} at P = {p}.")
    if layout not in LAYOUTS:
        raise ValueError(f"pk.{op}: layout={layout!r} is not one of {LAYOUTS}.")
    b, sl = q.shape[:2]
    if layout == "zigzag" and sl % 2:
        raise ValueError(f"pk.{op}: layout='zigzag' needs an even local sequence length, got "
                         f"{sl}.")
    masks, window, softcap = _attention_op.check_kernel_masks(op, masks, b, sl, window, softcap)
    # As ring_attention: without a mask by position the layout does not matter.
    positional = (causal or window is not None or masks.q_len is not None
                  or masks.kv_len is not None)
    zigzag = layout == "zigzag" and positional
    km = _attention_op.kernel_masks(global_segments(masks, axis_name, p, zigzag), b, sl * p)
    return _masked_ring(q, k, v, km, masks, axis_name, float(scale), bool(causal), p, zigzag,
                        window, softcap)


def global_segments(masks: _attention.Masks, axis_name: str, p: int,
                    zigzag: bool) -> _attention.Masks:
    """The masks with the whole sequence's segment ids [B, S] in global order (the kernels'
    positions), from every rank's [B, S/P] in its layout; one all-gather when the queries'
    and the keys' ids are one array. Without zigzag the ranks' rows in rank order are the
    kernels' positions (contiguous, or a layout no mask by position sees)."""
    if masks.q_seg is None:
        return masks
    sl = masks.q_seg.shape[1]
    order = np.argsort(zigzag_indices(sl * p, p)) if zigzag else None

    def gather(ids):  # pk.all_gather: its kernel wherever the ring's runs, no XLA collective
        whole = _all_gather.all_gather(ids.astype(jnp.int32), axis_name, axis=1)
        return whole if order is None else jnp.take(whole, jnp.asarray(order, jnp.int32), axis=1)

    q_seg = gather(masks.q_seg)
    k_seg = q_seg if masks.k_seg is masks.q_seg else gather(masks.k_seg)
    return masks._replace(q_seg=q_seg, k_seg=k_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _masked_ring(q, k, v, km, masks, axis_name, scale, causal, p, zigzag, window, softcap):
    return _masked_ring_fwd(q, k, v, km, masks, axis_name, scale, causal, p, zigzag, window,
                            softcap)[0]


def _masked_ring_fwd(q, k, v, km, masks, axis_name, scale, causal, p, zigzag, window, softcap):
    o, lse = _kernel_call(q, k, v, axis_name, causal, scale, zigzag, p=p, km=km, window=window,
                          softcap=softcap)
    return o, (q, k, v, km, masks, o, lse)


def _masked_ring_bwd(axis_name, scale, causal, p, zigzag, window, softcap, res, do):
    # The jax.lax ring's backward (K/V heads repeated, their gradients summed in float32) on
    # the kernel's output and lse (+inf on rows that see no key, as the reference's).
    q, k, v, _km, masks, o, lse = res
    kr, vr = _attention.repeat_kv(q, k, v)
    args = (q, kr, vr, o, lse.transpose(0, 2, 1), masks)
    if zigzag:
        dq, dkr, dvr, _ = _zigzag_bwd(axis_name, scale, p, causal, window, softcap, args, do)
    else:
        dq, dkr, dvr, _ = _ring_bwd(axis_name, causal, scale, p, window, softcap, args, do)
    b, s, hkv, d = k.shape
    fold = lambda g, x: _vjp.fit(g.astype(jnp.float32).reshape(b, s, hkv, -1, d).sum(3)
                                 .astype(x.dtype), x)
    return dq, fold(dkr, k), fold(dvr, v), None, None


_masked_ring.defvjp(_masked_ring_fwd, _masked_ring_bwd)

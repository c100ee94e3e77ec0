"""Blockwise softmax attention with an online softmax, shared by ring and Ulysses attention.

Layout [B, S, H, D] (batch, sequence, heads, head dim) for q, k, v and the output. Keys are
consumed block by block; after each block the state holds, per query row and head,

    m = max of the scores seen so far              float32 [B, Sq, H] (-inf before any key)
    l = sum of exp(score - m) over keys seen        float32 [B, Sq, H]
    o = sum of exp(score - m) * v over keys seen    float32 [B, Sq, H, D]

and the attention output is o / l. A new block rescales (o, l) by exp(m_old - m_new). Queries
are tiled too (rows are independent), so only one tile of scores, [B, QUERY_BLOCK, H,
KEY_BLOCK], is live at a time: memory grows with the tile, not with the sequence.

Masks (all optional, combined with AND; `visible` and `tile_mask` define them):
- causal: query at global position i sees key j when j <= i;
- window (left, right): j in [i - left, i + right] (`jax.nn.dot_product_attention`'s
  local_window_size);
- segment ids (`Masks.q_seg`, `Masks.k_seg`, int32 [B, S]): a query sees keys of its own segment
  only (packed sequences);
- lengths (`Masks.q_len`, `Masks.kv_len`, int32 [B], over global positions): keys at positions
  >= kv_len[b] are hidden; query rows at positions >= q_len[b] see no key (their output is 0);
and a logits soft cap c replaces each score s = scale * q.k by c * tanh(s / c) before masking.
A (query tile, key tile) pair that no mask lets through is skipped whole (lax.cond; `visible`
decides from the tile's position range, the ranges of its segment ids and the lengths), so a
window of W keys costs O(S W), and packed documents cost what the per-document calls do, up to
the tiles that straddle a document boundary.

All masks compare global positions (query row i of a call at q_pos0 + i, key j at k_pos0 + j),
so the same code serves a ring step, where the held key block came from another rank, and
Ulysses, where every rank sees the whole sequence.

The backward pass is written by hand (flash-attention style) rather than left to autodiff,
which would keep every block's state and scores: the forward saves only the output and the
log-sum-exp per row (lse = m + log l), and the backward walks the key blocks again with

    p = exp(s - lse),  dv = p^T do,  ds = p * (do v^T - rowsum(do * out)),
    dq = scale * ds' k,             dk = scale * ds'^T q,

where ds' = ds, or ds * (1 - tanh^2(scale q.k / c)) under a soft cap c.

`attention` wraps this in a custom VJP; ring attention calls `blockwise`, `log_sum_exp` and
`blockwise_grads` per ring step inside its own.

NOTES: a row that has seen only masked keys keeps m = -inf; exp is then taken relative to 0,
never as -inf - (-inf), so fully masked blocks give zeros, not NaN (and lse = +inf, so they get
zero gradients too). A row that no key is visible to thus gives zeros (FlashAttention's and
cuDNN's convention; `jax.nn.dot_product_attention(implementation="xla")` fills masked scores
with a large finite negative number instead, so there it gives the mean of all values).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pk_jax import _checks, _ffi
from pk_jax.ops import _vjp

# Tile sizes of the blockwise passes: query rows and keys per tile. Module-level so that tests
# can make them small.
QUERY_BLOCK = 512
KEY_BLOCK = 512


class State(NamedTuple):
    """Running online-softmax state for a set of query rows (see the module docstring)."""

    o: jax.Array
    m: jax.Array
    l: jax.Array


class Masks(NamedTuple):
    """The traced masks of one call, int32, each None where not given (module docstring).

    q_seg: [B, Sq], the segment id of each query row; k_seg: [B, Sk], of each key (given
    together). q_len, kv_len: [B], the number of valid query rows and keys, counted over
    global positions.
    """

    q_seg: jax.Array | None = None
    k_seg: jax.Array | None = None
    q_len: jax.Array | None = None
    kv_len: jax.Array | None = None


NO_MASKS = Masks()


def repeat_kv(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k, v with each K/V head repeated for its H / Hkv query heads (grouped-query attention);
    autodiff sums the repeats' gradients back into each K/V head."""
    groups = q.shape[2] // k.shape[2]
    if groups == 1:
        return k, v
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def check_nonempty(op: str, q, k, seq: str = "seq") -> None:
    """Raises a ValueError naming the dimension when q's sequence, heads or head_dim, or k's
    heads, is 0 (rank-4 operands only: the rank check comes after and names the rest). There
    is nothing to take a softmax over, and the 1/sqrt(head_dim) scale and H % Hkv would fail
    later with a bare numpy or division error. An empty batch is fine (an empty result)."""
    dims = [("q", q, 1, seq, "at least one position"),
            ("q", q, 2, "heads", "at least one head"),
            ("q", q, 3, "head_dim", "a head_dim of at least 1"),
            ("k", k, 2, "kv_heads", "at least one K/V head")]
    for name, x, i, dim, need in dims:
        if getattr(x, "ndim", None) == 4 and x.shape[i] == 0:
            raise ValueError(f"pk.{op}: {name}.shape[{i}] ({dim}) is 0 in {name} shape "
                             f"{tuple(x.shape)}; attention needs {need}. Skip the call for an "
                             "empty input.")


# ---------------------------------------------------------------------------------------------
# The mask arguments of pk.attention, pk.ring_attention and pk.ulysses_attention: checked at
# trace time, once, here.

class SegmentIds(NamedTuple):
    """Separate segment ids for the queries and the keys (as splash attention's `SegmentIds`).

    q: int [B, S] (per device: [B, S/P], laid out like q), the segment of each query row;
    kv: int [B, S] likewise for the keys. A plain array as `segment_ids` means the same ids for
    both, the usual case of packed sequences.
    """

    q: jax.Array
    kv: jax.Array


def mask_arguments_given(segment_ids=None, local_window_size=None, logits_soft_cap=None,
                         query_seq_lengths=None, key_value_seq_lengths=None) -> bool:
    """Whether any mask argument is given (then the call runs the jax.lax reference)."""
    return any(x is not None for x in (segment_ids, local_window_size, logits_soft_cap,
                                       query_seq_lengths, key_value_seq_lengths))


def _int_array(op: str, arg: str, x, shape: tuple, what: str) -> jax.Array:
    if not isinstance(x, jax.Array):
        if not isinstance(x, (np.ndarray, list, tuple)):
            raise TypeError(f"pk.{op}: {arg} must be an integer array of shape {what} = "
                            f"{shape}, got {type(x).__name__} {x!r}.")
        x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"pk.{op}: {arg} must be an integer array (int32), got dtype "
                        f"{np.dtype(x.dtype).name}. Cast it with {arg}.astype(jnp.int32).")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"pk.{op}: {arg} must have shape {what} = {tuple(shape)}, got "
                         f"{tuple(x.shape)}.")
    return x if x.dtype == jnp.int32 else x.astype(jnp.int32)


def _window(op: str, value, seq_total: int) -> tuple[int, int] | None:
    if value is None:
        return None
    is_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
    if is_int(value):
        value = (value, value)
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(is_int, value))):
        raise TypeError(f"pk.{op}: local_window_size must be an int or a (left, right) pair of "
                        f"Python ints (static), got {value!r}. E.g. local_window_size=(127, 0) "
                        "with causal=True: each query sees itself and the 127 keys before it.")
    if min(value) < 0:
        raise ValueError(f"pk.{op}: local_window_size={tuple(value)} has a negative size; "
                         "(left, right) are the keys visible before and after each query, "
                         "each >= 0.")
    # Beyond the sequence a window hides nothing; capped, positions +- it stay in int32.
    return tuple(min(int(x), seq_total) for x in value)


def _soft_cap(op: str, value) -> float | None:
    if value is None:
        return None
    return _checks.positive_float(op, "logits_soft_cap", value, example="30.0",
                                  none_means="no cap (logits become cap * tanh(logits / cap))")


def check_masks(op: str, q: jax.Array, *, segment_ids=None, local_window_size=None,
                logits_soft_cap=None, query_seq_lengths=None, key_value_seq_lengths=None,
                seq_total: int, axis_name: str | None = None,
                seq: str = "seq") -> tuple[Masks, tuple[int, int] | None, float | None]:
    """Checks the mask arguments of an attention op for (already checked) q [B, S, H, D].

    Args:
        op: the op, for the messages.
        q: the queries; segment ids are [B, q.shape[1]] (this device's rows).
        seq_total: the whole sequence's length (S; S/P * P for ring and Ulysses).
        axis_name: the sequence-parallel axis, along which the lengths must not vary.
        seq: how the messages name q.shape[1].

    Returns:
        (Masks, window (left, right) or None, soft cap or None).

    Raises:
        TypeError: segment ids or lengths not integer arrays; a window that is not an int or a
            pair of ints; a soft cap that is not a Python number.
        ValueError: shapes other than [B, S] (segment ids) and [B] (lengths); a negative
            window; a soft cap that is not finite and positive; lengths that vary along
            `axis_name`.
    """
    b, s = q.shape[:2]
    q_seg = k_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, tuple):
            if len(segment_ids) != 2:
                raise TypeError(f"pk.{op}: segment_ids must be one int array [batch, {seq}] "
                                "(the same ids for queries and keys) or pk.SegmentIds(q=..., "
                                f"kv=...), got a tuple of {len(segment_ids)}.")
            q_seg, k_seg = segment_ids
            q_seg = _int_array(op, "segment_ids.q", q_seg, (b, s), f"[batch, {seq}]")
            k_seg = _int_array(op, "segment_ids.kv", k_seg, (b, s), f"[batch, {seq}]")
        else:
            q_seg = k_seg = _int_array(op, "segment_ids", segment_ids, (b, s), f"[batch, {seq}]")
    lengths = []
    for arg, x in (("query_seq_lengths", query_seq_lengths),
                   ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None:
            x = _int_array(op, arg, x, (b,), "[batch]")
            if axis_name is not None and axis_name in _ffi.vma(x):
                raise ValueError(f"pk.{op}: {arg} varies along axis {axis_name!r}; it holds "
                                 "the lengths of the whole sequences, the same on every device "
                                 "of the axis: pass it replicated (PartitionSpec() or one "
                                 "sharded over other axes only).")
        lengths.append(x)
    window = _window(op, local_window_size, seq_total)
    return Masks(q_seg, k_seg, *lengths), window, _soft_cap(op, logits_soft_cap)


# ---------------------------------------------------------------------------------------------
# The online softmax.

def _varying_like(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - _ffi.vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def init_state(q: jax.Array, *like) -> State:
    """The empty state for queries `q`, varying along every mesh axis that q or `like` (arrays,
    or anything else, which is ignored) vary on (so it can be the carry of a scan or the
    operand of a cond inside shard_map)."""
    axes = _axes(q, *like)
    b, s, h, d = q.shape
    o = jnp.zeros((b, s, h, d), jnp.float32)
    m = jnp.full((b, s, h), -jnp.inf, jnp.float32)
    l = jnp.zeros((b, s, h), jnp.float32)
    return State(*(_varying_like(x, axes) for x in (o, m, l)))


def _logits(q: jax.Array, k: jax.Array, scale: float, softcap: float | None) -> jax.Array:
    """float32 [B, Sq, H, Sk]: scale * q . k, soft-capped."""
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST) * jnp.float32(scale)
    if softcap is not None:
        s = jnp.float32(softcap) * jnp.tanh(s / jnp.float32(softcap))
    return s


def _masked(s: jax.Array, mask: jax.Array | None) -> jax.Array:
    """Scores [B, Sq, H, Sk] with -inf where the mask ([B or 1, Sq, Sk]) is False."""
    return s if mask is None else jnp.where(mask[:, :, None, :], s, -jnp.inf)


def update(state: State, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
           mask: jax.Array | None = None, softcap: float | None = None) -> State:
    """Folds one block of keys into `state`.

    Args:
        state: the running state for the rows of `q`.
        q: [B, Sq, H, D]; k, v: [B, Sk, H, D].
        scale: multiplies q . k.
        mask: bool [B or 1, Sq, Sk], False where a key is hidden from a query (`tile_mask`);
            None: every key visible.
        softcap: the logits soft cap, or None.
    """
    s = _masked(_logits(q, k, scale, softcap), mask)
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(state.m - m_ref)
    l = alpha * state.l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bqhk,bkhd->bqhd", p, v.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
    return State(alpha[..., None] * state.o + pv, m_new, l)


def tile_mask(q_pos0, sq: int, k_pos0, sk: int, *, causal: bool,
              window: tuple[int, int] | None = None, masks: Masks = NO_MASKS,
              k_valid: jax.Array | None = None) -> jax.Array | None:
    """bool [B or 1, sq, sk]: whether query row i (at global position q_pos0 + i) sees key j
    (at k_pos0 + j) under every mask given; `masks` holds this tile's segment ids ([B, sq] and
    [B, sk]) and the lengths. k_valid: bool [sk], False for padding keys. None: all visible."""
    q_pos = q_pos0 + jnp.arange(sq, dtype=jnp.int32)
    k_pos = k_pos0 + jnp.arange(sk, dtype=jnp.int32)
    parts = []
    if causal:
        parts.append((q_pos[:, None] >= k_pos[None, :])[None])
    if window is not None:
        left, right = window
        parts.append(((k_pos[None, :] >= q_pos[:, None] - left)
                      & (k_pos[None, :] <= q_pos[:, None] + right))[None])
    if k_valid is not None:
        parts.append(k_valid[None, None, :])
    if masks.q_seg is not None:
        parts.append(masks.q_seg[:, :, None] == masks.k_seg[:, None, :])
    if masks.q_len is not None:
        parts.append(q_pos[None, :, None] < masks.q_len[:, None, None])
    if masks.kv_len is not None:
        parts.append(k_pos[None, None, :] < masks.kv_len[:, None, None])
    return functools.reduce(operator.and_, parts) if parts else None


def visible(q_pos0, sq: int, k_pos0, sk: int, *, causal: bool,
            window: tuple[int, int] | None = None, masks: Masks = NO_MASKS):
    """Whether any query of a tile may see any key of it (conservative: True may still mean
    all hidden, False never hides a visible pair), from the position ranges, the ranges of the
    segment ids (disjoint ranges share no id) and the lengths: None (no mask can hide the whole
    tile), a Python bool (known at trace time) or a traced bool scalar."""
    q_last, k_last = q_pos0 + (sq - 1), k_pos0 + (sk - 1)
    conds = []
    if causal:
        conds.append(k_pos0 <= q_last)
    if window is not None:
        left, right = window
        conds += [k_last >= q_pos0 - left, k_pos0 <= q_last + right]
    per_row = []  # per batch row: a pair may be visible there
    if masks.q_seg is not None:
        lo = jnp.maximum(jnp.min(masks.q_seg, axis=1), jnp.min(masks.k_seg, axis=1))
        per_row.append(lo <= jnp.minimum(jnp.max(masks.q_seg, axis=1),
                                         jnp.max(masks.k_seg, axis=1)))
    if masks.q_len is not None:
        per_row.append(q_pos0 < masks.q_len)
    if masks.kv_len is not None:
        per_row.append(k_pos0 < masks.kv_len)
    if per_row:
        conds.append(jnp.any(functools.reduce(operator.and_, per_row)))
    traced = None
    for c in conds:
        if isinstance(c, (bool, np.bool_)):
            if not c:
                return False
            continue
        traced = c if traced is None else traced & c
    return traced


def when(pred, compute, skip, operand):
    """compute(operand) where `pred` (from `visible`) allows, else skip(operand); a lax.cond
    only for a traced pred. Both branches must give the same types (varying axes included)."""
    if pred is None or pred is True:
        return compute(operand)
    if pred is False:
        return skip(operand)
    return lax.cond(pred, compute, skip, operand)


def _tile(x: jax.Array, block: int, fill: float = 0.0, edge: bool = False) -> jax.Array:
    """[B, S, ...] -> [n, B, block, ...], S padded with `fill` (or, with `edge`, the last row)
    to n * block."""
    n = -(-x.shape[1] // block)
    pad = n * block - x.shape[1]
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        x = (jnp.pad(x, widths, mode="edge") if edge
             else jnp.pad(x, widths, constant_values=fill))
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _tile_ids(ids: jax.Array | None, block: int) -> jax.Array | None:
    """Segment ids [B, S] -> [n, B, block] (edge-padded, so a padded tile's id range does not
    grow), or None."""
    return None if ids is None else _tile(ids, block, edge=True)


def _untile(x: jax.Array, length: int) -> jax.Array:
    """[n, B, block, ...] -> [B, length, ...] (drops the padding)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _axes(*xs) -> frozenset:
    """The union of the varying mesh axes of the arrays among `xs` (Python ints and None have
    none)."""
    return frozenset().union(*(_ffi.vma(x) for x in xs if isinstance(x, jax.Array)))


def _vary(axes: frozenset, xs):
    return jax.tree.map(lambda x: _varying_like(x, axes), xs)


def _offsets(n: int, block: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32) * block


def blockwise(state: State, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
              causal: bool, q_pos0=0, k_pos0=0, window: tuple[int, int] | None = None,
              softcap: float | None = None, masks: Masks | None = None) -> State:
    """Folds all keys of k, v into `state`, in tiles of QUERY_BLOCK rows by KEY_BLOCK keys.

    Args:
        state: the running state for the rows of `q`.
        q: [B, Sq, H, D]; k, v: [B, Sk, H, D].
        scale: multiplies q . k.
        causal: mask by global position: query row i is at q_pos0 + i, key j at k_pos0 + j
            (ints or traced int32 scalars).
        window: (left, right): key j visible from query i when pos_i - left <= pos_j <=
            pos_i + right; None: no window.
        softcap: the logits soft cap, or None.
        masks: segment ids (q_seg [B, Sq] for these rows, k_seg [B, Sk] for these keys) and
            lengths; None: none.

    Tiles that no mask lets through are skipped (`visible`).
    """
    masks = NO_MASKS if masks is None else masks
    sq = q.shape[1]
    fold = functools.partial(_fold_keys, k=k, v=v, scale=scale, causal=causal, window=window,
                             softcap=softcap, k_pos0=k_pos0)
    if sq <= QUERY_BLOCK:
        return fold(state, q, q_pos0=q_pos0, masks=masks)

    def body(_, xs):
        qt, st, off, q_seg = xs
        return (), fold(st, qt, q_pos0=q_pos0 + off, masks=masks._replace(q_seg=q_seg))

    n = -(-sq // QUERY_BLOCK)
    tiles = State(*(_tile(x, QUERY_BLOCK) for x in state))
    _, tiles = lax.scan(body, (), (_tile(q, QUERY_BLOCK), tiles, _offsets(n, QUERY_BLOCK),
                                   _tile_ids(masks.q_seg, QUERY_BLOCK)))
    return State(*(_untile(x, sq) for x in tiles))


def _fold_keys(state: State, q: jax.Array, *, k: jax.Array, v: jax.Array, scale: float,
               causal: bool, window, softcap, q_pos0, k_pos0, masks: Masks) -> State:
    """`blockwise` for one query tile: a scan over key blocks, the last one padded."""
    sq, sk = q.shape[1], k.shape[1]
    axes = _axes(*state, q, k, v, q_pos0, k_pos0, *masks)
    opts = {"causal": causal, "window": window}
    if sk <= KEY_BLOCK:
        def fold_all(st):
            mask = tile_mask(q_pos0, sq, k_pos0, sk, masks=masks, **opts)
            return _vary(axes, update(st, q, k, v, scale=scale, mask=mask, softcap=softcap))

        return when(visible(q_pos0, sq, k_pos0, sk, masks=masks, **opts), fold_all,
                    lambda st: st, _vary(axes, state))

    block, pad = KEY_BLOCK, -sk % KEY_BLOCK

    def body(st: State, xs):
        kc, vc, off, k_seg = xs
        tile_masks = masks._replace(k_seg=k_seg)
        k_valid = (off + jnp.arange(block, dtype=jnp.int32) < sk) if pad else None

        def fold(st):
            mask = tile_mask(q_pos0, sq, k_pos0 + off, block, masks=tile_masks,
                             k_valid=k_valid, **opts)
            return _vary(axes, update(st, q, kc, vc, scale=scale, mask=mask, softcap=softcap))

        pred = visible(q_pos0, sq, k_pos0 + off, block, masks=tile_masks, **opts)
        return when(pred, fold, lambda st: st, st), None

    n = -(-sk // block)
    state, _ = lax.scan(body, _vary(axes, state),
                        (_tile(k, block), _tile(v, block), _offsets(n, block),
                         _tile_ids(masks.k_seg, block)))
    return state


def finalize(state: State, dtype) -> jax.Array:
    """o / l cast to `dtype`; rows that saw no key (l == 0) give zeros."""
    l = jnp.where(state.l > 0, state.l, 1.0)
    return (state.o / l[..., None]).astype(dtype)


def log_sum_exp(state: State) -> jax.Array:
    """float32 [B, Sq, H]: log of the softmax denominator; +inf for rows that saw no key."""
    return jnp.where(state.l > 0, state.m + jnp.log(jnp.where(state.l > 0, state.l, 1.0)),
                     jnp.inf)


def block_grads(q, k, v, do, lse, delta, *, scale: float, mask=None,
                softcap: float | None = None):
    """Gradients of one key block: (dq [B,Sq,H,D], dk, dv [B,Sk,H,D]), all float32.

    `do` is the output cotangent (float32), `lse` the saved log-sum-exp and `delta` the row sum
    of do * out, both [B, Sq, H]; mask and softcap as in `update`.
    """
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    s = _logits(q, k, scale, softcap)
    p = jnp.exp(_masked(s, mask) - lse[..., None])
    dv = jnp.einsum("bqhk,bqhd->bkhd", p, do, precision=hi)
    dp = jnp.einsum("bqhd,bkhd->bqhk", do, v.astype(f32), precision=hi)
    ds = p * (dp - delta[..., None]) * f32(scale)
    if softcap is not None:  # d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (s / c)^2
        ds = ds * (1.0 - jnp.square(s / f32(softcap)))
    dq = jnp.einsum("bqhk,bkhd->bqhd", ds, k.astype(f32), precision=hi)
    dk = jnp.einsum("bqhk,bqhd->bkhd", ds, q.astype(f32), precision=hi)
    return dq, dk, dv


def blockwise_grads(q, k, v, do, lse, delta, *, scale: float, causal: bool, q_pos0=0,
                    k_pos0=0, window: tuple[int, int] | None = None,
                    softcap: float | None = None, masks: Masks | None = None):
    """`block_grads` over all of q and k, in tiles of QUERY_BLOCK rows by KEY_BLOCK keys
    (tiles that no mask lets through skipped); the masks as in `blockwise`.

    Returns:
        (dq, dk, dv) in float32.
    """
    masks = NO_MASKS if masks is None else masks
    sq = q.shape[1]
    grads = functools.partial(_grads_keys, k=k, v=v, scale=scale, causal=causal, window=window,
                              softcap=softcap, k_pos0=k_pos0)
    if sq <= QUERY_BLOCK:
        return grads(q, do, lse, delta, q_pos0=q_pos0, masks=masks)

    axes = _axes(q, k, v, do, lse, delta, q_pos0, k_pos0, *masks)

    def body(carry, xs):
        dk, dv = carry
        qt, dot, lset, deltat, off, q_seg = xs
        dq_t, dk_t, dv_t = grads(qt, dot, lset, deltat, q_pos0=q_pos0 + off,
                                 masks=masks._replace(q_seg=q_seg))
        return _vary(axes, (dk + dk_t, dv + dv_t)), _varying_like(dq_t, axes)

    zeros = _vary(axes, (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    n = -(-sq // QUERY_BLOCK)
    # Padded query rows get lse = +inf, so p = 0 there and they add nothing.
    xs = (_tile(q, QUERY_BLOCK), _tile(do, QUERY_BLOCK), _tile(lse, QUERY_BLOCK, jnp.inf),
          _tile(delta, QUERY_BLOCK), _offsets(n, QUERY_BLOCK),
          _tile_ids(masks.q_seg, QUERY_BLOCK))
    (dk, dv), dq = lax.scan(body, zeros, xs)
    return _untile(dq, sq), dk, dv


def _grads_keys(q, do, lse, delta, *, k, v, scale: float, causal: bool, window, softcap,
                q_pos0, k_pos0, masks: Masks):
    """`blockwise_grads` for one query tile: a scan over key blocks."""
    sq, sk = q.shape[1], k.shape[1]
    axes = _axes(q, k, v, do, lse, delta, q_pos0, k_pos0, *masks)
    opts = {"causal": causal, "window": window}
    zeros = lambda *shapes: tuple(_varying_like(jnp.zeros(s, jnp.float32), axes) for s in shapes)
    if sk <= KEY_BLOCK:
        def compute(_):
            mask = tile_mask(q_pos0, sq, k_pos0, sk, masks=masks, **opts)
            return _vary(axes, block_grads(q, k, v, do, lse, delta, scale=scale, mask=mask,
                                           softcap=softcap))

        return when(visible(q_pos0, sq, k_pos0, sk, masks=masks, **opts), compute,
                    lambda _: zeros(q.shape, k.shape, v.shape), None)

    block, pad = KEY_BLOCK, -sk % KEY_BLOCK

    def body(dq, xs):
        kc, vc, off, k_seg = xs
        tile_masks = masks._replace(k_seg=k_seg)
        k_valid = (off + jnp.arange(block, dtype=jnp.int32) < sk) if pad else None

        def compute(dq):
            mask = tile_mask(q_pos0, sq, k_pos0 + off, block, masks=tile_masks,
                             k_valid=k_valid, **opts)
            dq_c, dk_c, dv_c = block_grads(q, kc, vc, do, lse, delta, scale=scale, mask=mask,
                                           softcap=softcap)
            return _vary(axes, (dq + dq_c, (dk_c, dv_c)))

        def skip(dq):
            return dq, zeros(kc.shape, vc.shape)

        pred = visible(q_pos0, sq, k_pos0 + off, block, masks=tile_masks, **opts)
        return when(pred, compute, skip, dq)

    n = -(-sk // block)
    dq0 = _varying_like(jnp.zeros(q.shape, jnp.float32), axes)
    dq, (dk, dv) = lax.scan(body, dq0, (_tile(k, block), _tile(v, block), _offsets(n, block),
                                        _tile_ids(masks.k_seg, block)))
    return dq, _untile(dk, sk), _untile(dv, sk)


# ---------------------------------------------------------------------------------------------
# Attention of q over all of k, v (positions 0.. for both) with its custom VJP.

def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, causal: bool,
              window: tuple[int, int] | None = None, softcap: float | None = None,
              masks: Masks | None = None) -> jax.Array:
    """Softmax attention of q over all of k, v (same positions 0.. for both), computed
    blockwise with the masks of `blockwise`, with a blockwise custom VJP; output dtype = q's."""
    masks = NO_MASKS if masks is None else masks
    return _attention(q, k, v, masks, float(scale), bool(causal),
                      None if window is None else tuple(window),
                      None if softcap is None else float(softcap))


def _masked_forward(q, k, v, masks, scale, causal, window, softcap):
    state = blockwise(init_state(q, k, v, *masks), q, k, v, scale=scale, causal=causal,
                      window=window, softcap=softcap, masks=masks)
    out = finalize(state, q.dtype)
    return out, (q, k, v, out, log_sum_exp(state), masks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention(q, k, v, masks, scale, causal, window, softcap):
    return _masked_forward(q, k, v, masks, scale, causal, window, softcap)[0]


def _masked_backward(scale, causal, window, softcap, res, do):
    q, k, v, out, lse, masks = res
    return (*_backward(scale, causal, (q, k, v, out, lse), do, window=window, softcap=softcap,
                       masks=masks), None)


_attention.defvjp(_masked_forward, _masked_backward)


def _forward(q, k, v, scale, causal):
    """The unmasked forward: (out, residuals (q, k, v, out, lse)), for the kernels'
    stand-ins."""
    out, res = _masked_forward(q, k, v, NO_MASKS, scale, causal, None, None)
    return out, res[:5]


def _backward(scale, causal, res, do, *, window=None, softcap=None, masks=None):
    """dq, dk, dv in the operands' dtypes from residuals (q, k, v, out, lse) and the output
    cotangent."""
    q, k, v, out, lse = res
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)
    dq, dk, dv = blockwise_grads(q, k, v, do, lse, delta, scale=scale, causal=causal,
                                 window=window, softcap=softcap, masks=masks)
    return tuple(_vjp.fit(g.astype(x.dtype), x) for g, x in ((dq, q), (dk, k), (dv, v)))

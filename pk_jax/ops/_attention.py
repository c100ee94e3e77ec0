"""Blockwise softmax attention with an online softmax, shared by ring and Ulysses attention.

Layout [B, S, H, D] (batch, sequence, heads, head dim) for q, k, v and the output. Keys are
consumed block by block; after each block the state holds, per query row and head,

    m = max of the scores seen so far              float32 [B, Sq, H] (-inf before any key)
    l = sum of exp(score - m) over keys seen        float32 [B, Sq, H]
    o = sum of exp(score - m) * v over keys seen    float32 [B, Sq, H, D]

and the attention output is o / l. A new block rescales (o, l) by exp(m_old - m_new). Queries
are tiled too (rows are independent), so only one tile of scores, [B, QUERY_BLOCK, H,
KEY_BLOCK], is live at a time: memory grows with the tile, not with the sequence. With causal
masking, key blocks that come wholly after a query tile are skipped (lax.cond).

Causal masking compares global positions (query i sees key j when pos_q(i) >= pos_k(j)), so the
same code serves a ring step, where the held key block came from another rank, and Ulysses,
where every rank sees the whole sequence.

The backward pass is written by hand (flash-attention style) rather than left to autodiff,
which would keep every block's state and scores: the forward saves only the output and the
log-sum-exp per row (lse = m + log l), and the backward walks the key blocks again with

    p = exp(scale * q k^T - lse),  dv = p^T do,  ds = p * (do v^T - rowsum(do * out)),
    dq = scale * ds k,             dk = scale * ds^T q.

`attention` wraps this in a custom VJP; ring attention calls `blockwise`, `log_sum_exp` and
`blockwise_grads` per ring step inside its own.

NOTES: a row that has seen only masked keys keeps m = -inf; exp is then taken relative to 0,
never as -inf - (-inf), so fully masked blocks give zeros, not NaN (and lse = +inf, so they get
zero gradients too).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pk_jax import _ffi
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


def _varying_like(x: jax.Array, axes: frozenset) -> jax.Array:
    missing = tuple(sorted(axes - _ffi.vma(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def init_state(q: jax.Array, *like: jax.Array) -> State:
    """The empty state for queries `q`, varying along every mesh axis that q or `like` vary on
    (so it can be the carry of a scan or the operand of a cond inside shard_map)."""
    axes = frozenset().union(_ffi.vma(q), *(_ffi.vma(x) for x in like))
    b, s, h, d = q.shape
    o = jnp.zeros((b, s, h, d), jnp.float32)
    m = jnp.full((b, s, h), -jnp.inf, jnp.float32)
    l = jnp.zeros((b, s, h), jnp.float32)
    return State(*(_varying_like(x, axes) for x in (o, m, l)))


def update(state: State, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
           q_pos: jax.Array | None = None, k_pos: jax.Array | None = None,
           k_valid: jax.Array | None = None) -> State:
    """Folds one block of keys into `state`.

    Args:
        state: the running state for the rows of `q`.
        q: [B, Sq, H, D]; k, v: [B, Sk, H, D].
        scale: multiplies q . k.
        q_pos, k_pos: int32 [Sq] and [Sk] global positions; when given, the block is causally
            masked (key visible when k_pos <= q_pos).
        k_valid: bool [Sk]; keys where it is False are ignored (padding).
    """
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST) * jnp.float32(scale)
    mask = _mask(q_pos, k_pos, k_valid)
    if mask is not None:
        s = jnp.where(mask[None, :, None, :], s, -jnp.inf)
    m_new = jnp.maximum(state.m, jnp.max(s, axis=-1))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_ref[..., None])
    alpha = jnp.exp(state.m - m_ref)
    l = alpha * state.l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bqhk,bkhd->bqhd", p, v.astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
    return State(alpha[..., None] * state.o + pv, m_new, l)


def _tile(x: jax.Array, block: int, fill: float = 0.0) -> jax.Array:
    """[B, S, ...] -> [n, B, block, ...], S padded with `fill` to n * block."""
    n = -(-x.shape[1] // block)
    pad = n * block - x.shape[1]
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        x = jnp.pad(x, widths, constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _untile(x: jax.Array, length: int) -> jax.Array:
    """[n, B, block, ...] -> [B, length, ...] (drops the padding)."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _axes(*xs) -> frozenset:
    """The union of the varying mesh axes of the arrays among `xs` (Python ints have none)."""
    return frozenset().union(*(_ffi.vma(x) for x in xs if isinstance(x, jax.Array)))


def _vary(axes: frozenset, xs):
    return jax.tree.map(lambda x: _varying_like(x, axes), xs)


def _offsets(n: int, block: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32) * block


def blockwise(state: State, q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
              causal: bool, q_pos0=0, k_pos0=0) -> State:
    """Folds all keys of k, v into `state`, in tiles of QUERY_BLOCK rows by KEY_BLOCK keys.

    Args:
        state: the running state for the rows of `q`.
        q: [B, Sq, H, D]; k, v: [B, Sk, H, D].
        scale: multiplies q . k.
        causal: mask by global position: query row i is at q_pos0 + i, key j at k_pos0 + j
            (ints or traced int32 scalars). Key blocks that come wholly after a query tile are
            skipped.
    """
    sq = q.shape[1]
    fold = functools.partial(_fold_keys, k=k, v=v, scale=scale, causal=causal, k_pos0=k_pos0)
    if sq <= QUERY_BLOCK:
        return fold(state, q, q_pos0=q_pos0)

    def body(_, xs):
        qt, st, off = xs
        return (), fold(st, qt, q_pos0=q_pos0 + off)

    n = -(-sq // QUERY_BLOCK)
    tiles = State(*(_tile(x, QUERY_BLOCK) for x in state))
    _, tiles = lax.scan(body, (), (_tile(q, QUERY_BLOCK), tiles, _offsets(n, QUERY_BLOCK)))
    return State(*(_untile(x, sq) for x in tiles))


def _fold_keys(state: State, q: jax.Array, *, k: jax.Array, v: jax.Array, scale: float,
               causal: bool, q_pos0, k_pos0) -> State:
    """`blockwise` for one query tile: a scan over key blocks, the last one padded."""
    sq, sk = q.shape[1], k.shape[1]
    q_pos = (q_pos0 + jnp.arange(sq, dtype=jnp.int32)) if causal else None
    if sk <= KEY_BLOCK:
        k_pos = (k_pos0 + jnp.arange(sk, dtype=jnp.int32)) if causal else None
        return update(state, q, k, v, scale=scale, q_pos=q_pos, k_pos=k_pos)

    block, pad = KEY_BLOCK, -sk % KEY_BLOCK
    axes = _axes(*state, q, k, v, q_pos0, k_pos0)

    def body(st: State, xs):
        kc, vc, off = xs
        idx = off + jnp.arange(block, dtype=jnp.int32)
        k_pos = (k_pos0 + idx) if causal else None
        k_valid = (idx < sk) if pad else None

        def fold(st):
            return _vary(axes, update(st, q, kc, vc, scale=scale, q_pos=q_pos, k_pos=k_pos,
                                      k_valid=k_valid))

        if not causal:
            return fold(st), None
        # Hidden from the whole tile when the block's first key comes after its last query.
        return lax.cond(k_pos0 + off > q_pos[-1], lambda st: st, fold, st), None

    n = -(-sk // block)
    state, _ = lax.scan(body, _vary(axes, state),
                        (_tile(k, block), _tile(v, block), _offsets(n, block)))
    return state


def finalize(state: State, dtype) -> jax.Array:
    """o / l cast to `dtype`; rows that saw no key (l == 0) give zeros."""
    l = jnp.where(state.l > 0, state.l, 1.0)
    return (state.o / l[..., None]).astype(dtype)


def log_sum_exp(state: State) -> jax.Array:
    """float32 [B, Sq, H]: log of the softmax denominator; +inf for rows that saw no key."""
    return jnp.where(state.l > 0, state.m + jnp.log(jnp.where(state.l > 0, state.l, 1.0)),
                     jnp.inf)


def _mask(q_pos, k_pos, k_valid):
    mask = None
    if q_pos is not None:
        mask = q_pos[:, None] >= k_pos[None, :]
    if k_valid is not None:
        mask = k_valid[None, :] if mask is None else mask & k_valid[None, :]
    return mask


def block_grads(q, k, v, do, lse, delta, *, scale: float, q_pos=None, k_pos=None,
                k_valid=None):
    """Gradients of one key block: (dq [B,Sq,H,D], dk, dv [B,Sk,H,D]), all float32.

    `do` is the output cotangent (float32), `lse` the saved log-sum-exp and `delta` the row sum
    of do * out, both [B, Sq, H]; masks as in `update`.
    """
    hi = lax.Precision.HIGHEST
    f32 = jnp.float32
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k, preferred_element_type=f32, precision=hi) * f32(scale)
    mask = _mask(q_pos, k_pos, k_valid)
    if mask is not None:
        s = jnp.where(mask[None, :, None, :], s, -jnp.inf)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bqhk,bqhd->bkhd", p, do, precision=hi)
    dp = jnp.einsum("bqhd,bkhd->bqhk", do, v.astype(f32), precision=hi)
    ds = p * (dp - delta[..., None]) * f32(scale)
    dq = jnp.einsum("bqhk,bkhd->bqhd", ds, k.astype(f32), precision=hi)
    dk = jnp.einsum("bqhk,bqhd->bkhd", ds, q.astype(f32), precision=hi)
    return dq, dk, dv


def blockwise_grads(q, k, v, do, lse, delta, *, scale: float, causal: bool, q_pos0=0,
                    k_pos0=0):
    """`block_grads` over all of q and k, in tiles of QUERY_BLOCK rows by KEY_BLOCK keys
    (causally hidden blocks skipped).

    Returns:
        (dq, dk, dv) in float32.
    """
    sq = q.shape[1]
    grads = functools.partial(_grads_keys, k=k, v=v, scale=scale, causal=causal, k_pos0=k_pos0)
    if sq <= QUERY_BLOCK:
        return grads(q, do, lse, delta, q_pos0=q_pos0)

    axes = _axes(q, k, v, do, lse, delta, q_pos0, k_pos0)

    def body(carry, xs):
        dk, dv = carry
        qt, dot, lset, deltat, off = xs
        dq_t, dk_t, dv_t = grads(qt, dot, lset, deltat, q_pos0=q_pos0 + off)
        return _vary(axes, (dk + dk_t, dv + dv_t)), _varying_like(dq_t, axes)

    zeros = _vary(axes, (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
    n = -(-sq // QUERY_BLOCK)
    # Padded query rows get lse = +inf, so p = 0 there and they add nothing.
    xs = (_tile(q, QUERY_BLOCK), _tile(do, QUERY_BLOCK), _tile(lse, QUERY_BLOCK, jnp.inf),
          _tile(delta, QUERY_BLOCK), _offsets(n, QUERY_BLOCK))
    (dk, dv), dq = lax.scan(body, zeros, xs)
    return _untile(dq, sq), dk, dv


def _grads_keys(q, do, lse, delta, *, k, v, scale: float, causal: bool, q_pos0, k_pos0):
    """`blockwise_grads` for one query tile: a scan over key blocks."""
    sq, sk = q.shape[1], k.shape[1]
    q_pos = (q_pos0 + jnp.arange(sq, dtype=jnp.int32)) if causal else None
    if sk <= KEY_BLOCK:
        k_pos = (k_pos0 + jnp.arange(sk, dtype=jnp.int32)) if causal else None
        return block_grads(q, k, v, do, lse, delta, scale=scale, q_pos=q_pos, k_pos=k_pos)

    block, pad = KEY_BLOCK, -sk % KEY_BLOCK
    axes = _axes(q, k, v, do, lse, delta, q_pos0, k_pos0)

    def body(dq, xs):
        kc, vc, off = xs
        idx = off + jnp.arange(block, dtype=jnp.int32)
        k_pos = (k_pos0 + idx) if causal else None
        k_valid = (idx < sk) if pad else None

        def compute(dq):
            dq_c, dk_c, dv_c = block_grads(q, kc, vc, do, lse, delta, scale=scale, q_pos=q_pos,
                                           k_pos=k_pos, k_valid=k_valid)
            return _vary(axes, (dq + dq_c, (dk_c, dv_c)))

        def skip(dq):
            zero = _varying_like(jnp.zeros(kc.shape, jnp.float32), axes)
            return dq, (zero, zero)

        if not causal:
            return compute(dq)
        return lax.cond(k_pos0 + off > q_pos[-1], skip, compute, dq)

    n = -(-sk // block)
    dq0 = _varying_like(jnp.zeros(q.shape, jnp.float32), axes)
    dq, (dk, dv) = lax.scan(body, dq0, (_tile(k, block), _tile(v, block), _offsets(n, block)))
    return dq, _untile(dk, sk), _untile(dv, sk)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
              causal: bool) -> jax.Array:
    """Softmax attention of q over all of k, v (same positions 0.. for both), computed
    blockwise, with a blockwise custom VJP; output dtype = q's."""
    return _attention(q, k, v, float(scale), bool(causal))


def _forward(q, k, v, scale, causal):
    state = blockwise(init_state(q, k, v), q, k, v, scale=scale, causal=causal)
    out = finalize(state, q.dtype)
    return out, (q, k, v, out, log_sum_exp(state))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, scale, causal):
    return _forward(q, k, v, scale, causal)[0]


def _backward(scale, causal, res, do):
    q, k, v, out, lse = res
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)
    dq, dk, dv = blockwise_grads(q, k, v, do, lse, delta, scale=scale, causal=causal)
    return tuple(_vjp.fit(g.astype(x.dtype), x) for g, x in ((dq, q), (dk, k), (dv, v)))


_attention.defvjp(_forward, _backward)

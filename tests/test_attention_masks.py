"""The masks of pk.attention, pk.ring_attention and pk.ulysses_attention (segment ids for packed
sequences, local_window_size, logits_soft_cap, query_seq_lengths, key_value_seq_lengths), alone
and combined, forward and gradients, against a dense float64 numpy reference written here
(`dense_masked`), at odd sizes with tiles smaller than the sequence (so tiles are skipped and
padded); ring at P = 2, 4, 8 in both layouts with segments crossing chunk boundaries, Ulysses at
P = 2, 4; jax.nn.dot_product_attention(implementation="xla") where it takes the same masks; the
trace-time errors; that hidden tiles are skipped (a window of W costs O(S W) tiles); and that
with the kernels available (forced) a masked call traces to no attention kernel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from util import P, cpu_mesh

import pk_jax as pk
from pk_jax.ops import _attention

SEQ = P(None, "sp")


# --------------------------------------------------------------------------------------------
# The reference: dense masked softmax attention in float64 numpy, and its gradients by hand.

def dense_masked(q, k, v, *, causal=False, scale=None, segment_ids=None, window=None,
                 softcap=None, q_len=None, kv_len=None, w=None):
    """Attention of q [B, S, H, D] over k, v [B, S, Hkv, D] (Hkv dividing H) in float64 with
    every mask; a row that sees no key gives 0. With `w` (the output cotangent) also returns
    (dq, dk, dv) of sum(out * w). segment_ids: [B, S] for both, or a pair (q ids, kv ids)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, s, h, d = q.shape
    g = h // k.shape[2]
    kr, vr = np.repeat(k, g, 2), np.repeat(v, g, 2)
    scale = 1 / np.sqrt(d) if scale is None else scale
    x = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    if softcap is not None:
        t = np.tanh(x / softcap)
        x = softcap * t
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    vis = np.ones((b, s, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        left, right = (window, window) if np.isscalar(window) else window
        vis &= (j >= i - left) & (j <= i + right)
    if segment_ids is not None:
        qs, ks = segment_ids if isinstance(segment_ids, tuple) else (segment_ids,) * 2
        vis &= np.asarray(qs)[:, :, None] == np.asarray(ks)[:, None, :]
    if q_len is not None:
        vis &= i[None] < np.asarray(q_len)[:, None, None]
    if kv_len is not None:
        vis &= j[None] < np.asarray(kv_len)[:, None, None]
    vis = vis[:, None]
    mx = np.max(np.where(vis, x, -np.inf), -1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    e = np.where(vis, np.exp(np.where(vis, x, mx) - mx), 0)
    den = e.sum(-1, keepdims=True)
    p = e / np.where(den > 0, den, 1)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if w is None:
        return out
    w = np.asarray(w, np.float64)
    dvr = np.einsum("bhqk,bqhd->bkhd", p, w)
    dp = np.einsum("bqhd,bkhd->bhqk", w, vr)
    ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
    if softcap is not None:
        ds = ds * (1 - t ** 2)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dkr = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda x: x.reshape(b, s, h // g, g, d).sum(3)
    return out, (dq, fold(dkr), fold(dvr))


def normal(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def packed_ids(b, s, seed, *, mean=6):
    """int32 [B, S]: documents of random lengths (1 .. 2 mean) packed back to back, ids 0, 1,
    ... per row."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, s), np.int32)
    for r in range(b):
        pos, doc = 0, 0
        while pos < s:
            n = int(rng.integers(1, 2 * mean + 1))
            ids[r, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids


def _args(case: dict, b: int, s: int, seed: int) -> dict:
    """The keyword arguments of a mask case over [B, S]: names from CASES below."""
    kw = {}
    for name, value in case.items():
        if name == "causal":
            kw["causal"] = True
        elif name == "segments":
            kw["segment_ids"] = packed_ids(b, s, seed)
        elif name == "window":
            kw["local_window_size"] = value
        elif name == "softcap":
            kw["logits_soft_cap"] = value
        elif name == "q_len":
            kw["query_seq_lengths"] = np.array(value[:b], np.int32)
        elif name == "kv_len":
            kw["key_value_seq_lengths"] = np.array(value[:b], np.int32)
    return kw


def _dense(q, k, v, w, kw):
    return dense_masked(q, k, v, causal=kw.get("causal", False), scale=kw.get("scale"),
                        segment_ids=kw.get("segment_ids"), window=kw.get("local_window_size"),
                        softcap=kw.get("logits_soft_cap"), q_len=kw.get("query_seq_lengths"),
                        kv_len=kw.get("key_value_seq_lengths"), w=w)


def _check(got, want, atol=2e-5):
    out, grads = got
    np.testing.assert_allclose(np.asarray(out, np.float64), want[0], atol=atol, rtol=atol)
    for name, g, gw in zip(("dq", "dk", "dv"), grads, want[1]):
        assert np.all(np.isfinite(np.asarray(g))), name
        np.testing.assert_allclose(np.asarray(g, np.float64), gw, atol=atol * 5, rtol=atol * 5,
                                   err_msg=name)


CASES = {  # every mask alone and the combinations training uses
    "segments": {"segments": 1},
    "segments+causal": {"segments": 1, "causal": 1},
    "window": {"window": (3, 5)},
    "window+causal": {"window": (6, 0), "causal": 1},
    "softcap": {"softcap": 1.5},
    "softcap+segments+causal": {"softcap": 2.0, "segments": 1, "causal": 1},
    "lengths": {"q_len": (29, 13, 37), "kv_len": (17, 37, 1)},
    "kv_len+causal": {"kv_len": (20, 0, 37), "causal": 1},
    "all": {"segments": 1, "window": (4, 1), "causal": 1, "softcap": 3.0, "q_len": (31, 22),
            "kv_len": (35, 9)},
}


# --------------------------------------------------------------------------------------------
# pk.attention (one device)

@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_masks_match_dense(monkeypatch, name):
    """S = 37 in tiles of 8 queries by 16 keys (padded, and skipped where hidden), GQA 4:2,
    B = 2 (3 for lengths), float32: output and gradients of sum(out * w)."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 8)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 16)
    b, s = (3 if name in ("lengths", "kv_len+causal") else 2), 37
    q, k, v, w = normal((b, s, 4, 8), 0), normal((b, s, 2, 8), 1), normal((b, s, 2, 8), 2), \
        normal((b, s, 4, 8), 3)
    kw = _args(CASES[name], b, s, seed=7)

    def f(q, k, v, w):
        loss = lambda *x: jnp.sum(pk.attention(*x, **kw) * w)
        return pk.attention(q, k, v, **kw), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    _check(jax.jit(f)(q, k, v, w), _dense(q, k, v, w, kw))


def test_attention_one_tile_bf16_and_scale():
    """The default tiles (one tile here), bf16 operands, a scale: within bf16's tolerance."""
    b, s = 2, 45
    q, k, v = (normal((b, s, 2, 16), i).astype(jnp.bfloat16) for i in range(3))
    kw = dict(_args(CASES["all"], b, s, seed=3), scale=0.3)
    got = pk.attention(q, k, v, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64),
                               _dense(*(np.asarray(x, np.float32) for x in (q, k, v)), None, kw),
                               atol=3e-2, rtol=3e-2)


def test_separate_segment_ids_and_rows_that_see_no_key():
    """pk.SegmentIds(q, kv): query rows whose id no key has (and a batch row with
    key_value_seq_lengths 0) give 0 with zero gradients, not NaN; jax.nn.dot_product_attention
    ("xla") gives the mean of v there, and agrees everywhere else."""
    b, s = 2, 21
    q, k, v, w = (normal((b, s, 2, 8), i) for i in range(4))
    q_ids = packed_ids(b, s, 1, mean=4)
    kv_ids = np.where(q_ids == 2, 1, q_ids)  # no key has id 2
    kw = {"segment_ids": pk.SegmentIds(q=jnp.asarray(q_ids), kv=jnp.asarray(kv_ids)),
          "causal": True}
    loss = lambda *x: jnp.sum(pk.attention(*x, **kw) * w)
    out = pk.attention(q, k, v, **kw)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = dense_masked(q, k, v, causal=True, segment_ids=(q_ids, kv_ids), w=w)
    _check((out, grads), want)
    hidden = q_ids == 2
    assert hidden.any()
    np.testing.assert_array_equal(np.asarray(out)[hidden], 0)
    np.testing.assert_array_equal(np.asarray(grads[0])[hidden], 0)
    mask = jnp.asarray(q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    xla = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out)[~hidden], np.asarray(xla)[~hidden], atol=2e-5)
    assert not np.allclose(np.asarray(xla)[hidden], 0)
    kv_len = jnp.array([s, 0], jnp.int32)
    out = pk.attention(q, k, v, key_value_seq_lengths=kv_len)
    np.testing.assert_array_equal(np.asarray(out[1]), 0)
    g = jax.grad(lambda *x: jnp.sum(pk.attention(*x, key_value_seq_lengths=kv_len) * w),
                 argnums=(0, 1, 2))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in g)


@pytest.mark.parametrize("name", ["window", "window+causal", "lengths", "segments+causal"])
def test_attention_matches_xla_dot_product_attention(name):
    """The masks jax.nn.dot_product_attention takes (segments as its boolean mask), where every
    valid query row sees a key: output and gradients equal (GQA 4:2, S = 30)."""
    b, s = 2, 30
    q, k, v, w = normal((b, s, 4, 8), 4), normal((b, s, 2, 8), 5), normal((b, s, 2, 8), 6), \
        normal((b, s, 4, 8), 7)
    kw = _args(CASES[name], b, s, seed=2)
    if name == "lengths":
        kw["query_seq_lengths"], kw["key_value_seq_lengths"] = (
            np.array([25, 11], np.int32), np.array([17, 30], np.int32))
    xkw = {"is_causal": kw.get("causal", False), "implementation": "xla"}
    for ours, theirs in (("local_window_size", "local_window_size"),
                         ("query_seq_lengths", "query_seq_lengths"),
                         ("key_value_seq_lengths", "key_value_seq_lengths")):
        if ours in kw:
            xkw[theirs] = kw[ours]
    if "segment_ids" in kw:
        ids = kw["segment_ids"]
        xkw["mask"] = jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])

    def both(fn):
        loss = lambda *x: jnp.sum(fn(*x) * w)
        return jax.jit(lambda *x: (fn(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)))(q, k, v)

    got = both(lambda *x: pk.attention(*x, **kw))
    want = both(lambda *x: jax.nn.dot_product_attention(*x, **xkw))
    for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=5e-5, rtol=5e-5)


def _tiles_computed(monkeypatch, fn, *args) -> int:
    """How many (query tile, key tile) updates the forward of `fn` computes (the rest were
    skipped), counted at run time."""
    count = []
    inner = _attention.update

    def counted(*a, **kw):
        jax.debug.callback(lambda: count.append(1))
        return inner(*a, **kw)

    monkeypatch.setattr(_attention, "update", counted)
    jax.block_until_ready(jax.jit(fn)(*args))
    jax.effects_barrier()
    return len(count)


def test_hidden_tiles_are_skipped(monkeypatch):
    """S = 256 in 8 x 8 tiles of 32: a causal window of 16 keys computes at most 3 key tiles per
    query tile (O(S W)), causal alone 36 of 64, and documents of 32 aligned to the tiles one
    tile each; padding by key_value_seq_lengths = 100 (both rows) 4 key tiles of 8."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 32)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 32)
    s = 256
    q, k, v = (normal((2, s, 1, 8), i) for i in range(3))
    run = lambda **kw: _tiles_computed(monkeypatch, lambda *x: pk.attention(*x, **kw), q, k, v)
    assert run() == 64
    assert run(causal=True) == 36
    assert run(causal=True, local_window_size=(15, 0)) == 8 + 7
    assert run(local_window_size=(15, 15)) == 8 + 2 * 7
    ids = np.repeat(np.arange(8), 32)[None].repeat(2, 0)
    assert run(segment_ids=ids) == 8
    assert run(key_value_seq_lengths=np.array([100, 100], np.int32)) == 8 * 4


# --------------------------------------------------------------------------------------------
# ring and Ulysses over host devices

def _sharded_run(op, p, q, k, v, w, kw, *, layout="contiguous", check=True):
    """op(q, k, v, "sp", **kw) under jit(shard_map) over P devices on global arrays (the
    zigzag layout permuted in and back out), with the gradients of sum(out * w)."""
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    s = q.shape[1]
    idx = pk.zigzag_indices(s, p) if layout == "zigzag" else np.arange(s)
    extra = {} if op is pk.ulysses_attention else {"layout": layout}
    arrays, specs = {}, {}
    for name in ("segment_ids", "query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            x = kw[name]
            if name == "segment_ids":
                x = (pk.SegmentIds(x[0][:, idx], x[1][:, idx]) if isinstance(x, tuple)
                     else x[:, idx])
                specs[name] = jax.tree.map(lambda _: SEQ, x)
            else:
                specs[name] = P()
            arrays[name] = x
    static = {n: x for n, x in kw.items() if n not in arrays}

    def local(q, k, v, arrays):
        return op(q, k, v, "sp", **static, **extra, **arrays)

    f = jax.shard_map(local, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, specs), out_specs=SEQ)
    loss = lambda q, k, v, a: jnp.sum(f(q, k, v, a) * w[:, idx])
    g = jax.jit(lambda *x: (f(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)))
    out, grads = g(*(x[:, idx] for x in (q, k, v)), arrays)
    back = np.argsort(idx)
    return np.asarray(out)[:, back], [np.asarray(x)[:, back] for x in grads]


def _crosses_chunks(ids, chunk: int) -> bool:
    return any((ids[:, c - 1] == ids[:, c]).any() for c in range(chunk, ids.shape[1], chunk))


RING = [  # (P, layout, case, S/P)
    (2, "contiguous", "segments+causal", 7),
    (2, "zigzag", "window+causal", 6),
    (4, "contiguous", "all", 5),
    (4, "zigzag", "segments+causal", 6),
    (4, "zigzag", "window", 4),
    (4, "contiguous", "softcap+segments+causal", 3),
    (8, "zigzag", "all", 4),
    (8, "contiguous", "kv_len+causal", 5),
]


@pytest.mark.parametrize("p,layout,name,sl", RING)
def test_ring_masks_match_dense(monkeypatch, p, layout, name, sl):
    """Output and gradients over the whole sequence against `dense_masked`, in tiles of 3 queries
    by 2 keys (several per chunk, padded); segments cross the chunk boundaries; GQA 4:2; the
    lengths are global (replicated)."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 3)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 2)
    b, s = 2, sl * p
    q, k, v, w = normal((b, s, 4, 8), p), normal((b, s, 2, 8), p + 1), \
        normal((b, s, 2, 8), p + 2), normal((b, s, 4, 8), p + 3)
    case = dict(CASES[name])
    # Global lengths that end inside some rank's block; no key at all in one row.
    if "q_len" in case:
        case["q_len"] = (s - 3, s // 2 + 1)
    if "kv_len" in case:
        case["kv_len"] = (s // 2 + 1, 0 if name == "kv_len+causal" else s - 2)
    kw = _args(case, b, s, seed=p)
    if "segment_ids" in kw:
        chunk = sl // 2 if layout == "zigzag" else sl
        assert _crosses_chunks(kw["segment_ids"], chunk)
    got = _sharded_run(pk.ring_attention, p, q, k, v, w, kw, layout=layout)
    _check(got, _dense(q, k, v, w, kw), atol=3e-5)


def test_ring_separate_segment_ids_and_hidden_rows():
    """pk.SegmentIds in the zigzag ring at P = 4 with rows whose id no key has: those give 0."""
    p, b, s = 4, 1, 24
    q, k, v, w = (normal((b, s, 2, 8), 10 + i) for i in range(4))
    q_ids = packed_ids(b, s, 3, mean=3)
    kv_ids = np.where(q_ids == 1, 0, q_ids)
    kw = {"segment_ids": (q_ids, kv_ids), "causal": True}
    got = _sharded_run(pk.ring_attention, p, q, k, v, w, kw, layout="zigzag")
    _check(got, _dense(q, k, v, w, kw), atol=3e-5)
    assert np.all(got[0][q_ids == 1] == 0)


ULYSSES = [(2, "segments+causal", 7), (2, "all", 5), (4, "window+causal", 3),
           (4, "softcap+segments+causal", 5), (4, "lengths", 4)]


@pytest.mark.parametrize("p,name,sl", ULYSSES)
def test_ulysses_masks_match_dense(monkeypatch, p, name, sl):
    """As the ring test: the masks apply after the all-to-all, over the whole sequence of the
    head group (H = 2P query heads, P K/V heads)."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 3)
    b, s = 2, sl * p
    q, k, v, w = normal((b, s, 2 * p, 8), p), normal((b, s, p, 8), p + 1), \
        normal((b, s, p, 8), p + 2), normal((b, s, 2 * p, 8), p + 3)
    case = dict(CASES[name])
    for n in ("q_len", "kv_len"):
        if n in case:
            case[n] = (s - 2, s // 2 + 1)
    kw = _args(case, b, s, seed=p + 20)
    if "segment_ids" in kw:
        assert _crosses_chunks(kw["segment_ids"], sl)
    got = _sharded_run(pk.ulysses_attention, p, q, k, v, w, kw)
    _check(got, _dense(q, k, v, w, kw), atol=3e-5)


# --------------------------------------------------------------------------------------------
# Trace-time errors

ERRORS = [  # (keyword arguments, error, message)
    ({"segment_ids": np.zeros((2, 9), np.int32)}, ValueError,
     r"segment_ids must have shape \[batch, seq\] = \(2, 8\), got \(2, 9\)"),
    ({"segment_ids": np.zeros((2, 8), np.float32)}, TypeError,
     "segment_ids must be an integer array .*float32"),
    ({"segment_ids": (np.zeros((2, 8), np.int32),) * 3}, TypeError, "a tuple of 3"),
    ({"segment_ids": pk.SegmentIds(np.zeros((2, 8), np.int32), np.zeros((2, 7), np.int32))},
     ValueError, r"segment_ids.kv must have shape"),
    ({"segment_ids": "doc"}, TypeError, "segment_ids must be an integer array"),
    ({"local_window_size": -1}, ValueError, r"local_window_size=\(-1, -1\) has a negative"),
    ({"local_window_size": (3, -2)}, ValueError, "negative"),
    ({"local_window_size": (3,)}, TypeError, "local_window_size must be an int or a"),
    ({"local_window_size": 2.5}, TypeError, "local_window_size must be an int"),
    ({"local_window_size": (True, 1)}, TypeError, "local_window_size must be an int"),
    ({"logits_soft_cap": 0.0}, ValueError, "logits_soft_cap must be a finite positive"),
    ({"logits_soft_cap": -3}, ValueError, "logits_soft_cap must be a finite positive"),
    ({"logits_soft_cap": float("inf")}, ValueError, "finite positive"),
    ({"logits_soft_cap": jnp.float32(5)}, TypeError, "logits_soft_cap must be a positive Python"),
    ({"query_seq_lengths": np.array([3], np.int32)}, ValueError,
     r"query_seq_lengths must have shape \[batch\] = \(2,\), got \(1,\)"),
    ({"key_value_seq_lengths": np.array([3.0, 2.0])}, TypeError,
     "key_value_seq_lengths must be an integer array"),
    ({"key_value_seq_lengths": 4}, TypeError, "key_value_seq_lengths must be an integer array"),
]


@pytest.mark.parametrize("kw,err,msg", ERRORS)
def test_mask_errors_name_the_argument(kw, err, msg):
    q = jnp.zeros((2, 8, 2, 4))
    with pytest.raises(err, match="pk.attention: .*" + msg):
        pk.attention(q, q, q, **kw)


def test_sharded_mask_errors():
    """Ring and Ulysses name seq_local in the segment ids' shape, and refuse lengths that vary
    along the sequence axis (each rank would use its own)."""
    mesh = cpu_mesh((2,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((1, 8, 2, 4))
    for op in (pk.ring_attention, pk.ulysses_attention):
        f = jax.shard_map(lambda a, ids, op=op: op(a, a, a, "sp", segment_ids=ids), mesh=mesh,
                          in_specs=(SEQ, P()), out_specs=SEQ)
        with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_local\] "
                                             r"= \(1, 4\), got \(1, 8\)"):
            f(q, jnp.zeros((1, 8), jnp.int32))
        f = jax.shard_map(lambda a, n, op=op: op(a, a, a, "sp", query_seq_lengths=n[:1]),
                          mesh=mesh, in_specs=(SEQ, P("sp")), out_specs=SEQ)
        with pytest.raises(ValueError, match="query_seq_lengths varies along axis 'sp'"):
            f(q, jnp.zeros((2,), jnp.int32))


# --------------------------------------------------------------------------------------------
# With the kernels available (forced on CPU), a masked call traces to no attention kernel.

ATTENTION_KERNELS = ("pk_attention", "pk_ring_attn", "pk_ring_attn_bwd", "pk_ulysses_attn",
                     "pk_ulysses_attn_bwd")
MASKS = [{"segment_ids": 1}, {"local_window_size": (8, 0)}, {"logits_soft_cap": 30.0},
         {"query_seq_lengths": 1}, {"key_value_seq_lengths": 1}]


def _mask_kw(mask: dict, b: int, s: int) -> dict:
    kw = dict(mask)
    if "segment_ids" in kw:
        kw["segment_ids"] = jnp.zeros((b, s), jnp.int32)
    for n in ("query_seq_lengths", "key_value_seq_lengths"):
        if n in kw:
            kw[n] = jnp.full((b,), s, jnp.int32)
    return kw


def _targets(jaxpr) -> list[str]:
    from test_ring_attn import ffi_calls

    return [e.params["target_name"] for e in ffi_calls(jaxpr)]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: next(iter(m)))
def test_masked_attention_takes_the_reference_with_kernels_available(monkeypatch, mask):
    """bf16, head dim 64: the kernels' operands. Unmasked, the gradient traces to the two
    pk_attention calls; with any one mask, to none, and the lowering has no pk custom call."""
    from pk_jax import _backend
    from pk_jax.ops import attention as att

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    q = jnp.zeros((2, 40, 4, 64), jnp.bfloat16)
    grad = lambda **kw: jax.grad(lambda q: jnp.sum(pk.attention(q, q, q, causal=True, **kw)
                                                   .astype(jnp.float32)))
    assert _targets(jax.make_jaxpr(grad())(q)) == ["pk_attention"] * 2
    kw = _mask_kw(mask, 2, 40)
    assert att.forward_path(q, q, q, masked=True) == "reference"
    assert _targets(jax.make_jaxpr(grad(**kw))(q)) == []
    assert not re.findall(r"custom_call @(pk_\w+)", jax.jit(grad(**kw)).lower(q).as_text())


@pytest.mark.parametrize("op,p", [("ring", 1), ("ring", 2), ("ulysses", 1), ("ulysses", 2)])
def test_masked_sequence_parallel_takes_the_reference_with_kernels_available(monkeypatch, op, p):
    """Ring and Ulysses at P = 1 (where the pk.attention kernels would run) and P = 2 (the fused
    ring, the composed or fused Ulysses kernels): each mask routes forward_path to "reference",
    and the gradient traces to no attention kernel (Ulysses' reference may still use the
    pk_all_to_all kernel for its exchanges)."""
    from pk_jax import _backend
    from pk_jax.ops import _tp, ring_attn, ulysses_attn

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    monkeypatch.setattr(_tp, "check_workspace", lambda *a: None)
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    fn = pk.ring_attention if op == "ring" else pk.ulysses_attention
    mod = ring_attn if op == "ring" else ulysses_attn
    paths = []
    decide = mod.forward_path
    monkeypatch.setattr(mod, "forward_path",
                        lambda *a, **kw: paths.append(decide(*a, **kw)) or paths[-1])
    q = jax.device_put(jnp.zeros((1, 8 * p, 2 * p, 64), jnp.bfloat16), NamedSharding(mesh, SEQ))
    for mask in [{}] + MASKS:
        kw = _mask_kw(mask, 1, 8)
        f = jax.shard_map(lambda a, kw=kw: fn(a, a, a, "sp", causal=True, **kw), mesh=mesh,
                          in_specs=SEQ, out_specs=SEQ)
        jaxpr = jax.make_jaxpr(jax.grad(lambda a, f=f: jnp.sum(f(a).astype(jnp.float32))))(q)
        used = [t for t in _targets(jaxpr) if t in ATTENTION_KERNELS]
        if mask:
            assert paths[-1] == "reference" and not used, (mask, paths[-1], used)
        else:
            assert paths[-1] != "reference" and used, (paths[-1], used)

"""Shared by the attention mask tests (tests/test_attention.py, test_ring_attn.py,
test_ulysses_attn.py): a dense float64 numpy reference of masked softmax attention with its
gradients written by hand (`dense_masked`), packed segment ids, the mask cases, and the runners
of ring and Ulysses over host devices on global arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from util import P, cpu_mesh

import pk_jax as pk

SEQ = P(None, "sp")


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


def randn(shape, seed, dtype=np.float32):
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


def mask_args(case: dict, b: int, s: int, seed: int) -> dict:
    """The keyword arguments of a mask case of CASES (below) over [B, S]."""
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


def dense_for(q, k, v, w, kw):
    return dense_masked(q, k, v, causal=kw.get("causal", False), scale=kw.get("scale"),
                        segment_ids=kw.get("segment_ids"), window=kw.get("local_window_size"),
                        softcap=kw.get("logits_soft_cap"), q_len=kw.get("query_seq_lengths"),
                        kv_len=kw.get("key_value_seq_lengths"), w=w)


def check_close(got, want, atol=2e-5):
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



def sharded_run(op, p, q, k, v, w, kw, *, layout="contiguous"):
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


def crosses_chunks(ids, chunk: int) -> bool:
    return any((ids[:, c - 1] == ids[:, c]).any() for c in range(chunk, ids.shape[1], chunk))


ATTENTION_KERNELS = ("pk_attention", "pk_ring_attn", "pk_ring_attn_bwd", "pk_ulysses_attn",
                     "pk_ulysses_attn_bwd")
MASKS = [{"segment_ids": 1}, {"local_window_size": (8, 0)}, {"logits_soft_cap": 30.0},
         {"query_seq_lengths": 1}, {"key_value_seq_lengths": 1}]


def mask_kw(mask: dict, b: int, s: int) -> dict:
    kw = dict(mask)
    if "segment_ids" in kw:
        kw["segment_ids"] = jnp.zeros((b, s), jnp.int32)
    for n in ("query_seq_lengths", "key_value_seq_lengths"):
        if n in kw:
            kw[n] = jnp.full((b,), s, jnp.int32)
    return kw


def check_masked_sp_routing(monkeypatch, op: str, p: int) -> None:
    """With the kernels available (forced on CPU): op ("ring" or "ulysses") at P unmasked
    traces to an attention kernel. With each of MASKS, at P = 1 the gradient traces to
    pk.attention's masked kernels (two pk_attention calls with the mask attributes on, the
    ring's forward_path "local"); at P > 1 the ring's to its fused forward's masked kernel (one
    pk_ring_attn call, masked; forward_path "fused_masked"; the backward the jax.lax ring's)
    and Ulysses' to the masked pk.attention kernels on the head groups (forward and
    backward)."""
    from test_ring_attn import ffi_calls

    from pk_jax import _backend
    from pk_jax.ops import _tp, ring_attn

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    monkeypatch.setattr(_tp, "check_workspace", lambda *a: None)
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    fn = pk.ring_attention if op == "ring" else pk.ulysses_attention
    paths = []
    if op == "ring":
        decide = ring_attn.forward_path
        monkeypatch.setattr(ring_attn, "forward_path",
                            lambda *a, **kw: paths.append(decide(*a, **kw)) or paths[-1])
    q = jax.device_put(jnp.zeros((1, 8 * p, 2 * p, 64), jnp.bfloat16), NamedSharding(mesh, SEQ))
    for mask in [{}] + MASKS:
        kw = mask_kw(mask, 1, 8)
        f = jax.shard_map(lambda a, kw=kw: fn(a, a, a, "sp", causal=True, **kw), mesh=mesh,
                          in_specs=SEQ, out_specs=SEQ)
        jaxpr = jax.make_jaxpr(jax.grad(lambda a, f=f: jnp.sum(f(a).astype(jnp.float32))))(q)
        used = [e for e in ffi_calls(jaxpr) if e.params["target_name"] in ATTENTION_KERNELS]
        names = [e.params["target_name"] for e in used]
        path = paths[-1] if op == "ring" else None  # Ulysses: its kernels' absence says it
        flags = [dict(e.params["attributes"]).get("masked") for e in used]
        if mask and (p == 1 or op == "ulysses"):
            assert names == ["pk_attention"] * 2 and flags == [1, 1], (mask, names, flags)
            assert path == ("local" if op == "ring" else None), (mask, path)
        elif mask:
            assert names == ["pk_ring_attn"] and flags == [1], (mask, names, flags)
            assert path == "fused_masked", (mask, path)
        else:
            assert path != "reference" and used, (path, names)


def check_sharded_mask_errors(op) -> None:
    """op (pk.ring_attention or pk.ulysses_attention) names seq_local in the segment ids' shape,
    and refuses lengths that vary along the sequence axis (each rank would use its own)."""
    mesh = cpu_mesh((2,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((1, 8, 2, 4))
    f = jax.shard_map(lambda a, ids: op(a, a, a, "sp", segment_ids=ids), mesh=mesh,
                      in_specs=(SEQ, P()), out_specs=SEQ)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_local\] "
                                         r"= \(1, 4\), got \(1, 8\)"):
        f(q, jnp.zeros((1, 8), jnp.int32))
    f = jax.shard_map(lambda a, n: op(a, a, a, "sp", query_seq_lengths=n[:1]), mesh=mesh,
                      in_specs=(SEQ, P("sp")), out_specs=SEQ)
    with pytest.raises(ValueError, match="query_seq_lengths varies along axis 'sp'"):
        f(q, jnp.zeros((2,), jnp.int32))

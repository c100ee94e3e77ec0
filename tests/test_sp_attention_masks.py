"""The masks through ring_attention's and ulysses_attention's kernels (issue 38 section 3), on a
CPU: the entries the public ops route to at P > 1 with masks on GPUs.

- `ulysses_attn._composed_masked` (pk.all_to_all to head groups, the masked pk.attention
  kernels over the whole sequence, all_to_all back), with jax.lax stand-ins for the FFI calls
  (tests/util.py stand_in_attention: the stand-in reads the masks from the call's attributes
  and operands as ffi/attention.cu does) at P = 2, 4, against masks.dense_masked (float64
  numpy over the whole sequence), forward and gradients; the traced pk_attention calls'
  attributes and mask operands (the segment ids all-gathered, the lengths as given); the
  trace-time errors.
- `ring_attn._kernel_ring_masked` (the fused forward with masks, pk_ring_attn masked; its VJP
  the jax.lax ring's backward), with a stand-in for pk_ring_attn that computes what the kernel
  is specified to (dense attention of the local rows over the all-gathered K/V, every mask on
  global positions from the call's attributes and its whole-sequence ids, rows with no key
  O = 0 and lse = +inf) at P = 2, 4, 8 in both layouts, segments crossing chunk and rank
  boundaries, against masks.dense_masked: the ids must reach the kernel in global order (zigzag
  permuted back), the lengths and window global; the traced call's attributes and operands;
  the trace-time errors.

The kernels themselves run in the GPU tests: tests/gpu/sp_masked_mp.py (composed Ulysses and
the ring entry through JAX, and the public ops with `public`),
tests/gpu/test_emulator_ring_masks.py (the ring's fused forward, in the rank emulator).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from masks import CASES, check_close, crosses_chunks, dense_for, dense_masked, mask_args, randn
from util import P, cpu_mesh, stand_in_attention

import pk_jax as pk
from pk_jax.ops import _attention, ring_attn, ulysses_attn

SEQ = P(None, "sp")


def _private_masks(kw: dict):
    """(masks, window, softcap, causal) of mask_args' keyword arguments, for the private
    entries, which take the masks as `_attention.check_masks` returns them."""
    window = kw.get("local_window_size")
    if window is not None and np.isscalar(window):
        window = (window, window)
    return window, kw.get("logits_soft_cap"), bool(kw.get("causal", False))


def sharded_private(entry, p, q, k, v, w, kw, *, layout=None):
    """entry(q, k, v, "sp", masks, scale, causal, window, softcap) under jit(shard_map) over P
    host devices on global arrays (zigzag permuted in and back out), with the gradients of
    sum(out * w); the masks' arrays sharded as the public ops take them (segment ids along
    the sequence, lengths replicated)."""
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    s = q.shape[1]
    idx = pk.zigzag_indices(s, p) if layout == "zigzag" else np.arange(s)
    window, softcap, causal = _private_masks(kw)  # layout None: Ulysses (contiguous)
    seg = kw.get("segment_ids")
    ids = None if seg is None else jnp.asarray(np.asarray(seg)[:, idx])
    lens = tuple(None if kw.get(n) is None else jnp.asarray(kw[n])
                 for n in ("query_seq_lengths", "key_value_seq_lengths"))
    scale = q.shape[-1] ** -0.5

    def local(q, k, v, ids, lens):
        masks = _attention.Masks(ids, ids, *lens)
        extra = {} if layout is None else {"layout": layout}
        return entry(q, k, v, "sp", masks, scale, causal, window, softcap, **extra)

    specs = (SEQ, SEQ, SEQ, None if ids is None else SEQ, (P(), P()))
    lens_specs = tuple(None if x is None else P() for x in lens)
    f = jax.shard_map(local, mesh=mesh, in_specs=(*specs[:4], lens_specs), out_specs=SEQ)
    loss = lambda q, k, v, i, n: jnp.sum(f(q, k, v, i, n).astype(jnp.float32) * w[:, idx])
    g = jax.jit(lambda *x: (f(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)))
    out, grads = g(*(jnp.asarray(x[:, idx]) for x in (q, k, v)), ids, lens)
    back = np.argsort(idx)
    return np.asarray(out, np.float64)[:, back], [np.asarray(x, np.float64)[:, back]
                                                  for x in grads]


def _case(name, b, s, p, seed):
    case = dict(CASES[name])
    for n in ("q_len", "kv_len"):
        if n in case:
            case[n] = (s - 2, s // 2 + 1)[:b] if n == "q_len" else (s // 3, s - 1)[:b]
    return mask_args(case, b, s, seed=seed)


# ---------------------------------------------------------------------------------------------
# Ulysses, composed: pk.all_to_all and the masked pk.attention kernels (stand-ins).

ULYSSES = [(2, "segments+causal", 7), (2, "all", 5), (4, "window+causal", 3),
           (4, "softcap+segments+causal", 5), (4, "lengths", 4), (2, "segments", 6),
           (2, "softcap", 4), (4, "kv_len+causal", 3), (2, "window", 5)]


@pytest.mark.parametrize("p,name,sl", ULYSSES)
def test_ulysses_composed_masked_matches_dense(monkeypatch, p, name, sl):
    """Forward and gradients of the composed path with masks, the pk_attention kernels stood
    in by the blockwise reference on what the call passes (its attributes and mask operands),
    against float64 attention over the whole sequence: the ids the kernel sees must be the
    all-gathered ones in global order, the lengths and window global. float32 operands (the
    stand-in takes them; the check of dtypes is the kernels'), H = 2P, Hkv = P and (P = 4) 2:
    K/V heads repeated up to P."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 3)
    calls = stand_in_attention(monkeypatch)
    monkeypatch.setattr(ulysses_attn, "composed_supports", lambda q, p: True)
    b, s = 2, sl * p
    hkv = 2 if p == 4 and "lengths" in name else p
    q, k, v, w = (randn((b, s, 2 * p, 8), p), randn((b, s, hkv, 8), p + 1),
                  randn((b, s, hkv, 8), p + 2), randn((b, s, 2 * p, 8), p + 3))
    kw = _case(name, b, s, p, seed=p + 20)
    if "segment_ids" in kw:
        assert crosses_chunks(kw["segment_ids"], sl)
    got = sharded_private(ulysses_attn._composed_masked, p, q, k, v, w, kw)
    check_close(got, dense_for(q, k, v, w, kw), atol=3e-5)
    att = [c for c in calls if c["target"] == "pk_attention"]
    # the output and the gradient each trace the forward: forwards, then one backward
    assert [c["backward"] for c in att][-1] == 1 and {c["backward"] for c in att} == {0, 1}
    assert all(c["masked"] == 1 for c in att), att
    assert all(c["s"] == s and c["h"] == 2 and c["hkv"] == max(hkv, p) // p for c in att), att


def test_ulysses_composed_masked_calls():
    """The traced composed path: pk_all_to_all of q, k, v, one masked pk_attention forward on
    the head group [B, S, H/P, D] with the window, cap and segment attributes, the lengths as
    given and the segment ids gathered to [B, SP] (SP = S rounded up to 128) with their chunk
    ranges; all_to_all back; the backward: dO to head groups, one masked pk_attention backward
    with the same mask operands, dq, dk, dv back. No XLA all-to-all, no pk_ulysses_attn."""
    from test_ring_attn import ffi_calls

    p, b, sl, h, d = 2, 2, 100, 4, 64
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    x = jnp.zeros((b, sl * p, h, d), jnp.bfloat16)
    ids = jnp.zeros((b, sl * p), jnp.int32)
    lens = jnp.array([150, 7], jnp.int32)

    def local(q, ids, lens):
        masks = _attention.Masks(ids, ids, None, lens)
        return ulysses_attn._composed_masked(q, q, q, "sp", masks, 0.125, True, (64, 0), 30.0)

    f = jax.shard_map(local, mesh=mesh, in_specs=(SEQ, SEQ, P()), out_specs=SEQ)
    grad = jax.grad(lambda q, i, n: jnp.sum(f(q, i, n).astype(jnp.float32)))
    from pk_jax import _backend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
        eqns = ffi_calls(jax.make_jaxpr(grad)(x, ids, lens))
    targets = [e.params["target_name"] for e in eqns]
    assert "pk_ulysses_attn" not in targets and targets.count("pk_attention") == 2, targets
    assert targets.count("pk_all_to_all") == 8, targets
    fwd, bwd = [e for e in eqns if e.params["target_name"] == "pk_attention"]
    attrs = lambda e: {n: (float(a) if n in ("scale", "soft_cap") else int(a))
                       for n, a in dict(e.params["attributes"]).items()}
    want = {"scale": 0.125, "causal": 1, "masked": 1, "window_left": 64, "window_right": 0,
            "soft_cap": 30.0, "segments": 1}
    assert attrs(fwd) == {**want, "backward": 0} and attrs(bwd) == {**want, "backward": 1}
    s, sp = sl * p, 256
    masks = [((b,), jnp.int32), ((b,), jnp.int32), ((b, sp), jnp.int32), ((b, sp), jnp.int32),
             ((b, sp // 64, 4), jnp.int32), ((b, sp // 64, 4), jnp.int32)]
    shapes = lambda xs: [(tuple(v.aval.shape), v.aval.dtype) for v in xs]
    head = (b, s, h // p, d)
    assert shapes(fwd.invars) == [(head, jnp.bfloat16)] * 3 + masks
    assert shapes(bwd.invars) == [(head, jnp.bfloat16)] * 4 + [((b, h // p, sp), jnp.float32)] * 2 \
        + masks


@pytest.mark.parametrize("kw,msg", [
    ({"dtype": jnp.float32}, "bf16 or fp16"),
    ({"d": 96}, "head_dim"),
    ({"h": 3}, "P dividing H"),
    ({"masks": _attention.Masks(jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 32), jnp.int32),
                                None, None)},
     r"masks.q_seg must be an integer array of shape \(1, 16\)"),
    ({"masks": _attention.Masks(None, None, jnp.zeros((2,), jnp.int32), None)},
     r"masks.q_len must be an integer array of shape \(1,\)"),
    ({"window": (3, -1)}, r"window must be \(left, right\) >= 0"),
    ({"softcap": -2.0}, "softcap must be a finite positive"),
])
def test_ulysses_composed_masked_errors(kw, msg):
    p = 2
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((1, 16 * p, kw.get("h", 4), kw.get("d", 64)), kw.get("dtype", jnp.bfloat16))

    def local(q):
        return ulysses_attn._composed_masked(q, q, q, "sp", kw.get("masks"), 0.1, False,
                                             kw.get("window"), kw.get("softcap"))

    f = jax.shard_map(local, mesh=mesh, in_specs=SEQ, out_specs=SEQ)
    with pytest.raises(ValueError,
                       match=r"pk.ulysses_attention \(masked composed kernels\): .*" + msg):
        jax.make_jaxpr(f)(q)


# ---------------------------------------------------------------------------------------------
# Ring, fused forward with masks: a stand-in for pk_ring_attn (what the masked kernel computes).

def _stand_in_ring(monkeypatch, p: int) -> list[dict]:
    """stand_in_attention plus a stand-in for pk_ring_attn over axis "sp" of size p: dense
    attention of the rank's rows over every rank's K/V (all-gathered), positions global (the
    layout from the zigzag attribute), and when masked every mask from the attributes and the
    operands after the rank (q_len, kv_len; q_seg, kv_seg [B, SP] by global position, q_info,
    kv_info [B, SP / 64, 4]); o in q's dtype, lse [B, H, S/P] (+inf: no key). Appends
    {"target", attributes..., "operands": shapes after the rank} per call."""
    from pk_jax import _ffi

    calls = stand_in_attention(monkeypatch)
    inner = _ffi.call

    def fake(target, results, *args, out_vma=None, **attrs):
        if target != "pk_ring_attn":
            return inner(target, results, *args, out_vma=out_vma, **attrs)
        a = {n: (float(x) if n in ("scale", "soft_cap") else int(x)) for n, x in attrs.items()}
        q, k, v, _ = args[:4]
        extra = args[4:]
        calls.append({"target": target, **a,
                      "operands": [(tuple(x.shape), x.dtype) for x in extra]})
        b, sl, h, _ = q.shape
        s, group = sl * p, h // k.shape[2]
        rank = jax.lax.axis_index("sp")

        def gpos(owner, i):
            if not a["zigzag"]:
                return owner * sl + i
            c = sl // 2
            return jnp.where(i < c, owner * c + i, (2 * p - 1 - owner) * c + i - c)

        qpos = gpos(rank, jnp.arange(sl))
        kpos = gpos(jnp.arange(s) // sl, jnp.arange(s) % sl)
        kall, vall = (jnp.repeat(jax.lax.all_gather(x, "sp", axis=1, tiled=True), group, 2)
                      .astype(jnp.float32) for x in (k, v))
        x = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kall,
                       precision=jax.lax.Precision.HIGHEST) * a["scale"]
        vis = jnp.ones((b, 1, sl, s), bool)
        if a["causal"]:
            vis &= kpos[None, None, None, :] <= qpos[None, None, :, None]
        if a["masked"]:
            assert len(extra) == (6 if a["segments"] else 2)
            if a["soft_cap"] > 0:
                x = a["soft_cap"] * jnp.tanh(x / a["soft_cap"])
            lo = qpos[:, None] - a["window_left"]
            hi = qpos[:, None] + a["window_right"]
            vis &= ((kpos[None, :] >= lo) & (kpos[None, :] <= hi))[None, None]
            vis &= (qpos[None, :] < extra[0][:, None])[:, None, :, None]
            vis &= (kpos[None, :] < extra[1][:, None])[:, None, None, :]
            if a["segments"]:
                qid, kid = jnp.take(extra[2], qpos, axis=1), jnp.take(extra[3], kpos, axis=1)
                vis &= (qid[:, :, None] == kid[:, None, :])[:, None]
        else:
            assert not extra
        x = jnp.where(vis, x, -jnp.inf)
        mx = jnp.max(x, -1, keepdims=True)
        mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
        e = jnp.where(vis, jnp.exp(x - mx), 0.0)
        den = e.sum(-1, keepdims=True)
        o = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(den > 0, den, 1.0), vall,
                       precision=jax.lax.Precision.HIGHEST)
        lse = jnp.where(den[..., 0] > 0, mx[..., 0] + jnp.log(jnp.where(den > 0, den, 1.0))[..., 0],
                        jnp.inf)
        return o.astype(results[0].dtype), lse

    monkeypatch.setattr(_ffi, "call", fake)
    return calls


RING = [  # (P, layout, case, S/P)
    (2, "contiguous", "segments+causal", 8), (2, "zigzag", "window+causal", 6),
    (4, "contiguous", "all", 6), (4, "zigzag", "softcap+segments+causal", 6),
    (8, "zigzag", "lengths", 4), (8, "contiguous", "kv_len+causal", 4),
    (4, "zigzag", "segments", 6), (2, "zigzag", "all", 10), (2, "contiguous", "window", 6),
    (4, "zigzag", "window", 6), (2, "contiguous", "softcap", 6)]


@pytest.mark.parametrize("p,layout,name,sl", RING)
def test_ring_masked_matches_dense(monkeypatch, p, layout, name, sl):
    """Forward (stand-in kernel) and gradients (the jax.lax ring's backward on the kernel's
    output and lse) of `_kernel_ring_masked` against float64 attention over the whole
    sequence, at P = 2, 4, 8 in both layouts, segments crossing chunk and rank boundaries;
    float32 operands (the stand-in takes them), H = 4, Hkv = 2."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 3)
    calls = _stand_in_ring(monkeypatch, p)
    monkeypatch.setattr(ring_attn, "kernel_supports", lambda q, k, p: True)
    b, s = 2, sl * p
    q, k, v, w = (randn((b, s, 4, 8), p), randn((b, s, 2, 8), p + 1), randn((b, s, 2, 8), p + 2),
                  randn((b, s, 4, 8), p + 3))
    kw = _case(name, b, s, p, seed=p + 30)
    if "segment_ids" in kw:
        assert crosses_chunks(kw["segment_ids"], sl // 2 if layout == "zigzag" else sl)
    got = sharded_private(ring_attn._kernel_ring_masked, p, q, k, v, w, kw, layout=layout)
    check_close(got, dense_for(q, k, v, w, kw), atol=3e-5)
    ring = [c for c in calls if c["target"] == "pk_ring_attn"]
    assert ring and all(c["masked"] == 1 for c in ring), ring
    positional = any(n in kw for n in ("causal", "local_window_size", "query_seq_lengths",
                                       "key_value_seq_lengths"))
    assert all(c["zigzag"] == int(layout == "zigzag" and positional) for c in ring), ring


def test_ring_masked_call():
    """The traced entry: one masked pk_ring_attn per forward on q, k, v as given, then the
    masks' operands over the whole sequence (lengths [B]; ids [B, SP] and chunk ranges
    [B, SP / 64, 4], SP = S rounded up to 128) and the attributes (window clamped to S, cap,
    segments, zigzag with a mask by position); the backward is the jax.lax ring's (no
    pk_ring_attn_bwd)."""
    from test_ring_attn import ffi_calls

    from pk_jax import _backend

    p, b, sl, h, hkv, d = 4, 2, 100, 4, 2, 64
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((b, sl * p, h, d), jnp.bfloat16)
    kv = jnp.zeros((b, sl * p, hkv, d), jnp.bfloat16)
    ids = jnp.zeros((b, sl * p), jnp.int32)
    lens = jnp.array([150, 7], jnp.int32)

    def local(q, k, ids, lens):
        masks = _attention.Masks(ids, ids, lens, None)
        return ring_attn._kernel_ring_masked(q, k, k, "sp", masks, 0.125, False, (1000, 3), 30.0,
                                             layout="zigzag")

    f = jax.shard_map(local, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, P()), out_specs=SEQ)
    grad = jax.grad(lambda q, k, i, n: jnp.sum(f(q, k, i, n).astype(jnp.float32)),
                    argnums=(0, 1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
        eqns = ffi_calls(jax.make_jaxpr(grad)(q, kv, ids, lens))
    targets = [e.params["target_name"] for e in eqns]
    assert targets.count("pk_ring_attn") == 1 and "pk_ring_attn_bwd" not in targets, targets
    (call,) = [e for e in eqns if e.params["target_name"] == "pk_ring_attn"]
    attrs = {n: (float(a) if n in ("scale", "soft_cap") else int(a))
             for n, a in dict(call.params["attributes"]).items()}
    s, sp = sl * p, 512
    assert {n: attrs[n] for n in ("masked", "window_left", "window_right", "soft_cap",
                                  "segments", "zigzag", "causal", "scale")} == {
        "masked": 1, "window_left": s, "window_right": 3, "soft_cap": 30.0, "segments": 1,
        "zigzag": 1, "causal": 0, "scale": 0.125}
    shapes = [(tuple(v.aval.shape), v.aval.dtype) for v in call.invars]
    assert shapes[:3] == [((b, sl, h, d), jnp.bfloat16)] + [((b, sl, hkv, d), jnp.bfloat16)] * 2
    assert shapes[4:] == [((b,), jnp.int32)] * 2 + [((b, sp), jnp.int32)] * 2 + \
        [((b, sp // 64, 4), jnp.int32)] * 2


@pytest.mark.parametrize("kw,msg", [
    ({"dtype": jnp.float32}, "bf16 or fp16"),
    ({"d": 96}, "head_dim"),
    ({"layout": "spiral"}, "layout='spiral' is not one of"),
    ({"layout": "zigzag", "sl": 15}, "even local sequence length"),
    ({"masks": _attention.Masks(jnp.zeros((1, 32), jnp.int32), jnp.zeros((1, 32), jnp.int32),
                                None, None)},
     r"masks.q_seg must be an integer array of shape \(1, 16\)"),
    ({"masks": _attention.Masks(None, None, None, jnp.zeros((1, 2), jnp.int32))},
     r"masks.kv_len must be an integer array of shape \(1,\)"),
    ({"window": (-3, 1)}, r"window must be \(left, right\) >= 0"),
    ({"softcap": 0.0}, "softcap must be a finite positive"),
])
def test_ring_masked_errors(kw, msg):
    p = 2
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((1, kw.get("sl", 16) * p, 4, kw.get("d", 64)), kw.get("dtype", jnp.bfloat16))

    def local(q):
        return ring_attn._kernel_ring_masked(q, q, q, "sp", kw.get("masks"), 0.1, True,
                                             kw.get("window"), kw.get("softcap"),
                                             layout=kw.get("layout", "contiguous"))

    f = jax.shard_map(local, mesh=mesh, in_specs=SEQ, out_specs=SEQ)
    with pytest.raises(ValueError, match=r"pk.ring_attention \(masked kernels\): .*" + msg):
        jax.make_jaxpr(f)(q)


@pytest.mark.parametrize("p,zigzag,causal", [(2, True, True), (4, False, False), (4, True, False)])
def test_emulator_reference_matches_dense(p, zigzag, causal):
    """pk_jax.testing.ops.ring_attn_masked (the masked ring's emulator cases, GPU suite
    tests/gpu/test_emulator_ring_masks.py) against masks.dense_masked over the whole
    sequence, every rank's rows in its layout: o, and lse = +inf exactly on rows no key is
    visible to; its mask operands as the entry passes them."""
    from masks import packed_ids

    from pk_jax.testing import ops

    b, sl, h, hkv, d = 2, 10, 4, 2, 8
    s = sl * p
    rng = np.random.default_rng(p)
    qs = [rng.standard_normal((b, sl, h, d)) for _ in range(p)]
    ks = [rng.standard_normal((b, sl, hkv, d)) for _ in range(p)]
    vs = [rng.standard_normal((b, sl, hkv, d)) for _ in range(p)]
    ids = packed_ids(b, s, p, mean=4)
    q_len, kv_len = [s - 3, s], [s, 0]
    case = ops.ring_attn_masked(qs, ks, vs, "float32", causal=causal, zigzag=zigzag,
                                window=(5, 2), softcap=3.0, ids=ids, q_len=q_len,
                                kv_len=kv_len)
    pos = [ops.seq_positions(p, r, sl, zigzag) for r in range(p)]
    order = np.concatenate(pos)
    glob = lambda xs: np.concatenate(xs, axis=1)[:, np.argsort(order)]
    want = dense_masked(glob(qs), glob(ks), glob(vs), causal=causal, segment_ids=ids,
                        window=(5, 2), softcap=3.0, q_len=q_len, kv_len=kv_len)
    for r in range(p):
        np.testing.assert_allclose(case.expected[r]["o"], want[:, pos[r]], atol=1e-5, rtol=1e-5)
    lse = np.concatenate([e["lse"] for e in case.expected], axis=2)[:, :, np.argsort(order)]
    dead = ~ops.masked_visible(np.arange(s), np.arange(s), b=b, causal=causal, window=(5, 2),
                               ids=ids, q_len=q_len, kv_len=kv_len).any(2)
    assert dead[1].all() and not dead[0].all()
    assert np.all(np.isinf(lse.transpose(0, 2, 1)[dead])) and np.all(np.isfinite(
        lse.transpose(0, 2, 1)[~dead]))
    sp = 128
    inputs = case.inputs[0]
    assert {n: (x.shape, x.dtype) for n, x in inputs.items() if n not in "qkv"} == {
        "q_len": ((b,), np.int32), "kv_len": ((b,), np.int32), "q_seg": ((b, sp), np.int32),
        "kv_seg": ((b, sp), np.int32), "q_info": ((b, sp // 64, 4), np.int32),
        "kv_info": ((b, sp // 64, 4), np.int32)}
    assert case.params["masked"] == 1 and case.params["segments"] == 1
    assert (case.params["window_left"], case.params["window_right"]) == (5, 2)

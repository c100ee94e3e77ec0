"""The masks through ring_attention's and ulysses_attention's kernels (issue 38 section 3), on a
CPU: the private entries that the public ops do not route to yet (their GPU tests have not run).

- `ulysses_attn._composed_masked` (pk.all_to_all to head groups, the masked pk.attention
  kernels over the whole sequence, all_to_all back), with jax.lax stand-ins for the FFI calls
  (tests/util.py stand_in_attention: the stand-in reads the masks from the call's attributes
  and operands as ffi/attention.cu does) at P = 2, 4, against masks.dense_masked (float64
  numpy over the whole sequence), forward and gradients; the traced pk_attention calls'
  attributes and mask operands (the segment ids all-gathered, the lengths as given); the
  trace-time errors.

The kernels themselves run in the GPU tests: tests/gpu/ulysses_masked_mp.py (composed path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from masks import CASES, check_close, crosses_chunks, dense_for, mask_args, randn
from util import P, cpu_mesh, stand_in_attention

import pk_jax as pk
from pk_jax.ops import _attention, ulysses_attn

SEQ = P(None, "sp")


def _private_masks(kw: dict):
    """(masks, window, softcap, causal) of mask_args' keyword arguments, for the private
    entries, which take the masks as `_attention.check_masks` returns them."""
    window = kw.get("local_window_size")
    if window is not None and np.isscalar(window):
        window = (window, window)
    return window, kw.get("logits_soft_cap"), bool(kw.get("causal", False))


def sharded_private(entry, p, q, k, v, w, kw, *, layout="contiguous"):
    """entry(q, k, v, "sp", masks, scale, causal, window, softcap) under jit(shard_map) over P
    host devices on global arrays (zigzag permuted in and back out), with the gradients of
    sum(out * w); the masks' arrays sharded as the public ops take them (segment ids along
    the sequence, lengths replicated)."""
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    s = q.shape[1]
    idx = pk.zigzag_indices(s, p) if layout == "zigzag" else np.arange(s)
    window, softcap, causal = _private_masks(kw)
    seg = kw.get("segment_ids")
    ids = None if seg is None else jnp.asarray(np.asarray(seg)[:, idx])
    lens = tuple(None if kw.get(n) is None else jnp.asarray(kw[n])
                 for n in ("query_seq_lengths", "key_value_seq_lengths"))
    scale = q.shape[-1] ** -0.5

    def local(q, k, v, ids, lens):
        masks = _attention.Masks(ids, ids, *lens)
        return entry(q, k, v, "sp", masks, scale, causal, window, softcap)

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

"""pk.ulysses_attention on host devices against dense softmax attention over the whole
sequence: P in {1,2,3,4,8} with H divisible by P, causal or not, every dtype, odd local lengths,
B > 1, a 2-D mesh, key blocks shorter than the sequence, gradients, and the error messages; the
masks at P = 2, 4 against a float64 numpy reference (tests/masks.py), and that a masked call
takes no attention kernel; and,
with jax.lax stand-ins for the FFI calls, the GPU paths' wiring: the default composed kernels
(pk.all_to_all, the pk.attention forward and backward kernels on the head group), the fused
forward behind PK_JAX_ULYSSES_FUSED=1, the fused backward behind PK_JAX_ULYSSES_FUSED=bwd and, at
P = 1, the pk.attention kernels alone; on an H200 (marker gpu) P = 1 against pk.attention and a
float32 reference (the fused kernels' lowering: tests/gpu/ulysses_mp.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.test_util import check_grads
from masks import (
    CASES,
    check_close,
    check_masked_sp_routing,
    check_sharded_mask_errors,
    crosses_chunks,
    dense_for,
    mask_args,
    randn,
    sharded_run,
)
from test_ring_attn import (  # the shared references
    GPU_P1,
    GPU_P1_GRAD,
    _sharded,
    check_p1_forward,
    check_p1_grads,
    check_p1_kernel_calls,
    dense,
    dense_grads,
    dense_in_shard_map,
    ffi_calls,
    gpu_id,
    normal,
    qkv,
    traced_p1,
)
from util import (
    FLOAT_DTYPES,
    WORLD_SIZES,
    P,
    assert_close,
    cpu_mesh,
    product,
    run,
    stand_in_attention,
    vjp_both,
)

import pk_jax as pk
from pk_jax import cost_model
from pk_jax.ops import _attention
from pk_jax.ops import attention as _attention_op
from pk_jax.runtime import state

SEQ = P(None, "sp")


def ulysses(mesh, q, k, v, spec=SEQ, **kw):
    return run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp", **kw), mesh, (spec,) * 3,
               spec, q, k, v)


@pytest.mark.parametrize("p,causal", product(WORLD_SIZES, (False, True)))
def test_matches_dense(p, causal):
    q, k, v = qkv((2, 5 * p, 2 * p, 4), jnp.float32)  # odd S/P = 5, B = 2, H = 2P
    out = ulysses(cpu_mesh((p,), ("sp",)), q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, dense(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype,causal", product((jnp.bfloat16, jnp.float16), (False, True)))
def test_dtypes(dtype, causal):
    q, k, v = qkv((1, 4 * 7, 4, 8), dtype)
    out = ulysses(cpu_mesh((4,), ("sp",)), q, k, v, causal=causal)
    assert out.dtype == dtype
    assert_close(out, dense(q, k, v, causal=causal), dtype)


@pytest.mark.parametrize("p,causal", product((1, 3), (False, True)))
def test_tiles_shorter_than_the_sequence(monkeypatch, p, causal):
    # S = 7P in query tiles of 5 and key blocks of 4, the last of each padded; causally hidden
    # blocks skipped.
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 5)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 4)
    q, k, v = qkv((2, 7 * p, p, 4), jnp.float32)
    assert_close(ulysses(cpu_mesh((p,), ("sp",)), q, k, v, causal=causal),
                 dense(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", (False, True))
def test_2d_mesh_dp_sp(causal):
    mesh = cpu_mesh((2, 4), ("dp", "sp"))
    q, k, v = qkv((4, 4 * 5, 4, 4), jnp.float32)
    out = ulysses(mesh, q, k, v, spec=P("dp", "sp"), causal=causal)
    assert_close(out, dense(q, k, v, causal=causal))


@pytest.mark.parametrize("explicit,check_vma", [(False, True), (True, False)])
def test_auto_mesh_and_check_vma_off(explicit, check_vma):
    mesh = cpu_mesh((2,), ("sp",), explicit=explicit)
    q, k, v = qkv((1, 2 * 3, 2, 4), jnp.float32)
    out = run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp", causal=True), mesh,
              (SEQ,) * 3, SEQ, q, k, v, check_vma=check_vma)
    assert_close(out, dense(q, k, v, causal=True))


def test_scale():
    q, k, v = qkv((1, 2 * 3, 2, 4), jnp.float32)
    out = ulysses(cpu_mesh((2,), ("sp",)), q, k, v, causal=False, scale=2.5)
    assert_close(out, dense(q, k, v, causal=False, scale=2.5))


def test_all_to_all_around_local_attention():
    mesh = cpu_mesh((4,), ("sp",))
    pk.init(mesh)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, SEQ)) for x in qkv((1, 8, 4, 4),
                                                                        np.float32))
    f = jax.shard_map(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ)
    text = str(jax.make_jaxpr(f)(q, k, v))
    assert text.count("all_to_all") == 4  # q, k, v in; the output back
    assert "all_gather" not in text and "ppermute" not in text


@pytest.mark.parametrize("p,causal,explicit", [
    (2, True, True), (4, False, False), pytest.param(8, True, True, marks=pytest.mark.large)])
def test_grad_matches_dense(monkeypatch, p, causal, explicit):
    # S = 5P: scans over padded tiles of 3 queries by 4 keys.
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 3)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 4)
    mesh = cpu_mesh((p,), ("sp",), explicit=explicit)
    pk.init(mesh)
    q, k, v = qkv((2, 5 * p, p, 4), jnp.float32)
    w = normal(q.shape, np.float32, 9)
    f = _sharded(mesh, pk.ulysses_attention, SEQ, causal=causal)
    got = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * w), argnums=(0, 1, 2)))(q, k, v)
    want = dense_grads(q, k, v, w, causal=causal)
    for g, h in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("check_vma", (True,))
def test_vjp_typing_on_2d_mesh_with_q_replicated_over_dp(check_vma):
    mesh = cpu_mesh((2, 2), ("dp", "sp"))
    q = normal((2, 2 * 3, 4, 4), np.float32, 0)
    k, v, dy = (normal((4, 2 * 3, 4, 4), np.float32, i) for i in (1, 2, 3))
    ours, ref = vjp_both(lambda *x: pk.ulysses_attention(*x, "sp", causal=True),
                         dense_in_shard_map("sp", True), mesh,
                         (P(None, "sp"), P("dp", "sp"), P("dp", "sp")), P("dp", "sp"),
                         (q, k, v), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_check_grads():
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh)
    f = _sharded(mesh, pk.ulysses_attention, SEQ, causal=True)
    check_grads(f, qkv((1, 2 * 3, 2, 4), np.float32), order=1, modes=["rev"], eps=1e-3,
                atol=1e-2, rtol=1e-2)


BAD = [  # (q shape, k shape, v shape, dtype of v, options, error, message)
    ((4, 2, 8), (4, 2, 8), (4, 2, 8), None, {}, ValueError, "q must have rank 4"),
    ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 4), None, {}, ValueError,
     r"k and v must be \[batch, seq_local, kv_heads"),
    ((1, 4, 2, 8),) * 3 + (jnp.bfloat16, {}, TypeError, "q and v must have the same dtype"),
    ((1, 4, 3, 8),) * 3 + (None, {}, ValueError,
                           r"heads H \(q.shape\[2\]\) = 3 is not divisible by 2"),
    ((1, 4, 2, 8),) * 3 + (None, {"causal": 1}, TypeError, "causal must be a Python bool"),
    ((1, 4, 2, 8),) * 3 + (None, {"scale": float("nan")}, ValueError,
                           "scale must be a finite positive"),
    ((1, 4, 2, 8),) * 3 + (None, {"scale": "0.5"}, TypeError, "scale must be a positive"),
]


@pytest.mark.parametrize("qs,ks,vs,vdtype,kw,err,msg", BAD)
def test_errors(qs, ks, vs, vdtype, kw, err, msg):
    mesh = cpu_mesh((2,), ("sp",))
    q, k = np.zeros(qs, np.float32), np.zeros(ks, np.float32)
    v = np.zeros(vs, vdtype or np.float32)
    with pytest.raises(err, match="pk.ulysses_attention: .*" + msg):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp", **kw), mesh, (P(),) * 3, P(),
            q, k, v)


def test_errors_dtype_axis_and_init():
    mesh = cpu_mesh((2,), ("sp",))
    x = np.zeros((1, 4, 2, 8), np.int32)
    with pytest.raises(TypeError, match="ulysses_attention: q has dtype int32; supported"):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (P(),) * 3, P(),
            x, x, x)
    x = x.astype(np.float32)
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "tp"), mesh, (P(),) * 3, P(),
            x, x, x)
    pk.shutdown()
    with pytest.raises(ValueError, match=r"pk.init\(mesh\) has not been called"):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (P(),) * 3, P(),
            x, x, x, init=False)


@pytest.mark.large
@pytest.mark.parametrize("dtype,causal", product(FLOAT_DTYPES, (False, True)))
def test_large(monkeypatch, dtype, causal):
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 48)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 64)
    q, k, v = qkv((2, 8 * 61, 8, 32), dtype)
    out = ulysses(cpu_mesh((8,), ("sp",)), q, k, v, causal=causal)
    assert_close(out, dense(q, k, v, causal=causal), dtype)


# ---------------------------------------------------------------------------------------------
# The GPU paths' wiring on CPU with jax.lax stand-ins for the FFI calls: the default composed
# kernels (pk_all_to_all, the pk_attention forward and backward) and the fused forward
# (pk_ulysses_attn, PK_JAX_ULYSSES_FUSED=1; the kernel itself: tests/gpu/test_emulator_ulysses.py).

def _dense_gqa_grads(q, k, v, dy, causal):
    """float32 gradients of sum(dense attention * dy), each K/V head used by H / Hkv query
    heads (scale 1/sqrt(D))."""
    g = q.shape[2] // k.shape[2]
    f32 = lambda x: jnp.asarray(np.asarray(x, np.float32))
    dq, dk, dv = dense_grads(f32(q), f32(np.repeat(k, g, 2)), f32(np.repeat(v, g, 2)), f32(dy),
                             causal=causal)
    b, s, hkv, d = k.shape
    return (np.asarray(dq), *(np.asarray(x).reshape(b, s, hkv, g, d).sum(3) for x in (dk, dv)))


def _stand_in_ulysses(monkeypatch, fused: bool | str = True) -> list[dict]:
    """stand_in_attention (the pk_attention forward and backward: the composed path's
    head-group passes) plus a stand-in for pk_ulysses_attn that returns what the kernel does:
    o [B, S/P, H, D] and lse float32 [B, H, S/P], from K/V with the heads the call passes; and
    `_stand_in_fused_bwd` for pk_ulysses_attn_bwd. `fused`: PK_JAX_ULYSSES_FUSED=1 in the
    environment (read at the next pk.init), a string: that value, False: unset (the composed
    default)."""
    from pk_jax import _ffi

    if fused is False:
        monkeypatch.delenv("PK_JAX_ULYSSES_FUSED", raising=False)
    else:
        monkeypatch.setenv("PK_JAX_ULYSSES_FUSED", "1" if fused is True else fused)
    calls = stand_in_attention(monkeypatch)
    inner = _ffi.call

    def fake(target, results, *args, out_vma=None, **attrs):
        if target == "pk_ulysses_attn_bwd":
            return _stand_in_fused_bwd(calls, results, *args, **attrs)
        if target != "pk_ulysses_attn":
            return inner(target, results, *args, out_vma=out_vma, **attrs)
        q, k, v, _ = args
        calls.append({"target": target, "hkv": k.shape[2], "scale": float(attrs["scale"]),
                      **{n: int(attrs[n]) for n in ("causal", "num_comm_sms")}})
        k, v = _attention.repeat_kv(q, k, v)
        qh, kh, vh = (jax.lax.all_to_all(x, "sp", 2, 1, tiled=True) for x in (q, k, v))
        out, res = _attention._forward(qh, kh, vh, float(attrs["scale"]), bool(attrs["causal"]))
        o = jax.lax.all_to_all(out, "sp", 1, 2, tiled=True)
        lse = jax.lax.all_to_all(res[4], "sp", 1, 2, tiled=True).transpose(0, 2, 1)
        assert o.shape == results[0].shape and lse.shape == results[1].shape
        return o.astype(results[0].dtype), lse

    monkeypatch.setattr(_ffi, "call", fake)
    return calls


def _without_attention_kernel(monkeypatch) -> None:
    """After the stand-ins: pk_attention's kernel does not run (`_backend.use_kernel` says no
    for it alone), so the fused forward's backward is the reference's."""
    from pk_jax import _backend

    inner = _backend.use_kernel
    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: (
        stem != "attention" and inner(stem, axis_name)))


def _stand_in_fused_bwd(calls, results, do, qh, kh, vh, lse, delta, rank, **attrs):
    """What pk_ulysses_attn_bwd returns, with jax.lax collectives over "sp": dO [B, S/P, H, D]
    and delta float32 [B, H, S/P] to head shards, the blockwise attention backward of the head
    group (qh [B, S, H/P, D], kh, vh with the K/V heads the call passes, lse float32
    [B, H/P, S] padded to whole 128-row tiles), dq, dk, dv back to sequence shards. Appends
    {"target", "h", "hkv", "s", "sp", "scale", "causal", "num_comm_sms"} to `calls`."""
    b, s, g, d = qh.shape
    gk = kh.shape[2]
    scale, causal = float(attrs["scale"]), bool(attrs["causal"])
    calls.append({"target": "pk_ulysses_attn_bwd", "h": g, "hkv": gk, "s": s,
                  "sp": lse.shape[2], "scale": scale,
                  **{n: int(attrs[n]) for n in ("causal", "num_comm_sms", "comm_id")}})
    assert do.dtype == qh.dtype == kh.dtype == vh.dtype
    assert lse.dtype == delta.dtype == jnp.float32 and rank.shape == (1,)
    assert lse.shape == (b, g, -(-s // 128) * 128), lse.shape
    assert delta.shape == (b, do.shape[2], do.shape[1]) and do.shape[2] == g * s // do.shape[1]
    doh = jax.lax.all_to_all(do, "sp", 2, 1, tiled=True)
    dlh = jax.lax.all_to_all(delta, "sp", 1, 2, tiled=True)  # [B, H/P, S]
    kr, vr = _attention.repeat_kv(qh, kh, vh)
    dq, dk, dv = _attention.blockwise_grads(
        qh, kr, vr, doh.astype(jnp.float32), lse[:, :, :s].transpose(0, 2, 1),
        dlh.transpose(0, 2, 1), scale=scale, causal=causal)
    # The padded lse rows must be +inf (the kernel's padded rows then get P = 0): NaN if not.
    dq = jnp.where(jnp.all(lse[:, :, s:] == jnp.inf), dq, jnp.nan)
    dk, dv = (x.reshape(b, s, gk, g // gk, d).sum(axis=3) for x in (dk, dv))
    out = [jax.lax.all_to_all(x, "sp", 1, 2, tiled=True).astype(r.dtype)
           for x, r in zip((dq, dk, dv), results)]
    assert all(x.shape == r.shape for x, r in zip(out, results)), (out, results)
    return out


@pytest.mark.parametrize("p,causal,hkv,backward", [
    (2, True, 2, True), (4, False, 4, True), (2, False, 1, True), (4, True, 2, True),
    (4, True, 2, False), (2, False, 1, False)])
def test_fused_kernel_wiring_forward_and_backward(monkeypatch, p, causal, hkv, backward):
    """At P > 1 with bf16 and D = 64 the call takes pk_ulysses_attn (K/V heads passed as they
    are when P divides them, else repeated up to lcm(Hkv, P)); its output and the backward on
    its (out, lse), kernel-backed (pk_attention's backward on head shards) or the reference's
    (where pk_attention's kernel does not run), match the reference's."""
    from pk_jax.ops import ulysses_attn

    calls = _stand_in_ulysses(monkeypatch)
    if not backward:
        _without_attention_kernel(monkeypatch)
    mesh = cpu_mesh((p,), ("sp",))
    h = 4 * p
    q = normal((2, 3 * p, h, 64), jnp.bfloat16, 0)
    k, v = (normal((2, 3 * p, hkv, 64), jnp.bfloat16, i) for i in (1, 2))
    dy = normal(q.shape, jnp.bfloat16, 3)

    def ref(q, k, v):
        kr, vr = _attention.repeat_kv(q, k, v)
        return ulysses_attn.reference(q, kr, vr, "sp", causal=causal, scale=0.125)

    ours, want = vjp_both(lambda *x: pk.ulysses_attention(*x, "sp", causal=causal), ref, mesh,
                          (SEQ,) * 3, SEQ, (q, k, v), dy)
    np.testing.assert_allclose(np.asarray(ours[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)
    # The gradients against float32 ones (the bf16 reference sums the repeated heads' dK/dV
    # in bf16, which cancels badly), at the ring backward's tolerance.
    for g, w in zip(ours[1:], _dense_gqa_grads(q, k, v, dy, causal)):
        big = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=1.5e-2, atol=1.5e-2 * big)
    fused = [c for c in calls if c["target"] == "pk_ulysses_attn"]
    lcm = hkv * p // np.gcd(hkv, p)
    assert fused and all(c["hkv"] == lcm for c in fused), fused
    assert all(c["causal"] == int(causal) and c["scale"] == 0.125 and
               c["num_comm_sms"] == ulysses_attn.FWD_COMM_SMS for c in fused), fused
    assert not [c for c in calls if c["target"] == "pk_attention" and not c["backward"]]
    bwd = [c for c in calls if c["target"] == "pk_attention"]
    if not backward:
        assert not bwd, bwd
        return
    # One head group per rank: H/P query heads and lcm/P K/V heads over the whole sequence.
    assert bwd and all(c["h"] == h // p and c["hkv"] == lcm // p and c["s"] == 3 * p and
                       c["sp"] == 128 and c["causal"] == int(causal) and c["scale"] == 0.125
                       for c in bwd), bwd


@pytest.mark.parametrize("p,h,hkv,dtype,d,causal", [
    (2, 4, 2, jnp.float16, 128, True), (4, 8, 1, jnp.bfloat16, 64, False),
    (4, 4, 4, jnp.float16, 64, True), (2, 6, 3, jnp.bfloat16, 128, False)])
def test_kernel_backward_matches_the_reference_backward(monkeypatch, p, h, hkv, dtype, d,
                                                        causal):
    """The kernel-backed backward (stand-ins) against the reference backward on the same
    forward, both in the operands' dtype: equal to a few ulps (shapes, GQA with Hkv that P
    divides or not (3 heads at P = 2: lcm 6), fp16/bf16, D 64/128, S/P = 130, past one
    128-row tile); the gradients come back in the operands' shapes and dtypes."""
    _stand_in_ulysses(monkeypatch)
    mesh = cpu_mesh((p,), ("sp",))
    q = normal((1, 130 * p, h, d), dtype, 0)
    k, v = (normal((1, 130 * p, hkv, d), dtype, i) for i in (1, 2))
    dy = normal(q.shape, dtype, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=causal, scale=0.1)
    got = vjp_both(f, f, mesh, (SEQ,) * 3, SEQ, (q, k, v), dy)[0][1:]
    _without_attention_kernel(monkeypatch)
    want = vjp_both(f, f, mesh, (SEQ,) * 3, SEQ, (q, k, v), dy)[0][1:]
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=2e-2 if dtype == jnp.bfloat16 else 4e-3)


def test_kernel_backward_typing_on_2d_mesh_with_q_replicated_over_dp(monkeypatch):
    """The kernel-backed backward's cotangents carry their primals' varying axes (dq summed
    over dp, where q is replicated) and equal the reference backward's."""
    _stand_in_ulysses(monkeypatch)
    mesh = cpu_mesh((2, 2), ("dp", "sp"))
    q = normal((2, 2 * 64, 4, 64), jnp.bfloat16, 0)
    k, v = (normal((4, 2 * 64, 2, 64), jnp.bfloat16, i) for i in (1, 2))
    dy = normal((4, 2 * 64, 4, 64), jnp.bfloat16, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=True)
    specs = (P(None, "sp"), P("dp", "sp"), P("dp", "sp"))
    got = vjp_both(f, f, mesh, specs, P("dp", "sp"), (q, k, v), dy)[0][1:]
    _without_attention_kernel(monkeypatch)
    want = vjp_both(f, f, mesh, specs, P("dp", "sp"), (q, k, v), dy)[0][1:]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=3e-2)


def _causal_on_two():
    """pk.ulysses_attention(causal=True) under shard_map on 2 CPU devices (pk.init done), and
    its sequence-sharded bf16 q, k, v [1, 128, 4, 64]."""
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh)
    qkv_ = tuple(jax.device_put(x, NamedSharding(mesh, SEQ))
                 for x in qkv((1, 2 * 64, 4, 64), jnp.bfloat16))
    f = jax.shard_map(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp", causal=True),
                      mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
    return f, qkv_


def test_kernel_backward_exchanges(monkeypatch):
    """The kernel-backed backward's traffic: pk.all_to_all of q, dO, k, v and of (lse, delta)
    to head shards, one pk_attention backward, pk.all_to_all of dq, dk, dv back (8
    all_to_alls); the forward is the one pk_ulysses_attn call."""
    calls = _stand_in_ulysses(monkeypatch)
    f, (q, k, v) = _causal_on_two()
    jax.make_jaxpr(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32)),
                            argnums=(0, 1, 2)))(q, k, v)
    targets = [c["target"] for c in calls]
    assert sorted(set(targets)) == ["pk_all_to_all", "pk_attention", "pk_ulysses_attn"], targets
    assert targets.count("pk_ulysses_attn") == 1 and targets.count("pk_attention") == 1
    assert targets.count("pk_all_to_all") == 8, targets


@pytest.mark.needs_ext  # the workspace need is the extension's (ffi/launch.h)
def test_fused_kernel_takes_what_it_compiles(monkeypatch):
    """bf16/fp16, head dims 64/128, P > 1; anything else runs the reference. The workspace
    need is the kernel's layout; too small a workspace is a trace-time ValueError naming
    workspace_bytes."""
    from pk_jax.ops import ulysses_attn

    bf = jax.ShapeDtypeStruct((1, 130, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 130, 2, 128), jnp.bfloat16)
    assert ulysses_attn.kernel_supports(bf, 2)
    assert not ulysses_attn.kernel_supports(bf, 1)
    assert not ulysses_attn.kernel_supports(jax.ShapeDtypeStruct((1, 130, 4, 128), jnp.float32),
                                            4)
    assert not ulysses_attn.kernel_supports(jax.ShapeDtypeStruct((1, 130, 4, 96), jnp.float16),
                                            4)
    up = lambda x: -(-x // 1024) * 1024
    qb, kb = 130 * 4 * 128 * 2, 130 * 2 * 128 * 2
    assert ulysses_attn.workspace_need(bf, kv, 2) == up(
        up(up(up(up(qb) + kb) + kb) + qb) + 4 * 130 * 4)

    calls = _stand_in_ulysses(monkeypatch)
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh, workspace_bytes=1 << 16)
    q, k, v = qkv((1, 2 * 256, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pk.ulysses_attention: .*workspace_bytes="):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (SEQ,) * 3, SEQ, q, k, v,
            init=False)
    assert not [c for c in calls if c["target"] == "pk_ulysses_attn"]


def _vjp_against_reference(p, causal, h, hkv, dtype, d, sl):
    """pk.ulysses_attention's output and gradients, and the reference's (K/V heads repeated),
    at world p, S/P = sl, B = 2, with random q, k, v and dy: (ours, want, (q, k, v, dy))."""
    from pk_jax.ops import ulysses_attn

    mesh = cpu_mesh((p,), ("sp",))
    q = normal((2, sl * p, h, d), dtype, 0)
    k, v = (normal((2, sl * p, hkv, d), dtype, i) for i in (1, 2))
    dy = normal(q.shape, dtype, 3)

    def ref(q, k, v):
        kr, vr = _attention.repeat_kv(q, k, v)
        return ulysses_attn.reference(q, kr, vr, "sp", causal=causal, scale=d ** -0.5)

    ours, want = vjp_both(lambda *x: pk.ulysses_attention(*x, "sp", causal=causal), ref, mesh,
                          (SEQ,) * 3, SEQ, (q, k, v), dy)
    return ours, want, (q, k, v, dy)


# The default on GPUs: the composed kernels.

@pytest.mark.parametrize("p,causal,h,hkv,dtype,d", [
    (2, True, 8, 2, jnp.bfloat16, 64), (4, False, 16, 4, jnp.bfloat16, 64),
    (2, False, 8, 1, jnp.float16, 128), (4, True, 8, 2, jnp.bfloat16, 128),
    (4, True, 12, 6, jnp.float16, 64)])
def test_composed_wiring_forward_and_backward(monkeypatch, p, causal, h, hkv, dtype, d):
    """By default (PK_JAX_ULYSSES_FUSED unset) the kernel path is pk.all_to_all of q, k, v,
    one pk_attention forward on the head group [B, S, H/P, D] (K/V heads as they are when P
    divides them, else repeated up to lcm(Hkv, P): Hkv 1, 2, 6 at P = 2, 4, 4), all_to_all
    back, and no pk_ulysses_attn; the output matches the reference's and the gradients (the
    pk_attention backward on the saved head shards) the float32 ones."""

    calls = _stand_in_ulysses(monkeypatch, fused=False)
    ours, want, (q, k, v, dy) = _vjp_against_reference(p, causal, h, hkv, dtype, d, 3)
    assert ours[0].shape == q.shape and ours[0].dtype == dtype
    assert_close(ours[0], want[0], dtype)
    for g, w, x in zip(ours[1:], _dense_gqa_grads(q, k, v, dy, causal), (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        big = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=1.5e-2, atol=1.5e-2 * big)
    lcm = hkv * p // np.gcd(hkv, p)
    assert not [c for c in calls if c["target"] == "pk_ulysses_attn"], calls
    att = [c for c in calls if c["target"] == "pk_attention"]
    assert [c["backward"] for c in att] == [0, 1], att
    assert all(c["h"] == h // p and c["hkv"] == lcm // p and c["s"] == 3 * p and
               c["causal"] == int(causal) and c["scale"] == np.float32(d ** -0.5) for c in att), att
    assert att[1]["sp"] == 128


def test_composed_exchanges(monkeypatch):
    """The composed path's traffic: forward pk.all_to_all of q, k, v and the output (4) around
    one pk_attention forward; the backward exchanges only dO to head shards and dq, dk, dv back
    (4 more) around one pk_attention backward."""
    calls = _stand_in_ulysses(monkeypatch, fused=False)
    f, (q, k, v) = _causal_on_two()
    jax.make_jaxpr(f)(q, k, v)
    targets = [c["target"] for c in calls]
    assert targets.count("pk_all_to_all") == 4 and targets.count("pk_attention") == 1, targets
    assert "pk_ulysses_attn" not in targets
    calls.clear()
    jax.make_jaxpr(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32)),
                            argnums=(0, 1, 2)))(q, k, v)
    targets = [c["target"] for c in calls]
    assert sorted(set(targets)) == ["pk_all_to_all", "pk_attention"], targets
    assert [c["backward"] for c in calls if c["target"] == "pk_attention"] == [0, 1]
    assert targets.count("pk_all_to_all") == 8, targets


def _vjp_by_setting(monkeypatch, p, h, hkv, dtype, d, causal, modes):
    """pk.ulysses_attention's output and gradients at S/P = 130, B = 1 (random q, k, v, dy,
    scale 0.1) with the stand-in kernels under each PK_JAX_ULYSSES_FUSED mode (`fused` of
    _stand_in_ulysses): ({mode: (results, calls)}, (q, k, v))."""
    mesh = cpu_mesh((p,), ("sp",))
    q = normal((1, 130 * p, h, d), dtype, 0)
    k, v = (normal((1, 130 * p, hkv, d), dtype, i) for i in (1, 2))
    dy = normal(q.shape, dtype, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=causal, scale=0.1)
    runs = {}
    for mode in modes:
        pk.shutdown()
        calls = _stand_in_ulysses(monkeypatch, fused=mode)
        runs[mode] = (vjp_both(f, f, mesh, (SEQ,) * 3, SEQ, (q, k, v), dy)[0], calls)
    return runs, (q, k, v)


@pytest.mark.parametrize("p,h,hkv,dtype,d,causal", [
    (2, 4, 2, jnp.float16, 128, True), (4, 8, 1, jnp.bfloat16, 64, False),
    (2, 6, 3, jnp.bfloat16, 128, True)])
def test_composed_equals_fused_forward_and_backward(monkeypatch, p, h, hkv, dtype, d, causal):
    """The composed path and the fused switch (PK_JAX_ULYSSES_FUSED=1, stand-in kernel) give
    the same output and gradients: both backwards run the pk_attention backward on the same
    head shards and lse (the composed one from its saved head shards, the fused one after
    exchanging q, dO, k, v, lse and delta), S/P = 130 (past one 128-row tile)."""
    runs, (q, k, v) = _vjp_by_setting(monkeypatch, p, h, hkv, dtype, d, causal, (False, True))
    results = {}
    for fused, (results[fused], calls) in runs.items():
        targets = {c["target"] for c in calls}
        assert ("pk_ulysses_attn" in targets) == fused, targets
        kinds = [c["backward"] for c in calls if c["target"] == "pk_attention"]
        assert kinds.count(0) == (0 if fused else 2) and kinds.count(1) == 2, kinds
    for g, w, x in zip(results[False], results[True], (q, q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2 if dtype == jnp.bfloat16 else 2e-3)


def test_composed_typing_on_2d_mesh_with_q_replicated_over_dp(monkeypatch):
    """The composed backward's cotangents carry their primals' varying axes (dq summed over
    dp, where q is replicated: the backward keeps empty slices of q, k, v for that) and match
    the reference's."""
    from pk_jax.ops import ulysses_attn

    calls = _stand_in_ulysses(monkeypatch, fused=False)
    mesh = cpu_mesh((2, 2), ("dp", "sp"))
    q = normal((2, 2 * 64, 4, 64), jnp.bfloat16, 0)
    k, v = (normal((4, 2 * 64, 4, 64), jnp.bfloat16, i) for i in (1, 2))
    dy = normal((4, 2 * 64, 4, 64), jnp.bfloat16, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=True)
    ref = lambda *x: ulysses_attn.reference(*x, "sp", causal=True, scale=0.125)
    specs = (P(None, "sp"), P("dp", "sp"), P("dp", "sp"))
    ours, want = vjp_both(f, ref, mesh, specs, P("dp", "sp"), (q, k, v), dy)
    for g, w in zip(ours, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=3e-2)
    assert [c["backward"] for c in calls if c["target"] == "pk_attention"] == [0, 1]


# PK_JAX_ULYSSES_FUSED=bwd: the composed forward, the fused backward (pk_ulysses_attn_bwd).

@pytest.mark.parametrize("p,causal,h,hkv,dtype,d,sl", [
    (2, True, 8, 2, jnp.bfloat16, 64, 3), (4, False, 16, 4, jnp.bfloat16, 64, 3),
    (2, False, 8, 1, jnp.float16, 128, 3), (4, True, 8, 2, jnp.bfloat16, 128, 130),
    (4, True, 12, 6, jnp.float16, 64, 3), (2, True, 6, 3, jnp.bfloat16, 128, 130)])
def test_fused_bwd_wiring_forward_and_backward(monkeypatch, p, causal, h, hkv, dtype, d, sl):
    """With PK_JAX_ULYSSES_FUSED=bwd the forward is the composed one (one pk_attention forward
    on the head group, no pk_ulysses_attn) and the backward one pk_ulysses_attn_bwd call on
    the saved head shards (K/V heads repeated up to lcm(Hkv, P) where P does not divide them:
    Hkv 1, 2, 6, 3 at P = 2, 4, 4, 2), lse padded to whole 128-row tiles with +inf, delta on the
    local rows, no pk_attention backward; output and gradients match the reference's and the
    float32 ones (S/P 3 and 130: past one 128-row tile)."""
    from pk_jax.ops import ulysses_attn

    calls = _stand_in_ulysses(monkeypatch, fused="bwd")
    ours, want, (q, k, v, dy) = _vjp_against_reference(p, causal, h, hkv, dtype, d, sl)
    assert_close(ours[0], want[0], dtype)
    for g, w in zip(ours[1:], _dense_gqa_grads(q, k, v, dy, causal)):
        big = max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=1.5e-2, atol=1.5e-2 * big)
    lcm = hkv * p // np.gcd(hkv, p)
    assert not [c for c in calls if c["target"] == "pk_ulysses_attn"], calls
    assert [c["backward"] for c in calls if c["target"] == "pk_attention"] == [0], calls
    bwd = [c for c in calls if c["target"] == "pk_ulysses_attn_bwd"]
    assert len(bwd) == 1, calls
    assert bwd[0] == {"target": "pk_ulysses_attn_bwd", "h": h // p, "hkv": lcm // p,
                      "s": sl * p, "sp": -(-sl * p // 128) * 128,
                      "scale": np.float32(d ** -0.5), "causal": int(causal),
                      "num_comm_sms": ulysses_attn.NUM_COMM_SMS,
                      "comm_id": pk.runtime.state.comm_id("sp")}, bwd


def test_fused_bwd_exchanges(monkeypatch):
    """The fused backward's traffic: the forward's 4 pk.all_to_alls around one pk_attention
    forward, then one pk_ulysses_attn_bwd call and no other collective (it moves dO, delta and
    the gradients itself)."""
    calls = _stand_in_ulysses(monkeypatch, fused="bwd")
    f, (q, k, v) = _causal_on_two()
    jax.make_jaxpr(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32)),
                            argnums=(0, 1, 2)))(q, k, v)
    targets = [c["target"] for c in calls]
    assert targets == ["pk_all_to_all"] * 3 + ["pk_attention", "pk_all_to_all",
                                               "pk_ulysses_attn_bwd"], targets


@pytest.mark.parametrize("p,h,hkv,dtype,d,causal", [
    (2, 4, 2, jnp.float16, 128, True), (4, 8, 1, jnp.bfloat16, 64, False)])
def test_fused_bwd_equals_composed(monkeypatch, p, h, hkv, dtype, d, causal):
    """PK_JAX_ULYSSES_FUSED=bwd and the default give the same output (the same forward) and
    gradients (the same attention backward on the same head shards; delta from the
    sequence-sharded output instead of the head-sharded one), S/P = 130."""
    runs, _ = _vjp_by_setting(monkeypatch, p, h, hkv, dtype, d, causal, (False, "bwd"))
    results = {}
    for mode, (results[mode], calls) in runs.items():
        assert ("pk_ulysses_attn_bwd" in {c["target"] for c in calls}) == (mode == "bwd")
    np.testing.assert_array_equal(np.asarray(results[False][0], np.float32),
                                  np.asarray(results["bwd"][0], np.float32))
    for g, w in zip(results[False][1:], results["bwd"][1:]):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2 if dtype == jnp.bfloat16 else 2e-3)


def test_fused_bwd_typing_on_2d_mesh_with_q_replicated_over_dp(monkeypatch):
    """The fused backward's cotangents carry their primals' varying axes (dq summed over dp,
    where q is replicated) and match the reference's."""
    from pk_jax.ops import ulysses_attn

    calls = _stand_in_ulysses(monkeypatch, fused="bwd")
    mesh = cpu_mesh((2, 2), ("dp", "sp"))
    q = normal((2, 2 * 64, 4, 64), jnp.bfloat16, 0)
    k, v = (normal((4, 2 * 64, 2, 64), jnp.bfloat16, i) for i in (1, 2))
    dy = normal((4, 2 * 64, 4, 64), jnp.bfloat16, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=True)

    def ref(q, k, v):
        kr, vr = _attention.repeat_kv(q, k, v)
        return ulysses_attn.reference(q, kr, vr, "sp", causal=True, scale=0.125)

    specs = (P(None, "sp"), P("dp", "sp"), P("dp", "sp"))
    ours, want = vjp_both(f, ref, mesh, specs, P("dp", "sp"), (q, k, v), dy)
    for g, w in zip(ours, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=3e-2)
    assert [c["target"] for c in calls if "all_to_all" not in c["target"]] == [
        "pk_attention", "pk_ulysses_attn_bwd"], calls


@pytest.mark.needs_ext  # the workspace need is the extension's (ffi/launch.h)
def test_fused_bwd_takes_what_it_compiles(monkeypatch):
    """The fused backward's workspace need is its kernel's layout; too small a workspace is a
    ValueError naming workspace_bytes when the forward is traced (no gradient asked for);
    where pk_ulysses_attn_bwd does not take the operands (kernel_supports) the backward stays
    composed."""
    from pk_jax.ops import ulysses_attn

    q = jax.ShapeDtypeStruct((2, 130, 8, 128), jnp.bfloat16)
    kr = jax.ShapeDtypeStruct((2, 130, 4, 128), jnp.bfloat16)
    up = lambda x: -(-x // 1024) * 1024
    qb, kb, stats = 2 * 130 * 8 * 128 * 2, 2 * 130 * 4 * 128 * 2, 2 * 2 * 640 * 4
    assert ulysses_attn.fused_bwd_workspace_need(q, kr, 4) == up(
        up(up(up(up(qb) + stats) + 2 * qb) + kb) + kb)

    calls = _stand_in_ulysses(monkeypatch, fused="bwd")
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh, workspace_bytes=1 << 16)
    q, k, v = qkv((1, 2 * 256, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="pk.ulysses_attention: .*backward.*workspace_bytes="):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (SEQ,) * 3, SEQ, q, k, v,
            init=False)
    assert not calls

    pk.shutdown()
    monkeypatch.setattr(ulysses_attn, "kernel_supports", lambda q, p: False)
    f, (q, k, v) = _causal_on_two()
    jax.make_jaxpr(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32)),
                            argnums=(0, 1, 2)))(q, k, v)
    assert [c["backward"] for c in calls if c["target"] == "pk_attention"] == [0, 1], calls
    assert "pk_ulysses_attn_bwd" not in [c["target"] for c in calls]


@pytest.mark.parametrize("causal", (False, True))
def test_fused_bwd_setting_without_kernels_runs_the_reference(monkeypatch, causal):
    """On CPU (no kernels) PK_JAX_ULYSSES_FUSED=bwd changes nothing: the reference runs, with
    the same output and gradients as dense attention, and the program calls no pk kernel."""
    monkeypatch.setenv("PK_JAX_ULYSSES_FUSED", "bwd")
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 3)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 4)
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh)
    q, k, v = qkv((2, 5 * 2, 4, 4), jnp.float32)
    w = normal(q.shape, np.float32, 9)
    f = _sharded(mesh, pk.ulysses_attention, SEQ, causal=causal)
    assert_close(f(q, k, v), dense(q, k, v, causal=causal))
    loss = lambda *x: jnp.sum(f(*x) * w)
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, h in zip(got, dense_grads(q, k, v, w, causal=causal)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert not ffi_calls(jaxpr)
    assert cost_model.overlap_override("ulysses_attn_bwd") == "fused"
    assert cost_model.overlap_override("ulysses_attn") == "serial"


def test_fused_setting_values(monkeypatch):
    """PK_JAX_ULYSSES_FUSED is read at pk.init ("bwd" as given, case and spaces aside); 0 or
    unset, 1 and bwd are its values, anything else a ValueError naming them at trace time."""
    from pk_jax.runtime import state

    mesh = cpu_mesh((2,), ("sp",))
    x = np.zeros((1, 4, 2, 8), np.float32)
    for value, want in (("bwd", "bwd"), (" BWD ", "bwd"), ("", "auto"), ("0", "0"), ("1", "1")):
        monkeypatch.setenv("PK_JAX_ULYSSES_FUSED", value)
        pk.init(mesh)
        assert state.settings().ulysses_fused == want
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (SEQ,) * 3, SEQ, x, x, x,
            init=False)
        pk.shutdown()
    monkeypatch.setenv("PK_JAX_ULYSSES_FUSED", "fwd")
    with pytest.raises(ValueError, match="pk.ulysses_attention: PK_JAX_ULYSSES_FUSED='fwd' is "
                                         "not one of auto, 0, 1, bwd"):
        run(lambda a, b, c: pk.ulysses_attention(a, b, c, "sp"), mesh, (SEQ,) * 3, SEQ, x, x, x)


def test_paths_come_from_route(monkeypatch):
    """The forward's path, from _backend.route at trace time: "local" at P = 1 where the
    pk.attention kernels take q, k, v (bf16/fp16, D 64/128), "composed" by default where they
    take the head group (P > 1; the decider picks serial at this small shape), "fused" with
    PK_JAX_ULYSSES_FUSED=1 where pk_ulysses_attn takes the operands (P > 1), "reference"
    otherwise; the variable is fixed at pk.init (a change after it is a ValueError at trace
    time)."""
    from pk_jax.ops import ulysses_attn

    calls = _stand_in_ulysses(monkeypatch, fused=False)

    def path(p, dtype=jnp.bfloat16, d=128):  # the path the op takes, from its FFI calls
        mesh = cpu_mesh((p,), ("sp",))
        pk.init(mesh)
        calls.clear()
        got = []

        def body(x):
            if p == 1:  # the op's P = 1 choice (the stand-ins have no 1-rank all_to_all)
                got.append(_attention_op.p1_path(x, x, x, "sp"))
                return x
            return pk.ulysses_attention(x, x, x, "sp")

        f = jax.shard_map(body, mesh=mesh, in_specs=SEQ, out_specs=SEQ)
        jax.make_jaxpr(f)(jax.device_put(np.zeros((1, 260, 4, d), dtype),
                                         NamedSharding(mesh, SEQ)))
        if got:
            return got[0]
        targets = {c["target"] for c in calls}
        if "pk_ulysses_attn" in targets:
            return "fused"
        return "composed" if "pk_attention" in targets else "reference"

    assert path(2) == "composed" and path(2, jnp.float16, 64) == "composed"
    assert path(1) == "local" and path(1, jnp.float16, 64) == "local"
    assert path(1, jnp.float32) == "reference" and path(1, jnp.bfloat16, 96) == "reference"
    assert path(2, jnp.float32) == "reference" and path(2, jnp.float16, 96) == "reference"
    monkeypatch.setenv(ulysses_attn.FUSED_ENV, "1")
    with pytest.raises(ValueError, match="PK_JAX_ULYSSES_FUSED='1' .*changed after pk.init"):
        jax.make_jaxpr(jax.shard_map(lambda x: pk.ulysses_attention(x, x, x, "sp"),
                                     mesh=state.mesh_or_none(), in_specs=SEQ, out_specs=SEQ))(
            jax.device_put(np.zeros((1, 260, 4, 128), jnp.bfloat16),
                           NamedSharding(state.mesh_or_none(), SEQ)))
    pk.shutdown()
    assert path(2) == "fused" and path(1) == "local" and path(2, jnp.float32) == "reference"
    pk.shutdown()
    monkeypatch.setenv(ulysses_attn.FUSED_ENV, "bwd")  # the composed forward; fused backward
    assert path(2) == "composed" and path(1) == "local" and path(2, jnp.float32) == "reference"


# ---------------------------------------------------------------------------------------------
# Masks (segment ids, local_window_size, logits_soft_cap, query/key_value_seq_lengths) after the
# all-to-all, against masks.dense_masked (float64 numpy), P = 2, 4.

ULYSSES = [(2, "segments+causal", 7), (2, "all", 5), (4, "window+causal", 3),
           (4, "softcap+segments+causal", 5), (4, "lengths", 4)]


@pytest.mark.parametrize("p,name,sl", ULYSSES)
def test_ulysses_masks_match_dense(monkeypatch, p, name, sl):
    """As test_ring_attn's mask test: the masks apply after the all-to-all, over the whole
    sequence of the head group (H = 2P query heads, P K/V heads)."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 3)
    b, s = 2, sl * p
    q, k, v, w = randn((b, s, 2 * p, 8), p), randn((b, s, p, 8), p + 1), \
        randn((b, s, p, 8), p + 2), randn((b, s, 2 * p, 8), p + 3)
    case = dict(CASES[name])
    for n in ("q_len", "kv_len"):
        if n in case:
            case[n] = (s - 2, s // 2 + 1)
    kw = mask_args(case, b, s, seed=p + 20)
    if "segment_ids" in kw:
        assert crosses_chunks(kw["segment_ids"], sl)
    got = sharded_run(pk.ulysses_attention, p, q, k, v, w, kw)
    check_close(got, dense_for(q, k, v, w, kw), atol=3e-5)


def test_ulysses_mask_errors():
    check_sharded_mask_errors(pk.ulysses_attention)


@pytest.mark.parametrize("p", (1, 2))
def test_masked_ulysses_routing_with_kernels_available(monkeypatch, p):
    """With the kernels forced: unmasked calls trace to attention kernels (pk.attention's at
    P = 1, the composed or fused ones at P = 2); masked ones to pk.attention's masked kernels
    at P = 1, to none at P = 2 (the reference)."""
    check_masked_sp_routing(monkeypatch, "ulysses", p)


# P = 1 (a 1-device axis): the pk.attention kernels (the "local" path).

@pytest.mark.parametrize("causal,h,hkv,d,dtype,fused", [
    (False, 4, 4, 64, jnp.bfloat16, False), (True, 8, 2, 128, jnp.float16, False),
    (True, 4, 1, 64, jnp.bfloat16, True), (False, 6, 3, 128, jnp.bfloat16, False)])
def test_p1_runs_pk_attention(monkeypatch, causal, h, hkv, d, dtype, fused):
    """At P = 1 with the kernels available (forced here; the CPU has none), with or without
    PK_JAX_ULYSSES_FUSED=1, Ulysses attention is pk.attention: its route is "local", and
    the gradient traces to one pk_attention forward on q, k, v as given (K/V heads in place,
    the causal flag, the scale) and one pk_attention backward; no all_to_all."""
    from pk_jax import _backend

    if fused:
        monkeypatch.setenv("PK_JAX_ULYSSES_FUSED", "1")
    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    jaxpr = check_p1_kernel_calls(monkeypatch, pk.ulysses_attention, (h, hkv, d), dtype, causal)
    assert "all_to_all" not in str(jaxpr)


@pytest.mark.parametrize("dtype,d", [(jnp.float32, 64), (jnp.bfloat16, 96)])
def test_p1_keeps_the_reference_where_pk_attention_does_not_run(monkeypatch, dtype, d):
    """fp32 operands and head dims other than 64/128 at P = 1 keep the reference, even with
    the kernels available."""
    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    jaxpr, paths = traced_p1(monkeypatch, pk.ulysses_attention, cpu_mesh((1,), ("sp",)),
                             [(1, 8, 2, d)] * 3, dtype, causal=True)
    assert paths == ["reference"]
    assert "pk_attention" not in [e.params["target_name"] for e in ffi_calls(jaxpr)]


@pytest.mark.parametrize("causal,dtype", [(False, jnp.bfloat16), (True, jnp.float16)])
def test_p1_local_matches_the_reference(monkeypatch, causal, dtype):
    """The local path's wiring with jax.lax stand-ins for the pk_attention calls, on a (dp 2,
    sp 1) mesh with q replicated over dp (dq summed over dp): output and gradients match the
    reference's in the same dtype, and every cotangent varies like its primal (vjp_both);
    GQA 4:2, S = 130 (past one 128-row tile), scale 0.1."""
    calls = _stand_in_ulysses(monkeypatch, fused=False)
    mesh = cpu_mesh((2, 1), ("dp", "sp"))
    q = normal((2, 130, 4, 64), dtype, 0)
    k, v = (normal((4, 130, 2, 64), dtype, i) for i in (1, 2))
    dy = normal((4, 130, 4, 64), dtype, 3)
    f = lambda *x: pk.ulysses_attention(*x, "sp", causal=causal, scale=0.1)

    def ref(q, k, v):  # the reference's attention (its all_to_alls are the identity at P = 1)
        kr, vr = _attention.repeat_kv(q, k, v)
        return _attention.attention(q, kr, vr, causal=causal, scale=0.1)

    specs = (P(None, "sp"), P("dp", "sp"), P("dp", "sp"))
    ours, want = vjp_both(f, ref, mesh, specs, P("dp", "sp"), (q, k, v), dy)
    for g, w in zip(ours, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=3e-2 if dtype == jnp.bfloat16 else 4e-3)
    assert [c["target"] for c in calls] == ["pk_attention"] * 2, calls
    assert [c["backward"] for c in calls] == [0, 1], calls
    assert all(c["h"] == 4 and c["hkv"] == 2 and c["s"] == 130 and c["causal"] == causal
               and np.isclose(c["scale"], 0.1) for c in calls), calls


# GPU tests (marker gpu): Ulysses attention over a 1-device axis of the H200 runs the
# pk.attention kernels; the checks of tests/test_ring_attn.py's GPU tests (the program's only pk
# custom calls are pk_attention, no collective; poisoned outputs, two calls; the output bit for
# bit pk.attention's; output and gradients within twice XLA's error of a float32 reference).

@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_P1, ids=gpu_id)
def test_gpu_p1_forward(case):
    check_p1_forward(pk.ulysses_attention, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_P1_GRAD, ids=gpu_id)
def test_gpu_p1_grads(case):
    check_p1_grads(pk.ulysses_attention, case)

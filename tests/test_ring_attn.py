"""pk.ring_attention on host devices against dense softmax attention over the whole sequence:
P in {1,2,3,4,8}, causal or not, every dtype, odd local lengths, B > 1, a 2-D mesh, blocks of
keys smaller than the local length, gradients, and the error messages; the masks at P = 2, 4, 8
in both layouts (segments crossing chunks) against a float64 numpy reference (tests/masks.py),
and that a masked call takes no attention kernel; at P = 1 with the kernels forced, the choice
of the pk.attention kernels and (with jax.lax stand-ins for them) its wiring; on an H200 (marker
gpu) P = 1 against pk.attention and a float32 reference."""

import functools
import re

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
    dense_masked,
    mask_args,
    packed_ids,
    randn,
    sharded_run,
)
from util import (
    FLOAT_DTYPES,
    WORLD_SIZES,
    P,
    assert_close,
    assert_same,
    cpu_mesh,
    poison,
    product,
    run,
    stand_in_attention,
    vjp_both,
)

import pk_jax as pk
from pk_jax.ops import _attention

SEQ = P(None, "sp")


def dense(q, k, v, *, causal, scale=None):
    """Softmax attention over the full sequence in float64 numpy, [B, S, H, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", e / e.sum(axis=-1, keepdims=True), v)


@functools.partial(jax.jit, static_argnames="causal")
def dense_grads(q, k, v, w, *, causal):
    """d/d(q, k, v) of sum(dense attention * w), float32 jnp on the full sequence."""
    def loss(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(q.shape[-1])
        if causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")
        return jnp.sum(o * w)
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def normal(shape, dtype, seed):
    # numpy, not jax.random: no eager compilation for every new shape.
    return np.random.default_rng(seed).standard_normal(shape, np.float32).astype(dtype)


def qkv(shape, dtype, seed=0):
    return [normal(shape, dtype, seed + i) for i in range(3)]


def ring(mesh, q, k, v, spec=SEQ, **kw):
    return run(lambda a, b, c: pk.ring_attention(a, b, c, "sp", **kw), mesh, (spec,) * 3, spec,
               q, k, v)


@pytest.mark.parametrize("p,causal", product(WORLD_SIZES, (False, True)))
def test_matches_dense(p, causal):
    q, k, v = qkv((2, 5 * p, 3, 4), jnp.float32)  # odd S/P = 5, B = 2, odd H
    out = ring(cpu_mesh((p,), ("sp",)), q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, dense(q, k, v, causal=causal))


@pytest.mark.parametrize("dtype,causal", product((jnp.bfloat16, jnp.float16), (False, True)))
def test_dtypes(dtype, causal):
    q, k, v = qkv((1, 4 * 7, 2, 8), dtype)
    out = ring(cpu_mesh((4,), ("sp",)), q, k, v, causal=causal)
    assert out.dtype == dtype
    assert_close(out, dense(q, k, v, causal=causal), dtype)


@pytest.mark.parametrize("p,causal", product((1, 3), (False, True)))
def test_tiles_smaller_than_the_shard(monkeypatch, p, causal):
    # S/P = 7 rows in query tiles of 4 and key blocks of 3, the last of each padded, at every
    # ring step (and causally hidden blocks skipped on the diagonal).
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 3)
    q, k, v = qkv((2, 7 * p, 2, 4), jnp.float32)
    assert_close(ring(cpu_mesh((p,), ("sp",)), q, k, v, causal=causal),
                 dense(q, k, v, causal=causal))


@pytest.mark.parametrize("causal", (False, True))
def test_2d_mesh_dp_sp(causal):
    mesh = cpu_mesh((2, 4), ("dp", "sp"))
    q, k, v = qkv((4, 4 * 5, 2, 4), jnp.float32)
    out = ring(mesh, q, k, v, spec=P("dp", "sp"), causal=causal)
    assert_close(out, dense(q, k, v, causal=causal))


@pytest.mark.parametrize("explicit,check_vma", [(False, True), (True, False)])
def test_auto_mesh_and_check_vma_off(explicit, check_vma):
    mesh = cpu_mesh((4,), ("sp",), explicit=explicit)
    q, k, v = qkv((1, 4 * 3, 2, 4), jnp.float32)
    out = run(lambda a, b, c: pk.ring_attention(a, b, c, "sp", causal=True), mesh, (SEQ,) * 3,
              SEQ, q, k, v, check_vma=check_vma)
    assert_close(out, dense(q, k, v, causal=True))


def test_scale():
    q, k, v = qkv((1, 2 * 3, 2, 4), jnp.float32)
    out = ring(cpu_mesh((2,), ("sp",)), q, k, v, causal=True, scale=0.3)
    assert_close(out, dense(q, k, v, causal=True, scale=0.3))


def test_ring_of_ppermutes_never_gathers_kv():
    mesh = cpu_mesh((4,), ("sp",))
    pk.init(mesh)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, SEQ)) for x in qkv((1, 8, 2, 4),
                                                                        jnp.float32))
    f = jax.shard_map(lambda a, b, c: pk.ring_attention(a, b, c, "sp", causal=True), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ)
    text = str(jax.make_jaxpr(f)(q, k, v))
    assert "ppermute" in text
    assert "all_gather" not in text and "all_to_all" not in text and "psum" not in text


def test_core_fully_masked_block_is_a_no_op():
    q, k, v = qkv((1, 3, 2, 4), np.float32)

    def f(q, k, v):
        st = _attention.init_state(q)
        # Keys at positions 10.. come after every query (0..2): the whole block is masked.
        st = _attention.blockwise(st, q, k, v, scale=0.5, causal=True, k_pos0=10)
        hidden = _attention.finalize(st, q.dtype)
        st = _attention.blockwise(st, q, k, v, scale=0.5, causal=True)
        return hidden, _attention.finalize(st, q.dtype)

    hidden, out = jax.jit(f)(q, k, v)
    np.testing.assert_array_equal(np.asarray(hidden), 0)
    assert_close(out, dense(q, k, v, causal=True, scale=0.5))
    grads = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x)[1]), argnums=(0, 1, 2)))(q, k, v)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def _sharded(mesh, fn, spec, **kw):
    f = jax.shard_map(lambda a, b, c: fn(a, b, c, "sp", **kw), mesh=mesh, in_specs=(spec,) * 3,
                      out_specs=spec)
    return jax.jit(lambda *xs: f(*(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)))


@pytest.mark.parametrize("p,causal,explicit", [
    (3, True, True), (4, False, False), pytest.param(8, True, True, marks=pytest.mark.large)])
def test_grad_matches_dense(monkeypatch, p, causal, explicit):
    # S/P = 5: scans over padded tiles of 3 queries by 4 keys.
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 3)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 4)
    mesh = cpu_mesh((p,), ("sp",), explicit=explicit)
    pk.init(mesh)
    q, k, v = qkv((2, 5 * p, 2, 4), jnp.float32)
    w = normal(q.shape, np.float32, 9)
    f = _sharded(mesh, pk.ring_attention, SEQ, causal=causal)
    got = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * w), argnums=(0, 1, 2)))(q, k, v)
    want = dense_grads(q, k, v, w, causal=causal)
    for g, h in zip(got, want):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(h), rtol=1e-4, atol=1e-5)


def dense_in_shard_map(axis, causal):
    """Dense attention inside shard_map: all-gather q, k, v along `axis`, keep own rows."""
    def f(q, k, v):
        qa, ka, va = (jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", qa, ka, precision="highest") / np.sqrt(q.shape[-1])
        if causal:
            s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), va, precision="highest")
        n = q.shape[1]
        return jax.lax.dynamic_slice_in_dim(o, jax.lax.axis_index(axis) * n, n, axis=1)
    return f


@pytest.mark.parametrize("dtype", (jnp.bfloat16,))
def test_grad_low_precision(dtype):
    mesh = cpu_mesh((2,), ("sp",))
    pk.init(mesh)
    q, k, v = qkv((1, 2 * 4, 2, 8), dtype)
    w = normal(q.shape, np.float32, 9)
    f = _sharded(mesh, pk.ring_attention, SEQ, causal=True)
    got = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x).astype(jnp.float32) * w),
                           argnums=(0, 1, 2)))(q, k, v)
    want = dense_grads(*(x.astype(np.float32) for x in (q, k, v)), w, causal=True)
    for g, h in zip(got, want):
        assert g.dtype == dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(h), rtol=5e-2,
                                   atol=5e-2)


@pytest.mark.parametrize("check_vma", (True, False))
def test_vjp_typing_on_2d_mesh_with_q_replicated_over_dp(check_vma):
    # q is shared by the dp replicas while k, v differ: dq must be summed over dp, and every
    # cotangent must vary exactly like its primal (checked inside vjp_both).
    mesh = cpu_mesh((2, 4), ("dp", "sp"))
    q = normal((2, 4 * 3, 2, 4), np.float32, 0)
    k, v, dy = (normal((4, 4 * 3, 2, 4), np.float32, i) for i in (1, 2, 3))
    ours, ref = vjp_both(lambda *x: pk.ring_attention(*x, "sp", causal=True),
                         dense_in_shard_map("sp", True), mesh,
                         (P(None, "sp"), P("dp", "sp"), P("dp", "sp")), P("dp", "sp"),
                         (q, k, v), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_check_grads():
    mesh = cpu_mesh((3,), ("sp",))
    pk.init(mesh)
    f = _sharded(mesh, pk.ring_attention, SEQ, causal=True)
    check_grads(f, qkv((1, 3 * 2, 2, 4), jnp.float32), order=1, modes=["rev"], eps=1e-3,
                atol=1e-2, rtol=1e-2)


BAD = [  # (q shape, k shape, v shape, dtype of v, options, error, message)
    ((4, 2, 8), (4, 2, 8), (4, 2, 8), None, {}, ValueError, "q must have rank 4"),
    ((1, 4, 2, 8), (1, 4, 2, 4), (1, 4, 2, 8), None, {}, ValueError,
     r"k and v must be \[batch, seq_local, kv_heads"),
    ((1, 4, 2, 8),) * 3 + (jnp.float16, {}, TypeError, "q and v must have the same dtype"),
    ((1, 4, 2, 8),) * 3 + (None, {"causal": "yes"}, TypeError, "causal must be a Python bool"),
    ((1, 4, 2, 8),) * 3 + (None, {"scale": -1.0}, ValueError, "scale must be a finite positive"),
    ((1, 4, 2, 8),) * 3 + (None, {"scale": 0.0}, ValueError, "scale must be a finite positive"),
    ((1, 4, 2, 8),) * 3 + (None, {"scale": jnp.float32(0.5)}, TypeError, "static, not a jax"),
    ((1, 0, 2, 8),) * 3 + (None, {}, ValueError, r"q.shape\[1\] \(seq_local\) is 0"),
    ((1, 4, 2, 0),) * 3 + (None, {}, ValueError, r"q.shape\[3\] \(head_dim\) is 0"),
    ((1, 4, 0, 8),) * 3 + (None, {}, ValueError, r"q.shape\[2\] \(heads\) is 0"),
    ((1, 4, 2, 8), (1, 4, 0, 8), (1, 4, 0, 8), None, {}, ValueError,
     r"k.shape\[2\] \(kv_heads\) is 0"),
]


@pytest.mark.parametrize("qs,ks,vs,vdtype,kw,err,msg", BAD)
def test_errors(qs, ks, vs, vdtype, kw, err, msg):
    mesh = cpu_mesh((2,), ("sp",))
    q, k = np.zeros(qs, np.float32), np.zeros(ks, np.float32)
    v = np.zeros(vs, vdtype or np.float32)
    with pytest.raises(err, match=msg):
        run(lambda a, b, c: pk.ring_attention(a, b, c, "sp", **kw), mesh, (P(),) * 3, P(),
            q, k, v)


def test_errors_dtype_axis_and_init():
    mesh = cpu_mesh((2,), ("sp",))
    x = np.zeros((1, 4, 2, 8), np.int32)
    with pytest.raises(TypeError, match="ring_attention: q has dtype int32; supported"):
        run(lambda a, b, c: pk.ring_attention(a, b, c, "sp"), mesh, (P(),) * 3, P(), x, x, x)
    x = x.astype(jnp.float32)
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        run(lambda a, b, c: pk.ring_attention(a, b, c, "tp"), mesh, (P(),) * 3, P(), x, x, x)
    pk.shutdown()
    with pytest.raises(ValueError, match=r"pk.init\(mesh\) has not been called"):
        run(lambda a, b, c: pk.ring_attention(a, b, c, "sp"), mesh, (P(),) * 3, P(), x, x, x,
            init=False)


@pytest.mark.large
@pytest.mark.parametrize("dtype,causal", product(FLOAT_DTYPES, (False, True)))
def test_large(monkeypatch, dtype, causal):
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 32)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 24)
    q, k, v = qkv((2, 8 * 61, 4, 32), dtype)
    out = ring(cpu_mesh((8,), ("sp",)), q, k, v, causal=causal)
    assert_close(out, dense(q, k, v, causal=causal), dtype)


# --- layout="zigzag": rank r holds chunks r and 2P-1-r of 2P (balanced causal work) ---------

def test_zigzag_indices_is_a_balanced_permutation():
    idx = pk.zigzag_indices(16, 2)
    assert idx.dtype == np.int32 and sorted(idx.tolist()) == list(range(16))
    np.testing.assert_array_equal(idx, [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    with pytest.raises(ValueError, match="divisible by 2 P"):
        pk.zigzag_indices(12, 4)


@pytest.mark.parametrize("s,p,err,msg", [
    (-8, 2, ValueError, "seq_len must be positive, got -8"),
    (0, 2, ValueError, "seq_len must be positive, got 0"),
    (8, 0, ValueError, "world must be positive, got 0"),
    (8, -2, ValueError, "world must be positive, got -2"),
    (-4, -1, ValueError, "seq_len must be positive"),
    (8.0, 2, TypeError, "seq_len must be an int, got 8.0"),
    (8, True, TypeError, "world must be an int, got True"),
    (8, "2", TypeError, "world must be an int"),
    (10, 2, ValueError, "divisible by 2 P = 4"),
])
def test_zigzag_indices_refuses_invalid_sizes(s, p, err, msg):
    with pytest.raises(err, match=msg):
        pk.zigzag_indices(s, p)


def test_zigzag_indices_takes_numpy_ints():
    np.testing.assert_array_equal(pk.zigzag_indices(np.int64(8), np.int32(2)),
                                  pk.zigzag_indices(8, 2))


@pytest.mark.parametrize("p,causal", product(WORLD_SIZES, (True, False)))
def test_zigzag_matches_dense(p, causal):
    s = 8 * p
    q, k, v = qkv((2, s, 2, 16), np.float32, seed=p)
    idx = pk.zigzag_indices(s, p)
    out = ring(cpu_mesh((p,), ("sp",)), q[:, idx], k[:, idx], v[:, idx], causal=causal,
               layout="zigzag")
    assert_close(np.asarray(out)[:, np.argsort(idx)], dense(q, k, v, causal=causal))


@pytest.mark.parametrize("p", (2, 4))
def test_zigzag_grads_match_dense(p, monkeypatch):
    monkeypatch.setattr(_attention, "KEY_BLOCK", 4)  # several key tiles per chunk
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 4)
    s = 16 * p
    q, k, v = qkv((1, s, 2, 8), np.float32, seed=10 + p)
    w = normal((1, s, 2, 8), np.float32, 99)
    idx = pk.zigzag_indices(s, p)
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)

    def loss(a, b, c):
        f = jax.shard_map(lambda x, y, z: pk.ring_attention(x, y, z, "sp", causal=True,
                                                            layout="zigzag"),
                          mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        return jnp.sum(f(a, b, c) * w[:, idx])

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[:, idx], k[:, idx], v[:, idx])
    want = dense_grads(q, k, v, w, causal=True)
    for g, gw in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g)[:, np.argsort(idx)], gw, atol=2e-4, rtol=2e-4)


def test_zigzag_errors():
    mesh = cpu_mesh((2,), ("sp",))
    q, k, v = qkv((1, 6, 2, 8), np.float32)  # S/P = 3: odd
    with pytest.raises(ValueError, match="even"):
        ring(mesh, q, k, v, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="layout"):
        ring(mesh, *qkv((1, 8, 2, 8), np.float32), layout="striped")


@pytest.mark.needs_ext  # the workspace need is the extension's (ffi/launch.h)
def test_fused_kernel_takes_what_it_compiles():
    """The fused forward (pk_ring_attn) takes P > 1, bf16/fp16 and head dims 64/128; it needs
    2 (P - 1) K/V blocks of workspace. Everything else, and every CPU mesh, runs the reference
    (the GPU tests: tests/gpu/test_emulator_attention.py and tests/gpu/ring_mp.py)."""
    from pk_jax.ops import ring_attn

    bf = jax.ShapeDtypeStruct((1, 130, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 130, 2, 128), jnp.bfloat16)
    assert ring_attn.kernel_supports(bf, kv, 2)
    assert not ring_attn.kernel_supports(bf, kv, 1)
    assert not ring_attn.kernel_supports(jax.ShapeDtypeStruct((1, 130, 4, 128), jnp.float32),
                                         kv, 4)
    assert not ring_attn.kernel_supports(jax.ShapeDtypeStruct((1, 130, 4, 96), jnp.float16),
                                         kv, 4)
    assert ring_attn.workspace_need(kv, 4) == 2 * 3 * 130 * 2 * 128 * 2
    # The fused backward (pk_ring_attn_bwd): the forward's K/V ring plus P fp32 dK/dV blocks
    # of whole 128-row tiles (130 rows: 2 tiles per K/V head) and an fp32 dQ.
    assert ring_attn.workspace_need_bwd(bf, kv, 4) == (2 * 3 * 130 * 2 * 128 * 2
                                                       + 4 * (2 * 2 * 1) * 2 * 128 * 128 * 4
                                                       + 130 * 4 * 128 * 4)


@pytest.mark.parametrize("causal,layout", [(False, "contiguous"), (True, "zigzag")])
def test_fused_path_traces_to_the_kernels_with_their_attributes(monkeypatch, causal, layout):
    """Where the fused path runs (forced here on a CPU mesh of 2, traced only): the gradient is
    one pk_ring_attn forward on q, k, v as given (FWD_COMM_SMS_UNMASKED communication blocks
    without a mask, FWD_COMM_SMS with the causal one) and one pk_ring_attn_bwd (NUM_COMM_SMS),
    each with the mask, the layout and the scale."""
    from pk_jax.ops import ring_attn

    monkeypatch.setattr(ring_attn, "forward_path", lambda *a, **kw: "fused")
    monkeypatch.setattr(ring_attn._tp, "check_workspace", lambda *a: None)
    shapes = [(1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)]
    jaxpr, _ = traced_p1(monkeypatch, pk.ring_attention, cpu_mesh((2,), ("sp",)), shapes,
                         jnp.bfloat16, causal=causal, scale=0.3, layout=layout)
    calls = ffi_calls(jaxpr)
    assert [e.params["target_name"] for e in calls] == ["pk_ring_attn", "pk_ring_attn_bwd"]
    attrs = [dict(e.params["attributes"]) for e in calls]
    fwd = ring_attn.FWD_COMM_SMS if causal else ring_attn.FWD_COMM_SMS_UNMASKED
    assert [a["num_comm_sms"] for a in attrs] == [fwd, ring_attn.NUM_COMM_SMS]
    assert ring_attn.FWD_COMM_SMS_UNMASKED == 16 and ring_attn.FWD_COMM_SMS == 8
    assert all(a["causal"] == causal and a["zigzag"] == (layout == "zigzag")
               and np.isclose(a["scale"], 0.3) for a in attrs), attrs
    assert [x.aval.shape for x in calls[0].invars[:3]] == [(1, 4, 4, 64), (1, 4, 2, 64),
                                                           (1, 4, 2, 64)]


# --- masks: segment ids, local_window_size, logits_soft_cap, query/key_value_seq_lengths ------
# against masks.dense_masked (float64 numpy) over the whole sequence, P = 2, 4, 8, both layouts.

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
    q, k, v, w = randn((b, s, 4, 8), p), randn((b, s, 2, 8), p + 1), \
        randn((b, s, 2, 8), p + 2), randn((b, s, 4, 8), p + 3)
    case = dict(CASES[name])
    # Global lengths that end inside some rank's block; no key at all in one row.
    if "q_len" in case:
        case["q_len"] = (s - 3, s // 2 + 1)
    if "kv_len" in case:
        case["kv_len"] = (s // 2 + 1, 0 if name == "kv_len+causal" else s - 2)
    kw = mask_args(case, b, s, seed=p)
    if "segment_ids" in kw:
        chunk = sl // 2 if layout == "zigzag" else sl
        assert crosses_chunks(kw["segment_ids"], chunk)
    got = sharded_run(pk.ring_attention, p, q, k, v, w, kw, layout=layout)
    check_close(got, dense_for(q, k, v, w, kw), atol=3e-5)


def test_ring_separate_segment_ids_and_hidden_rows():
    """pk.SegmentIds in the zigzag ring at P = 4 with rows whose id no key has: those give 0."""
    p, b, s = 4, 1, 24
    q, k, v, w = (randn((b, s, 2, 8), 10 + i) for i in range(4))
    q_ids = packed_ids(b, s, 3, mean=3)
    kv_ids = np.where(q_ids == 1, 0, q_ids)
    kw = {"segment_ids": (q_ids, kv_ids), "causal": True}
    got = sharded_run(pk.ring_attention, p, q, k, v, w, kw, layout="zigzag")
    check_close(got, dense_for(q, k, v, w, kw), atol=3e-5)
    assert np.all(got[0][q_ids == 1] == 0)


@pytest.mark.parametrize("check_vma", (True, False))
def test_ring_masks_on_a_2d_mesh(check_vma):
    """A (dp 2, sp 4) mesh with explicit axes: batch rows, their segment ids and their key
    lengths sharded over dp (the lengths vary along dp, not along the ring's axis), the zigzag
    ring with a causal window; check_vma on and off."""
    mesh = cpu_mesh((2, 4), ("dp", "sp"))
    pk.init(mesh)
    b, s = 4, 24
    q, k, v, w = (randn((b, s, 2, 8), 30 + i) for i in range(4))
    ids, kv_len = packed_ids(b, s, 5), np.array([24, 10, 0, 17], np.int32)
    idx, spec = pk.zigzag_indices(s, 4), P("dp", "sp")
    f = jax.shard_map(lambda q, k, v, ids, n: pk.ring_attention(
        q, k, v, "sp", causal=True, layout="zigzag", segment_ids=ids, local_window_size=5,
        key_value_seq_lengths=n), mesh=mesh, in_specs=(spec,) * 4 + (P("dp"),),
        out_specs=spec, check_vma=check_vma)
    args = [jax.device_put(x[:, idx], NamedSharding(mesh, spec)) for x in (q, k, v, ids)]
    args.append(jax.device_put(kv_len, NamedSharding(mesh, P("dp"))))
    loss = lambda *a: jnp.sum(f(*a) * w[:, idx])
    got = jax.jit(lambda *a: (f(*a), jax.grad(loss, argnums=(0, 1, 2))(*a)))(*args)
    back = np.argsort(idx)
    got = (np.asarray(got[0])[:, back], [np.asarray(g)[:, back] for g in got[1]])
    check_close(got, dense_masked(q, k, v, causal=True, segment_ids=ids, window=5, kv_len=kv_len,
                             w=w), atol=3e-5)


def test_ring_mask_errors():
    check_sharded_mask_errors(pk.ring_attention)


@pytest.mark.parametrize("p", (1, 2))
def test_masked_ring_routing_with_kernels_available(monkeypatch, p):
    """With the kernels forced: unmasked calls trace to attention kernels; masked ones to
    pk.attention's masked kernels at P = 1, to none at P = 2 (the jax.lax ring)."""
    check_masked_sp_routing(monkeypatch, "ring", p)


# --- P = 1 (a 1-device axis): the pk.attention kernels (forward_path "local") ----------------

def ffi_calls(jaxpr) -> list:
    """The FFI-call equations of a jaxpr and of the jaxprs inside it (shard_map bodies, ...),
    in order."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for e in jaxpr.eqns:
        if "target_name" in e.params:
            found.append(e)
        for value in e.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    found += ffi_calls(sub)
    return found


def traced_p1(monkeypatch, fn, mesh, shapes, dtype, spec=SEQ, **kw):
    """The jaxpr of the gradient of sum(fn(q, k, v, "sp", **kw)) under shard_map on `mesh`,
    with q, k, v of `shapes`, and the P = 1 paths ring and Ulysses took while tracing (both ask
    pk.attention's p1_path there: "local" or "reference")."""
    from pk_jax.ops import attention as attention_op

    pk.init(mesh)
    paths = []

    def spy(*a, decide=attention_op.p1_path, **kw):
        paths.append(decide(*a, **kw))
        return paths[-1]

    monkeypatch.setattr(attention_op, "p1_path", spy)
    xs = [jax.device_put(normal(s, dtype, i), NamedSharding(mesh, spec))
          for i, s in enumerate(shapes)]
    f = jax.shard_map(lambda a, b, c: fn(a, b, c, "sp", **kw), mesh=mesh, in_specs=(spec,) * 3,
                      out_specs=spec)
    loss = lambda *x: jnp.sum(f(*x).astype(jnp.float32))
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*xs), paths


def check_p1_kernel_calls(monkeypatch, fn, heads, dtype, causal, **kw):
    """Asserts that the gradient of `fn` at P = 1 (B 2, S 10, heads = (H, Hkv, D), scale 0.3)
    took the "local" path and traces to one pk_attention forward on q, k, v as given and one
    backward (dq, dk, dv and the float32 dq scratch), with the causal flag and the scale; returns
    the jaxpr."""
    h, hkv, d = heads
    shapes = [(2, 10, h, d), (2, 10, hkv, d), (2, 10, hkv, d)]
    jaxpr, paths = traced_p1(monkeypatch, fn, cpu_mesh((1,), ("sp",)), shapes, dtype,
                             causal=causal, scale=0.3, **kw)
    assert paths == ["local"]
    calls = ffi_calls(jaxpr)
    assert [e.params["target_name"] for e in calls] == ["pk_attention"] * 2, calls
    attrs = [dict(e.params["attributes"]) for e in calls]
    assert [a["backward"] for a in attrs] == [0, 1]
    assert all(a["causal"] == causal and np.isclose(a["scale"], 0.3) for a in attrs), attrs
    assert [x.aval.shape for x in calls[0].invars] == shapes
    assert [x.aval.shape for x in calls[1].outvars] == shapes + [shapes[0]]  # + dq scratch
    return jaxpr


@pytest.mark.parametrize("causal,layout,h,hkv,d,dtype", [
    (False, "contiguous", 4, 4, 64, jnp.bfloat16), (True, "contiguous", 8, 2, 128, jnp.float16),
    (True, "zigzag", 4, 1, 64, jnp.bfloat16), (False, "zigzag", 6, 3, 128, jnp.bfloat16)])
def test_p1_runs_pk_attention(monkeypatch, causal, layout, h, hkv, d, dtype):
    """At P = 1 with the kernels available (forced here; the CPU has none) ring attention is
    pk.attention: forward_path says "local", and the gradient traces to one pk_attention
    forward on q, k, v as given (K/V heads in place, the causal flag: zigzag is the identity
    permutation at P = 1, the scale) and one pk_attention backward; no ppermute, no
    pk_ring_attn."""
    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    assert pk.zigzag_indices(10, 1).tolist() == list(range(10))
    jaxpr = check_p1_kernel_calls(monkeypatch, pk.ring_attention, (h, hkv, d), dtype, causal,
                                  layout=layout)
    assert "ppermute" not in str(jaxpr)


@pytest.mark.parametrize("dtype,d", [(jnp.float32, 64), (jnp.bfloat16, 96)])
def test_p1_keeps_the_reference_where_pk_attention_does_not_run(monkeypatch, dtype, d):
    """fp32 operands and head dims other than 64/128 at P = 1 keep the jax.lax ring, even with
    the kernels available."""
    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    jaxpr, paths = traced_p1(monkeypatch, pk.ring_attention, cpu_mesh((1,), ("sp",)),
                             [(1, 8, 2, d)] * 3, dtype, causal=True, layout="zigzag")
    assert paths == ["reference"] and not ffi_calls(jaxpr)


@pytest.mark.parametrize("causal,layout,dtype", [
    (False, "contiguous", jnp.bfloat16), (True, "contiguous", jnp.float16),
    (True, "zigzag", jnp.bfloat16)])
def test_p1_local_matches_the_reference(monkeypatch, causal, layout, dtype):
    """The local path's wiring with jax.lax stand-ins for the pk_attention calls, on a (dp 2,
    sp 1) mesh with q replicated over dp (dq summed over dp): output and gradients match the
    reference ring's in the same dtype, and every cotangent varies like its primal (vjp_both);
    GQA 4:2, S = 130 (past one 128-row tile), scale 0.1."""
    from pk_jax.ops import ring_attn

    calls = stand_in_attention(monkeypatch)
    mesh = cpu_mesh((2, 1), ("dp", "sp"))
    q = normal((2, 130, 4, 64), dtype, 0)
    k, v = (normal((4, 130, 2, 64), dtype, i) for i in (1, 2))
    dy = normal((4, 130, 4, 64), dtype, 3)
    f = lambda *x: pk.ring_attention(*x, "sp", causal=causal, scale=0.1, layout=layout)

    def ref(q, k, v):
        kr, vr = _attention.repeat_kv(q, k, v)
        return ring_attn.reference(q, kr, vr, "sp", causal=causal, scale=0.1, p=1,
                                   zigzag=layout == "zigzag")

    specs = (P(None, "sp"), P("dp", "sp"), P("dp", "sp"))
    ours, want = vjp_both(f, ref, mesh, specs, P("dp", "sp"), (q, k, v), dy)
    for g, w in zip(ours, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=2e-2, atol=3e-2 if dtype == jnp.bfloat16 else 4e-3)
    assert [c["backward"] for c in calls] == [0, 1], calls
    assert all(c["h"] == 4 and c["hkv"] == 2 and c["s"] == 130 and c["causal"] == causal
               and np.isclose(c["scale"], 0.1) for c in calls), calls


@pytest.mark.parametrize("causal,zigzag", [(False, False), (True, False), (True, True)])
def test_emulator_backward_reference_matches_autodiff(causal, zigzag):
    """pk_jax.testing.ops.ring_attn_bwd (the GPU emulator tests' expected gradients of the
    fused backward) equals the autodiff gradients of dense attention over the whole sequence
    in global order, GQA 2:1, P = 3 with zigzag shards."""
    from pk_jax.testing import ops

    p, b, sl, h, hkv, d = 3, 1, 6, 4, 2, 8
    rng = np.random.default_rng(3)
    xs = [[rng.standard_normal(shape) for _ in range(p)]
          for shape in ((b, sl, h, d), (b, sl, hkv, d), (b, sl, hkv, d), (b, sl, h, d))]
    case = ops.ring_attn_bwd(*xs, "float32", causal=causal, zigzag=zigzag)
    pos = np.concatenate([ops.seq_positions(p, r, sl, causal and zigzag) for r in range(p)])
    order = np.argsort(pos)  # global order of the concatenated shards
    q, k, v, w = (np.concatenate(x, axis=1)[:, order].astype(np.float32) for x in xs)
    k, v = (np.repeat(x, h // hkv, axis=2) for x in (k, v))
    want = [np.asarray(g) for g in dense_grads(q, k, v, w, causal=causal)]
    want[1], want[2] = (x.reshape(b, p * sl, hkv, h // hkv, d).sum(3) for x in want[1:])
    inv = np.argsort(order)  # back to shard order
    for i, name in enumerate(("dq", "dk", "dv")):
        got = np.concatenate([case.expected[r][name] for r in range(p)], axis=1)
        np.testing.assert_allclose(got, want[i][:, inv], rtol=1e-4, atol=1e-4)


# GPU tests (marker gpu): ring attention over a 1-device axis of the H200 runs the pk.attention
# kernels. Per case: the jitted program's only pk custom calls are pk_attention (the forward;
# and the backward for the gradients), with no collective; outputs are poisoned first (util.
# poison) and every call is made twice, with identical results; the output is bit for bit
# pk.attention's on the same operands (the same kernel), and output and gradients are within
# twice the error of XLA's attention in the same dtype against a float32 reference
# (tests/test_attention.py's criterion). tests/test_ulysses_attn.py runs the same checks.

GPU_P1 = [  # (B, S, H, Hkv, D, causal, dtype); S even (the zigzag layout)
    (1, 1000, 8, 2, 128, True, jnp.bfloat16), (2, 256, 4, 4, 64, False, jnp.float16),
    (1, 334, 4, 1, 64, True, jnp.bfloat16)]
GPU_P1_GRAD = [(1, 300, 8, 2, 64, True, jnp.bfloat16), (1, 512, 4, 1, 128, False, jnp.float16)]


def gpu_id(case) -> str:
    return "x".join(str(x) for x in case[:5]) + ("-causal-" if case[5] else "-") + \
        jnp.dtype(case[6]).name


def _p1_operands(case, seed, platform):
    """A pk.init'ed 1-device ("sp",) mesh, q, k, v of `case` (random normal) and a key."""
    mesh = jax.make_mesh((1,), ("sp",), devices=jax.devices(platform)[:1])
    pk.init(mesh)
    return (mesh, *_p1_inputs(case, seed))


def _p1_inputs(case, seed):
    b, s, h, hkv, d, _, dtype = case
    keys = jax.random.split(jax.random.key(seed + 7919 * s + 31 * h + d), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
    return (mk(keys[0], h), mk(keys[1], hkv), mk(keys[2], hkv)), keys[3]


@functools.cache
def _p1_references(case, grad: bool):
    """(float32 reference, XLA's attention in the dtype of `case`): outputs, or gradients of
    sum(out * w) (seed 1), on the operands of `_p1_operands`; cached, so that the ring and
    Ulysses tests of one process compute them once per case."""
    causal = case[5]
    (q, k, v), key = _p1_inputs(case, int(grad))
    xla = lambda a, b_, c: jax.nn.dot_product_attention(a, b_, c, is_causal=causal,
                                                        implementation="xla")
    if not grad:
        return _exact(q, k, v, causal), jax.jit(xla)(q, k, v)
    w = jax.random.normal(key, q.shape, jnp.float32)

    def grads(fn, *args):
        loss = lambda a, b_, c: jnp.sum(fn(a, b_, c).astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    return grads(lambda a, b_, c: _exact(a, b_, c, causal), q, k, v), grads(xla, q, k, v)


def _pk_targets(f, *args) -> list:
    """The pk FFI targets in jitted f's lowered program, in order; it must have no collective."""
    text = f.lower(*args).as_text()
    for op in ("collective_permute", "all_to_all", "all_gather", "all_reduce"):
        assert op not in text, op
    return re.findall(r"custom_call @(pk_\w+)", text)


def _max_err(y, ref) -> float:
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))


def _exact(q, k, v, causal):
    from pk_jax.ops import attention as att

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return att.reference(*f32, causal=causal, scale=1.0 / np.sqrt(q.shape[-1]))


def check_p1_forward(op, case, platform="gpu", **kw):
    """The forward checks above for `op` (pk.ring_attention or pk.ulysses_attention, with
    options `kw`) at `case`."""
    causal, dtype = case[5:]
    mesh, (q, k, v), _ = _p1_operands(case, 0, platform)
    placed = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v)]
    f = jax.jit(jax.shard_map(lambda a, b_, c: op(a, b_, c, "sp", causal=causal, **kw),
                              mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ))
    assert _pk_targets(f, *placed) == ["pk_attention"]
    exact, xla = _p1_references(case, False)
    err_xla = _max_err(xla, exact)
    want = jax.jit(lambda a, b_, c: pk.attention(a, b_, c, causal=causal))(q, k, v)
    outs = []
    for _ in range(2):
        poison(q.shape, dtype)
        outs.append(jax.block_until_ready(f(*placed)))
    for y in outs:
        assert y.shape == q.shape and y.dtype == dtype
        assert not bool(jnp.any(jnp.isnan(y))), "output not fully written"
        assert_same(y, want)
        err = _max_err(y, exact)
        assert err <= 2 * err_xla + 2e-3, (err, err_xla)


def check_p1_grads(op, case, platform="gpu", **kw):
    """The gradient checks above for `op` (options `kw`) at `case`: d/d(q, k, v) of
    sum(out * w), w random normal float32."""
    causal, dtype = case[5:]
    mesh, (q, k, v), key = _p1_operands(case, 1, platform)
    w = jax.random.normal(key, q.shape, jnp.float32)
    f = jax.shard_map(lambda a, b_, c: op(a, b_, c, "sp", causal=causal, **kw), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ)
    g = jax.jit(jax.grad(lambda a, b_, c, w_: jnp.sum(f(a, b_, c).astype(jnp.float32) * w_),
                         argnums=(0, 1, 2)))
    placed = [jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v, w)]
    assert _pk_targets(g, *placed) == ["pk_attention"] * 2
    exact, xla = _p1_references(case, True)
    runs = []
    for _ in range(2):
        for x in (q, k, v):
            poison(x.shape, dtype)
        runs.append(jax.block_until_ready(g(*placed)))
    for got in runs:
        for name, gr, gx, ge, x in zip("qkv", got, xla, exact, (q, k, v)):
            assert gr.shape == x.shape and gr.dtype == dtype, name
            assert not bool(jnp.any(jnp.isnan(gr))), name
            err, err_xla = _max_err(gr, ge), _max_err(gx, ge)
            atol = 2e-3 * float(jnp.max(jnp.abs(ge))) + 1e-3
            assert err <= 2 * err_xla + atol, (name, err, err_xla, atol)
    for g0, g1 in zip(runs[0][1:], runs[1][1:]):  # dk, dv; the one-pass backward's dq sums
        assert_same(g0, g1)                        # its parts with float32 atomics


_GPU_P1_LAYOUTS = [(c, "contiguous") for c in GPU_P1] + [(c, "zigzag") for c in GPU_P1 if c[5]]


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", _GPU_P1_LAYOUTS,
                         ids=[f"{gpu_id(c)}-{lay}" for c, lay in _GPU_P1_LAYOUTS])
def test_gpu_p1_forward(case, layout):
    check_p1_forward(pk.ring_attention, case, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("case,layout", [(GPU_P1_GRAD[0], "zigzag"),
                                         (GPU_P1_GRAD[1], "contiguous")],
                         ids=[f"{gpu_id(GPU_P1_GRAD[0])}-zigzag",
                              f"{gpu_id(GPU_P1_GRAD[1])}-contiguous"])
def test_gpu_p1_grads(case, layout):
    check_p1_grads(pk.ring_attention, case, layout=layout)

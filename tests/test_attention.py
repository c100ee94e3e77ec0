"""pk.attention (one device) against jax.nn.dot_product_attention on CPU: causal and not, GQA
and MQA, odd lengths, bf16 and fp32, gradients, and the trace-time errors; the masks (segment
ids, local_window_size, logits_soft_cap, query/key_value_seq_lengths), alone and combined,
forward and gradients, against a float64 numpy reference (tests/masks.py) and XLA's attention,
their skipped tiles and errors, and that a masked call never reaches the kernels; on an H200
(marker gpu) the CUDA kernels' forward and gradients against a float32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from masks import (
    CASES,
    MASKS,
    check_close,
    dense_for,
    dense_masked,
    mask_args,
    mask_kw,
    packed_ids,
    randn,
)
from util import poison

import pk_jax as pk
from pk_jax.ops import _attention


def _qkv(b, s, h, hkv, d, dtype, seed=0):
    rng = np.random.default_rng(seed)
    mk = lambda heads: jnp.asarray(rng.standard_normal((b, s, heads, d)), dtype)
    return mk(h), mk(hkv), mk(hkv)


@pytest.mark.parametrize("s,h,hkv,d,causal", [(64, 4, 4, 64, False), (300, 8, 2, 64, True),
                                              (129, 8, 1, 128, True), (96, 4, 2, 32, False)])
def test_matches_dot_product_attention(s, h, hkv, d, causal):
    q, k, v = _qkv(2, s, h, hkv, d, jnp.float32, seed=s)
    got = jax.jit(lambda a, b, c: pk.attention(a, b, c, causal=causal))(q, k, v)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_bf16_within_twice_xla_error():
    q, k, v = _qkv(1, 256, 8, 2, 64, jnp.bfloat16, seed=3)
    exact = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                         is_causal=True)
    err = lambda y: float(jnp.max(jnp.abs(y.astype(jnp.float32) - exact)))
    xla = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert err(pk.attention(q, k, v, causal=True)) <= 2 * err(xla) + 1e-2


def test_grads_match_dot_product_attention():
    q, k, v = _qkv(1, 100, 4, 2, 32, jnp.float32, seed=5)
    w = jnp.asarray(np.random.default_rng(6).standard_normal(q.shape), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c) * w), argnums=(0, 1, 2)))(
            q, k, v)

    got = grads(lambda a, b, c: pk.attention(a, b, c, causal=True, scale=0.2))
    want = grads(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True,
                                                              scale=0.2))
    for g, gw in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gw), atol=5e-5, rtol=5e-5)


def test_errors_name_the_fix():
    q, k, v = _qkv(1, 8, 4, 4, 16, jnp.float32)
    with pytest.raises(ValueError, match="divide"):
        pk.attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="batch, seq"):
        pk.attention(q[0], k, v)
    with pytest.raises(TypeError, match="causal"):
        pk.attention(q, k, v, causal=1)
    with pytest.raises(TypeError):
        pk.attention(q, k.astype(jnp.bfloat16), v)


@pytest.mark.parametrize("shape,hkv,msg", [
    ((1, 0, 4, 16), 2, r"q.shape\[1\] \(seq\) is 0 in q shape \(1, 0, 4, 16\)"),
    ((1, 8, 4, 0), 2, r"q.shape\[3\] \(head_dim\) is 0 .*head_dim of at least 1"),
    ((1, 8, 0, 16), 1, r"q.shape\[2\] \(heads\) is 0"),
    ((1, 8, 4, 16), 0, r"k.shape\[2\] \(kv_heads\) is 0"),
])
def test_empty_dimensions_name_the_argument(shape, hkv, msg):
    """S = 0, head_dim = 0 or no heads: a ValueError naming the dimension (it was a numpy
    reduction error, or a ZeroDivisionError), jitted or not; an empty batch is an empty result.
    The same check guards pk.ring_attention and pk.ulysses_attention."""
    b, s, _, d = shape
    q, kv = jnp.zeros(shape, jnp.float32), jnp.zeros((b, s, hkv, d), jnp.float32)
    for f in (pk.attention, jax.jit(pk.attention)):
        with pytest.raises(ValueError, match=msg):
            f(q, kv, kv)
    mesh = jax.make_mesh((2,), ("sp",), devices=jax.devices()[:2])
    pk.init(mesh)
    for op in (pk.ring_attention, pk.ulysses_attention):
        f = jax.shard_map(lambda a, c, op=op: op(a, c, c, "sp"), mesh=mesh,
                          in_specs=(jax.sharding.PartitionSpec(),) * 2,
                          out_specs=jax.sharding.PartitionSpec())
        with pytest.raises(ValueError, match=msg.replace(r"\(seq\)", r"\(seq_local\)")):
            f(q, kv)
    q, kv = jnp.ones((0, 8, 4, 16), jnp.float32), jnp.ones((0, 8, 2, 16), jnp.float32)
    assert pk.attention(q, kv, kv).shape == (0, 8, 4, 16)


def test_kernel_path_calls_pk_attention_forward_and_backward(monkeypatch):
    """With the kernel chosen (forced here; the CPU has none), bf16 head-dim-64 operands trace to
    one pk_attention call forward (o and float32 lse [B, H, S]) and one backward (lse and
    delta padded to a multiple of 128; dq, dk, dv in the operands' shapes)."""
    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    q, k, v = _qkv(2, 300, 8, 2, 64, jnp.bfloat16)
    loss = lambda a, b, c: jnp.sum(pk.attention(a, b, c, causal=True).astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    calls = [e for e in jaxpr.eqns if e.params.get("target_name") == "pk_attention"]
    assert len(calls) == 2
    fwd, bwd = calls
    attrs = lambda e: dict(e.params["attributes"])
    assert attrs(fwd)["backward"] == 0 and attrs(bwd)["backward"] == 1
    assert attrs(fwd)["causal"] == 1 and np.isclose(attrs(fwd)["scale"], 0.125)
    assert [x.aval.shape for x in fwd.outvars] == [(2, 300, 8, 64), (2, 8, 300)]
    assert [x.aval.shape for x in bwd.invars[4:]] == [(2, 8, 384), (2, 8, 384)]
    # dq, dk, dv and the one-pass backward's float32 dq scratch.
    assert [(x.aval.shape, x.aval.dtype) for x in bwd.outvars] == [
        (q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), (q.shape, jnp.float32)]
    # fp32 operands and other head dims keep the reference.
    for args in ((q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)),
                 _qkv(1, 40, 2, 2, 32, jnp.bfloat16)):
        jaxpr = jax.make_jaxpr(lambda a, b, c: pk.attention(a, b, c))(*args)
        assert "pk_attention" not in str(jaxpr)


# ---------------------------------------------------------------------------------------------
# Masks (segment ids, local_window_size, logits_soft_cap, query/key_value_seq_lengths), alone and
# combined, against masks.dense_masked (float64 numpy), jax.nn.dot_product_attention where it
# takes them, the skipped tiles, the errors, and the reference with the kernels available.

@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_masks_match_dense(monkeypatch, name):
    """S = 37 in tiles of 8 queries by 16 keys (padded, and skipped where hidden), GQA 4:2,
    B = 2 (3 for lengths), float32: output and gradients of sum(out * w)."""
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 8)
    monkeypatch.setattr(_attention, "KEY_BLOCK", 16)
    b, s = (3 if name in ("lengths", "kv_len+causal") else 2), 37
    q, k, v, w = randn((b, s, 4, 8), 0), randn((b, s, 2, 8), 1), randn((b, s, 2, 8), 2), \
        randn((b, s, 4, 8), 3)
    kw = mask_args(CASES[name], b, s, seed=7)

    def f(q, k, v, w):
        loss = lambda *x: jnp.sum(pk.attention(*x, **kw) * w)
        return pk.attention(q, k, v, **kw), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    check_close(jax.jit(f)(q, k, v, w), dense_for(q, k, v, w, kw))


def test_attention_one_tile_bf16_and_scale():
    """The default tiles (one tile here), bf16 operands, a scale: within bf16's tolerance."""
    b, s = 2, 45
    q, k, v = (randn((b, s, 2, 16), i).astype(jnp.bfloat16) for i in range(3))
    kw = dict(mask_args(CASES["all"], b, s, seed=3), scale=0.3)
    got = pk.attention(q, k, v, **kw)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64),
                               dense_for(*(np.asarray(x, np.float32) for x in (q, k, v)), None, kw),
                               atol=3e-2, rtol=3e-2)


def test_separate_segment_ids_and_rows_that_see_no_key():
    """pk.SegmentIds(q, kv): query rows whose id no key has (and a batch row with
    key_value_seq_lengths 0) give 0 with zero gradients, not NaN; jax.nn.dot_product_attention
    ("xla") gives the mean of v there, and agrees everywhere else."""
    b, s = 2, 21
    q, k, v, w = (randn((b, s, 2, 8), i) for i in range(4))
    q_ids = packed_ids(b, s, 1, mean=4)
    kv_ids = np.where(q_ids == 2, 1, q_ids)  # no key has id 2
    kw = {"segment_ids": pk.SegmentIds(q=jnp.asarray(q_ids), kv=jnp.asarray(kv_ids)),
          "causal": True}
    loss = lambda *x: jnp.sum(pk.attention(*x, **kw) * w)
    out = pk.attention(q, k, v, **kw)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    want = dense_masked(q, k, v, causal=True, segment_ids=(q_ids, kv_ids), w=w)
    check_close((out, grads), want)
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
    q, k, v, w = randn((b, s, 4, 8), 4), randn((b, s, 2, 8), 5), randn((b, s, 2, 8), 6), \
        randn((b, s, 4, 8), 7)
    kw = mask_args(CASES[name], b, s, seed=2)
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
    q, k, v = (randn((2, s, 1, 8), i) for i in range(3))
    run = lambda **kw: _tiles_computed(monkeypatch, lambda *x: pk.attention(*x, **kw), q, k, v)
    assert run() == 64
    assert run(causal=True) == 36
    assert run(causal=True, local_window_size=(15, 0)) == 8 + 7
    assert run(local_window_size=(15, 15)) == 8 + 2 * 7
    ids = np.repeat(np.arange(8), 32)[None].repeat(2, 0)
    assert run(segment_ids=ids) == 8
    assert run(key_value_seq_lengths=np.array([100, 100], np.int32)) == 8 * 4


MASK_ERRORS = [  # (keyword arguments, error, message)
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


@pytest.mark.parametrize("kw,err,msg", MASK_ERRORS)
def test_mask_errors_name_the_argument(kw, err, msg):
    q = jnp.zeros((2, 8, 2, 4))
    with pytest.raises(err, match="pk.attention: .*" + msg):
        pk.attention(q, q, q, **kw)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: next(iter(m)))
def test_masked_attention_takes_the_masked_kernels(monkeypatch, mask):
    """bf16, head dim 64: the kernels' operands (forced here). Unmasked and masked alike the
    gradient traces to two pk_attention calls, forward and backward: unmasked with the mask
    attributes off, masked with them on (and the kernels' mask operands); fp32 takes the
    reference, masked or not."""
    from test_ring_attn import ffi_calls

    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)

    def traced(q, **kw):
        grad = jax.grad(lambda q: jnp.sum(pk.attention(q, q, q, causal=True, **kw)
                                          .astype(jnp.float32)))
        return ffi_calls(jax.make_jaxpr(grad)(q))

    q = jnp.zeros((2, 40, 4, 64), jnp.bfloat16)
    kw = mask_kw(mask, 2, 40)
    plain, masked = traced(q), traced(q, **kw)
    for calls, flag in ((plain, 0), (masked, 1)):
        assert [e.params["target_name"] for e in calls] == ["pk_attention"] * 2
        assert [dict(e.params["attributes"])["masked"] for e in calls] == [flag, flag]
        assert [dict(e.params["attributes"])["backward"] for e in calls] == [0, 1]
    assert len(masked[0].invars) > len(plain[0].invars) == 3  # + lengths (and segment info)
    assert traced(q.astype(jnp.float32), **kw) == []


# GPU tests
# The CUDA kernels (bf16 and fp16, head dims 64 and 128) against a float32 reference, within
# twice the error of XLA's own attention in the same dtype: causal and not, GQA and MQA,
# lengths that are not multiples of the tiles. Outputs are poisoned first (a NaN-filled array
# of the output's size is allocated and freed right before each call), every call is jitted
# and made twice, and the two results must be identical, except dq: the one-pass backward sums
# its blocks' dQ parts with float32 atomics in any order (both calls are checked against the
# reference).

_GPU_FWD = [  # (B, S, H, Hkv, D, causal)
    (2, 256, 4, 4, 64, False), (1, 1000, 8, 2, 128, True), (2, 333, 4, 1, 64, True),
    (1, 2048, 16, 2, 128, False), (1, 129, 2, 2, 128, False), (1, 4096, 8, 1, 64, True),
    (3, 77, 6, 3, 128, True),
    # Non-causal, more query blocks than SMs (576, batch 4, GQA 4:1) with two key tiles each,
    # and 160 blocks of one tile each (added for the persistent forward of
    # bench/results/attention_notes.md, "A persistent forward again").
    (4, 300, 48, 12, 128, False), (2, 100, 80, 16, 64, False),
]
_GPU_GRAD = [
    (1, 512, 4, 4, 128, False), (2, 300, 8, 2, 64, True), (1, 1100, 8, 1, 128, True),
    (1, 2048, 4, 2, 64, False),
    # D = 64, causal, one K/V head per query head: key block 1 streams a single query block,
    # the pipelined backward's peeled last step alone; key block 0 streams three.
    (1, 150, 2, 2, 64, True),
]


def _gpu_init():
    from pk_jax.ops import attention as att

    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    assert pk.backend_name(att.NAME) == "cuda"


def _gpu_qkv(b, s, h, hkv, d, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed + 7919 * s + 31 * h + d), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
    return mk(keys[0], h), mk(keys[1], hkv), mk(keys[2], hkv), keys[3]


def _exact(q, k, v, causal):
    from pk_jax.ops import attention as att

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return att.reference(*f32, causal=causal, scale=1.0 / np.sqrt(q.shape[-1]))


def _max_err(y, ref):
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))


def _gpu_id(v):
    if isinstance(v, tuple):
        return "x".join(str(int(x)) for x in v)
    return jnp.dtype(v).name


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", [(c, t) for c in _GPU_FWD
                                        for t in (jnp.bfloat16, jnp.float16)], ids=_gpu_id)
def test_gpu_forward(case, dtype):
    b, s, h, hkv, d, causal = case
    _gpu_init()
    q, k, v, _ = _gpu_qkv(b, s, h, hkv, d, dtype)
    exact = _exact(q, k, v, causal)
    xla = jax.jit(lambda a, b_, c: jax.nn.dot_product_attention(
        a, b_, c, is_causal=causal, implementation="xla"))(q, k, v)
    err_xla = _max_err(xla, exact)
    f = jax.jit(lambda a, b_, c: pk.attention(a, b_, c, causal=causal))
    outs = []
    for _ in range(2):
        poison(q.shape, dtype)
        outs.append(jax.block_until_ready(f(q, k, v)))
    for y in outs:
        assert y.shape == q.shape and y.dtype == dtype
        assert not bool(jnp.any(jnp.isnan(y))), "output not fully written"
        err = _max_err(y, exact)
        assert err <= 2 * err_xla + 2e-3, (err, err_xla)
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32),
                                  np.asarray(outs[1], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", [(c, jnp.bfloat16) for c in _GPU_GRAD]
                         + [(_GPU_GRAD[1], jnp.float16)], ids=_gpu_id)
def test_gpu_grads(case, dtype):
    b, s, h, hkv, d, causal = case
    _gpu_init()
    q, k, v, kw = _gpu_qkv(b, s, h, hkv, d, dtype, seed=1)
    w = jax.random.normal(kw, q.shape, jnp.float32)

    def grads(fn, *args):
        loss = lambda a, b_, c: jnp.sum(fn(a, b_, c).astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exact = grads(lambda a, b_, c: _exact(a, b_, c, causal), *f32)
    xla = grads(lambda a, b_, c: jax.nn.dot_product_attention(
        a, b_, c, is_causal=causal, implementation="xla"), q, k, v)
    runs = []
    for _ in range(2):
        for x in (q, k, v):
            poison(x.shape, dtype)
        runs.append(jax.block_until_ready(
            grads(lambda a, b_, c: pk.attention(a, b_, c, causal=causal), q, k, v)))
    for got in runs:
        for name, g, gx, ge in zip("qkv", got, xla, exact):
            assert g.dtype == dtype and not bool(jnp.any(jnp.isnan(g))), name
            err, err_xla = _max_err(g, ge), _max_err(gx, ge)
            atol = 2e-3 * float(jnp.max(jnp.abs(ge))) + 1e-3
            assert err <= 2 * err_xla + atol, (name, err, err_xla, atol)
    for g0, g1 in zip(runs[0][1:], runs[1][1:]):  # dk, dv
        np.testing.assert_array_equal(np.asarray(g0, np.float32), np.asarray(g1, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(jnp.float32, 64), (jnp.bfloat16, 96)])
def test_gpu_unsupported_operands_run_the_reference(dtype, d):
    _gpu_init()
    q, k, v, _ = _gpu_qkv(1, 200, 4, 2, d, dtype)
    got = jax.jit(lambda a, b_, c: pk.attention(a, b_, c, causal=True))(q, k, v)
    from pk_jax.ops import attention as att

    want = jax.jit(lambda a, b_, c: att.reference(a, b_, c, causal=True,
                                                  scale=1.0 / np.sqrt(d)))(q, k, v)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)

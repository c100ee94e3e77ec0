"""pk.attention (one device) against jax.nn.dot_product_attention on CPU: causal and not, GQA
and MQA, odd lengths, bf16 and fp32, gradients, and the trace-time errors; on an H200 (marker
gpu) the CUDA kernels' forward and gradients against a float32 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import poison

import pk_jax as pk


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

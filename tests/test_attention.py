"""pk.attention (one device) against jax.nn.dot_product_attention on CPU: causal and not, GQA
and MQA, odd lengths, bf16 and fp32, gradients, and the trace-time errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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

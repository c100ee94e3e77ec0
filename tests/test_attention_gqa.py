"""Grouped-query attention (K/V with fewer heads than Q) in pk.ring_attention (both layouts)
and pk.ulysses_attention, against dense float64 attention with repeated K/V heads, forward and
gradients (the repeats' gradients summed back into each K/V head), on CPU host devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ring_attn import SEQ, dense, dense_grads, normal
from util import assert_close, cpu_mesh

import pk_jax as pk

H, HKV = 8, 2


def _qkv(s, seed=0):
    return (normal((1, s, H, 16), np.float32, seed), normal((1, s, HKV, 16), np.float32, seed + 1),
            normal((1, s, HKV, 16), np.float32, seed + 2))


def _rep(x):
    return np.repeat(x, H // HKV, axis=2)


@pytest.mark.parametrize("op,p,layout", [("ring", 4, "contiguous"), ("ring", 4, "zigzag"),
                                         ("ring", 8, "zigzag"), ("ulysses", 4, "contiguous")])
def test_gqa_forward_and_grads(op, p, layout):
    s = 8 * p
    q, k, v = _qkv(s, seed=p)
    w = normal(q.shape, np.float32, 7)
    idx = pk.zigzag_indices(s, p) if layout == "zigzag" else np.arange(s)
    mesh = cpu_mesh((p,), ("sp",), explicit=False)
    pk.init(mesh)
    kw = {"layout": layout} if op == "ring" else {}
    fn = pk.ring_attention if op == "ring" else pk.ulysses_attention
    f = jax.shard_map(lambda a, b, c: fn(a, b, c, "sp", causal=True, **kw), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ)
    qz, kz, vz = (x[:, idx] for x in (q, k, v))
    out = np.asarray(jax.jit(f)(qz, kz, vz))[:, np.argsort(idx)]
    assert_close(out, dense(q, _rep(k), _rep(v), causal=True))
    grads = jax.jit(jax.grad(lambda a, b, c: jnp.sum(f(a, b, c) * w[:, idx]),
                             argnums=(0, 1, 2)))(qz, kz, vz)
    gq, gk, gv = dense_grads(q, _rep(k), _rep(v), w, causal=True)
    fold = lambda g: np.asarray(g).reshape(1, s, HKV, H // HKV, 16).sum(axis=3)
    back = np.argsort(idx)
    np.testing.assert_allclose(np.asarray(grads[0])[:, back], gq, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(grads[1])[:, back], fold(gk), atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(grads[2])[:, back], fold(gv), atol=2e-4, rtol=2e-4)


def test_kv_heads_must_divide_q_heads():
    mesh = cpu_mesh((2,), ("sp",), explicit=False)
    pk.init(mesh)
    q = jnp.zeros((1, 4, 8, 16))
    kv = jnp.zeros((1, 4, 3, 16))
    f = jax.shard_map(lambda a, b, c: pk.ring_attention(a, b, c, "sp"), mesh=mesh,
                      in_specs=(SEQ,) * 3, out_specs=SEQ)
    with pytest.raises(ValueError, match="must divide the 8 query heads"):
        f(q, kv, kv)

"""pk.moe_dispatch / pk.moe_combine (jax.lax references) against an independent NumPy model,
on 1, 2, 4 and 8 CPU host devices: skewed and empty experts, capacity overflow (dropped and
counted), the combine of the dispatch, and gradients through both."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pk_jax as pk


def _mesh(p: int):
    mesh = jax.make_mesh((p,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])
    pk.init(mesh)
    return mesh


def model(xs, ids, num_experts, capacity):
    """Loops over (dest rank, local expert, source rank, token, slot), as the API promises."""
    p, t, k = ids.shape
    el = num_experts // p
    bufs = np.zeros((p, capacity, xs.shape[-1]), np.float64)
    sizes = np.zeros((p, el), np.int64)
    pos = -np.ones((p, t, k), np.int64)
    for d in range(p):
        row = 0
        for le in range(el):
            for s, tt, j in itertools.product(range(p), range(t), range(k)):
                if ids[s, tt, j] == d * el + le:
                    if row < capacity:
                        bufs[d, row] = xs[s, tt]
                        pos[s, tt, j] = row
                        sizes[d, le] += 1
                    row += 1
    return bufs, sizes, pos


def run(p, t, k, h, num_experts, capacity, seed, *, skew=False):
    rng = np.random.default_rng(seed)
    xs = rng.integers(-4, 5, (p, t, h)).astype(np.float32)
    if skew:  # Zipf-like: most slots on a few experts, many experts empty
        ids = np.minimum(rng.zipf(1.5, (p, t, k)) - 1, num_experts - 1).astype(np.int32)
    else:
        ids = rng.integers(0, num_experts, (p, t, k)).astype(np.int32)
    weights = rng.integers(0, 4, (p, t, k)).astype(np.float32) / 4
    mesh = _mesh(p)

    def body(x, e, w):
        tokens, sizes, handle = pk.moe_dispatch(x[0], e[0], "ep", num_experts=num_experts,
                                                capacity=capacity)
        out = pk.moe_combine(tokens * 2, w[0], handle, "ep")
        return tokens[None], sizes[None], handle.position[None], handle.dropped, out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 5))
    tokens, sizes, pos, dropped, out = (np.asarray(v) for v in f(xs, ids, weights))
    bufs, want_sizes, want_pos = model(xs, ids, num_experts, capacity)
    np.testing.assert_array_equal(tokens, bufs)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(dropped, (want_pos < 0).sum(axis=(1, 2)))
    kept = (want_pos >= 0).astype(np.float64)
    want_out = 2 * np.einsum("ptk,ptk,pth->pth", weights, kept, xs)
    np.testing.assert_array_equal(out, want_out)
    for d in range(p):  # rows past the kept ones are zero (grouped_matmul's contract)
        assert not tokens[d, want_sizes[d].sum():].any()

    def loss(x, w):
        return jnp.sum(f(x, ids, w)[4] * jnp.arange(h, dtype=jnp.float32))

    gx, gw = jax.grad(loss, argnums=(0, 1))(xs, weights)
    g = np.arange(h, dtype=np.float64)
    np.testing.assert_allclose(gx, 2 * np.einsum("ptk,ptk->pt", weights, kept)[..., None] * g)
    np.testing.assert_allclose(gw, 2 * kept * (xs @ g)[..., None])
    return int((want_pos < 0).sum())


CASES = [  # p, t, k, h, experts, capacity, skew
    (1, 16, 2, 8, 4, 32, False),
    (2, 16, 2, 8, 8, 64, False),
    (4, 12, 3, 8, 8, 40, True),
    (8, 8, 2, 16, 16, 16, False),
    (8, 10, 4, 8, 32, 200, True),
]


@pytest.mark.parametrize("p,t,k,h,experts,capacity,skew", CASES)
def test_dispatch_combine_against_model(p, t, k, h, experts, capacity, skew):
    run(p, t, k, h, experts, capacity, seed=p * 100 + t, skew=skew)


def test_capacity_overflow_drops_and_counts():
    # 2 ranks x 16 tokens x 2 slots = 64 assignments, 8 rows per rank: most are dropped.
    assert run(2, 16, 2, 8, 4, 8, seed=1) > 0


def test_errors_name_the_fix():
    mesh = _mesh(2)
    x = jnp.zeros((2, 4, 8))
    bad = [
        ({"num_experts": 3, "capacity": 8}, jnp.zeros((2, 4, 2), jnp.int32), "divisible"),
        ({"num_experts": 4, "capacity": 0}, jnp.zeros((2, 4, 2), jnp.int32), "capacity"),
        ({"num_experts": 4, "capacity": 8}, jnp.zeros((2, 4, 2), jnp.float32), "int32"),
        ({"num_experts": 4, "capacity": 8}, jnp.zeros((2, 3, 2), jnp.int32), "expert_ids"),
    ]
    for kw, ids, words in bad:
        f = jax.shard_map(lambda a, e, kw=kw: pk.moe_dispatch(a[0], e[0], "ep", **kw)[0][None],
                          mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
        with pytest.raises((ValueError, TypeError), match=words):
            f(x, ids)


def test_fused_forms_equal_dispatch_grouped_matmul_combine():
    p, t, k, h, f, experts, capacity = 4, 8, 2, 16, 24, 8, 24
    mesh = _mesh(p)
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.integers(-2, 3, (p, t, h)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, experts, (p, t, k)), jnp.int32)
    w = jnp.asarray(rng.integers(0, 3, (p, t, k)) / 2, jnp.float32)
    w1 = jnp.asarray(rng.integers(-1, 2, (experts, h, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.integers(-1, 2, (experts, f, h)), jnp.bfloat16)

    def fused(x, e, wt, a, b):
        hid, _, handle = pk.moe_dispatch_gemm(x[0], e[0], a, "ep", num_experts=experts,
                                              capacity=capacity)
        return pk.moe_gemm_combine(hid, b, wt[0], handle, "ep")[None]

    def unfused(x, e, wt, a, b):
        tok, sizes, handle = pk.moe_dispatch(x[0], e[0], "ep", num_experts=experts,
                                             capacity=capacity)
        y = pk.grouped_matmul(pk.grouped_matmul(tok, a, sizes), b, sizes)
        return pk.moe_combine(y, wt[0], handle, "ep")[None]

    specs = (P("ep"), P("ep"), P("ep"), P("ep"), P("ep"))
    got, want = (jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("ep")))(
        xs, ids, w, w1, w2) for fn in (fused, unfused))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(got, np.float32)).sum() > 0

"""pk_jax.nn ParallelAttention (Flax nnx and Equinox) on a 2 x 4 ("tp", "sp") CPU mesh: ring
(contiguous and zigzag) and Ulysses attention with tensor-parallel projections, grouped-query
heads, against the block on one device with the full weights."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pk_jax as pk
import pk_jax.nn.equinox as pkq
import pk_jax.nn.flax as pkf
from pk_jax.nn import _attn

B, S, F, H, HKV = 2, 32, 64, 8, 4
SEQ = P(None, "sp", None)


def _mesh():
    mesh = jax.make_mesh((2, 4), ("tp", "sp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    pk.init(mesh)
    return mesh


def _x(layout: str):
    x = jax.random.normal(jax.random.key(0), (B, S, F), jnp.float32)
    idx = pk.zigzag_indices(S, 4) if layout == "zigzag" else np.arange(S)
    return x, idx


@pytest.mark.parametrize("kind,layout,causal", [("ring", "contiguous", True),
                                                ("ring", "zigzag", True),
                                                ("ring", "contiguous", False),
                                                ("ulysses", "contiguous", True)])
def test_flax_block_matches_one_device(kind, layout, causal):
    mesh = _mesh()
    model = pkf.ParallelAttention(F, H, num_kv_heads=HKV, axis_name="tp", seq_axis="sp",
                                  attention=kind, causal=causal, layout=layout,
                                  rngs=nnx.Rngs(1))
    graph, state = nnx.split(model)
    specs = pkf.partition_specs(state)
    f = jax.jit(jax.shard_map(lambda st, x: nnx.merge(graph, st)(x), mesh=mesh,
                              in_specs=(specs, SEQ), out_specs=SEQ))
    x, idx = _x(layout)
    y = np.asarray(f(state, x[:, idx]), np.float32)[:, np.argsort(idx)]
    want = _attn.reference_block(x, model.q.kernel[...], model.k.kernel[...],
                                 model.v.kernel[...], model.o.kernel[...], num_heads=H,
                                 num_kv_heads=HKV, causal=causal)
    np.testing.assert_allclose(y, np.asarray(want), atol=4e-2, rtol=4e-2)


def test_equinox_block_matches_one_device_and_has_grads():
    mesh = _mesh()
    model = pkq.ParallelAttention(F, H, key=jax.random.key(2), num_kv_heads=HKV,
                                  axis_name="tp", seq_axis="sp", attention="ulysses")
    params, static = eqx.partition(model, eqx.is_array)
    specs = pkq.partition_specs(params)
    f = jax.shard_map(lambda prm, x: eqx.combine(prm, static)(x), mesh=mesh,
                      in_specs=(specs, SEQ), out_specs=SEQ)
    x, _ = _x("contiguous")
    y = np.asarray(jax.jit(f)(params, x), np.float32)
    want = _attn.reference_block(x, model.q.weight, model.k.weight, model.v.weight,
                                 model.o.weight, num_heads=H, num_kv_heads=HKV, causal=True)
    np.testing.assert_allclose(y, np.asarray(want), atol=4e-2, rtol=4e-2)
    grads = jax.jit(jax.grad(lambda prm: jnp.sum(f(prm, x).astype(jnp.float32) ** 2)))(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).sum()) > 0
               for g in jax.tree.leaves(grads))


def test_bad_heads_name_the_fix():
    with pytest.raises(ValueError, match="num_kv_heads"):
        pkf.ParallelAttention(F, H, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention="):
        pkf.ParallelAttention(F, H, attention="striped", rngs=nnx.Rngs(0))


def test_heads_that_do_not_split_fail_when_the_block_is_built():
    _mesh()  # tp = 2, sp = 4
    with pytest.raises(ValueError, match=r"flax.ParallelAttention: num_heads=3 .*'tp' of size 2"):
        pkf.ParallelAttention(48, 3, axis_name="tp", seq_axis="sp", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_kv_heads=1 .*'tp' of size 2"):
        pkq.ParallelAttention(F, H, num_kv_heads=1, key=jax.random.key(0), axis_name="tp",
                              seq_axis="sp")
    with pytest.raises(ValueError, match=r"num_heads=4 .*Ulysses.*multiple of 8"):
        pkf.ParallelAttention(F, 4, axis_name="tp", seq_axis="sp", attention="ulysses",
                              rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_heads=6 must divide features=64"):
        pkf.ParallelAttention(F, 6, rngs=nnx.Rngs(0))


def test_heads_that_do_not_split_fail_at_the_first_call():
    # Built before the mesh is known: 6 heads of 16 give q 96 columns, which tp = 4 divides,
    # but not the heads: the first call says so instead of failing in a reshape.
    model = pkf.ParallelAttention(96, 6, axis_name="tp", seq_axis="sp", rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((4, 2), ("tp", "sp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    pk.init(mesh)
    graph, state = nnx.split(model)
    f = jax.jit(jax.shard_map(lambda st, x: nnx.merge(graph, st)(x), mesh=mesh,
                              in_specs=(pkf.partition_specs(state), SEQ), out_specs=SEQ))
    with pytest.raises(ValueError, match=r"num_heads=6 .*'tp' of size 4"):
        f(state, jnp.zeros((B, S, 96)))

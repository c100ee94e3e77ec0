"""pk_jax.nn ParallelAttention (Flax nnx and Equinox) on a 2 x 4 ("tp", "sp") CPU mesh: ring
(contiguous and zigzag) and Ulysses attention with tensor-parallel projections, grouped-query
heads, against the block on one device with the full weights; with masks (packed documents'
segment ids, a sliding window, a soft cap, key padding by lengths) too."""

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


def _packed_ids(seed: int = 0) -> np.ndarray:
    """int32 [B, S]: documents of 1..11 positions packed back to back (crossing the shards)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((B, S), np.int32)
    for r in range(B):
        pos, doc = 0, 0
        while pos < S:
            n = int(rng.integers(1, 12))
            ids[r, pos:pos + n], pos, doc = doc, pos + n, doc + 1
    return ids


@pytest.mark.parametrize("kind,layout", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_flax_block_with_masks_matches_one_device(kind, layout):
    """Packed documents (segment ids, laid out like x), a causal sliding window and a soft cap
    (the block's), key padding by lengths (the call's): the block equals the one-device block
    with the same masks, and its gradients are finite."""
    mesh = _mesh()
    model = pkf.ParallelAttention(F, H, num_kv_heads=HKV, axis_name="tp", seq_axis="sp",
                                  attention=kind, layout=layout, local_window_size=(9, 0),
                                  logits_soft_cap=5.0, rngs=nnx.Rngs(3))
    graph, state = nnx.split(model)
    specs = pkf.partition_specs(state)
    f = jax.shard_map(lambda st, x, ids, n: nnx.merge(graph, st)(
        x, segment_ids=ids, key_value_seq_lengths=n), mesh=mesh,
        in_specs=(specs, SEQ, P(None, "sp"), P()), out_specs=SEQ)
    x, idx = _x(layout)
    ids = _packed_ids()
    lengths = jnp.array([S, S - 5], jnp.int32)
    y = np.asarray(jax.jit(f)(state, x[:, idx], ids[:, idx], lengths), np.float32)
    want = _attn.reference_block(x, model.q.kernel[...], model.k.kernel[...],
                                 model.v.kernel[...], model.o.kernel[...], num_heads=H,
                                 num_kv_heads=HKV, causal=True, segment_ids=jnp.asarray(ids),
                                 local_window_size=(9, 0), logits_soft_cap=5.0,
                                 key_value_seq_lengths=lengths)
    np.testing.assert_allclose(y[:, np.argsort(idx)], np.asarray(want), atol=4e-2, rtol=4e-2)
    loss = lambda st: jnp.sum(f(st, x[:, idx], ids[:, idx], lengths).astype(jnp.float32) ** 2)
    grads = jax.jit(jax.grad(loss))(state)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_equinox_block_with_segments_matches_one_device():
    mesh = _mesh()
    model = pkq.ParallelAttention(F, H, key=jax.random.key(4), num_kv_heads=HKV,
                                  axis_name="tp", seq_axis="sp", attention="ring")
    params, static = eqx.partition(model, eqx.is_array)
    specs = pkq.partition_specs(params)
    f = jax.shard_map(lambda prm, x, ids: eqx.combine(prm, static)(x, segment_ids=ids),
                      mesh=mesh, in_specs=(specs, SEQ, P(None, "sp")), out_specs=SEQ)
    x, _ = _x("contiguous")
    ids = _packed_ids(1)
    y = np.asarray(jax.jit(f)(params, x, ids), np.float32)
    want = _attn.reference_block(x, model.q.weight, model.k.weight, model.v.weight,
                                 model.o.weight, num_heads=H, num_kv_heads=HKV, causal=True,
                                 segment_ids=jnp.asarray(ids))
    np.testing.assert_allclose(y, np.asarray(want), atol=4e-2, rtol=4e-2)


def test_bad_static_masks_fail_when_the_block_is_built():
    with pytest.raises(ValueError, match=r"nn.flax.ParallelAttention: local_window_size=\(-1, 0\)"):
        pkf.ParallelAttention(F, H, local_window_size=(-1, 0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="nn.equinox.ParallelAttention: logits_soft_cap"):
        pkq.ParallelAttention(F, H, key=jax.random.key(0), logits_soft_cap=0.0)
    block = pkq.ParallelAttention(F, H, key=jax.random.key(0), local_window_size=16)
    assert block.local_window_size == (16, 16)

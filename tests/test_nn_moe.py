"""The expert-parallel MoE block (pk_jax.nn.flax.MoE, pk_jax.nn.equinox.MoE) on CPU host
devices: the same function as a one-device reference with the full weights, a balanced-router
loss near 1, and a training step that lowers the loss."""

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
from pk_jax.nn import _moe

H, F, E, K, T = 16, 32, 8, 2, 12  # width, expert hidden, experts, top-k, tokens per device


def _mesh(p):
    mesh = jax.make_mesh((p,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])
    pk.init(mesh)
    return mesh


def _flax_fn(model, mesh):
    graph, state = nnx.split(model)
    specs = pkf.partition_specs(state)

    def body(st, x):
        return nnx.merge(graph, st)(x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep")),
                                 out_specs=(P("ep"), P()))), state


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_flax_moe_matches_the_reference(p):
    mesh = _mesh(p)
    model = pkf.MoE(H, F, E, top_k=K, axis_name="ep", capacity_factor=float(p),
                    dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    f, state = _flax_fn(model, mesh)
    x = jax.random.normal(jax.random.key(1), (p * T, H), jnp.float32)
    y, aux = f(state, x)
    want = _moe.reference_moe(x, model.router[...], model.w1[...], model.w2[...], top_k=K,
                              activation=jax.nn.gelu)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)
    assert 0.5 < float(aux) < float(E)


def test_equinox_moe_matches_the_reference():
    mesh = _mesh(4)
    model = pkq.MoE(H, F, E, key=jax.random.key(2), top_k=K, axis_name="ep",
                    capacity_factor=4.0)
    params, static = eqx.partition(model, eqx.is_array)
    specs = pkq.partition_specs(params)
    f = jax.jit(jax.shard_map(lambda prm, x: eqx.combine(prm, static)(x), mesh=mesh,
                              in_specs=(specs, P("ep")), out_specs=(P("ep"), P())))
    x = jax.random.normal(jax.random.key(3), (4 * T, H), jnp.float32)
    y, _ = f(params, x)
    want = _moe.reference_moe(x, model.router, model.w1, model.w2, top_k=K,
                              activation=jax.nn.gelu)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_flax_moe_trains():
    mesh = _mesh(4)
    model = pkf.MoE(H, F, E, top_k=K, axis_name="ep", rngs=nnx.Rngs(4))
    graph, state = nnx.split(model)
    specs = pkf.partition_specs(state)
    x = jax.random.normal(jax.random.key(5), (4 * T, H), jnp.float32)
    target = jnp.tanh(x[:, ::-1])

    def loss(st):
        def body(s, xx, tt):
            y, aux = nnx.merge(graph, s)(xx)
            err = jax.lax.pmean(jnp.mean((y.astype(jnp.float32) - tt) ** 2), "ep")
            return err + 0.01 * aux

        return jax.shard_map(body, mesh=mesh, in_specs=(specs, P("ep"), P("ep")),
                             out_specs=P())(st, x, target)

    step = jax.jit(lambda st: jax.tree.map(lambda w, g: w - 0.5 * g, st, jax.grad(loss)(st)))
    first = float(jax.jit(loss)(state))
    for _ in range(30):
        state = step(state)
    assert float(jax.jit(loss)(state)) < 0.8 * first


def test_moe_rejects_full_weights_inside_shard_map():
    mesh = _mesh(2)
    model = pkf.MoE(H, F, E, top_k=K, axis_name="ep", rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    f = jax.shard_map(lambda st, x: nnx.merge(graph, st)(x), mesh=mesh,
                      in_specs=(P(), P("ep")), out_specs=(P("ep"), P()))
    with pytest.raises(ValueError, match="partition specs"):
        f(state, jnp.zeros((2 * T, H)))


def test_moe_sizes_that_do_not_split_fail_when_the_block_is_built():
    _mesh(8)
    with pytest.raises(ValueError, match=r"flax.MoE: num_experts=12 .*'ep' of size 8"):
        pkf.MoE(H, F, 12, axis_name="ep", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"equinox.MoE: hidden=20 .*multiple of 8"):
        pkq.MoE(H, 20, E, key=jax.random.key(0), axis_name="ep")
    with pytest.raises(ValueError, match=r"top_k=9 must be in 1..num_experts"):
        pkf.MoE(H, F, E, top_k=9, axis_name="ep", rngs=nnx.Rngs(0))


def test_moe_example_runs():
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, str(root / "examples" / "04_moe_flax.py"), "--steps",
                          "3"], capture_output=True, text=True, timeout=300, env=env,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(line.split()[3]) for line in out.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0], out.stdout

"""pk_jax.nn.flax: the tensor-parallel MLP equals the unsharded MLP (forward and gradients) in
both modes on P = 1, 2, 4, 8, and optax training lowers its loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from util import P, cpu_mesh, product

import pk_jax as pk
from pk_jax import nn as pknn
from pk_jax.nn import flax as pkn

FEATURES, HIDDEN, SEQ, BATCH = 32, 64, 16, 2
BIAS_INIT = jax.nn.initializers.normal(0.5)  # non-zero, so a bias added P times would show
REL_TOL = {jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 5e-3}


def _setup(p, sp, dtype=jnp.bfloat16, *, mesh=None, x_spec=None):
    mesh = mesh or cpu_mesh((p,), ("tp",))
    pk.init(mesh)
    model = pkn.ParallelMLP(FEATURES, HIDDEN, sequence_parallel=sp, dtype=dtype,
                            bias_init=BIAS_INIT, rngs=nnx.Rngs(0))
    full = model.full_weights()
    pkn.shard(model, mesh)
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)
    if x_spec is None:
        x_spec = P("tp") if sp else P()

    def apply(params, x):
        local = lambda params, x: nnx.merge(graphdef, params)(x)
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)(
            params, x)

    def place(x):
        return jax.device_put(x, NamedSharding(mesh, x_spec))

    apply.local = lambda params, x: nnx.merge(graphdef, params)(x)
    apply.specs, apply.x_spec, apply.mesh = specs, x_spec, mesh
    return full, params, apply, place


def _grads_by_name(g) -> dict:
    return {"w1": g["up"]["kernel"][...], "b1": g["up"]["bias"][...],
            "w2": g["down"]["kernel"][...], "b2": g["down"]["bias"][...]}


def _assert_rel_close(actual, expected, dtype, what):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected))) or 1.0
    err = float(np.max(np.abs(actual - expected))) / scale
    assert err <= REL_TOL[jnp.dtype(dtype)], f"{what}: max error {err:.3g} of max |ref| {scale:.3g}"


@pytest.mark.parametrize("p,sp,dtype", product((1, 2, 4, 8), (False, True), (jnp.bfloat16,))
                         + product((8,), (False, True), (jnp.float16,)))
def test_tp_mlp_equals_unsharded(p, sp, dtype):
    full, params, apply, place = _setup(p, sp, dtype)
    kx, kr = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (SEQ, BATCH, FEATURES), jnp.float32)
    r = jax.random.normal(kr, (SEQ, BATCH, FEATURES), jnp.float32)

    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * r), y

    (_, y), (g, dx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, place(x))

    def ref_loss(w, x):
        y = pknn.reference_mlp(x, **w, dtype=dtype)
        return jnp.sum(y.astype(jnp.float32) * r), y

    (_, y_ref), (g_ref, dx_ref) = jax.value_and_grad(ref_loss, (0, 1), has_aux=True)(full, x)
    assert y.shape == y_ref.shape and y.dtype == jnp.dtype(dtype)
    _assert_rel_close(y, y_ref, dtype, "output")
    _assert_rel_close(dx, dx_ref, dtype, "dx")
    for name, value in _grads_by_name(g).items():
        assert value.shape == full[name].shape
        _assert_rel_close(value, g_ref[name], dtype, f"d{name}")


@pytest.mark.parametrize("sp", [False, True])
def test_gradients_taken_inside_shard_map(sp):
    # The whole step inside shard_map (check_vma=True): the loss sums over the sharded rows
    # with a psum in sequence-parallel mode; the gradients are the local shards.
    full, params, apply, place = _setup(4, sp)
    x = jax.random.normal(jax.random.key(4), (SEQ, BATCH, FEATURES), jnp.float32)

    def local_grads(params, x):
        def loss(params, x):
            total = jnp.sum(apply.local(params, x).astype(jnp.float32) ** 2)
            return jax.lax.psum(total, "tp") if sp else total

        return jax.grad(loss, (0, 1))(params, x)

    f = jax.shard_map(local_grads, mesh=apply.mesh, in_specs=(apply.specs, apply.x_spec),
                      out_specs=(apply.specs, apply.x_spec))
    g, dx = jax.jit(f)(params, place(x))
    g_ref, dx_ref = jax.grad(
        lambda w, x: jnp.sum(pknn.reference_mlp(x, **w).astype(jnp.float32) ** 2), (0, 1))(
        full, x)
    _assert_rel_close(dx, dx_ref, jnp.bfloat16, "dx")
    for name, value in _grads_by_name(g).items():
        _assert_rel_close(value, g_ref[name], jnp.bfloat16, f"d{name}")


@pytest.mark.parametrize("p,sp", product((1, 2, 4, 8), (False, True)))
def test_training_lowers_the_loss(p, sp):
    _, params, apply, place = _setup(p, sp)
    kx, kt = jax.random.split(jax.random.key(2))
    x = place(jax.random.normal(kx, (SEQ, BATCH, FEATURES), jnp.float32))
    target = place(jnp.tanh(jax.random.normal(kt, (SEQ, BATCH, FEATURES), jnp.float32)))
    tx = optax.adam(3e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss_fn(params):
            return jnp.mean((apply(params, x).astype(jnp.float32) - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(6):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    # The parameters keep their sharding through the optimiser.
    assert params["up"]["kernel"][...].sharding.spec == P(None, "tp")


@pytest.mark.parametrize("explicit", [True, False])
def test_2d_mesh_data_and_tensor_parallel(explicit):
    mesh = cpu_mesh((2, 4), ("dp", "tp"), explicit=explicit)
    full, params, apply, place = _setup(4, False, mesh=mesh, x_spec=P(None, "dp"))
    x = jax.random.normal(jax.random.key(3), (SEQ, BATCH, FEATURES), jnp.float32)

    def loss(params, x):
        return jnp.sum(apply(params, x).astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss))(params, place(x))
    g_ref = jax.grad(lambda w: jnp.sum(pknn.reference_mlp(x, **w).astype(jnp.float32) ** 2))(
        full)
    for name, value in _grads_by_name(g).items():
        _assert_rel_close(value, g_ref[name], jnp.bfloat16, f"d{name}")


def test_eager_sharding_under_set_mesh():
    mesh = cpu_mesh((4,), ("tp",))
    with jax.set_mesh(mesh):
        model = pkn.ParallelMLP(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
    assert model.up.kernel[...].sharding.spec == P(None, "tp")
    assert model.down.kernel[...].sharding.spec == P("tp", None)


def test_full_weights_inside_shard_map_fail_clearly():
    mesh = cpu_mesh((4,), ("tp",))
    pk.init(mesh)
    model = pkn.ParallelMLP(FEATURES, HIDDEN, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    f = jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh, in_specs=(P(), P()),
                      out_specs=P())
    with pytest.raises(ValueError, match=r"FULL weight.*partition_specs"):
        jax.jit(f)(params, jnp.ones((8, FEATURES)))


def test_sequence_parallel_row_layer_needs_a_divisible_first_dimension():
    mesh = cpu_mesh((4,), ("tp",))
    pk.init(mesh)
    layer = pkn.RowParallelLinear(HIDDEN, FEATURES, sequence_parallel=True, rngs=nnx.Rngs(0))
    pkn.shard(layer, mesh)
    graphdef, params = nnx.split(layer)
    f = jax.shard_map(lambda p, h: nnx.merge(graphdef, p)(h), mesh=mesh,
                      in_specs=(pkn.partition_specs(params), P(None, "tp")), out_specs=P("tp"))
    h = jax.device_put(jnp.ones((6, HIDDEN)), NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(ValueError, match=r"first dimension.*multiple of 4"):
        jax.jit(f)(params, h)


def test_out_features_not_divisible_by_p_fails_at_the_first_call():
    # Built before any mesh is known: the first call checks it, at trace time.
    layer = pkn.ColumnParallelLinear(FEATURES, 10, rngs=nnx.Rngs(0))
    mesh = cpu_mesh((4,), ("tp",))
    pk.init(mesh)
    graphdef, params = nnx.split(layer)
    f = jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=mesh,
                      in_specs=(P(), P()), out_specs=P(None, "tp"))
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: out_features=10 .*size 4.*8 or "
                                         r"12"):
        jax.jit(f)(params, jnp.ones((8, FEATURES)))


def test_row_layer_local_k_not_a_multiple_of_8_fails_at_the_first_call():
    layer = pkn.RowParallelLinear(32, FEATURES, rngs=nnx.Rngs(0))  # K/P = 4 at P = 8
    mesh = cpu_mesh((8,), ("tp",))
    pk.init(mesh)
    graphdef, params = nnx.split(pkn.shard(layer, mesh))
    f = jax.shard_map(lambda p, h: nnx.merge(graphdef, p)(h), mesh=mesh,
                      in_specs=(pkn.partition_specs(params), P(None, "tp")), out_specs=P())
    h = jax.device_put(jnp.ones((8, 32)), NamedSharding(mesh, P(None, "tp")))
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features=32 .*multiple of 64"):
        jax.jit(f)(params, h)


def test_sizes_that_do_not_split_fail_when_the_layer_is_built():
    pk.init(cpu_mesh((8,), ("tp",)))  # the axis size is known from pk.init's mesh
    with pytest.raises(ValueError, match=r"flax.ColumnParallelLinear: out_features=100 .*axis "
                                         r"'tp' of size 8.*Pick e.g. 96 or 104"):
        pkn.ColumnParallelLinear(32, 100, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ColumnParallelLinear: in_features=30 .*multiple of 8"):
        pkn.ColumnParallelLinear(30, 64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"RowParallelLinear: in_features=32 .*size 8.*"
                                         r"multiple of 64"):
        pkn.RowParallelLinear(32, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"flax.ParallelMLP: hidden=100 .*64 or 128"):
        pkn.ParallelMLP(32, 100, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"flax.ParallelMLP: features=20"):
        pkn.ParallelMLP(20, 128, rngs=nnx.Rngs(0))
    pkn.ParallelMLP(32, 64, rngs=nnx.Rngs(0))  # what does split is accepted
    # Another axis name: its size is not known yet, so only the first call can check it.
    pkn.ColumnParallelLinear(32, 100, axis_name="model", rngs=nnx.Rngs(0))
    # A mesh set with jax.set_mesh comes first.
    with (jax.set_mesh(cpu_mesh((4,), ("model",))),
          pytest.raises(ValueError, match=r"out_features=10 .*'model' of size 4")):
        pkn.ColumnParallelLinear(32, 10, axis_name="model", rngs=nnx.Rngs(0))


def test_fp32_compute_dtype_is_refused():
    with pytest.raises(TypeError, match="dtype=float32"):
        pkn.ColumnParallelLinear(FEATURES, HIDDEN, dtype=jnp.float32, rngs=nnx.Rngs(0))

"""The checks of the tensor-parallel MLP block that pk_jax.nn.flax and pk_jax.nn.equinox share
(tests/test_nn_flax.py, tests/test_nn_equinox.py): each test file passes its framework as an
adapter `fw` with
    model(sp, dtype, fp8=None) -> ParallelMLP(FEATURES, HIDDEN) built from one seed
    split(model, mesh) -> (params, specs, merge): the parameters placed on the mesh, their
        PartitionSpecs, and merge(params) -> the module
    grads_by_name(g) -> {"w1", "b1", "w2", "b2"}; apply_updates(params, updates) (optax's
    update applied); up_kernel(params) -> the first layer's weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from util import P, cpu_mesh

import pk_jax as pk
from pk_jax import nn as pknn

FEATURES, HIDDEN, SEQ, BATCH = 32, 64, 16, 2
BIAS_INIT = jax.nn.initializers.normal(0.5)  # non-zero, so a bias added P times would show
REL_TOL = {jnp.dtype(jnp.bfloat16): 3e-2, jnp.dtype(jnp.float16): 5e-3}


def setup(fw, p, sp, dtype=jnp.bfloat16, *, mesh=None, x_spec=None, fp8=None):
    """(full weights, params, apply, place): apply(params, x) runs the model under shard_map
    (apply.local inside one), place(x) puts x on the mesh as the model takes it."""
    mesh = mesh or cpu_mesh((p,), ("tp",))
    pk.init(mesh)
    model = fw.model(sp, dtype, fp8=fp8)
    full = model.full_weights()
    params, specs, merge = fw.split(model, mesh)
    if x_spec is None:
        x_spec = P("tp") if sp else P()

    def local(params, x):
        return merge(params)(x)

    def apply(params, x):
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)(
            params, x)

    def place(x):
        return jax.device_put(x, NamedSharding(mesh, x_spec))

    apply.local = local
    apply.specs, apply.x_spec, apply.mesh = specs, x_spec, mesh
    return full, params, apply, place


def rel_error(actual, expected) -> tuple[float, float]:
    """(max |actual - expected| / max |expected|, max |expected|), in float32."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = float(np.max(np.abs(expected))) or 1.0
    return float(np.max(np.abs(actual - expected))) / scale, scale


def assert_rel_close(actual, expected, dtype, what):
    err, scale = rel_error(actual, expected)
    assert err <= REL_TOL[jnp.dtype(dtype)], f"{what}: max error {err:.3g} of max |ref| {scale:.3g}"


def value_and_grads(fw, p, sp, dtype, x, r, *, fp8=None):
    """The model's output y, dx and named weight gradients of sum(y * r), and the full weights."""
    full, params, apply, place = setup(fw, p, sp, dtype, fp8=fp8)

    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * r), y

    (_, y), (g, dx) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, place(x))
    return y, dx, fw.grads_by_name(g), full


def reference_value_and_grads(full, x, r, dtype):
    def ref_loss(w, x):
        y = pknn.reference_mlp(x, **w, dtype=dtype)
        return jnp.sum(y.astype(jnp.float32) * r), y

    (_, y), (g, dx) = jax.value_and_grad(ref_loss, (0, 1), has_aux=True)(full, x)
    return y, dx, g


def tp_mlp_equals_unsharded(fw, p, sp, dtype):
    kx, kr = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (SEQ, BATCH, FEATURES), jnp.float32)
    r = jax.random.normal(kr, (SEQ, BATCH, FEATURES), jnp.float32)
    y, dx, g, full = value_and_grads(fw, p, sp, dtype, x, r)
    y_ref, dx_ref, g_ref = reference_value_and_grads(full, x, r, dtype)
    assert y.shape == y_ref.shape and y.dtype == jnp.dtype(dtype)
    assert_rel_close(y, y_ref, dtype, "output")
    assert_rel_close(dx, dx_ref, dtype, "dx")
    for name, value in g.items():
        assert value.shape == full[name].shape
        assert_rel_close(value, g_ref[name], dtype, f"d{name}")


def gradients_taken_inside_shard_map(fw, sp):
    # The whole step inside shard_map (check_vma=True): the loss sums over the sharded rows
    # with a psum in sequence-parallel mode; the gradients are the local shards.
    full, params, apply, place = setup(fw, 4, sp)
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
    assert_rel_close(dx, dx_ref, jnp.bfloat16, "dx")
    for name, value in fw.grads_by_name(g).items():
        assert_rel_close(value, g_ref[name], jnp.bfloat16, f"d{name}")


def training_lowers_the_loss(fw, p, sp):
    _, params, apply, place = setup(fw, p, sp)
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
        return fw.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(6):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    # The parameters keep their sharding through the optimiser.
    assert fw.up_kernel(params).sharding.spec == P(None, "tp")


def mesh_2d_data_and_tensor_parallel(fw, explicit):
    mesh = cpu_mesh((2, 4), ("dp", "tp"), explicit=explicit)
    full, params, apply, place = setup(fw, 4, False, mesh=mesh, x_spec=P(None, "dp"))
    x = jax.random.normal(jax.random.key(3), (SEQ, BATCH, FEATURES), jnp.float32)

    def loss(params, x):
        return jnp.sum(apply(params, x).astype(jnp.float32) ** 2)

    g = jax.jit(jax.grad(loss))(params, place(x))
    g_ref = jax.grad(lambda w: jnp.sum(pknn.reference_mlp(x, **w).astype(jnp.float32) ** 2))(
        full)
    for name, value in fw.grads_by_name(g).items():
        assert_rel_close(value, g_ref[name], jnp.bfloat16, f"d{name}")

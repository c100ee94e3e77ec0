"""pk_jax.nn.flax: the tensor-parallel MLP equals the unsharded MLP (forward and gradients) in
both modes on P = 1, 2, 4, 8, and optax training lowers its loss (tests/nn_mlp.py, shared with
pk_jax.nn.equinox); the layers' flax-specific behaviour and errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import nn_mlp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from nn_mlp import BIAS_INIT, FEATURES, HIDDEN
from util import P, cpu_mesh, product

import pk_jax as pk
from pk_jax.nn import flax as pkn


class FW:
    """pk_jax.nn.flax for tests/nn_mlp.py."""

    @staticmethod
    def model(sp, dtype, fp8=None):
        return pkn.ParallelMLP(FEATURES, HIDDEN, sequence_parallel=sp, dtype=dtype, fp8=fp8,
                               bias_init=BIAS_INIT, rngs=nnx.Rngs(0))

    @staticmethod
    def split(model, mesh):
        pkn.shard(model, mesh)
        graphdef, params = nnx.split(model)
        return params, pkn.partition_specs(params), lambda params: nnx.merge(graphdef, params)

    @staticmethod
    def grads_by_name(g):
        return {"w1": g["up"]["kernel"][...], "b1": g["up"]["bias"][...],
                "w2": g["down"]["kernel"][...], "b2": g["down"]["bias"][...]}

    apply_updates = staticmethod(optax.apply_updates)

    @staticmethod
    def up_kernel(params):
        return params["up"]["kernel"][...]


@pytest.mark.parametrize("p,sp,dtype", product((1, 2, 4, 8), (False, True), (jnp.bfloat16,))
                         + product((8,), (False, True), (jnp.float16,)))
def test_tp_mlp_equals_unsharded(p, sp, dtype):
    nn_mlp.tp_mlp_equals_unsharded(FW, p, sp, dtype)


@pytest.mark.parametrize("sp", [False, True])
def test_gradients_taken_inside_shard_map(sp):
    nn_mlp.gradients_taken_inside_shard_map(FW, sp)


@pytest.mark.parametrize("p,sp", product((1, 2, 4, 8), (False, True)))
def test_training_lowers_the_loss(p, sp):
    nn_mlp.training_lowers_the_loss(FW, p, sp)


@pytest.mark.parametrize("explicit", [True, False])
def test_2d_mesh_data_and_tensor_parallel(explicit):
    nn_mlp.mesh_2d_data_and_tensor_parallel(FW, explicit)


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

"""The FFI wiring: pk_ping (y = x + rank) through the CPU handler under jit(shard_map), with
check_vma on; the CUDA handler on the GPU machine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import P, cpu_mesh, run

from pk_jax.ops.ping import ping


@pytest.mark.needs_ext
@pytest.mark.parametrize("explicit", [True, False])
def test_ping_cpu_handler_adds_rank(explicit):
    mesh = cpu_mesh((4, 2), ("dp", "tp"), explicit=explicit)
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    y = run(lambda a: ping(a, "tp"), mesh, (P("dp", "tp"),), P("dp", "tp"), x)
    rank = np.repeat(np.arange(2), 3)[None, :]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) + rank)


@pytest.mark.gpu
def test_ping_cuda_handler_in_jit_shard_map():
    gpu = jax.devices("gpu")[:1]
    mesh = jax.make_mesh((1,), ("tp",), devices=gpu)
    x = jax.random.normal(jax.random.key(0), (1000, 3), jnp.float32)
    for _ in range(2):  # the output varies along "tp" (it holds the rank)
        y = run(lambda a: ping(a, "tp"), mesh, (P("tp"),), P("tp"), x)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))

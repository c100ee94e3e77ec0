"""Executables compiled before pk.shutdown() stay correct after a new pk.init (issue 10 item 4):
XLA records pk's handlers into CUDA graphs, whose kernel arguments hold the communicator's
addresses; after shutdown those addresses are unmapped, so a replay of the old graph must never
happen."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import util

import pk_jax as pk
from pk_jax import cost_model

pytestmark = pytest.mark.gpu


def test_jitted_ops_after_shutdown_and_init_with_another_workspace():
    mesh = util.gpu_mesh("gemm_rs", workspace_bytes=32 << 20)

    def body(x, w):
        return pk.all_reduce(x @ w, "tp"), pk.gemm_reduce_scatter(x, w, "tp")

    with cost_model.override(mode="fused"):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                  out_specs=(P(), P("tp"))))
        rng = np.random.default_rng(0)
        outs = []
        for step in range(3):
            x = jnp.asarray(rng.integers(-2, 3, (512, 256)), jnp.bfloat16)
            w = jnp.asarray(rng.integers(-2, 3, (256, 384)), jnp.bfloat16)
            want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
            for _ in range(2):  # replays of the same executable
                a, b = f(x, w)
                outs.append((np.asarray(a, np.float32), np.asarray(b, np.float32), want))
            pk.shutdown()
            pk.init(mesh, workspace_bytes=(64 << 20) * (step + 1))
    for a, b, want in outs:
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)

"""Shared trace-time helpers of the fused tensor-parallel GEMM lowerings (gemm_rs, ag_gemm,
gemm_ar): the cost-model plan for a call, the N padding TMA needs, and the workspace check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import cost_model
from pk_jax.runtime import state


def gpu() -> cost_model.GPU:
    mesh = state.mesh_or_none()
    kind = next(iter(mesh.devices.flat)).device_kind if mesh is not None else ""
    return cost_model.gpu_for(kind)


def plan(op: str, m: int, n: int, k: int, p: int, dtype) -> cost_model.Plan:
    """The cost model's plan for one call (overrides applied): at P > 1 the fused kernel
    wherever the model predicts it beats pk.matmul + the pk collective, else that serial path.

    NOTES: the fused kernels run by default across ranks since they passed the rank emulator
    (tests/gpu/test_emulator.py: P = 2, 3, 4, 8 ranks truly concurrent on disjoint SM
    partitions, 1000 back-to-back calls with skew, missing ranks, unequal partitions).
    """
    itemsize = np.dtype(dtype).itemsize
    return cost_model.plan(op, m, n, k, p, itemsize=itemsize, gpu=gpu())


def pad_n(w: jax.Array) -> tuple[jax.Array, int]:
    """w with its columns padded to a multiple of 8 (16-byte TMA rows), and the padded N."""
    n = w.shape[1]
    n_pad = -(-n // 8) * 8
    if n_pad != n:
        w = jnp.pad(w, ((0, 0), (0, n_pad - n)))
    return w, n_pad


def check_workspace(name: str, need: int, what: str) -> None:
    """Raises ValueError when the symmetric workspace cannot hold `need` bytes."""
    have = state.workspace_bytes()
    if need > have:
        mib = -(-need // (1 << 20))
        raise ValueError(
            f"pk.{name}: this call needs {need} bytes of symmetric workspace per device for "
            f"{what}, and pk.init was given {have}. Call pk.init(mesh, "
            f"workspace_bytes={mib << 20}) (or more), or use smaller shards.")

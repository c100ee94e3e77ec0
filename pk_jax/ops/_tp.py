"""Shared trace-time helpers of the fused tensor-parallel GEMM lowerings (gemm_rs, ag_gemm,
gemm_ar): the N padding TMA needs, and the workspace check. Which path a call takes is
decided in one place, `pk_jax._backend.route`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pk_jax.runtime import state


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

"""Process-wide pk_jax state: the mesh given to `pk.init`, and its communicators.

`init` is collective (every process calls it with the same mesh) and idempotent for the same
mesh; `shutdown` releases everything and is also run at exit.
"""

from __future__ import annotations

import atexit
import os
import threading

import jax

_lock = threading.Lock()
_mesh: jax.sharding.Mesh | None = None
_options: dict = {}

DEFAULT_TIMEOUT_S = 60.0


def mesh_or_none() -> jax.sharding.Mesh | None:
    return _mesh


def options() -> dict:
    return dict(_options)


def resolve_timeout(value: float | None = None) -> float:
    """The spin-wait timeout: the argument, else PK_JAX_TIMEOUT_S, else 60 s."""
    if value is None:
        value = float(os.environ.get("PK_JAX_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    if not value > 0:
        raise ValueError(f"pk.init: timeout_s must be positive, got {value}.")
    return float(value)


def init(mesh: jax.sharding.Mesh, *, workspace_bytes: int | None = None,
         timeout_s: float | None = None) -> None:
    """Registers `mesh` with pk_jax and sets up its communicators.

    Call once, outside jit, on every process, before any pk op runs over the mesh. Calling it
    again with the same mesh does nothing.

    Args:
        mesh: the mesh that the shard_maps calling pk ops use.
        workspace_bytes: size of each symmetric workspace; default: sized for the ops.
        timeout_s: how long a kernel waits for a peer before it fails (default 60 s, or the
            environment variable PK_JAX_TIMEOUT_S).

    Raises:
        TypeError: `mesh` is not a jax.sharding.Mesh.
        ValueError: pk.init was already called with another mesh, or a bad option.
    """
    global _mesh, _options
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"pk.init: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if workspace_bytes is not None and (not isinstance(workspace_bytes, int)
                                        or workspace_bytes <= 0):
        raise ValueError(f"pk.init: workspace_bytes must be a positive int, got {workspace_bytes!r}.")
    opts = {"workspace_bytes": workspace_bytes, "timeout_s": resolve_timeout(timeout_s)}
    with _lock:
        if _mesh is not None:
            if _mesh == mesh and opts == _options:
                return
            raise ValueError(
                "pk.init: pk_jax is already initialised with another mesh or other options "
                f"(axes {tuple(_mesh.axis_names)}, shape {dict(_mesh.shape)}). Call "
                "pk.shutdown() first."
            )
        _mesh, _options = mesh, opts


def shutdown() -> None:
    """Releases every communicator and forgets the mesh. Safe to call more than once."""
    global _mesh, _options
    with _lock:
        _mesh, _options = None, {}


atexit.register(shutdown)


def axis_on_one_host(axis_name: str) -> bool:
    """Whether every group of devices along `axis_name` lies on one host (one NVLink domain).

    Single-process meshes always do. With several processes, hosts are told apart by
    `process_index` groups recorded at init by the runtime (`_hosts`), defaulting to one host.
    """
    if _mesh is None or not _hosts:
        return True
    axis = _mesh.axis_names.index(axis_name)
    groups = _mesh.devices.swapaxes(axis, -1).reshape(-1, _mesh.devices.shape[axis])
    return all(len({_hosts.get(d.process_index, 0) for d in group}) == 1 for group in groups)


# process_index -> host id, filled in by the runtime at init when several processes run.
_hosts: dict[int, int] = {}

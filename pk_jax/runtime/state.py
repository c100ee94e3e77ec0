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
_runtime = None  # comm.Runtime while communicators exist (GPU meshes with the extension)

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
        workspace_bytes: bytes of each symmetric workspace (one per device and mesh axis);
            default 64 MiB. The ops' errors say how many they need.
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
        raise ValueError("pk.init: workspace_bytes must be a positive int, got "
                         f"{workspace_bytes!r}.")
    opts = {"workspace_bytes": workspace_bytes, "timeout_s": resolve_timeout(timeout_s)}
    global _runtime
    with _lock:
        if _mesh is not None:
            if _mesh == mesh and opts == _options:
                return
            raise ValueError(
                "pk.init: pk_jax is already initialised with another mesh or other options "
                f"(axes {tuple(_mesh.axis_names)}, shape {dict(_mesh.shape)}). Call "
                "pk.shutdown() first."
            )
        if uses_symmetric_memory(mesh):
            from pk_jax.runtime import comm

            _runtime = comm.Runtime.create(mesh, workspace_bytes=workspace_bytes,
                                           timeout_s=opts["timeout_s"])
            _hosts.clear()
            _hosts.update(_runtime.hosts)
        _mesh, _options = mesh, opts


def uses_symmetric_memory(mesh: jax.sharding.Mesh) -> bool:
    """Whether pk.init builds communicators for `mesh`: it is on GPUs, the extension is built
    and PK_JAX_BACKEND is not "reference". Otherwise pk.init is bookkeeping only."""
    from pk_jax import _ffi

    if os.environ.get("PK_JAX_BACKEND", "auto").strip().lower() == "reference":
        return False
    if not _ffi.HAS_CUDA or not hasattr(_ffi._pk_ffi, "comm_register"):
        return False
    return all(d.platform == "gpu" for d in mesh.devices.flat)


def runtime():
    """The communicators of the current pk.init (a comm.Runtime), or None on CPU meshes."""
    return _runtime


def comm_id(axis_name: str) -> int:
    """The static id the ops pass to their handlers for `axis_name` (an FFI attribute).

    Every group along the axis has the same id; a handler finds its own group's communicator by
    (comm_id, DeviceOrdinal).

    Raises:
        ValueError: pk.init was not called, or `axis_name` is not an axis of its mesh.
    """
    mesh = _mesh
    if mesh is None:
        raise ValueError(f"pk_jax: pk.init(mesh) must be called before using axis "
                         f"{axis_name!r}.")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"pk_jax: axis {axis_name!r} is not an axis of the mesh given to "
                         f"pk.init (axes {tuple(mesh.axis_names)}).")
    return mesh.axis_names.index(axis_name)


def workspace_bytes() -> int:
    """Bytes of each symmetric workspace: pk.init's workspace_bytes, else the default."""
    from pk_jax.runtime import comm

    return _options.get("workspace_bytes") or comm.DEFAULT_WORKSPACE_BYTES


def signal_count() -> int:
    """uint64 counters in each signal pad."""
    from pk_jax.runtime import comm

    return _runtime.signal_count if _runtime is not None else comm.DEFAULT_SIGNAL_COUNT


def shutdown() -> None:
    """Releases every communicator and forgets the mesh. Safe to call more than once.

    Local only (no rendezvous): it unmaps this process's views of its peers' memory and
    releases its own; memory a peer still maps stays alive until that peer shuts down too.
    """
    global _mesh, _options, _runtime
    with _lock:
        rt, _runtime = _runtime, None
        _mesh, _options = None, {}
        _hosts.clear()
        if rt is not None:
            rt.close()


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception:  # noqa: BLE001, S110 -- the driver may be going away; the OS reclaims it
        pass


atexit.register(_shutdown_at_exit)


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

"""Process-wide pk_jax state: the meshes given to `pk.init`, their communicators, and the
settings fixed at the first `pk.init`.

`init` is collective (every process calls it with the same meshes, in the same order) and
idempotent for a mesh it already has; another mesh is added beside the first ones. `shutdown`
releases everything and is also run at exit. JAX's compilation caches are cleared when they
could hold an executable that is wrong after the next `pk.init`: at a shutdown that releases
communicators (an executable, or a CUDA graph recorded from one, would use them), and at a
`pk.init` whose settings differ from those pk ops were traced with. A function jitted before is
then traced again; otherwise its executable stays valid and is reused.

Communicator ids. An op finds its communicator by a static id (an FFI attribute) and the device
ordinal. Inside `shard_map` an op sees only the abstract mesh (axis names and sizes), so ids are
given per *signature* (the mesh's axis names, its shape, and the axis): meshes of one signature
share an id, and pk.init refuses a mesh whose signature is taken by a mesh that puts one of the
same devices in another group. The memory behind a communicator is per (axis name, device
group): a group that an earlier mesh already has is shared, not allocated again.
"""

from __future__ import annotations

import atexit
import numbers
import os
import threading
from dataclasses import dataclass

import jax
import numpy as np

_lock = threading.Lock()
_meshes: list[jax.sharding.Mesh] = []
_options: dict = {}
_settings: Settings | None = None
_traced_with: Settings | None = None  # the settings pk ops were traced with since the last clear
_runtime = None  # comm.Runtime while communicators exist (GPU meshes with the extension)
# (axis names, mesh shape, axis name) -> communicator id, in the order pk.init saw them.
_comm_ids: dict[tuple, int] = {}
# comm id -> {device id: (device ids of its group, in rank order)}
_groups: dict[int, dict[int, tuple[int, ...]]] = {}

DEFAULT_TIMEOUT_S = 60.0
# A kernel that waits on a peer for longer than a day is hung. The bound also keeps the
# kernels' deadline (their nanosecond clock + timeout_s * 1e9, in uint64) far from overflowing.
MAX_TIMEOUT_S = 86400.0
# Above any GPU's memory: a larger workspace is a mistake (bytes given as bits, a wrong
# exponent), reported here instead of as a failed allocation on every device.
MAX_WORKSPACE_BYTES = 1 << 40


# ------------------------------------------------------------------------------------------
# Settings that change how ops lower: read once, at the first pk.init
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """The environment variables that change lowering, as read at the first `pk.init`.

    They stay fixed until `pk.shutdown()` (which also clears JAX's caches), so a function jitted
    before and after a change can never disagree with its cached executable. An op traced after
    the environment changed raises instead of silently using the old value.
    """

    backend: str = "auto"                  # PK_JAX_BACKEND
    tp_mode: str = ""                      # PK_JAX_TP_MODE
    tp_comm_sms: str = ""                  # PK_JAX_TP_COMM_SMS
    all_reduce_algorithm: str = "auto"     # PK_JAX_ALL_REDUCE_ALGORITHM
    single_device_kernels: str = "0"       # PK_JAX_SINGLE_DEVICE_KERNELS
    ulysses_fused: str = "auto"            # PK_JAX_ULYSSES_FUSED (ulysses_attn.FUSED_MODES)
    moe_fused: str = "auto"                # PK_JAX_MOE_FUSED

    @classmethod
    def from_env(cls) -> Settings:
        return cls(**{field: os.environ.get(var, default).strip().lower() or default
                      for field, (var, default) in SETTINGS_ENV.items()})


# Settings field -> (environment variable, default).
SETTINGS_ENV = {"backend": ("PK_JAX_BACKEND", "auto"), "tp_mode": ("PK_JAX_TP_MODE", ""),
                "tp_comm_sms": ("PK_JAX_TP_COMM_SMS", ""),
                "all_reduce_algorithm": ("PK_JAX_ALL_REDUCE_ALGORITHM", "auto"),
                "single_device_kernels": ("PK_JAX_SINGLE_DEVICE_KERNELS", "0"),
                "ulysses_fused": ("PK_JAX_ULYSSES_FUSED", "auto"),
                "moe_fused": ("PK_JAX_MOE_FUSED", "auto")}


def settings() -> Settings:
    """The settings in force: fixed at the first pk.init; before it, the environment's now.

    Raises:
        ValueError: an environment variable changed since pk.init fixed it.
    """
    global _traced_with
    fixed = _settings
    now = Settings.from_env()
    if fixed is None:
        _traced_with = now
        return now
    if now != fixed:
        changed = [f"{var}={getattr(now, f)!r} (was {getattr(fixed, f)!r})"
                   for f, (var, _) in SETTINGS_ENV.items() if getattr(now, f) != getattr(fixed, f)]
        raise ValueError(
            f"pk_jax: {', '.join(changed)} changed after pk.init. Settings that change how ops "
            "lower are fixed at the first pk.init (a jitted function would otherwise keep the "
            "old one): call pk.shutdown() and then pk.init(mesh) to apply the new value.")
    return fixed


# ------------------------------------------------------------------------------------------
# Meshes
# ------------------------------------------------------------------------------------------


def meshes() -> tuple[jax.sharding.Mesh, ...]:
    """Every mesh given to pk.init since the last shutdown, in order."""
    return tuple(_meshes)


def mesh_or_none() -> jax.sharding.Mesh | None:
    """The first mesh given to pk.init (None before it)."""
    return _meshes[0] if _meshes else None


def _signature(names, shape) -> tuple:
    return tuple(names), tuple(int(s) for s in shape)


def _current_signature() -> tuple | None:
    """(axis names, shape) of the mesh of the enclosing shard_map, None outside one."""
    try:
        am = jax.sharding.get_abstract_mesh()
    except AttributeError:  # pragma: no cover -- every supported jax has it
        return None
    if am is None or not getattr(am, "axis_names", ()):
        return None
    return _signature(am.axis_names, am.axis_sizes)


def mesh_for(axis_name: str) -> jax.sharding.Mesh | None:
    """The mesh given to pk.init that an op over `axis_name` runs on.

    Inside shard_map: the first registered mesh with the enclosing mesh's axis names and shape
    (meshes of one signature share communicator ids, see the module docstring). Outside: the
    first registered mesh with that axis. None when no registered mesh fits.
    """
    sig = _current_signature()
    for mesh in _meshes:
        if sig is not None:
            if _signature(mesh.axis_names, mesh.devices.shape) == sig:
                return mesh
        elif axis_name in mesh.axis_names:
            return mesh
    return None


def options() -> dict:
    return dict(_options)


def resolve_timeout(value: float | None = None) -> float:
    """The spin-wait timeout: the argument, else PK_JAX_TIMEOUT_S, else 60 s.

    Raises:
        TypeError: `value` is not a real number (or is a bool).
        ValueError: the timeout is not in (0, MAX_TIMEOUT_S], or PK_JAX_TIMEOUT_S is not a
            number.
    """
    name = "timeout_s"
    if value is None:
        name = "PK_JAX_TIMEOUT_S"
        text = os.environ.get(name)
        if text is None:
            return DEFAULT_TIMEOUT_S
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"pk.init: the environment variable PK_JAX_TIMEOUT_S={text!r} is not "
                             "a number; give seconds, e.g. PK_JAX_TIMEOUT_S=60 or 2.5.") from None
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"pk.init: timeout_s must be a number of seconds (int or float), got "
                        f"{value!r} of type {type(value).__name__}.")
    value = float(value)
    if not 0 < value <= MAX_TIMEOUT_S:  # also NaN
        raise ValueError(f"pk.init: {name} must be a finite number of seconds in (0, "
                         f"{MAX_TIMEOUT_S:g}] (at most one day), got {value!r}.")
    return value


def _check_workspace_bytes(value) -> int | None:
    """pk.init's workspace_bytes as an int (None: the default).

    Raises:
        TypeError: not an integer (or a bool).
        ValueError: not in [1, MAX_WORKSPACE_BYTES].
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"pk.init: workspace_bytes must be an int (bytes), got {value!r} of type "
                        f"{type(value).__name__}.")
    value = int(value)
    if not 0 < value <= MAX_WORKSPACE_BYTES:
        top = MAX_WORKSPACE_BYTES.bit_length() - 1
        raise ValueError(f"pk.init: workspace_bytes must be in [1, 2**{top}], got {value}. The "
                         "ops' errors say how many bytes they need.")
    return value


def _inside_a_trace() -> bool:
    try:
        from jax._src import core

        return not isinstance(core.trace_ctx.trace, core.EvalTrace)
    except (ImportError, AttributeError):  # pragma: no cover -- private API moved
        return False


def _groups_of(mesh, axis_index: int) -> dict[int, tuple[int, ...]]:
    devices = np.moveaxis(np.asarray(mesh.devices), axis_index, -1)
    rows = devices.reshape(-1, devices.shape[-1])
    return {d.id: tuple(e.id for e in row) for row in rows for d in row}


def _plan_comm_ids(mesh) -> tuple[dict[str, int], dict[tuple, int], dict[int, dict]]:
    """Communicator ids for `mesh`'s axes (new ones where its signature is new).

    Raises:
        ValueError: a mesh of the same signature puts a device of `mesh` in another group.
    """
    ids, new_ids, new_groups = {}, {}, {}
    sig = _signature(mesh.axis_names, mesh.devices.shape)
    for i, axis in enumerate(mesh.axis_names):
        key = (*sig, axis)
        groups = _groups_of(mesh, i)
        cid = _comm_ids.get(key)
        if cid is None:
            cid = len(_comm_ids) + len(new_ids)
            new_ids[key] = cid
        else:
            for dev, group in groups.items():
                old = _groups.get(cid, {}).get(dev)
                if old is not None and old != group:
                    raise ValueError(
                        f"pk.init: this mesh (axes {sig[0]}, shape {sig[1]}) has the same axis "
                        "names and shape as a mesh given to pk.init before, but puts device "
                        f"{dev} in another group along {axis!r} ({list(group)} instead of "
                        f"{list(old)}). Inside shard_map pk_jax tells meshes apart by axis "
                        "names and shape only: give this mesh other axis names, or call "
                        "pk.shutdown() first.")
        ids[axis] = cid
        new_groups.setdefault(cid, {}).update(groups)
    return ids, new_ids, new_groups


def init(mesh: jax.sharding.Mesh, *, workspace_bytes: int | None = None,
         timeout_s: float | None = None) -> None:
    """Registers `mesh` with pk_jax and sets up its communicators.

    Call it outside jit, on every process, before any pk op runs over the mesh. Calling it
    again with a mesh it has does nothing; calling it with another mesh adds that mesh, so a
    program may use several (training and evaluation meshes, sub-meshes). The first call fixes
    the options and the settings read from the environment (PK_JAX_BACKEND, PK_JAX_TP_MODE,
    PK_JAX_TP_COMM_SMS, PK_JAX_ALL_REDUCE_ALGORITHM, PK_JAX_SINGLE_DEVICE_KERNELS,
    PK_JAX_ULYSSES_FUSED, PK_JAX_MOE_FUSED) until `pk.shutdown()`.

    Args:
        mesh: a mesh that the shard_maps calling pk ops use.
        workspace_bytes: bytes of each symmetric workspace (one per device and mesh axis), an
            int in [1, 2**40]; default 64 MiB. The ops' errors say how many they need.
        timeout_s: how long a kernel waits for a peer before it fails, in seconds: a finite
            number in (0, 86400] (default 60 s, or the environment variable PK_JAX_TIMEOUT_S).

    Raises:
        TypeError: `mesh` is not a jax.sharding.Mesh, or an option of the wrong type.
        RuntimeError: called inside jax.jit or another transformation.
        ValueError: other options than the first pk.init's, settings that changed since it, a
            mesh that cannot be told apart from an earlier one, or a bad option.
    """
    global _options, _settings, _runtime
    from pk_jax.runtime import errors

    errors.check_pending()
    if _inside_a_trace():
        raise RuntimeError(
            "pk.init was called inside jax.jit (or another JAX transformation). It allocates "
            "memory and talks to the other processes, which a traced function cannot do: call "
            "pk.init(mesh) once, before the jitted function, outside any transformation.")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"pk.init: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}."
                        " Build one with jax.make_mesh(shape, axis_names).")
    workspace_bytes = _check_workspace_bytes(workspace_bytes)
    opts = {"workspace_bytes": workspace_bytes, "timeout_s": resolve_timeout(timeout_s)}
    with _lock:
        if _meshes:
            if opts != _options:
                raise ValueError(
                    f"pk.init: pk_jax was initialised with {_options} and this call asks for "
                    f"{opts}. Every mesh shares the first pk.init's options: pass the same ones "
                    "(or none), or call pk.shutdown() first.")
            settings()  # raises if the environment changed since the first pk.init
            if any(m == mesh for m in _meshes):
                return
        fixed = Settings.from_env() if not _meshes else _settings
        ids, new_ids, new_groups = _plan_comm_ids(mesh)
        if uses_symmetric_memory(mesh, fixed):
            from pk_jax.runtime import comm

            if _runtime is None:
                rt = comm.Runtime.create(mesh, workspace_bytes=workspace_bytes,
                                         timeout_s=opts["timeout_s"], comm_ids=ids)
                _runtime = rt
            else:
                _runtime.add(mesh, comm_ids=ids)
            _hosts.clear()
            _hosts.update(_runtime.hosts)
        _meshes.append(mesh)
        _options, _settings = opts, fixed
        _clear_caches_unless(fixed)
        _comm_ids.update(new_ids)
        for cid, groups in new_groups.items():
            _groups.setdefault(cid, {}).update(groups)


def uses_symmetric_memory(mesh: jax.sharding.Mesh, fixed: Settings | None = None) -> bool:
    """Whether pk.init builds communicators for `mesh`: it is on GPUs, the extension is built
    and PK_JAX_BACKEND is not "reference". Otherwise pk.init is bookkeeping only."""
    from pk_jax import _ffi

    backend = (fixed or Settings.from_env()).backend
    if backend == "reference":
        return False
    if not _ffi.HAS_CUDA or not hasattr(_ffi._pk_ffi, "comm_register"):
        return False
    return all(d.platform == "gpu" for d in mesh.devices.flat)


def runtime():
    """The communicators of every pk.init since shutdown (a comm.Runtime), None on CPU."""
    return _runtime


def comm_id(axis_name: str) -> int:
    """The static id the ops pass to their handlers for `axis_name` (an FFI attribute).

    Every group along the axis has the same id; a handler finds its own group's communicator by
    (comm_id, DeviceOrdinal). Inside shard_map the id is the one of the enclosing mesh's
    signature; outside, of the first registered mesh with the axis.

    Raises:
        ValueError: pk.init was not called, or `axis_name` is not an axis of its meshes.
    """
    if not _meshes:
        raise ValueError(f"pk_jax: pk.init(mesh) must be called before using axis "
                         f"{axis_name!r}.")
    mesh = mesh_for(axis_name)
    if mesh is None or axis_name not in mesh.axis_names:
        raise ValueError(f"pk_jax: axis {axis_name!r} is not an axis of the mesh given to "
                         f"pk.init ({describe_meshes()}).")
    return _comm_ids[(*_signature(mesh.axis_names, mesh.devices.shape), axis_name)]


def describe_meshes() -> str:
    """The registered meshes' axes, for error messages."""
    return "; ".join(f"axes {tuple(m.axis_names)} shape {tuple(m.devices.shape)}"
                     for m in _meshes) or "none"


def workspace_bytes() -> int:
    """Bytes of each symmetric workspace: pk.init's workspace_bytes, else the default."""
    from pk_jax.runtime import comm

    return _options.get("workspace_bytes") or comm.DEFAULT_WORKSPACE_BYTES


def signal_count() -> int:
    """uint64 counters in each signal pad."""
    from pk_jax.runtime import comm

    return _runtime.signal_count if _runtime is not None else comm.DEFAULT_SIGNAL_COUNT


def _finish_dispatched(rt) -> None:
    """Waits for the computations dispatched so far: those whose results are still referenced,
    and, through a small computation on each of this process's communicator devices queued
    behind them, those whose results were dropped (`f(x); pk.shutdown()`). Best effort: a
    failed or deleted result is its owner's to see, and at exit JAX may be gone already."""
    me = jax.process_index()
    devices = {d for g in rt.groups for d in g.devices if d.process_index == me}
    try:
        pending = list(jax.live_arrays()) + [jax.numpy.zeros((), device=d) for d in devices]
    except Exception:  # noqa: BLE001 -- nothing to wait for that JAX can still name
        return
    for array in pending:
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001, S110
            pass


def shutdown() -> None:
    """Releases every communicator of every mesh, forgets the meshes and the fixed settings,
    and clears JAX's caches. Safe to call more than once.

    Local only (no rendezvous): it unmaps this process's views of its peers' memory and
    releases its own; memory a peer still maps stays alive until that peer shuts down too.
    Functions jitted before stay usable: when communicators are released, JAX's caches are
    cleared, so after the next pk.init those functions are traced and compiled again. An
    executable kept past the shutdown (a `.lower(...).compile()` object) bound its
    communicators when XLA instantiated it (ffi/comm_state.h): its calls fail with an error
    saying to compile it again, and never touch the released memory.

    Computations already dispatched whose results are still referenced finish first, on the
    communicators they were compiled for. Any other (its results dropped, or dispatched by
    another thread meanwhile) either gets its communicator before the release, and then its
    kernels finish before the memory is unmapped (`Runtime.close`), or fails with that error.
    """
    global _options, _runtime, _settings, _traced_with
    rt = _runtime
    if rt is not None:
        _finish_dispatched(rt)  # before _lock: it lasts as long as the slowest computation
    with _lock:
        rt, _runtime = _runtime, None
        _meshes.clear()
        _options, _settings = {}, None
        _comm_ids.clear()
        _groups.clear()
        _hosts.clear()
        try:
            if rt is not None:
                rt.close()
        finally:
            if rt is not None:
                jax.clear_caches()
                _traced_with = None


def _clear_caches_unless(fixed: Settings) -> None:
    """Clears JAX's caches if pk ops may have been traced with other settings than `fixed`."""
    global _traced_with
    if _traced_with is not None and _traced_with != fixed:
        jax.clear_caches()
    _traced_with = fixed


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
    mesh = mesh_for(axis_name)
    if mesh is None or not _hosts:
        return True
    axis = mesh.axis_names.index(axis_name)
    groups = mesh.devices.swapaxes(axis, -1).reshape(-1, mesh.devices.shape[axis])
    return all(len({_hosts.get(d.process_index, 0) for d in group}) == 1 for group in groups)


# process_index -> host id, filled in by the runtime at init when several processes run.
_hosts: dict[int, int] = {}

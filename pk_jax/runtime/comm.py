"""Communicators: per mesh axis and per group of devices along it, symmetric memory on every
member, every peer's memory mapped into every member, registered in the C++ table (ffi/comm.h).

`Runtime.create(mesh, ...)` is collective: every process holding devices of the mesh calls it
(through `pk.init`) with the same mesh; `Runtime.add(mesh, ...)` adds another mesh's
communicators the same way (a later `pk.init`). A group that the runtime already has (the same
axis name and devices in the same order) is shared: registered under the new mesh's id too,
never allocated twice. Steps:

1. Every such process publishes its host (hostname and boot id) through the `jax.distributed`
   key-value store, and whether its devices have room for the workspaces; a failure anywhere
   fails `pk.init` everywhere with that process's message.
2. For every axis and every group along it that holds a device of this process and lies on one
   host, each local member allocates `workspace | signal pad` with `cuMemCreate` (POSIX-FD
   handles, granularity-rounded) and zeroes it.
3. With several processes, each process serves its allocations' FDs on a private Unix socket
   (`exchange.FdServer`), publishes the socket's path, fetches the FDs of the remote members of
   its groups, imports them (`cuMemImportFromShareableHandle`) and closes the FDs.
4. Each process maps every member's allocation once (`cuMemAddressReserve`/`cuMemMap`) and
   grants access to its local members (`cuMemSetAccess`), then registers one view per local
   member device in the C++ table under (comm_id, device ordinal).
5. A closing rendezvous: after it, no process needs another's socket; servers and exported FDs
   are closed. `close()` unregisters, unmaps and releases everything, without talking to peers.

Layout of one allocation: the workspace at offset 0 (`workspace_bytes`), then the signal pad
(`signal_count` uint64 counters) at `signal_offset`, the total rounded up to the granularity.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field

import numpy as np

from pk_jax import _op_table
from pk_jax.runtime import errors, exchange, vmm

DEFAULT_WORKSPACE_BYTES = 64 << 20
DEFAULT_SIGNAL_COUNT = _op_table.SIGNAL_COUNT  # every op's slot range fits (ffi/op_table.h)
SIGNAL_ALIGN = 4096
MEMORY_MARGIN_BYTES = 64 << 20  # left free beside the workspaces for the driver and kernels
DEFAULT_INIT_TIMEOUT_S = 300.0
_KV_PREFIX = "pk_jax/runtime"

# Rendezvous rounds per mesh (its device ids and axis names) in this process: every process of
# the mesh counts the same, so each pk.init of that mesh gets fresh key-value keys.
_rounds: dict[str, int] = {}


def init_timeout_s() -> float:
    """How long the rendezvous of pk.init waits for other processes (PK_JAX_INIT_TIMEOUT_S)."""
    return float(os.environ.get("PK_JAX_INIT_TIMEOUT_S", DEFAULT_INIT_TIMEOUT_S))


def host_identity() -> str:
    """A name for this machine that differs between machines: hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def axis_groups(mesh, axis_index: int) -> np.ndarray:
    """[n_groups, axis_size] array of devices: row g is one group, in rank order."""
    devices = np.asarray(mesh.devices)
    size = devices.shape[axis_index]
    return np.moveaxis(devices, axis_index, -1).reshape(-1, size)


def layout(workspace_bytes: int, signal_count: int, gran: int) -> tuple[int, int]:
    """(signal_offset, allocation_size) of one member's allocation."""
    signal_offset = vmm.round_up(workspace_bytes, SIGNAL_ALIGN)
    return signal_offset, vmm.round_up(signal_offset + 8 * signal_count, gran)


@dataclass
class Group:
    """One communicator: the devices of one group along one axis, in rank order."""

    comm_id: int
    axis_name: str
    devices: list  # jax devices, rank order
    ptrs: list[int] = field(default_factory=list)  # each member's allocation, mapped here
    aliases: list[int] = field(default_factory=list)  # further comm ids sharing it

    @property
    def key(self) -> tuple:
        return (self.axis_name, tuple(d.id for d in self.devices))

    @property
    def world(self) -> int:
        return len(self.devices)

    def rank_of(self, device) -> int:
        return [d.id for d in self.devices].index(device.id)


def _key(axis_name: str, devices) -> tuple:
    return (axis_name, tuple(d.id for d in devices))


def _mesh_key(mesh) -> str:
    ids = ",".join(str(d.id) for d in mesh.devices.flat)
    return f"{'.'.join(mesh.axis_names)}:{list(mesh.devices.shape)}:{ids}"


class _KV:
    """The jax.distributed key-value store, under a per-round key prefix."""

    def __init__(self, round_key: str, participants: list[int], timeout_s: float):
        import hashlib

        from jax._src.distributed import global_state

        self.client = global_state.client
        if self.client is None:
            raise RuntimeError(
                "pk.init: the mesh spans several processes but jax.distributed is not "
                "initialised; call jax.distributed.initialize() (or pk_jax.launch.initialize())"
                " first.")
        self.prefix = f"{_KV_PREFIX}/{hashlib.sha1(round_key.encode()).hexdigest()[:16]}"
        self.participants = participants
        self.timeout_ms = int(timeout_s * 1000)

    def put(self, key: str, value: dict) -> None:
        self.client.key_value_set(f"{self.prefix}/{key}", json.dumps(value))

    def get(self, key: str, what: str) -> dict:
        try:
            text = self.client.blocking_key_value_get(f"{self.prefix}/{key}", self.timeout_ms)
        except Exception as e:  # the client raises XlaRuntimeError on a timeout
            raise RuntimeError(
                f"pk.init: waited {self.timeout_ms / 1000:g} s for {what} and it never came "
                f"({e}). Every process must call pk.init with the same mesh; raise "
                "PK_JAX_INIT_TIMEOUT_S if some start much later.") from e
        return json.loads(text)

    def gather(self, phase: str, value: dict) -> dict[int, dict]:
        """Publishes this process's value for `phase`; returns every participant's."""
        from jax import process_index

        self.put(f"{phase}/{process_index()}", value)
        return {p: self.get(f"{phase}/{p}", f"process {p} ({phase})")
                for p in self.participants}


def _raise_remote(values: dict[int, dict]) -> None:
    failed = [(p, v["error"]) for p, v in sorted(values.items()) if v.get("error")]
    if failed:
        p, message = failed[0]
        raise RuntimeError(message if p == _me() else f"pk.init failed on process {p}: {message}")


def _me() -> int:
    import jax

    return jax.process_index()


class Runtime:
    """Every communicator of one `pk.init`, and what backs them in this process."""

    def __init__(self):
        self.groups: list[Group] = []
        self.keys: list[tuple[int, int]] = []  # (comm_id, ordinal) registered in the table
        self.contexts: dict[int, vmm.Context] = {}
        self.allocations: list[vmm.Allocation] = []
        self.mappings: list[vmm.Mapping] = []
        self.record: vmm.HostRecord | None = None
        self.hosts: dict[int, int] = {}
        self.workspace_bytes = 0
        self.signal_count = 0
        self.signal_offset = 0
        self.allocation_bytes = 0
        self.timeout_s = 0.0

    # ---------------------------------------------------------------------------------------
    @classmethod
    def create(cls, mesh, *, workspace_bytes: int | None, timeout_s: float,
               signal_count: int = DEFAULT_SIGNAL_COUNT,
               comm_ids: dict[str, int] | None = None) -> Runtime:
        """Builds the communicators of `mesh` (collective over the job's processes).

        Args:
            mesh: the mesh.
            workspace_bytes: bytes of each workspace (None: the default).
            timeout_s: the kernels' spin-wait bound.
            signal_count: uint64 counters per signal pad.
            comm_ids: axis name -> communicator id (default: the axis index).
        """
        rt = cls()
        rt.workspace_bytes, rt.signal_count, rt.timeout_s = (
            int(workspace_bytes or DEFAULT_WORKSPACE_BYTES), int(signal_count), float(timeout_s))
        try:
            rt._build(mesh, comm_ids)
        except BaseException:
            rt.close()
            raise
        return rt

    def add(self, mesh, *, comm_ids: dict[str, int]) -> None:
        """Adds the communicators of another mesh (collective, like `create`).

        On failure everything this call made is released, and what was there stays.
        """
        marks = (len(self.groups), len(self.keys), len(self.mappings), len(self.allocations),
                 [len(g.aliases) for g in self.groups], set(self.contexts))
        try:
            self._build(mesh, comm_ids)
        except BaseException:
            self._roll_back(marks)
            raise

    def _roll_back(self, marks) -> None:
        n_groups, n_keys, n_maps, n_allocs, n_aliases, contexts = marks
        from pk_jax import _ffi

        for comm_id, ordinal in self.keys[n_keys:]:
            try:
                _ffi._pk_ffi.comm_unregister(comm_id, ordinal)
            except Exception:  # noqa: BLE001, S110 -- best effort; the first error is raised
                pass
        for ctx in self.contexts.values():
            try:
                ctx.synchronize()
            except Exception:  # noqa: BLE001, S110
                pass
        if self.contexts:
            with next(iter(self.contexts.values())):
                for m in self.mappings[n_maps:]:
                    m.unmap()
                for a in self.allocations[n_allocs:]:
                    a.release()
        for ordinal in set(self.contexts) - contexts:
            self.contexts.pop(ordinal).release()
        del self.keys[n_keys:], self.mappings[n_maps:], self.allocations[n_allocs:]
        del self.groups[n_groups:]
        for g, n in zip(self.groups, n_aliases):
            del g.aliases[n:]

    def _build(self, mesh, comm_ids: dict[str, int] | None) -> None:
        import jax

        from pk_jax import _ffi

        comm_ids = comm_ids or {a: i for i, a in enumerate(mesh.axis_names)}
        me = jax.process_index()
        # The processes holding devices of the mesh (the others need not call pk.init).
        participants = sorted({d.process_index for d in mesh.devices.flat})
        if me not in participants:
            return
        kv = None
        if len(participants) > 1:
            key = _mesh_key(mesh)
            _rounds[key] = _rounds.get(key, 0) + 1
            kv = _KV(f"{key}#{_rounds[key]}", participants, init_timeout_s())
        existing = {g.key: g for g in self.groups}

        # 1. Contexts, room on every local device (each device is in one group per axis), hosts.
        gran = 2 << 20
        try:
            for d in mesh.devices.flat:
                if d.process_index == me and d.local_hardware_id not in self.contexts:
                    self.contexts[d.local_hardware_id] = vmm.Context(d.local_hardware_id)
            gran = max([vmm.granularity(o) for o in self.contexts] + [gran])
            if not self.allocation_bytes:
                self.signal_offset, self.allocation_bytes = layout(
                    self.workspace_bytes, self.signal_count, gran)
            new_axes = sum(1 for i, a in enumerate(mesh.axis_names)
                           if any(_key(a, row) not in existing
                                  for row in axis_groups(mesh, i)))
            error = self._memory_error(new_axes) if new_axes else ""
        except Exception as e:
            if kv is None:
                raise
            error = str(e)
        if kv is not None:
            values = kv.gather("hello", {"host": host_identity(), "error": error})
            _raise_remote(values)
            names = sorted({v["host"] for v in values.values()})
            self.hosts = {p: names.index(v["host"]) for p, v in values.items()}
        else:
            if error:
                raise RuntimeError(error)
            self.hosts = {me: 0}

        # 2. The groups of this process that lie on one host, and their local allocations; a
        #    group the runtime has already is shared under this mesh's id.
        new: list[Group] = []
        shared: list[tuple[int, Group]] = []
        for axis_index, axis_name in enumerate(mesh.axis_names):
            cid = comm_ids[axis_name]
            for row in axis_groups(mesh, axis_index):
                devices = list(row)
                if not any(d.process_index == me for d in devices):
                    continue
                if len({self.hosts.get(d.process_index, 0) for d in devices}) != 1:
                    continue  # spans hosts: the ops fall back to XLA's collectives
                if len(devices) > _ffi_max_peers():
                    raise ValueError(
                        f"pk.init: axis {axis_name!r} has {len(devices)} devices per group; "
                        f"pk_jax's communicators hold at most {_ffi_max_peers()}.")
                old = existing.get(_key(axis_name, devices))
                if old is None:
                    new.append(Group(cid, axis_name, devices))
                elif cid != old.comm_id and cid not in old.aliases:
                    shared.append((cid, old))
        self.groups += new
        owned: dict[tuple[int, int], vmm.Allocation] = {}
        problem = ""
        try:
            for g in new:
                for d in g.devices:
                    if d.process_index == me:
                        ctx = self.contexts[d.local_hardware_id]
                        with ctx:
                            alloc = vmm.Allocation.create(d.local_hardware_id,
                                                          self.allocation_bytes)
                            self.allocations.append(alloc)
                            owned[(g.comm_id, d.id)] = alloc
            if self.record is None and self.groups:
                with next(iter(self.contexts.values())) if self.contexts else _null():
                    self.record = vmm.HostRecord(errors.RECORD_BYTES)
        except Exception as e:
            if kv is None:
                raise
            problem = str(e)

        # 3. Several processes: FDs of remote members through each process's socket.
        imported: dict[tuple[int, int], vmm.Allocation] = {}
        if kv is not None:
            self._exchange(kv, owned, imported, problem, new)

        # 4. Map every member's allocation once; local members get access; zero own memory.
        for g in new:
            local_ordinals = [d.local_hardware_id for d in g.devices if d.process_index == me]
            with self.contexts[local_ordinals[0]]:
                for d in g.devices:
                    alloc = owned.get((g.comm_id, d.id)) or imported[(g.comm_id, d.id)]
                    mapping = vmm.Mapping(alloc, local_ordinals, alignment=gran)
                    self.mappings.append(mapping)
                    g.ptrs.append(mapping.ptr)
                    if d.process_index == me:
                        with self.contexts[d.local_hardware_id]:
                            vmm.memset_d8(mapping.ptr, 0, mapping.size)
        for cid, g in [(g.comm_id, g) for g in new] + shared:
            for d in g.devices:
                if d.process_index != me:
                    continue
                key = (cid, d.local_hardware_id)
                _ffi._pk_ffi.comm_register(
                    cid, d.local_hardware_id, g.rank_of(d), g.world, list(g.ptrs),
                    [p + self.signal_offset for p in g.ptrs], self.workspace_bytes,
                    self.signal_count, int(self.timeout_s * 1e9), self.record.device_ptr)
                self.keys.append(key)
            if g.comm_id != cid:
                g.aliases.append(cid)
        if self.record is not None and errors._host_ptr != self.record.host_ptr:
            errors._attach(self.record.host_ptr, self.timeout_s)

        # 5. Nobody proceeds (and launches kernels that signal into zeroed pads) before all
        #    processes have mapped and zeroed everything.
        if kv is not None:
            kv.gather("ready", {})

    def _memory_error(self, comms_per_device: int) -> str:
        need = comms_per_device * self.allocation_bytes
        for ordinal, ctx in self.contexts.items():
            free, total = ctx.mem_info()
            if free < need + MEMORY_MARGIN_BYTES:
                return (
                    f"pk.init: the symmetric workspaces need {need} bytes on GPU {ordinal} "
                    f"({comms_per_device} communicator(s) x {self.allocation_bytes} bytes: "
                    f"workspace_bytes={self.workspace_bytes} plus {8 * self.signal_count} "
                    f"bytes of signals, rounded up), plus {MEMORY_MARGIN_BYTES} bytes of "
                    f"margin, but only {free} of {total} bytes are free. XLA preallocates most "
                    "of the GPU: set XLA_PYTHON_CLIENT_MEM_FRACTION lower (e.g. 0.7, or below "
                    "1/N with N processes on one GPU) before JAX starts, or pass a smaller "
                    "pk.init(workspace_bytes=...).")
        return ""

    def _exchange(self, kv: _KV, owned: dict, imported: dict, problem: str,
                  new: list[Group]) -> None:
        me = _me()
        exported: dict[str, tuple[int, object]] = {}
        server = None
        try:
            if not problem:
                try:
                    for (comm_id, dev_id), alloc in owned.items():
                        exported[f"{comm_id}/{dev_id}"] = (alloc.export_fd(), {"size": alloc.size})
                    server = exchange.FdServer(exported, timeout_s=init_timeout_s())
                except Exception as e:  # noqa: BLE001 -- told to every peer, raised below
                    problem = str(e)
            values = kv.gather("sockets", {"path": server.path if server else "",
                                           "error": problem})
            _raise_remote(values)
            wanted: dict[int, list[tuple[int, int]]] = {}
            for g in new:
                for d in g.devices:
                    if d.process_index != me:
                        wanted.setdefault(d.process_index, []).append((g.comm_id, d.id))
            for p, keys in sorted(wanted.items()):
                try:
                    got = exchange.fetch(values[p]["path"], [f"{c}/{i}" for c, i in keys],
                                         timeout_s=init_timeout_s())
                except (exchange.ExchangeError, OSError) as e:
                    raise RuntimeError(
                        f"pk.init: waited for process {p}'s workspaces and did not get them "
                        f"({e}). Process {p} may have died or stalled; every process must "
                        "call pk.init with the same meshes (PK_JAX_INIT_TIMEOUT_S sets how "
                        "long to wait).") from e
                try:
                    for (c, i), (fd, meta) in zip(keys, got, strict=True):
                        if int(meta["size"]) != self.allocation_bytes:
                            raise RuntimeError(
                                f"pk.init: process {p} allocated {meta['size']} bytes per "
                                f"workspace and this one {self.allocation_bytes}; every "
                                "process must pass the same workspace_bytes.")
                        with next(iter(self.contexts.values())):
                            alloc = vmm.Allocation.import_fd(fd, self.allocation_bytes)
                        self.allocations.append(alloc)
                        imported[(c, i)] = alloc
                finally:
                    for fd, _ in got:
                        os.close(fd)
            # Peers may still be fetching from this process's server until they say "fetched".
            kv.gather("fetched", {})
        finally:
            if server is not None:
                server.close()
            for fd, _ in exported.values():
                os.close(fd)

    # ---------------------------------------------------------------------------------------
    def group(self, comm_id: int, device) -> Group | None:
        """The communicator of `device` along axis `comm_id` (None if it has none)."""
        for g in self.groups:
            if ((g.comm_id == comm_id or comm_id in g.aliases)
                    and any(d.id == device.id for d in g.devices)):
                return g
        return None

    def close(self) -> None:
        """Unregisters, unmaps and releases everything; safe to call twice.

        Every step is tried even when an earlier one fails; the first failure is raised at the
        end.
        """
        first: BaseException | None = None

        def attempt(fn, *args):
            nonlocal first
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 -- keep releasing the rest
                if first is None:
                    first = e

        # NOTES: the order makes a kernel on released memory impossible. comm_unregister
        # returns once no FFI handler holds the communicator (ffi/comm.h): a handler that
        # checked it before is past its kernel's launch, and one that checks it after fails
        # with the "pk.shutdown() released" error. The synchronisation then waits for every
        # kernel so launched; only then is the memory unmapped.
        if self.keys:
            from pk_jax import _ffi

            for comm_id, ordinal in self.keys:
                attempt(lambda c=comm_id, o=ordinal: _ffi._pk_ffi.comm_unregister(c, o))
            self.keys = []
        errors._attach(0)
        for ctx in self.contexts.values():
            attempt(ctx.synchronize)  # no kernel may still touch what is unmapped next
        if self.contexts:
            try:
                with next(iter(self.contexts.values())):
                    for m in self.mappings:
                        attempt(m.unmap)
                    for a in self.allocations:
                        attempt(a.release)
                    if self.record is not None:
                        attempt(self.record.free)
            except BaseException as e:  # noqa: BLE001 -- raised after the rest is released
                if first is None:
                    first = e
        self.mappings, self.allocations, self.record = [], [], None
        for ctx in self.contexts.values():
            attempt(ctx.release)
        self.contexts = {}
        self.groups = []
        if first is not None:
            raise first


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _ffi_max_peers() -> int:
    return 16  # ffi/comm.h kMaxPeers

"""The symmetric-memory runtime: the descriptor exchange (SCM_RIGHTS over a private Unix socket,
uid checks, unique names, no leaked descriptors), the error record, the communicator table,
bookkeeping-only pk.init on CPU, and on the GPU the VMM workspaces of one process.

The multi-process GPU checks (P processes sharing one GPU) are in tests/gpu/test_runtime_mp.py.
"""

import ctypes
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from util import cpu_mesh, product

import pk_jax as pk
from pk_jax import _ffi
from pk_jax.runtime import comm, errors, exchange, state

_EXCHANGE_PY = exchange.__file__

# A child process that loads exchange.py by path (no JAX), then fetches or serves.
_CHILD = r"""
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("exchange", sys.argv[1])
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
if sys.argv[2] == "fetch":
    out = []
    for fd, meta in ex.fetch(sys.argv[3], sys.argv[4].split(",")):
        os.lseek(fd, 0, os.SEEK_SET)
        out.append([os.read(fd, 100).decode(), meta])
        os.close(fd)
    print(json.dumps(out), flush=True)
else:
    r, w = os.pipe()
    os.write(w, b"from the child")
    os.close(w)
    with ex.FdServer({"pipe": (r, {"kind": "pipe"})}) as server:
        print(server.path, flush=True)
        sys.stdin.readline()
    os.close(r)
"""


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _file_fd(tmp_path, name: str, text: str) -> int:
    path = tmp_path / name
    path.write_text(text)
    return os.open(path, os.O_RDONLY)


def _child(*args, **kw):
    return [sys.executable, "-c", _CHILD, _EXCHANGE_PY, *args]


def test_exchange_parent_serves_child_fetches(tmp_path):
    fa, fb = _file_fd(tmp_path, "a", "alpha"), _file_fd(tmp_path, "b", "beta")
    try:
        with exchange.FdServer({"a": (fa, {"n": 1}), "b": (fb, {"n": 2})}) as server:
            out = subprocess.run(_child("fetch", server.path, "b,a"), capture_output=True,
                                 text=True, timeout=60, check=False)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout) == [["beta", {"n": 2}], ["alpha", {"n": 1}]]
            assert server.served == 2
    finally:
        os.close(fa)
        os.close(fb)


def test_exchange_child_serves_parent_fetches_without_leaks():
    before = _fd_count()
    child = subprocess.Popen(_child("serve"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        path = child.stdout.readline().strip()
        assert os.path.exists(path)
        [(fd, meta)] = exchange.fetch(path, ["pipe"])
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
        assert not os.path.exists(path)  # the server removed its socket
        assert meta == {"kind": "pipe"}
        assert os.read(fd, 100) == b"from the child"  # still valid after the server exited
        os.close(fd)
    finally:
        if child.poll() is None:
            child.kill()
        child.stdin.close()
        child.stdout.close()
    assert _fd_count() == before


def test_exchange_private_directory_and_unique_names(tmp_path):
    fd = _file_fd(tmp_path, "x", "one")
    fd2 = _file_fd(tmp_path, "y", "two")
    try:
        with exchange.FdServer({"k": (fd, None)}) as s1, \
                exchange.FdServer({"k": (fd2, None)}) as s2:
            assert s1.path != s2.path and s1.directory != s2.directory
            for s in (s1, s2):
                mode = os.stat(s.directory).st_mode
                assert stat.S_IMODE(mode) == 0o700
                assert os.stat(s.directory).st_uid == os.getuid()
            [(g1, _)] = exchange.fetch(s1.path, ["k"])
            [(g2, _)] = exchange.fetch(s2.path, ["k"])
            assert os.pread(g1, 10, 0) == b"one" and os.pread(g2, 10, 0) == b"two"
            os.close(g1)
            os.close(g2)
        assert not os.path.exists(s1.directory) and not os.path.exists(s2.directory)
    finally:
        os.close(fd)
        os.close(fd2)


def test_exchange_server_refuses_other_uid(tmp_path):
    fd = _file_fd(tmp_path, "x", "secret")
    try:
        before = _fd_count()
        with exchange.FdServer({"k": (fd, None)}, allowed_uid=os.getuid() + 1) as server:
            with pytest.raises(exchange.ExchangeError, match="uid"):
                exchange.fetch(server.path, ["k"])
            assert server.refused == [os.getuid()] and server.served == 0
        assert _fd_count() == before  # the server (a thread here) has closed its end too
    finally:
        os.close(fd)


def test_exchange_client_refuses_server_of_other_uid(tmp_path):
    fd = _file_fd(tmp_path, "x", "secret")
    try:
        with exchange.FdServer({"k": (fd, None)}) as server:
            with pytest.raises(exchange.ExchangeError, match="runs as uid"):
                exchange.fetch(server.path, ["k"], expected_uid=os.getuid() + 1)
            assert server.served == 0
    finally:
        os.close(fd)


def test_exchange_errors_name_the_problem(tmp_path):
    fd = _file_fd(tmp_path, "x", "one")
    try:
        before = _fd_count()
        with exchange.FdServer({"k": (fd, None)}) as server:
            with pytest.raises(exchange.ExchangeError, match="no descriptor named 'nope'"):
                exchange.fetch(server.path, ["k", "nope"])  # the first fd is closed again
            path = server.path
        assert _fd_count() == before
        with pytest.raises(exchange.ExchangeError, match="cannot reach"):
            exchange.fetch(path, ["k"])
        with pytest.raises(ValueError, match="space or newline"), exchange.FdServer({}) as server:
            exchange.fetch(server.path, ["a b"])
    finally:
        os.close(fd)


def test_exchange_many_descriptors_no_leak(tmp_path):
    fds = {f"f{i}": (_file_fd(tmp_path, f"f{i}", str(i)), {"i": i}) for i in range(40)}
    try:
        before = _fd_count()
        with exchange.FdServer(fds) as server:
            got = exchange.fetch(server.path, sorted(fds))
            for (fd, meta), key in zip(got, sorted(fds), strict=True):
                assert os.pread(fd, 10, 0).decode() == str(meta["i"]) == key[1:]
                os.close(fd)
        assert _fd_count() == before
    finally:
        for fd, _ in fds.values():
            os.close(fd)


def test_exchange_a_stalled_client_blocks_nobody(tmp_path):
    # Two clients connect and stall (one silent, one with half a request); a third is served
    # at once, and the server's per-connection deadline ends the stalled ones.
    fd = _file_fd(tmp_path, "x", "one")
    stalled = []
    try:
        with exchange.FdServer({"k": (fd, None)}, timeout_s=1.0) as server:
            for partial in (b"", b"GET k"):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(server.path)
                c.sendall(partial)
                stalled.append(c)
            t0 = time.monotonic()
            [(got, _)] = exchange.fetch(server.path, ["k"], timeout_s=5)
            assert time.monotonic() - t0 < 0.5, "a stalled client delayed another"
            assert os.pread(got, 10, 0) == b"one"
            os.close(got)
            deadline = time.monotonic() + 5
            while server.expired < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.expired == 2 and server.served == 1
            for c in stalled:
                c.settimeout(5)
                assert c.recv(1) == b""  # the server hung up on it
    finally:
        for c in stalled:
            c.close()
        os.close(fd)


@pytest.mark.parametrize("code,op,name", product([1, 2], [1, 5], ["x"]))
def test_error_record_check_names_op_rank_and_peer(code, op, name):
    buf = (ctypes.c_int32 * errors.RECORD_WORDS)()
    errors._attach(ctypes.addressof(buf), 2.5)
    try:
        errors.check()  # all zero: nothing raised
        buf[0], buf[1], buf[2], buf[3] = code, op, 3, 1
        pattern = errors.OP_NAMES[op] + ".*rank 3"
        with pytest.raises(RuntimeError, match=pattern) as info:
            errors.check()
        if code == 1:
            assert "peer 1 never arrived within 2.5 s" in str(info.value)
        with pytest.raises(RuntimeError):  # sticky until reset
            errors.check(reset=True)
        errors.check()
        assert errors.read() == (0,) * errors.RECORD_WORDS
    finally:
        errors._attach(0)
    errors.check()


def test_op_names_are_the_handlers_op_ids():
    """The error record's op ids are defined in C++ (kOp<Stem> = id in ffi/): Python's names for
    them must be those stems, every one of them."""
    import pathlib
    import re

    ffi = pathlib.Path(__file__).resolve().parent.parent / "ffi"
    ids = {}
    for f in sorted(ffi.glob("*.[ch]*")):
        for name, value in re.findall(r"\bkOp([A-Z]\w*) = (\d+)", f.read_text()):
            ids[int(value)] = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    assert len(ids) >= 9, ids
    assert errors.OP_NAMES == ids


def test_comm_id_is_the_axis_index_and_checks_its_argument():
    with pytest.raises(ValueError, match="pk.init"):
        state.comm_id("tp")
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    pk.init(mesh)
    assert (state.comm_id("dp"), state.comm_id("tp")) == (0, 1)
    with pytest.raises(ValueError, match="'sp' is not an axis"):
        state.comm_id("sp")


def test_cpu_init_is_bookkeeping_only():
    mesh = cpu_mesh((8,), ("x",))
    assert not state.uses_symmetric_memory(mesh)
    pk.init(mesh)
    pk.init(mesh)  # idempotent
    assert state.runtime() is None and state.mesh_or_none() is mesh
    assert state.workspace_bytes() == comm.DEFAULT_WORKSPACE_BYTES
    pk.shutdown()
    pk.init(mesh, workspace_bytes=1 << 20)
    assert state.workspace_bytes() == 1 << 20


@pytest.mark.parametrize("shape,axis", [((2, 4), 0), ((2, 4), 1), ((2, 2, 2), 1), ((8,), 0)])
def test_axis_groups_are_in_rank_order(shape, axis):
    mesh = cpu_mesh(shape, tuple("abc"[:len(shape)]))
    groups = comm.axis_groups(mesh, axis)
    assert groups.shape == (8 // shape[axis], shape[axis])
    index = {d.id: i for i, d in np.ndenumerate(mesh.devices)}
    for row in groups:
        assert [index[d.id][axis] for d in row] == list(range(shape[axis]))
        others = {tuple(np.delete(index[d.id], axis)) for d in row}
        assert len(others) == 1
    assert sorted(d.id for d in groups.flat) == sorted(d.id for d in mesh.devices.flat)


def test_layout_rounds_to_granularity():
    off, size = comm.layout(1000, 16, 2 << 20)
    assert off == 4096 and size == 2 << 20
    off, size = comm.layout(64 << 20, 1 << 16, 2 << 20)
    assert off == 64 << 20 and size == (64 << 20) + (2 << 20)


# A rank of a CPU job under the launcher: the real rendezvous (key-value store, FdServer,
# grouping) with fake VMM calls whose "allocations" are memfds, so the right descriptor must
# reach the right peer slot for the contents to match.
_FAKE_VMM_RANK = r"""
import os
import pk_jax.launch
pk_jax.launch.initialize()
import ctypes, jax
from jax._src.distributed import global_state
from pk_jax import _ffi
from pk_jax.runtime import comm, vmm

me, n = jax.process_index(), jax.process_count()
maps, table, counter = {}, {}, [1 << 20]

class Ctx:
    def __init__(self, ordinal): pass
    def __enter__(self): return self
    def __exit__(self, *exc): pass
    def synchronize(self): pass
    def mem_info(self): return (1 << 40, 1 << 41)
    def release(self): pass

class Alloc:
    live = 0
    def __init__(self, size, fd=None):
        Alloc.live += 1
        self.size = size
        self.fd = os.memfd_create("fake") if fd is None else os.dup(fd)
    @classmethod
    def create(cls, ordinal, size): return cls(size)
    @classmethod
    def import_fd(cls, fd, size): return cls(size, fd)
    def export_fd(self): return os.dup(self.fd)
    def release(self): os.close(self.fd); Alloc.live -= 1

class Mapping:
    def __init__(self, alloc, ordinals, alignment=0):
        self.size, self.ptr = alloc.size, counter[0]
        counter[0] += alloc.size
        maps[self.ptr] = alloc
    def unmap(self): maps.pop(self.ptr)

class Record:
    def __init__(self, nbytes):
        self.buf = (ctypes.c_int32 * 8)()
        self.host_ptr = self.device_ptr = ctypes.addressof(self.buf)
    def free(self): pass

class Table:
    def comm_register(self, cid, ordinal, rank, world, ws, sig, *rest):
        assert (cid, ordinal) not in table
        table[(cid, ordinal)] = (rank, world, ws)
    def comm_unregister(self, cid, ordinal): return table.pop((cid, ordinal), None) is not None

vmm.Context, vmm.Allocation, vmm.Mapping, vmm.HostRecord = Ctx, Alloc, Mapping, Record
vmm.granularity = lambda ordinal: 2 << 20
vmm.memset_d8 = lambda *args: None
_ffi._pk_ffi = Table()

def barrier(name, k=None):
    global_state.client.key_value_set(f"t/{name}/{me}", "1")
    for p in range(k or n):
        global_state.client.blocking_key_value_get(f"t/{name}/{p}", 60000)

cases = [((n,), ("x",), n), ((2, n // 2), ("dp", "tp"), n), ((2,), ("x",), 2), ((n,), ("x",), n)]
for i, (shape, names, k) in enumerate(cases):
    barrier(f"start{i}")
    if me >= k:
        continue  # a process without devices in the mesh need not call pk.init
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:k])
    base = len(os.listdir("/proc/self/fd"))
    rt = comm.Runtime.create(mesh, workspace_bytes=None, timeout_s=5)
    assert rt.hosts == {p: 0 for p in range(k)}, rt.hosts
    assert len(rt.groups) == len(names) and len(table) == len(names)
    for g in rt.groups:
        rank = [d.process_index for d in g.devices].index(me)
        assert table[(g.comm_id, 0)][:2] == (rank, g.world)
        os.pwrite(maps[g.ptrs[rank]].fd, f"{i}:{g.comm_id}:{me}".encode(), 0)
    barrier(f"written{i}", k)
    for g in rt.groups:
        for p, d in enumerate(g.devices):
            got = os.pread(maps[g.ptrs[p]].fd, 64, 0).decode()
            assert got == f"{i}:{g.comm_id}:{d.process_index}", (got, p)
    barrier(f"read{i}", k)
    rt.close()
    assert not table and not maps and Alloc.live == 0
    assert len(os.listdir("/proc/self/fd")) == base
print("fake-vmm rank OK")
"""


def test_rendezvous_and_exchange_across_processes_with_fake_vmm(tmp_path):
    script = tmp_path / "fake_vmm_rank.py"
    script.write_text(_FAKE_VMM_RANK)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU job, also on a GPU machine
    root = os.path.dirname(os.path.dirname(pk.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", "4", "--timeout", "150",
                          str(script)], capture_output=True, text=True, env=env, timeout=200,
                         check=False)
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-2000:]
    assert out.stdout.count("fake-vmm rank OK") == 4, out.stdout[-5000:]


def _has_table() -> bool:
    return _ffi.HAS_CUDA and hasattr(_ffi._pk_ffi, "comm_register")


@pytest.mark.needs_ext
def test_comm_table_register_find_unregister():
    m = _ffi._pk_ffi
    assert _has_table(), "the built extension lacks comm_register: rebuild it"
    base = m.comm_count()
    m.comm_register(9001, 3, 1, 2, [0x1000, 0x2000], [0x3000, 0x4000], 4096, 64, 10**9, 0x5000)
    try:
        info = m.comm_info(9001, 3)
        assert info.pop("serial") > 0
        assert info == {"rank": 1, "world": 2, "timeout_ns": 10**9,
                        "workspace_ptrs": [0x1000, 0x2000], "signal_ptrs": [0x3000, 0x4000],
                        "workspace_bytes": 4096, "signal_count": 64, "error_ptr": 0x5000,
                        "link_clock": 0, "link_ps_per_kib": 0}  # the link throttle is off
        assert m.comm_info(9001, 4) is None and m.comm_count() == base + 1
        with pytest.raises(ValueError, match="already registered"):
            m.comm_register(9001, 3, 0, 1, [1], [1], 1, 1, 1, 1)
    finally:
        assert m.comm_unregister(9001, 3)
    assert not m.comm_unregister(9001, 3) and m.comm_count() == base
    for args, msg in [((0, 2, [1], [1]), "needs 2"), ((2, 2, [1, 1], [1, 1]), "rank 2"),
                      ((0, 17, [1] * 17, [1] * 17), "world 17"),
                      ((0, 2, [1, 0], [1, 1]), "null pointer")]:
        with pytest.raises(ValueError, match=msg):
            m.comm_register(9002, 0, *args, 1, 1, 1, 1)
    assert m.comm_count() == base


@pytest.mark.needs_ext
def test_comm_table_serials_and_version():
    """Each registration gets a new serial, also under a key used before; the version moves at
    every unregister and only then."""
    m = _ffi._pk_ffi
    args = ([0x1000], [0x3000], 4096, 64, 10**9, 0x5000)
    v0 = m.comm_table_version()
    m.comm_register(9004, 0, 0, 1, *args)
    m.comm_register(9004, 1, 0, 1, *args)
    try:
        s0, s1 = m.comm_info(9004, 0)["serial"], m.comm_info(9004, 1)["serial"]
        assert 0 < s0 < s1 and m.comm_table_version() == v0  # registering moves nothing
        assert m.comm_unregister(9004, 0)
        assert m.comm_table_version() == v0 + 1 and m.comm_info(9004, 1)["serial"] == s1
        assert not m.comm_unregister(9004, 0) and m.comm_table_version() == v0 + 1
        m.comm_register(9004, 0, 0, 1, *args)  # the key again: a new registration
        assert m.comm_info(9004, 0)["serial"] > s1
    finally:
        m.comm_unregister(9004, 0)
        m.comm_unregister(9004, 1)
    assert m.comm_table_version() == v0 + 3


@pytest.mark.needs_ext
def test_comm_table_from_threads():
    """Threads registering, reading and unregistering the same keys at once (pk.init, pk.shutdown
    and readers of the table; issue 39 section 2): each registration is unregistered exactly
    once, each thread sees a key's serial only grow, the version moves once per unregistration,
    and unregistering a communicator that no handler holds returns at once (nothing on this CPU
    holds one)."""
    m = _ffi._pk_ffi
    args = ([0x1000], [0x3000], 4096, 64, 10**9, 0x5000)
    keys = [(9200, d) for d in range(3)]
    v0, base = m.comm_table_version(), m.comm_count()
    registered, unregistered, failures = [0], [0], []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        last = dict.fromkeys(keys, 0)  # the serial this thread saw last under each key
        try:
            for _ in range(400):
                cid, dev = keys[rng.integers(len(keys))]
                if rng.integers(2):
                    try:
                        m.comm_register(cid, dev, 0, 1, *args)
                    except ValueError as e:
                        assert "already registered" in str(e)
                    else:
                        with lock:
                            registered[0] += 1
                elif m.comm_unregister(cid, dev):
                    with lock:
                        unregistered[0] += 1
                info = m.comm_info(cid, dev)
                if info is not None:
                    assert info["serial"] >= last[cid, dev], (info["serial"], last[cid, dev])
                    last[cid, dev] = info["serial"]
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            failures.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a table call blocked"
    assert not failures, failures
    left = sum(m.comm_unregister(cid, dev) for cid, dev in keys)
    assert registered[0] == unregistered[0] + left > 0
    assert m.comm_table_version() == v0 + registered[0] and m.comm_count() == base


@pytest.mark.needs_ext
def test_communicator_handlers_register_an_instantiate_stage():
    """Every CUDA handler with a comm_id attribute comes as a dict of stages whose instantiate
    stage (one for all) builds the per-executable state; the others are plain capsules."""
    regs = {(name, plat): h for name, plat, h in _ffi.registrations()}
    comm = {"pk_all_reduce", "pk_all_gather", "pk_reduce_scatter", "pk_all_to_all",
            "pk_gemm_rs", "pk_ag_gemm", "pk_gemm_ar", "pk_moe_dispatch", "pk_moe_scatter",
            "pk_moe_combine", "pk_moe_dispatch_gemm", "pk_moe_gemm_combine", "pk_ring_attn",
            "pk_ring_attn_bwd", "pk_ulysses_attn", "pk_ulysses_attn_bwd", "pk_gemm_rs_fp8",
            "pk_gemm_ar_fp8", "pk_ag_gemm_fp8"}
    staged = {name for (name, _), h in regs.items() if isinstance(h, dict)}
    assert staged == comm
    instantiate = set()
    for name in comm:
        stages = regs[(name, "CUDA")]
        assert sorted(stages) == ["execute", "instantiate"]
        assert type(stages["execute"]).__name__ == "PyCapsule"
        instantiate.add(_capsule_address(stages["instantiate"]))
    assert len(instantiate) == 1
    for (name, _), h in regs.items():
        if name not in comm:
            assert type(h).__name__ == "PyCapsule", name
    t = _ffi._pk_ffi.comm_state_type()
    assert sorted(t) == ["type_id", "type_info"]


def _capsule_address(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, None)


# XLA's CPU client runs the instantiate stage of a stateful handler when it compiles the call:
# registered on the "cpu" platform (in a child process: registering the type there assigns
# the state type's id, which the CUDA registration of this process must do), the stage finds
# no communicator, then finds the registered one and gets as far as the device query, which
# this machine may answer (a GPU) or not.
_INSTANTIATE_PY = r"""
import jax, jax.numpy as jnp, numpy as np
from pk_jax import _ffi
m = _ffi._pk_ffi
jax.devices()  # the cpu client takes type and target registrations once it exists
jax.ffi.register_ffi_type(_ffi.COMM_STATE_TYPE, m.comm_state_type(), platform="cpu")
assert m.comm_state_type_id() > 0, "XLA gave the state type no id"
stages = [h for n, p, h in _ffi.registrations() if n == "pk_all_reduce"][0]
jax.ffi.register_ffi_target("pk_probe", stages, platform="cpu", api_version=1)
def f(x, r):
    return jax.ffi.ffi_call("pk_probe", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, r, comm_id=np.int64(9005), algo=np.int64(0))
args = (jnp.ones(8, jnp.float32), jnp.zeros(1, jnp.int32))
try:
    jax.jit(f).lower(*args).compile()
    print("NO-ERROR-1")
except Exception as e:
    print("ERR1", str(e).replace(chr(10), " "))
m.comm_register(9005, 0, 0, 1, [0x1000], [0x3000], 4096, 64, 10**9, 0x5000)
try:
    jax.jit(f).lower(*args).compile()
    print("COMPILED-2")
except Exception as e:
    print("ERR2", str(e).replace(chr(10), " "))
m.comm_unregister(9005, 0)
"""


@pytest.mark.needs_ext
def test_instantiate_stage_runs_when_xla_compiles(tmp_path):
    # The child imports the pk_jax this process imported (with its extension): that copy's
    # parent first on its path, and a working directory away from the source tree (python -c
    # puts the working directory first, and CI's source tree has no built extension).
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(pk.__file__)))
    path = os.pathsep.join(p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", _INSTANTIATE_PY], capture_output=True,
                         text=True, timeout=240, check=False, cwd=tmp_path,
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) if " " in line else (line, "")
                 for line in out.stdout.splitlines())
    assert "communicator 9005, which this process does not have" in lines["ERR1"], out.stdout
    # With the communicator registered the stage copies its view and asks for the SM count:
    # compiled where a GPU answers, else refused with that query named.
    assert "COMPILED-2" in lines or "MultiProcessorCount" in lines.get("ERR2", ""), out.stdout


@pytest.mark.needs_ext
def test_comm_table_link_throttle():
    """comm_set_link (the rank emulator's link cap): GB/s -> ps per KiB, off again with 0."""
    m = _ffi._pk_ffi
    m.comm_register(9003, 0, 0, 1, [0x1000], [0x3000], 4096, 64, 10**9, 0x5000)
    try:
        m.comm_set_link(9003, 0, 50.0, 0x7000)
        info = m.comm_info(9003, 0)
        assert info["link_clock"] == 0x7000
        assert info["link_ps_per_kib"] == round(1024 * 1000 / 50.0)  # 20480 ps = 1 KiB at 50 GB/s
        m.comm_set_link(9003, 0, 0.0, 0x7000)
        info = m.comm_info(9003, 0)
        assert info["link_clock"] == 0 and info["link_ps_per_kib"] == 0
        with pytest.raises(ValueError, match="needs a link clock"):
            m.comm_set_link(9003, 0, 10.0, 0)
        with pytest.raises(ValueError, match="below 0.1 GB/s"):
            m.comm_set_link(9003, 0, 0.01, 0x7000)
    finally:
        assert m.comm_unregister(9003, 0)
    with pytest.raises(ValueError, match="not registered"):
        m.comm_set_link(9003, 0, 10.0, 0x7000)


# ------------------------------------------------------------------------------------------
# GPU: one process, VMM workspaces of P=1 communicators
# ------------------------------------------------------------------------------------------

def _gpu_mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices("gpu")[:1])


def _free_bytes(rt_or_none=None) -> int:
    from pk_jax.runtime import vmm

    ctx = vmm.Context(jax.devices("gpu")[0].local_hardware_id)
    try:
        return ctx.mem_info()[0]
    finally:
        ctx.release()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,names", [((1,), ("tp",)), ((1, 1), ("dp", "tp"))])
def test_gpu_single_process_communicators(shape, names):
    from pk_jax.runtime import vmm

    mesh = _gpu_mesh(shape, names)
    dev = mesh.devices.flat[0]
    pk.init(mesh, workspace_bytes=3 << 20)
    rt = state.runtime()
    assert rt is not None and len(rt.groups) == len(names) and state._hosts == {0: 0}
    seen = set()
    for axis in names:
        cid = state.comm_id(axis)
        info = _ffi._pk_ffi.comm_info(cid, dev.local_hardware_id)
        assert info["rank"] == 0 and info["world"] == 1
        assert info["workspace_bytes"] == 3 << 20 and info["signal_count"] == rt.signal_count
        assert info["timeout_ns"] == int(state.options()["timeout_s"] * 1e9)
        assert info["error_ptr"] == rt.record.device_ptr
        assert info["link_clock"] == 0 and info["link_ps_per_kib"] == 0  # never throttled
        ws, sig = info["workspace_ptrs"][0], info["signal_ptrs"][0]
        assert sig - ws == rt.signal_offset and ws not in seen
        seen.add(ws)
        with rt.contexts[dev.local_hardware_id]:
            assert vmm.copy_to_host(sig, 8 * rt.signal_count) == bytes(8 * rt.signal_count)
            vmm.memset_d32(ws, 0x01020304 + cid, (3 << 20) // 4)
            back = np.frombuffer(vmm.copy_to_host(ws, 3 << 20), np.uint32)
        assert (back == 0x01020304 + cid).all()
    assert errors.read() == (0,) * errors.RECORD_WORDS
    pk.shutdown()
    assert _ffi._pk_ffi.comm_count() == 0 and state.runtime() is None
    assert _ffi._pk_ffi.comm_info(0, dev.local_hardware_id) is None


@pytest.mark.gpu
def test_gpu_init_shutdown_leaks_no_fds_or_memory():
    mesh = _gpu_mesh((1, 1), ("dp", "tp"))
    pk.init(mesh)  # warm-up: the driver may open its own descriptors once
    pk.shutdown()
    fds, free = _fd_count(), _free_bytes()
    for _ in range(3):
        pk.init(mesh)
        assert _free_bytes() < free - (64 << 20)  # two 64 MiB workspaces are allocated
        pk.shutdown()
    assert _fd_count() == fds
    assert abs(_free_bytes() - free) <= 4 << 20


@pytest.mark.gpu
def test_gpu_workspace_that_does_not_fit_says_what_to_do():
    mesh = _gpu_mesh((1,), ("tp",))
    fds = _fd_count()
    # 512 GiB: inside pk.init's bound (2**40) and beyond any Hopper GPU's memory
    with pytest.raises(RuntimeError, match="XLA_PYTHON_CLIENT_MEM_FRACTION") as info:
        pk.init(mesh, workspace_bytes=1 << 39)
    assert str(1 << 39) in str(info.value)
    assert state.mesh_or_none() is None and state.runtime() is None
    assert _fd_count() == fds
    pk.init(mesh)
    assert state.runtime() is not None


@pytest.mark.gpu
def test_gpu_error_record_is_device_writable():
    from pk_jax.runtime import vmm

    mesh = _gpu_mesh((1,), ("tp",))
    pk.init(mesh, timeout_s=7)
    rt = state.runtime()
    with rt.contexts[mesh.devices.flat[0].local_hardware_id]:
        vmm.memset_d32(rt.record.device_ptr + 4, 2, 1)  # op: all_gather
        vmm.memset_d32(rt.record.device_ptr + 12, 5, 1)  # peer
        vmm.memset_d32(rt.record.device_ptr, 1, 1)  # code: timeout
    with pytest.raises(RuntimeError, match="all_gather timed out on rank 0: peer 5 never "
                                           "arrived within 7 s"):
        errors.check(reset=True)
    errors.check()


@pytest.mark.gpu
def test_gpu_reference_backend_skips_vmm(monkeypatch):
    monkeypatch.setenv("PK_JAX_BACKEND", "reference")
    mesh = _gpu_mesh((1,), ("tp",))
    pk.init(mesh)
    assert state.runtime() is None
    assert _ffi._pk_ffi.comm_count() == 0

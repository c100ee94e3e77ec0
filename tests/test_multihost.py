"""Beyond one node, on one machine: four CPU processes under the launcher, two of which say
they are on another host (each rank script replaces comm.host_identity). pk.init's rendezvous
tells the hosts apart, builds communicators only for the groups inside one host, and on a 2-D
mesh an op over the intra-host axis takes the kernel path (a lax stand-in for the FFI call
here) while an op over the axis that spans hosts falls back to XLA's collective with one
warning, with correct results."""

import os
import subprocess
import sys

import pk_jax as pk

_RANK = r"""
import os, warnings
import pk_jax.launch
pk_jax.launch.initialize()
import ctypes, jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import pk_jax as pk
from pk_jax import _backend, _ffi
from pk_jax.runtime import comm, errors, state, vmm

me = jax.process_index()
# Two hosts: ranks 0, 1 on host a, ranks 2, 3 on host b (the name pk.init's rendezvous
# exchanges).
comm.host_identity = lambda: "host-" + "ab"[me // 2]

# A fake driver and communicator table (the runtime's bookkeeping is real), and a GPU-like
# platform whose kernels are lax stand-ins.
class Ctx:
    def __init__(self, o): pass
    def __enter__(self): return self
    def __exit__(self, *e): pass
    def synchronize(self): pass
    def mem_info(self): return (1 << 40, 1 << 41)
    def release(self): pass
class Alloc:
    def __init__(self, size, fd=None):
        self.size, self.fd = size, os.memfd_create("fake") if fd is None else os.dup(fd)
    @classmethod
    def create(cls, o, size): return cls(size)
    @classmethod
    def import_fd(cls, fd, size): return cls(size, fd)
    def export_fd(self): return os.dup(self.fd)
    def release(self): os.close(self.fd)
class Mapping:
    n = 1 << 20
    def __init__(self, alloc, ordinals, alignment=0):
        self.size, self.ptr = alloc.size, Mapping.n
        Mapping.n += alloc.size
    def unmap(self): pass
class Record:
    def __init__(self, nbytes):
        self.buf = (ctypes.c_int32 * 8)()
        self.host_ptr = self.device_ptr = ctypes.addressof(self.buf)
    def free(self): pass
table = {}
class Table:
    def comm_register(self, cid, o, rank, world, *rest): table[(cid, o)] = (rank, world)
    def comm_unregister(self, cid, o): return table.pop((cid, o), None) is not None
vmm.Context, vmm.Allocation, vmm.Mapping, vmm.HostRecord = Ctx, Alloc, Mapping, Record
vmm.granularity = lambda o: 2 << 20
vmm.memset_d8 = lambda *a: None
_ffi._pk_ffi = Table()
_ffi.HAS_CUDA = True
_ffi.targets = lambda platform="CUDA": {"pk_all_reduce"}
_ffi.register = lambda platform: True
state.uses_symmetric_memory = lambda mesh, fixed=None: True
_backend._platform = lambda devices: "gpu"
_backend.all_hopper = lambda devices: True
calls = []
def fake_call(target, results, x, rank, *, out_vma=None, comm_id, **attrs):
    axis = {0: "dp", 1: "tp"}[int(comm_id)]
    calls.append((target, axis))
    return jax.lax.psum(x, axis)
_ffi.call = fake_call

devices = sorted(jax.devices(), key=lambda d: d.process_index)
mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("dp", "tp"))  # rows: hosts
pk.init(mesh)
assert state._hosts == {0: 0, 1: 0, 2: 1, 3: 1}, state._hosts
assert state.axis_on_one_host("tp") and not state.axis_on_one_host("dp")
rt = state.runtime()
assert [g.axis_name for g in rt.groups] == ["tp"], rt.groups  # no communicator across hosts
assert set(table) == {(1, 0)} and table[(1, 0)] == (me % 2, 2), table

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for scale in (1.0, 2.0):  # two traces: one warning
        f = jax.jit(jax.shard_map(lambda v: pk.all_reduce(pk.all_reduce(v * scale, "tp"), "dp"),
                                  mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P()))
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(("dp", "tp"))),
                                                   np.full((1,), me + 1.0, np.float32))
        y = float(f(x)[0])
        assert y == 10.0 * scale, y
hosts = [w for w in caught if "spans several hosts" in str(w.message)]
assert len(hosts) == 1, [str(w.message) for w in caught]
assert calls == [("pk_all_reduce", "tp")] * 2, calls  # the intra-host axis: the kernel path
pk.shutdown()
assert not table
print("multi-host rank OK")
"""


def test_axes_across_hosts_fall_back_and_intra_host_axes_keep_kernels(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    env["CUDA_VISIBLE_DEVICES"] = ""
    root = os.path.dirname(os.path.dirname(pk.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", "4", "--timeout", "200",
                          str(script)], capture_output=True, text=True, env=env, timeout=250,
                         check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert out.stdout.count("multi-host rank OK") == 4, out.stdout[-6000:]

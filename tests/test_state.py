"""pk.init / pk.shutdown as a program sees them (CPU host devices): several meshes at once and
their communicator ids, shutdown then init under functions jitted before, pk.init inside jit,
the settings fixed at pk.init and the cost-model override in jit's cache key, and errors that
kernels record surfacing without the user asking (watcher, next pk call, pk.check_errors)."""

import ctypes
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import P, assert_same, cpu_mesh, small_ints, stand_in_kernels

import pk_jax as pk
from pk_jax import _ffi, cost_model
from pk_jax.runtime import errors, state

EXPLICIT = jax.sharding.AxisType.Explicit


def _placed(mesh, spec, x):
    return jax.device_put(x, jax.NamedSharding(mesh, spec))


# ------------------------------------------------------------------------ several meshes


def test_second_mesh_is_added_and_ids_are_per_signature():
    a = cpu_mesh((8,), ("tp",))
    b = cpu_mesh((2, 4), ("dp", "tp"))
    pk.init(a)
    pk.init(b)
    pk.init(a)  # idempotent for a mesh it has
    assert state.meshes() == (a, b)
    assert state._comm_ids == {(("tp",), (8,), "tp"): 0, (("dp", "tp"), (2, 4), "dp"): 1,
                               (("dp", "tp"), (2, 4), "tp"): 2}
    # Disjoint sub-meshes of one signature share the id: each device has one group there.
    c = jax.make_mesh((4,), ("sp",), devices=jax.devices()[:4], axis_types=(EXPLICIT,))
    d = jax.make_mesh((4,), ("sp",), devices=jax.devices()[4:], axis_types=(EXPLICIT,))
    pk.init(c)
    pk.init(d)
    assert state._comm_ids[(("sp",), (4,), "sp")] == 3 and len(state._comm_ids) == 4
    pk.shutdown()
    assert state.meshes() == () and state._comm_ids == {}


def test_a_mesh_that_cannot_be_told_apart_is_refused():
    pk.init(cpu_mesh((8,), ("tp",)))
    devices = jax.devices()[:8]
    swapped = jax.make_mesh((8,), ("tp",), devices=devices[1::-1] + devices[2:],
                            axis_types=(EXPLICIT,))
    with pytest.raises(ValueError, match="same axis names and shape.*other axis names"):
        pk.init(swapped)
    assert len(state.meshes()) == 1


def test_other_options_for_a_second_mesh_are_refused():
    pk.init(cpu_mesh((8,), ("tp",)), workspace_bytes=1 << 20)
    with pytest.raises(ValueError, match="Every mesh shares the first pk.init's options"):
        pk.init(cpu_mesh((2, 4), ("dp", "tp")), workspace_bytes=2 << 20)


@pytest.mark.parametrize("kernels", (False, True))
def test_ops_over_two_meshes_interleaved_in_one_program(monkeypatch, kernels):
    calls = stand_in_kernels(monkeypatch) if kernels else []
    a = cpu_mesh((8,), ("tp",), explicit=False)
    b = cpu_mesh((2, 4), ("dp", "tp"), explicit=False)
    pk.init(a)
    pk.init(b)
    r = 8  # rows per device
    x = small_ints(jax.random.key(0), (8 * r, 4), jnp.float32, lo=-8, hi=8)

    on_a = jax.shard_map(lambda v: pk.all_reduce(v, "tp"), mesh=a, in_specs=P("tp"),
                         out_specs=P())
    on_b = jax.shard_map(
        lambda v: pk.all_reduce(pk.all_gather(pk.reduce_scatter(v, "tp"), "tp"), "dp"),
        mesh=b, in_specs=P(("dp", "tp")), out_specs=P(), check_vma=False)

    @jax.jit
    def program(v):
        s8 = on_a(v)  # [r, 4]: the sum of the 8 blocks
        t8 = on_b(v)  # the same sum, by other ops over the other mesh's two axes
        return on_a(jnp.tile(s8, (8, 1)) + jnp.tile(t8, (8, 1))), t8

    y, t8 = program(x)
    s8 = np.asarray(x, np.float64).reshape(8, r, 4).sum(0)
    assert_same(t8, s8)
    assert_same(y, 16 * s8)
    if kernels:  # the FFI calls carry each mesh's own ids
        got = [(c["target"], c["axis"], c["comm_id"]) for c in calls]
        assert got == [("pk_all_reduce", "tp", 0), ("pk_reduce_scatter", "tp", 2),
                       ("pk_all_gather", "tp", 2), ("pk_all_reduce", "dp", 1),
                       ("pk_all_reduce", "tp", 0)]


def test_shard_map_over_a_mesh_not_given_to_init_says_so():
    pk.init(cpu_mesh((8,), ("tp",)))
    other = cpu_mesh((4,), ("tp",))
    f = jax.shard_map(lambda v: pk.all_reduce(v, "tp"), mesh=other, in_specs=P("tp"),
                      out_specs=P())
    with pytest.raises(ValueError, match=r"not one given to pk.init \(pk.init has axes "
                                         r"\('tp',\) shape \(8,\)\)"):
        jax.jit(f)(_placed(other, P("tp"), jnp.ones(8)))


# ------------------------------------------------------- shutdown, init again, jit before


def _traced_all_reduce(mesh, traces):
    @jax.jit
    def f(v):
        def body(a):
            traces.append(1)
            return pk.all_reduce(a, "tp")
        return jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P())(v)

    return f


def test_function_jitted_before_shutdown_runs_after_init_again():
    # On host devices nothing in an executable refers to pk_jax's state: it is reused.
    mesh = cpu_mesh((4,), ("tp",))
    traces = []
    f = _traced_all_reduce(mesh, traces)
    x = _placed(mesh, P("tp"), jnp.arange(8.0))
    pk.init(mesh)
    assert_same(f(x), [12.0, 16.0])
    assert_same(f(x), [12.0, 16.0]) and len(traces) == 1
    pk.shutdown()
    pk.init(mesh)
    assert_same(f(x), [12.0, 16.0])
    pk.shutdown()
    pk.init(cpu_mesh((2, 4), ("dp", "tp")))  # another mesh: f's own is not registered now
    with pytest.raises(ValueError, match="not one given to pk.init"):
        _traced_all_reduce(mesh, traces)(x)


def test_shutdown_that_releases_communicators_makes_jitted_functions_retrace(fake):
    # With communicators (a fake driver here), an executable may hold their ids and CUDA graphs
    # recorded from it their memory: shutdown clears JAX's caches, so f is traced again.
    mesh = cpu_mesh((4,), ("tp",))
    traces = []
    f = _traced_all_reduce(mesh, traces)
    x = _placed(mesh, P("tp"), jnp.arange(8.0))
    pk.init(mesh)
    assert state.runtime() is not None
    assert_same(f(x), [12.0, 16.0])
    assert_same(f(x), [12.0, 16.0]) and len(traces) == 1
    pk.shutdown()
    with pytest.raises(ValueError, match=r"pk.init\(mesh\) has not been called"):
        f(x)
    pk.init(mesh)
    assert_same(f(x), [12.0, 16.0])
    assert len(traces) == 3


def test_init_inside_jit_raises():
    mesh = cpu_mesh((4,), ("tp",))

    def g(v):
        pk.init(mesh)
        return v

    with pytest.raises(RuntimeError, match="pk.init was called inside jax.jit.*before the "
                                           "jitted function"):
        jax.jit(g)(jnp.ones(2))
    assert state.meshes() == ()
    with pytest.raises(RuntimeError, match="inside jax.jit"):
        jax.grad(lambda v: (g(v) ** 2).sum())(jnp.ones(2))


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize(("value", "error", "match"), [
    (True, TypeError, "timeout_s must be a number of seconds.*bool"),
    ("60", TypeError, "timeout_s must be a number of seconds.*str"),
    (float("inf"), ValueError, r"timeout_s must be a finite number of seconds in \(0, 86400\]"),
    (float("nan"), ValueError, "timeout_s must be a finite"),
    (1e300, ValueError, "timeout_s must be a finite.*at most one day"),
    (86400.5, ValueError, "timeout_s must be a finite"),
    (0, ValueError, "timeout_s must be a finite"),
    (-1.0, ValueError, "timeout_s must be a finite"),
])
def test_init_refuses_a_bad_timeout(value, error, match):
    with pytest.raises(error, match=match):
        pk.init(cpu_mesh((2,), ("tp",)), timeout_s=value)
    assert state.meshes() == ()


@pytest.mark.parametrize("value", (86400, 2.5, np.float32(0.25)))
def test_init_takes_a_timeout_up_to_a_day(value):
    pk.init(cpu_mesh((2,), ("tp",)), timeout_s=value)
    assert state.options()["timeout_s"] == float(value)
    assert type(state.options()["timeout_s"]) is float


@pytest.mark.parametrize(("value", "error", "match"), [
    (True, TypeError, "workspace_bytes must be an int.*bool"),
    (1.5, TypeError, "workspace_bytes must be an int.*float"),
    (float(1 << 20), TypeError, "workspace_bytes must be an int"),
    ("1048576", TypeError, "workspace_bytes must be an int"),
    (0, ValueError, r"workspace_bytes must be in \[1, 2\*\*40\], got 0"),
    (-(1 << 20), ValueError, "workspace_bytes must be in"),
    (2 ** 80, ValueError, "workspace_bytes must be in"),
    ((1 << 40) + 1, ValueError, "workspace_bytes must be in"),
])
def test_init_refuses_a_bad_workspace_size(value, error, match):
    with pytest.raises(error, match=match):
        pk.init(cpu_mesh((2,), ("tp",)), workspace_bytes=value)
    assert state.meshes() == ()


@pytest.mark.parametrize("value", (1, 1 << 40, np.int64(1 << 20)))
def test_init_takes_a_workspace_size_up_to_a_tebibyte(value):
    pk.init(cpu_mesh((2,), ("tp",)), workspace_bytes=value)  # bookkeeping only on CPU
    assert state.workspace_bytes() == int(value)
    assert type(state.options()["workspace_bytes"]) is int


@pytest.mark.parametrize(("text", "match"), [
    ("abc", r"PK_JAX_TIMEOUT_S='abc' is not a number; give seconds"),
    ("", r"PK_JAX_TIMEOUT_S='' is not a number"),
    ("inf", r"PK_JAX_TIMEOUT_S must be a finite number of seconds"),
    ("-5", r"PK_JAX_TIMEOUT_S must be a finite number of seconds"),
])
def test_a_bad_timeout_variable_is_named(monkeypatch, text, match):
    monkeypatch.setenv("PK_JAX_TIMEOUT_S", text)
    with pytest.raises(ValueError, match=match):
        pk.init(cpu_mesh((2,), ("tp",)))
    assert state.meshes() == ()


def test_the_timeout_variable_applies_without_an_argument(monkeypatch):
    monkeypatch.setenv("PK_JAX_TIMEOUT_S", " 2.5 ")
    pk.init(cpu_mesh((2,), ("tp",)))
    assert state.options()["timeout_s"] == 2.5
    pk.shutdown()
    monkeypatch.delenv("PK_JAX_TIMEOUT_S")
    pk.init(cpu_mesh((2,), ("tp",)))
    assert state.options()["timeout_s"] == state.DEFAULT_TIMEOUT_S == 60.0


# --------------------------------------------------------------------------- settings


def test_a_backend_setting_applies_at_the_next_init(monkeypatch):
    mesh = cpu_mesh((4,), ("tp",))
    f = jax.jit(jax.shard_map(lambda v: pk.all_reduce(v, "tp"), mesh=mesh, in_specs=P("tp"),
                              out_specs=P()))
    x = _placed(mesh, P("tp"), jnp.arange(8.0))
    pk.init(mesh)
    assert_same(f(x), [12.0, 16.0])
    monkeypatch.setenv("PK_JAX_BACKEND", "cuda")  # fail instead of falling back
    assert_same(f(x), [12.0, 16.0])  # cached: settings are fixed at pk.init
    with pytest.raises(ValueError, match=r"PK_JAX_BACKEND='cuda' \(was 'auto'\) changed after "
                                         r"pk.init.*pk.shutdown\(\) and then pk.init"):
        jax.jit(lambda v: jax.shard_map(lambda a: pk.all_reduce(a, "tp"), mesh=mesh,
                                        in_specs=P("tp"), out_specs=P())(v))(x)
    with pytest.raises(ValueError, match="changed after pk.init"):
        pk.init(cpu_mesh((2,), ("dp",)))
    pk.shutdown()
    pk.init(mesh)  # the new setting applies, also to the function jitted before
    with pytest.raises(ValueError, match="PK_JAX_BACKEND=cuda, but the mesh is on cpu"):
        f(x)
    monkeypatch.setenv("PK_JAX_BACKEND", "reference")
    pk.shutdown()
    pk.init(mesh)
    assert_same(f(x), [12.0, 16.0])


def test_cost_model_override_is_part_of_the_jit_key(monkeypatch):
    from pk_jax import _backend

    mesh = cpu_mesh((2,), ("tp",), explicit=False)
    pk.init(mesh)
    modes = []
    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    monkeypatch.setattr(_backend, "_gpu", lambda: cost_model.H200)
    route = jax.shard_map(
        # a small product: the fixed costs of the fused protocol make "auto" serial
        lambda v: modes.append(_backend.route("gemm_rs", "tp", gemm=(512, 512, 512,
                                                                      jnp.bfloat16)).path) or v,
        mesh=mesh, in_specs=P(), out_specs=P())

    @jax.jit
    def f(v):
        return route(v) + 1

    f(1.0)
    with cost_model.override(mode="fused"):
        f(1.0)
        f(1.0)
    with cost_model.override(mode="serial"):
        f(1.0)
    f(1.0)
    assert modes == ["serial", "fused", "serial"]


# ------------------------------------------------------------------------------ errors


@pytest.fixture
def record():
    """A host error record attached as the runtime attaches its own (a fast watcher)."""
    words = (ctypes.c_int32 * errors.RECORD_WORDS)()
    errors._attach(ctypes.addressof(words), 5.0, poll_s=0.01)
    yield words
    errors._attach(0)


def _kernel_records(words, code=1, op=3, rank=2, peer=6):
    for i, v in enumerate((code, op, rank, peer, 7, 8, 0, 0)):
        words[i] = v


def test_watcher_prints_at_once_and_next_pk_call_raises_once(record, capfd):
    mesh = cpu_mesh((4,), ("tp",))
    pk.init(mesh)
    f = jax.shard_map(lambda v: pk.all_reduce(v, "tp"), mesh=mesh, in_specs=P("tp"),
                      out_specs=P())
    x = _placed(mesh, P("tp"), jnp.ones(4))
    _kernel_records(record)
    deadline = time.monotonic() + 5
    while "reduce_scatter" not in capfd.readouterr().err and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() < deadline, "the watcher printed nothing"
    assert errors._pending is not None
    with pytest.raises(RuntimeError, match="reduce_scatter timed out on rank 2: peer 6 never "
                                           "arrived within 5 s"):
        jax.jit(f)(x)
    assert errors.read()[0] == 0  # cleared: the next call may run
    assert_same(jax.jit(f)(x), [4.0])
    _kernel_records(record, code=2, op=5, rank=1, peer=0)
    with pytest.raises(RuntimeError, match="gemm_rs on rank 1: the rank operand"):
        pk.init(mesh)


def test_check_errors_is_public(record):
    pk.check_errors()  # nothing recorded
    _kernel_records(record, op=7)
    with pytest.raises(RuntimeError, match="gemm_ar timed out on rank 2"):
        pk.check_errors()
    pk.check_errors()  # reset by default
    _kernel_records(record, op=7)
    with pytest.raises(RuntimeError, match="gemm_ar"):
        pk.check_errors(reset=False)
    with pytest.raises(RuntimeError, match="gemm_ar"):
        pk.check_errors()


def test_detached_record_stops_the_watcher():
    words = (ctypes.c_int32 * errors.RECORD_WORDS)()
    errors._attach(ctypes.addressof(words), poll_s=0.01)
    watcher = errors._watcher
    assert watcher is not None and watcher.is_alive()
    errors._attach(0)
    assert not watcher.is_alive() and errors._watcher is None
    errors.check_pending()  # no record: nothing to raise


# ------------------------------------------- communicators of several meshes (fake VMM)


class _FakeDriver:
    """Stands in for the CUDA driver (vmm) and the C++ communicator table, on host devices."""

    def __init__(self, monkeypatch):
        from pk_jax import _ffi
        from pk_jax.runtime import vmm

        fake = self
        self.table: dict[tuple[int, int], tuple] = {}
        self.live: set[int] = set()
        self.created = 0
        self.fail_at: int | None = None
        self.next_ptr = 1 << 20

        class Ctx:
            def __init__(self, ordinal):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def synchronize(self):
                pass

            def mem_info(self):
                return (1 << 40, 1 << 41)

            def release(self):
                pass

        class Alloc:
            def __init__(self, size):
                fake.created += 1
                if fake.fail_at is not None and fake.created >= fake.fail_at:
                    raise RuntimeError("fake cuMemCreate: out of memory")
                self.size, self.id = size, fake.created
                fake.live.add(self.id)

            @classmethod
            def create(cls, ordinal, size):
                return cls(size)

            def release(self):
                fake.live.remove(self.id)

        class Mapping:
            def __init__(self, alloc, ordinals, alignment=0):
                self.size, self.ptr = alloc.size, fake.next_ptr
                fake.next_ptr += alloc.size

            def unmap(self):
                pass

        class Record:
            def __init__(self, nbytes):
                self.buf = (ctypes.c_int32 * errors.RECORD_WORDS)()
                self.host_ptr = self.device_ptr = ctypes.addressof(self.buf)

            def free(self):
                pass

        class Table:
            def comm_register(self, cid, ordinal, rank, world, ws, sig, *rest):
                assert (cid, ordinal) not in fake.table, (cid, ordinal)
                fake.table[(cid, ordinal)] = (rank, world, tuple(ws))

            def comm_unregister(self, cid, ordinal):
                return fake.table.pop((cid, ordinal), None) is not None

        for name, value in (("Context", Ctx), ("Allocation", Alloc), ("Mapping", Mapping),
                            ("HostRecord", Record), ("granularity", lambda o: 2 << 20),
                            ("memset_d8", lambda *a: None)):
            monkeypatch.setattr(vmm, name, value)
        monkeypatch.setattr(_ffi, "_pk_ffi", Table())
        monkeypatch.setattr(state, "uses_symmetric_memory", lambda mesh, fixed=None: True)


@pytest.fixture
def fake(monkeypatch):
    yield _FakeDriver(monkeypatch)
    pk.shutdown()  # while the fakes are still in place


def test_communicators_of_several_meshes_are_per_group_and_shared(fake):
    a = cpu_mesh((8,), ("tp",))
    b = cpu_mesh((2, 4), ("dp", "tp"))
    c = jax.make_mesh((4,), ("tp",), devices=jax.devices()[:4], axis_types=(EXPLICIT,))
    pk.init(a)
    rt = state.runtime()
    assert set(fake.table) == {(0, o) for o in range(8)} and len(fake.live) == 8
    pk.init(b)
    assert state.runtime() is rt and len(fake.live) == 8 + 16
    assert {cid for cid, _ in fake.table} == {0, 1, 2}
    assert fake.table[(1, 5)][:2] == (1, 2) and fake.table[(2, 5)][:2] == (1, 4)
    pk.init(c)  # its one group is b's first "tp" group: shared under c's id, nothing allocated
    assert len(fake.live) == 24
    for o in range(4):
        assert fake.table[(3, o)] == fake.table[(2, o)]
    assert (3, 4) not in fake.table
    group = rt.group(3, jax.devices()[0])
    assert group is rt.group(2, jax.devices()[0]) and group.aliases == [3]
    assert errors._host_ptr == rt.record.host_ptr and errors._watcher.is_alive()
    pk.shutdown()
    assert fake.table == {} and fake.live == set() and errors._host_ptr == 0
    assert errors._watcher is None


def test_a_failing_second_init_leaves_the_first_mesh_as_it_was(fake):
    a = cpu_mesh((8,), ("tp",))
    pk.init(a)
    table, live = dict(fake.table), set(fake.live)
    fake.fail_at = fake.created + 5  # the fifth allocation of the second mesh fails
    with pytest.raises(RuntimeError, match="out of memory"):
        pk.init(cpu_mesh((2, 4), ("dp", "tp")))
    assert fake.table == table and fake.live == live
    assert state.meshes() == (a,) and len(state._comm_ids) == 1
    fake.fail_at = None
    pk.init(cpu_mesh((2, 4), ("dp", "tp")))  # and it may be tried again
    assert len(fake.live) == 24


def test_shutdown_finishes_dispatched_work_then_unregisters_then_synchronises(fake, monkeypatch):
    """pk.shutdown's order (issue 39 section 2): computations already dispatched finish (one
    that failed or was deleted does not stop it), then every communicator is unregistered (which
    waits out the FFI handlers holding it, ffi/comm.h), then every device is synchronised (the
    kernels those handlers launched), and only then is memory unmapped and released."""
    pk.init(cpu_mesh((8,), ("tp",)))
    rt = state.runtime()
    counts = {"synchronize": len(rt.contexts), "unmap": len(rt.mappings),
              "release": len(rt.allocations), "unregister": 8, "ready": 2}
    log = []

    class Pending:
        def __init__(self, error):
            self.error = error

        def block_until_ready(self):
            log.append("ready")
            if self.error:
                raise RuntimeError("Array has been deleted")
            return self

    monkeypatch.setattr(jax, "live_arrays", lambda: [Pending(True), Pending(False)])
    table = _ffi._pk_ffi
    unregister = table.comm_unregister
    monkeypatch.setattr(table, "comm_unregister",
                        lambda c, o: log.append("unregister") or unregister(c, o))
    for ctx in rt.contexts.values():
        monkeypatch.setattr(ctx, "synchronize", lambda: log.append("synchronize"))
    for m in rt.mappings:
        monkeypatch.setattr(m, "unmap", lambda: log.append("unmap"))
    for a in rt.allocations:
        monkeypatch.setattr(a, "release", lambda r=a.release: log.append("release") or r())
    pk.shutdown()
    assert [k for k, _ in itertools.groupby(log)] == [
        "ready", "unregister", "synchronize", "unmap", "release"]
    assert {k: log.count(k) for k in counts} == counts and counts["synchronize"] == 8
    assert fake.table == {} and fake.live == set() and state.runtime() is None


# --------------------------------------------------------------------- on the H200 (P = 1)


def _gpu_meshes():
    dev = jax.devices("gpu")[:1]
    return (jax.make_mesh((1,), ("tp",), devices=dev),
            jax.make_mesh((1, 1), ("dp", "tp"), devices=dev))


@pytest.mark.gpu
def test_gpu_two_meshes_interleaved_in_one_program():
    a, b = _gpu_meshes()
    pk.init(a)
    pk.init(b)
    assert state.meshes() == (a, b)
    for stem in ("all_reduce", "all_gather", "reduce_scatter"):
        assert pk.backend_name(stem, "tp") == "cuda"
    x = small_ints(jax.random.key(3), (40, 24), jnp.float32, lo=-8, hi=8)
    on_a = jax.shard_map(lambda v: pk.all_reduce(v, "tp"), mesh=a, in_specs=P(), out_specs=P())
    on_b = jax.shard_map(
        lambda v: pk.all_reduce(pk.all_gather(pk.reduce_scatter(v, "tp"), "tp"), "dp"),
        mesh=b, in_specs=P(), out_specs=P(), check_vma=False)

    @jax.jit
    def program(v):
        return on_a(on_b(v) + 1) * 2, on_b(on_a(v))

    for i in range(2):  # two calls in a row over both meshes' communicators
        y, z = program(x + i)
        assert_same(y, 2 * (x + i + 1))
        assert_same(z, x + i)
    rt = state.runtime()
    assert rt is not None and len(state._comm_ids) == 3
    pk.shutdown()
    assert state.runtime() is None and state.meshes() == ()


@pytest.mark.gpu
@pytest.mark.parametrize("op", ("all_reduce", "gemm_rs"))
def test_gpu_function_jitted_before_shutdown_runs_after_init_with_another_workspace(op):
    # The executable's communicator view is prepared when XLA instantiates it; pk.shutdown
    # unmaps the old workspace, so an executable (or CUDA graph) kept from before would point
    # at unmapped memory. The same jitted function must give the right answer after pk.init
    # with another workspace size, twice.
    mesh, _ = _gpu_meshes()
    kx, kw = jax.random.split(jax.random.key(11))
    x = small_ints(kx, (256, 128), jnp.bfloat16, lo=-4, hi=4)
    w = small_ints(kw, (128, 192), jnp.bfloat16, lo=-4, hi=4)
    if op == "all_reduce":
        body, want = (lambda a, b: pk.all_reduce(a, "tp")), np.asarray(x, np.float32)
    else:
        body = lambda a, b: pk.gemm_reduce_scatter(a, b, "tp")
        exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # integers: exact in fp32
        want = np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32)  # one rounding
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(),
                              check_vma=False))
    for ws in (None, 64 << 20, 8 << 20):
        pk.init(mesh, workspace_bytes=ws)
        for i in range(2):
            assert_same(np.asarray(f(x, w), np.float32), want)
        pk.shutdown()

"""all_gather against its reference `lax.all_gather(..., tiled=True)`: bit-for-bit data movement
with x = rank patterns for P in {1,2,3,4,8} and on 2-D meshes, every gather axis, odd shapes,
every dtype (int32 too), explicit and Auto axes, check_vma on and off, the VJP against JAX's AD
of the reference, check_grads, and the error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import (
    WORLD_SIZES,
    P,
    assert_same,
    check_grads_sharded,
    collective_vjp_test,
    cpu_mesh,
    gpu_mesh,
    product,
    rand,
    run,
    small_ints,
    stand_in_kernels,
    vjp_both,
)

import pk_jax as pk
from pk_jax.ops import all_gather as ag

KEYS = jax.random.split(jax.random.key(5), 4)
MOVE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)


def _tagged(shape, dtype):
    """Values that name their position: exact in every dtype for small shapes."""
    return (jnp.arange(np.prod(shape)) % 251).reshape(shape).astype(dtype)


@pytest.mark.parametrize("p,explicit", [(p, True) for p in WORLD_SIZES] + [(3, False)])
def test_bit_exact_every_dtype_and_axis(p, explicit):
    # One program per P: each dtype gathered along dims 0, 1 and -1 of a rank-3 array, and a
    # rank pattern (the received block j is all j).
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    local = (3, 2, 5)
    xs = [_tagged((p * local[0], *local[1:]), d) for d in MOVE_DTYPES]

    def body(*a):
        rank = jax.lax.axis_index("tp")
        outs = []
        for x in a:
            outs += [pk.all_gather(x, "tp"), pk.all_gather(x, "tp", axis=1),
                     pk.all_gather(x, "tp", axis=-1)]
        return (*outs, pk.all_gather(jnp.full((2, 1), rank, jnp.int32), "tp"))

    n = 3 * len(xs)
    outs = run(body, mesh, (P("tp"),) * len(xs), (P("tp"),) * n + (P("tp"),), *xs)
    for i, x in enumerate(xs):
        blocks = np.split(np.asarray(x, np.float64), p, axis=0)
        expect = [np.concatenate(blocks, axis=d) for d in (0, 1, 2)]
        for y, e in zip(outs[3 * i:3 * i + 3], expect):
            assert y.dtype == x.dtype
            # out_specs P("tp") stacks the P identical copies along dim 0
            assert_same(y, np.concatenate([e] * p, axis=0))
    rank_rows = np.repeat(np.arange(p), 2)[:, None]
    assert_same(outs[-1], np.tile(rank_rows, (p, 1)))


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    p = dict(zip(names, shape))[axis]
    mesh = cpu_mesh(shape, names)
    x = _tagged((8 * 3, 5), jnp.int32)
    # rows sharded over (other, axis): gathering over `axis` gives `other`'s block of rows on
    # each of the p devices of the group (the result still varies along `axis`).
    y = run(lambda a: pk.all_gather(a, axis), mesh, (P((other, axis)),), P((other, axis)), x)
    groups = np.split(np.asarray(x), 8 // p)
    assert_same(y, np.concatenate([g for g in groups for _ in range(p)]))


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,axis",
                         product(WORLD_SIZES, MOVE_DTYPES, (True, False), (True, False),
                                 (0, 1)))
def test_bit_exact_large(p, dtype, explicit, check_vma, axis):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = _tagged((p * 7, 3), dtype)
    y = run(lambda a: pk.all_gather(a, "tp", axis=axis), mesh, (P("tp"),), P("tp"), x,
            check_vma=check_vma)
    e = np.concatenate(np.split(np.asarray(x, np.float64), p, axis=0), axis=axis)
    assert_same(y, np.concatenate([e] * p, axis=0))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_spec, out_spec, global x shape, global y shape)."""
    if kind == "varying":
        return cpu_mesh((4,), ("tp",)), P("tp"), P("tp"), (12, 5), (48, 5)
    if kind == "2d":
        return cpu_mesh((2, 4), ("dp", "tp")), P(("dp", "tp")), P(("dp", "tp")), (16, 5), \
            (64, 5)
    if kind == "invariant":  # gathering a replicated value
        return cpu_mesh((4,), ("tp",)), P(), P("tp"), (3, 5), (48, 5)
    raise ValueError(kind)


VJP_KINDS = ("varying", "2d", "invariant")


def _model(kind, x, dy):
    """(y, dx) of the global function in numpy. Every device of a tp group holds the group's
    rows gathered, so y repeats each group's rows once per device (4 tp devices; 2 dp groups
    in "2d"; a replicated x: 16 copies, 4 per device x 4 devices), and dx sums the copies."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    groups, copies = {"varying": (1, 4), "2d": (2, 4), "invariant": (1, 16)}[kind]
    xg = x.reshape(groups, 1, -1, x.shape[1])
    y = np.tile(xg, (1, copies, 1, 1)).reshape(-1, x.shape[1])
    dx = dy.reshape(groups, copies, -1, x.shape[1]).sum(1).reshape(x.shape)
    return y, dx


# Value and VJP of the global function against a numpy model, on the reference path and on
# the kernel path's custom VJP; the gradients without check_vma against JAX's AD of plain lax.
test_vjp_matches_numpy_model = collective_vjp_test(
    VJP_KINDS, _vjp_case, KEYS, lambda a: pk.all_gather(a, "tp"),
    lambda a: jax.lax.all_gather(a, "tp", tiled=True), _model)


@pytest.mark.parametrize("kind", ("varying", "2d"))
def test_check_grads_float32(kind):
    mesh, in_spec, out_spec, xs, _ = _vjp_case(kind)
    check_grads_sharded(lambda a: pk.all_gather(a, "tp"), mesh, (in_spec,), out_spec,
                        (rand(KEYS[2], xs, jnp.float32),))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, *, axis_name="tp", init=True, **kw):
    with pytest.raises(exc, match=match):
        run(lambda a: pk.all_gather(a, axis_name, **kw), cpu_mesh((4,), ("tp",)), (P(),), P(),
            x, init=init)


def test_error_init_not_called():
    _raises(ValueError, r"pk.all_gather: pk.init\(mesh\) has not been called", jnp.ones(4),
            init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"pk.all_gather: axis_name='x' is not an axis of the mesh", jnp.ones(4),
            axis_name="x")


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"pk.all_gather: axis 'tp' is not bound here"):
        jax.jit(lambda a: pk.all_gather(a, "tp"))(jnp.ones(4))


@pytest.mark.parametrize("dtype", (jnp.int8, jnp.bool_, jnp.uint32))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"pk.all_gather: x has dtype {name}; supported: bfloat16, float16, "
            "float32, int32", jnp.ones(4, dtype))


@pytest.mark.parametrize("axis", (2, -3))
def test_error_axis_out_of_range(axis):
    _raises(ValueError, f"pk.all_gather: axis={axis} is out of range for an array of rank 2",
            jnp.ones((4, 2)), axis=axis)


def test_error_axis_not_an_int():
    _raises(TypeError, "pk.all_gather: axis must be an int, got '0'", jnp.ones((4, 2)),
            axis="0")


def test_error_scalar():
    _raises(ValueError, r"pk.all_gather: x must have at least 1 dimensions, got shape \(\)",
            jnp.float32(1))


# GPU tests

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape_axis,ws",
                         product((jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32),
                                 (((3, 5), 0), ((1,), 0), ((300, 257), 1), ((4, 8, 16), 2)),
                                 (1 << 20,)))
def test_gpu_p1_kernel_equals_reference(dtype, shape_axis, ws):
    shape, axis = shape_axis
    mesh = gpu_mesh("all_gather", ws)
    x = jax.random.randint(jax.random.key(0), shape, -1000, 1000).astype(dtype)
    f = lambda a: pk.all_gather(a, "tp", axis=axis)
    for i in range(2):
        xi = x + i
        assert_same(run(f, mesh, (P(),), P("tp"), xi, init=False), xi)


@pytest.mark.gpu
def test_gpu_p1_vjp_matches_reference():
    mesh = gpu_mesh("all_gather")
    x = rand(jax.random.key(1), (16, 24), jnp.float32)
    dy = rand(jax.random.key(2), (16, 24), jnp.float32)
    ours, ref = vjp_both(lambda a: pk.all_gather(a, "tp", axis=1),
                         lambda a: ag.reference(a, "tp", axis=1), mesh, (P(),), P("tp"), (x,), dy,
                         init=False)
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.parametrize("check_vma,axis", product((True, False), (0, 1)))
def test_kernel_path_wiring(monkeypatch, check_vma, axis):
    # The CUDA path with lax stand-ins for the FFI calls: the all-gather kernel runs forward
    # with the comm id of "tp", and its VJP is the reduce-scatter kernel along the same axis.
    calls = stand_in_kernels(monkeypatch)
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = small_ints(KEYS[0], (2 * 3, 4 * 2), jnp.float32)  # per device [3, 2]
    dy = small_ints(KEYS[1], (2 * 3 * 4, 4 * 2) if axis == 0 else (2 * 3, 4 * 4 * 2),
                    jnp.float32)
    ours, ref = vjp_both(lambda a: pk.all_gather(a, "tp", axis=axis),
                         lambda a: ag.reference(a, "tp", axis=axis), mesh, (P("dp", "tp"),),
                         P("dp", "tp"), (x,), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        assert_same(a, b)
    assert [(c["target"], c["axis"], c["comm_id"]) for c in calls] == [
        ("pk_all_gather", "tp", 1), ("pk_reduce_scatter", "tp", 1)]

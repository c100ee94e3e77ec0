"""reduce_scatter against its reference `lax.psum_scatter(..., tiled=True)`: exact sums on
integer inputs and x = rank for P in {1,2,3,4,8} and on 2-D meshes, every scatter dimension, odd
shapes, every dtype, explicit and Auto axes, check_vma on and off, the VJP against JAX's AD of
the reference, check_grads, and the error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import (
    FLOAT_DTYPES,
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
    tp_blocks_sum_model,
    vjp_both,
)

import pk_jax as pk
from pk_jax.ops import reduce_scatter as rs

KEYS = jax.random.split(jax.random.key(6), 4)


def _blocks_sum(x, p):
    return np.asarray(x, np.float64).reshape(p, -1, *x.shape[1:]).sum(0)


def _spec_on(dim, ndim, axis="tp"):
    return P(*([None] * dim + [axis] + [None] * (ndim - dim - 1)))


@pytest.mark.parametrize("p,explicit", [(p, True) for p in WORLD_SIZES] + [(4, False)])
def test_exact_every_dtype_and_dimension(p, explicit):
    # One program per P: every dtype scattered along dims 0, 1 and -1 of a rank-3 array with
    # odd sizes, and x = rank + 1. With the result's scattered dim sharded over "tp", the
    # global result is the sum of the P input blocks.
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    local = (3 * p, p, 5 * p)
    xs = [small_ints(KEYS[i % 4], (p * local[0], *local[1:]), d, lo=-8, hi=8)
          for i, d in enumerate(FLOAT_DTYPES)]

    def body(*a):
        rank = jax.lax.axis_index("tp").astype(jnp.float32) + 1
        outs = []
        for x in a:
            outs += [pk.reduce_scatter(x, "tp"), pk.reduce_scatter(x, "tp", scatter_dimension=1),
                     pk.reduce_scatter(x, "tp", scatter_dimension=-1)]
        return (*outs, pk.reduce_scatter(jnp.full((p, 3), rank), "tp"))

    out_specs = [_spec_on(d, 3) for d in (0, 1, 2)] * len(xs) + [P("tp")]
    outs = run(body, mesh, (P("tp"),) * len(xs), tuple(out_specs), *xs)
    for i, x in enumerate(xs):
        for y in outs[3 * i:3 * i + 3]:
            assert y.dtype == x.dtype
            assert_same(y, _blocks_sum(x, p))
    assert_same(outs[-1], np.full((p, 3), p * (p + 1) / 2))


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    p = dict(zip(names, shape))[axis]
    mesh = cpu_mesh(shape, names)
    x = small_ints(KEYS[0], (p * 3 * p, 4 * 5), jnp.float32, lo=-8, hi=8)
    y = run(lambda a: pk.reduce_scatter(a, axis), mesh, (P(axis, other),), P(axis, other), x)
    assert_same(y, _blocks_sum(x, p))


@pytest.mark.parametrize("check_vma,dim", product((True, False), (0, 1)))
def test_kernel_path_wiring(monkeypatch, check_vma, dim):
    # The CUDA path with lax stand-ins for the FFI calls: the reduce-scatter kernel runs forward
    # with the comm id of "tp", and its VJP is the all-gather kernel along the same dimension.
    calls = stand_in_kernels(monkeypatch)
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = small_ints(KEYS[0], (2 * 8, 8), jnp.float32)
    # per device: x [4, 4] -> [1, 4] (dim 0) or [4, 1] (dim 1)
    dy = small_ints(KEYS[1], (4, 8) if dim == 0 else (16, 2), jnp.float32)
    ours, ref = vjp_both(lambda a: pk.reduce_scatter(a, "tp", scatter_dimension=dim),
                         lambda a: rs.reference(a, "tp", scatter_dimension=dim), mesh,
                         (P("tp", "dp"),), P("tp", "dp"), (x,), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        assert_same(a, b)
    assert [(c["target"], c["axis"], c["comm_id"]) for c in calls] == [
        ("pk_reduce_scatter", "tp", 1), ("pk_all_gather", "tp", 1)]


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,dim",
                         product(WORLD_SIZES, FLOAT_DTYPES, (True, False), (True, False), (0, 1)))
def test_exact_large(p, dtype, explicit, check_vma, dim):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = small_ints(KEYS[0], (p * 7 * p, 3 * p), dtype, lo=-8, hi=8)
    y = run(lambda a: pk.reduce_scatter(a, "tp", scatter_dimension=dim), mesh, (P("tp"),),
            _spec_on(dim, 2), x, check_vma=check_vma)
    assert_same(y, _blocks_sum(x, p))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_spec, out_spec, global x shape, global y shape)."""
    if kind == "varying":
        return cpu_mesh((4,), ("tp",)), P("tp"), P("tp"), (32, 5), (8, 5)
    if kind == "2d":
        return cpu_mesh((2, 4), ("dp", "tp")), P("tp", "dp"), P("tp", "dp"), (32, 10), (8, 10)
    if kind == "invariant":  # reduce-scatter of a replicated value: P times its slice
        return cpu_mesh((4,), ("tp",)), P(), P("tp"), (8, 5), (8, 5)
    raise ValueError(kind)


VJP_KINDS = ("varying", "2d", "invariant")


# Value and VJP of the global function against a numpy model, on the reference path and on
# the kernel path's custom VJP; the gradients without check_vma against JAX's AD of plain lax.
test_vjp_matches_numpy_model = collective_vjp_test(
    VJP_KINDS, _vjp_case, KEYS, lambda a: pk.reduce_scatter(a, "tp"),
    lambda a: jax.lax.psum_scatter(a, "tp", tiled=True), tp_blocks_sum_model)


@pytest.mark.parametrize("kind", ("varying", "2d"))
def test_check_grads_float32(kind):
    mesh, in_spec, out_spec, xs, _ = _vjp_case(kind)
    check_grads_sharded(lambda a: pk.reduce_scatter(a, "tp"), mesh, (in_spec,), out_spec,
                        (rand(KEYS[2], xs, jnp.float32),))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, *, axis_name="tp", init=True, **kw):
    with pytest.raises(exc, match=match):
        run(lambda a: pk.reduce_scatter(a, axis_name, **kw), cpu_mesh((4,), ("tp",)), (P(),),
            P(), x, init=init)


def test_error_init_not_called():
    _raises(ValueError, r"pk.reduce_scatter: pk.init\(mesh\) has not been called",
            jnp.ones(4), init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"pk.reduce_scatter: axis_name='dp' is not an axis of the mesh",
            jnp.ones(4), axis_name="dp")


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"pk.reduce_scatter: axis 'tp' is not bound here"):
        jax.jit(lambda a: pk.reduce_scatter(a, "tp"))(jnp.ones(4))


@pytest.mark.parametrize("dtype", (jnp.int32, jnp.int8))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"pk.reduce_scatter: x has dtype {name}; supported: bfloat16, float16, "
            "float32", jnp.ones(4, dtype))


def test_error_not_divisible_by_p():
    _raises(ValueError, r"pk.reduce_scatter: x.shape\[1\] \(the scatter dimension\) = 6 is not "
            r"divisible by 4. Pad it to a multiple of the size of axis 'tp'",
            jnp.ones((4, 6)), scatter_dimension=1)


@pytest.mark.parametrize("dim", (2, -3))
def test_error_scatter_dimension_out_of_range(dim):
    _raises(ValueError, f"pk.reduce_scatter: scatter_dimension={dim} is out of range for an "
            "array of rank 2", jnp.ones((4, 4)), scatter_dimension=dim)


def test_error_scalar():
    _raises(ValueError, r"pk.reduce_scatter: x must have at least 1 dimensions",
            jnp.float32(1))


# GPU tests

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,shape_dim,ws",
                         product(FLOAT_DTYPES, (((3, 5), 0), ((1,), 0), ((300, 257), 1)),
                                 (1 << 20,)))
def test_gpu_p1_kernel_equals_reference(dtype, shape_dim, ws):
    shape, dim = shape_dim
    mesh = gpu_mesh("reduce_scatter", ws)
    x = small_ints(jax.random.key(0), shape, dtype, lo=-8, hi=8)
    f = lambda a: pk.reduce_scatter(a, "tp", scatter_dimension=dim)
    for i in range(2):
        xi = x + i
        assert_same(run(f, mesh, (P(),), P("tp"), xi, init=False), xi)


@pytest.mark.gpu
def test_gpu_p1_vjp_matches_reference():
    mesh = gpu_mesh("reduce_scatter")
    x = rand(jax.random.key(1), (16, 24), jnp.float32)
    dy = rand(jax.random.key(2), (16, 24), jnp.float32)
    ours, ref = vjp_both(lambda a: pk.reduce_scatter(a, "tp", scatter_dimension=1),
                         lambda a: rs.reference(a, "tp", scatter_dimension=1), mesh, (P(),), P("tp"),
                         (x,), dy, init=False)
    for a, b in zip(ours, ref):
        assert_same(a, b)

"""all_to_all against its reference `lax.all_to_all(..., tiled=True)`: bit-for-bit data
movement with values that name their sender and position, for P in {1,2,3,4,8} and on 2-D
meshes, several (split_axis, concat_axis) pairs, odd shapes, every dtype (int32 too), explicit
and Auto axes, check_vma on and off, the VJP against a numpy model, check_grads, and
the error messages."""

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
from pk_jax.ops import all_to_all as a2a

KEYS = jax.random.split(jax.random.key(7), 4)
MOVE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32)
PAIRS = ((0, 0), (0, 1), (1, 0), (2, 1), (-1, -3))


def _tagged(shape, dtype):
    """Values that name their position (exact in every dtype for these small shapes)."""
    return (jnp.arange(np.prod(shape)) % 251).reshape(shape).astype(dtype)


def _expected(x, p, split, concat):
    """The numpy all_to_all of the P row blocks of global x; results stacked along dim 0."""
    blocks = np.split(np.asarray(x, np.float64), p, axis=0)
    outs = []
    for r in range(p):
        received = [np.split(b, p, axis=split)[r] for b in blocks]
        outs.append(np.concatenate(received, axis=concat))
    return np.concatenate(outs, axis=0)


@pytest.mark.parametrize("p,explicit", [(p, True) for p in WORLD_SIZES] + [(3, False)])
def test_bit_exact_every_dtype_and_axes(p, explicit):
    # One program per P: each dtype through every (split, concat) pair, and x = rank.
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    local = (2 * p, 3, p)  # odd middle dim; dims 0 and 2 divisible by P
    pairs = [(s, c) for s, c in PAIRS if local[s] % p == 0]
    xs = [_tagged((p * local[0], *local[1:]), d) for d in MOVE_DTYPES]

    def body(*a):
        rank = jax.lax.axis_index("tp")
        outs = [pk.all_to_all(x, "tp", s, c) for x in a for s, c in pairs]
        return (*outs, pk.all_to_all(jnp.full((p, 2), rank, jnp.int32), "tp", 0, 1))

    n = len(pairs) * len(xs)
    outs = run(body, mesh, (P("tp"),) * len(xs), (P("tp"),) * (n + 1), *xs)
    for i, x in enumerate(xs):
        for (s, c), y in zip(pairs, outs[len(pairs) * i:len(pairs) * (i + 1)]):
            assert y.dtype == x.dtype
            assert_same(y, _expected(x, p, s % 3, c % 3))
    # rank r receives one row from every rank j, concatenated along dim 1 in rank order
    assert_same(outs[-1], np.tile(np.repeat(np.arange(p), 2)[None, :], (p, 1)))


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    p = dict(zip(names, shape))[axis]
    mesh = cpu_mesh(shape, names)
    x = _tagged((p * 2 * p, 3 * (8 // p)), jnp.int32)
    y = run(lambda a: pk.all_to_all(a, axis, 0, 0), mesh, (P(axis, other),), P(axis, other), x)
    cols = np.split(np.asarray(x), 8 // p, axis=1)
    expect = np.concatenate([_expected(c, p, 0, 0) for c in cols], axis=1)
    assert_same(y, expect)


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,pair",
                         product(WORLD_SIZES, MOVE_DTYPES, (True, False), (True, False),
                                 ((0, 1), (1, 0))))
def test_bit_exact_large(p, dtype, explicit, check_vma, pair):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = _tagged((p * 3 * p, 5 * p), dtype)
    y = run(lambda a: pk.all_to_all(a, "tp", *pair), mesh, (P("tp"),), P("tp"), x,
            check_vma=check_vma)
    assert_same(y, _expected(x, p, *pair))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_spec, out_spec, global x shape, global y shape) for split 0, concat 1."""
    if kind == "varying":
        return cpu_mesh((4,), ("tp",)), P("tp"), P("tp"), (32, 5), (8, 20)
    if kind == "2d":
        return cpu_mesh((2, 4), ("dp", "tp")), P("tp", "dp"), P("tp", "dp"), (32, 10), \
            (8, 40)
    raise ValueError(kind)


VJP_KINDS = ("varying", "2d")


def _model(kind, x, dy):
    """(y, dx) of the global function in numpy, per dp column block of width c (one block in
    "varying", two in "2d"): rank r's rows [2r, 2r+2) of y hold, at columns [c s, c (s+1)),
    rows [8s + 2r, 8s + 2r + 2) of x (split rows over 4 ranks, concatenate columns); dx is the
    inverse permutation of dy."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    blocks = {"varying": 1, "2d": 2}[kind]
    c = x.shape[1] // blocks
    ys, dxs = [], []
    for b in range(blocks):
        xb, dyb = x[:, b * c:(b + 1) * c], dy[:, b * 4 * c:(b + 1) * 4 * c]
        ys.append(xb.reshape(4, 4, 2, c).transpose(1, 2, 0, 3).reshape(8, 4 * c))
        dxs.append(dyb.reshape(4, 2, 4, c).transpose(2, 0, 1, 3).reshape(32, c))
    return np.concatenate(ys, axis=1), np.concatenate(dxs, axis=1)


# Value and VJP of the global function against a numpy model, on the reference path and on
# the kernel path's custom VJP; the gradients without check_vma against JAX's AD of plain lax.
test_vjp_matches_numpy_model = collective_vjp_test(
    VJP_KINDS, _vjp_case, KEYS, lambda a: pk.all_to_all(a, "tp", 0, 1),
    lambda a: jax.lax.all_to_all(a, "tp", 0, 1, tiled=True), _model)


@pytest.mark.parametrize("kind", VJP_KINDS)
def test_check_grads_float32(kind):
    mesh, in_spec, out_spec, xs, _ = _vjp_case(kind)
    check_grads_sharded(lambda a: pk.all_to_all(a, "tp", 0, 1), mesh, (in_spec,), out_spec,
                        (rand(KEYS[2], xs, jnp.float32),))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, *args, axis_name="tp", init=True):
    args = args or (0, 0)
    with pytest.raises(exc, match=match):
        run(lambda a: pk.all_to_all(a, axis_name, *args), cpu_mesh((4,), ("tp",)), (P(),), P(),
            x, init=init)


def test_error_init_not_called():
    _raises(ValueError, r"pk.all_to_all: pk.init\(mesh\) has not been called", jnp.ones(4),
            init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"pk.all_to_all: axis_name='ep' is not an axis of the mesh",
            jnp.ones(4), axis_name="ep")


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"pk.all_to_all: axis 'tp' is not bound here"):
        jax.jit(lambda a: pk.all_to_all(a, "tp", 0, 0))(jnp.ones(4))


@pytest.mark.parametrize("dtype", (jnp.int8, jnp.bool_))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"pk.all_to_all: x has dtype {name}; supported: bfloat16, float16, "
            "float32, int32", jnp.ones(4, dtype))


def test_error_split_not_divisible_by_p():
    _raises(ValueError, r"pk.all_to_all: x.shape\[1\] \(the split axis\) = 6 is not divisible "
            r"by 4. Pad it to a multiple of the size of axis 'tp'", jnp.ones((4, 6)), 1, 0)


@pytest.mark.parametrize("args,match", [((2, 0), "split_axis=2 is out of range"),
                                        ((0, -3), "concat_axis=-3 is out of range"),
                                        ((0.0, 0), "split_axis must be an int"),
                                        ((0, None), "concat_axis must be an int")])
def test_error_bad_axis_index(args, match):
    exc = TypeError if "must be an int" in match else ValueError
    _raises(exc, "pk.all_to_all: " + match, jnp.ones((4, 4)), *args)


def test_error_scalar():
    _raises(ValueError, r"pk.all_to_all: x must have at least 1 dimensions", jnp.float32(1))


# GPU tests

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,case,ws",
                         product((jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32),
                                 (((3, 5), 0, 1), ((1,), 0, 0), ((2, 40, 4, 8), 2, 1)),
                                 (1 << 20,)))
def test_gpu_p1_kernel_equals_reference(dtype, case, ws):
    shape, split, concat = case
    mesh = gpu_mesh("all_to_all", ws)
    x = jax.random.randint(jax.random.key(0), shape, -1000, 1000).astype(dtype)
    f = lambda a: pk.all_to_all(a, "tp", split, concat)
    for i in range(2):
        xi = x + i
        assert_same(run(f, mesh, (P(),), P("tp"), xi, init=False), xi)


@pytest.mark.gpu
def test_gpu_p1_vjp_matches_reference():
    mesh = gpu_mesh("all_to_all")
    x = rand(jax.random.key(1), (2, 8, 4, 8), jnp.float32)
    dy = rand(jax.random.key(2), (2, 8, 4, 8), jnp.float32)
    ours, ref = vjp_both(lambda a: pk.all_to_all(a, "tp", 2, 1),
                         lambda a: a2a.reference(a, "tp", 2, 1), mesh, (P(),), P("tp"), (x,), dy,
                         init=False)
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.parametrize("check_vma", (True, False))
def test_kernel_path_wiring(monkeypatch, check_vma):
    # The CUDA path with lax stand-ins for the FFI calls: the kernel runs forward with the comm
    # id of "tp", and its VJP is the kernel with split and concat axes swapped.
    calls = stand_in_kernels(monkeypatch)
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x = small_ints(KEYS[0], (2 * 8, 4 * 3), jnp.float32)  # per device [8, 3] -> [2, 12]
    dy = small_ints(KEYS[1], (2 * 2, 4 * 12), jnp.float32)
    ours, ref = vjp_both(lambda a: pk.all_to_all(a, "tp", 0, 1),
                         lambda a: a2a.reference(a, "tp", 0, 1), mesh, (P("dp", "tp"),),
                         P("dp", "tp"), (x,), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        assert_same(a, b)
    assert [(c["target"], c["axis"], c["comm_id"]) for c in calls] == [
        ("pk_all_to_all", "tp", 1), ("pk_all_to_all", "tp", 1)]

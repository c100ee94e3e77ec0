"""all_reduce against its reference `lax.psum`: exact sums on integer inputs and x = rank for P
in {1,2,3,4,8} and on 2-D meshes, odd shapes, every dtype, explicit and Auto axes, check_vma on
and off, the VJP against a numpy model, check_grads, and the error messages."""

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
from pk_jax.ops import all_reduce as ar

KEYS = jax.random.split(jax.random.key(4), 4)
SHAPE = (3, 5)  # per device, odd on purpose


def _blocks_sum(x, p):
    return np.asarray(x, np.float64).reshape(p, -1, *x.shape[1:]).sum(0)


@pytest.mark.parametrize("p,explicit", [(p, True) for p in WORLD_SIZES] + [(4, False)])
def test_exact_every_dtype_and_rank_pattern(p, explicit):
    # One program per P: every dtype at once, plus x = rank + 1.
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    xs = [small_ints(KEYS[i % 4], (p * SHAPE[0], SHAPE[1]), d, lo=-8, hi=8)
          for i, d in enumerate(FLOAT_DTYPES)]

    def body(*a):
        rank = jax.lax.axis_index("tp").astype(jnp.float32) + 1
        return (*(pk.all_reduce(x, "tp") for x in a),
                pk.all_reduce(jnp.full((2, 3, 1), rank), "tp"))

    outs = run(body, mesh, (P("tp"),) * len(xs), (P(),) * (len(xs) + 1), *xs)
    for x, y in zip(xs, outs):
        assert y.dtype == x.dtype and y.shape == SHAPE
        assert_same(y, _blocks_sum(x, p))
    assert_same(outs[-1], np.full((2, 3, 1), p * (p + 1) / 2))


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    p = dict(zip(names, shape))[axis]
    mesh = cpu_mesh(shape, names)
    x = small_ints(KEYS[0], (p * 3, 4 * 5), jnp.float32, lo=-8, hi=8)
    y = run(lambda a: pk.all_reduce(a, axis), mesh, (P(axis, other),), P(None, other), x)
    assert_same(y, _blocks_sum(x, p))


@pytest.mark.parametrize("check_vma,algorithm", product((True, False), (None, "two_shot")))
def test_kernel_path_wiring(monkeypatch, check_vma, algorithm):
    # The CUDA path with a lax stand-in for the FFI call: the kernel is chosen, gets the comm id
    # of "tp" and the algorithm, and its custom VJP is right: with check_vma the cotangent of
    # the invariant sum is a cast (no second all-reduce), without it another all-reduce.
    calls = stand_in_kernels(monkeypatch)
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    x, dy = small_ints(KEYS[0], (2 * 3, 4 * 5), jnp.float32), small_ints(KEYS[1], (2 * 3, 5),
                                                                         jnp.float32)
    ours, ref = vjp_both(lambda a: pk.all_reduce(a, "tp", algorithm=algorithm),
                         lambda a: ar.reference(a, "tp"), mesh, (P("dp", "tp"),), P("dp"),
                         (x,), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        assert_same(a, b)
    algo = ar.ALGORITHMS[algorithm or "auto"]
    want = [{"target": "pk_all_reduce", "axis": "tp", "comm_id": 1, "algo": algo}]
    assert calls == want * (1 if check_vma else 2)


def test_algorithm_is_checked_and_fixed_at_init(monkeypatch):
    monkeypatch.setenv("PK_JAX_ALL_REDUCE_ALGORITHM", "one_shot")
    pk.init(cpu_mesh((2,), ("tp",)))
    assert ar._algorithm(None) == 1 and ar._algorithm("two_shot") == 2
    with pytest.raises(ValueError, match="algorithm='three_shot' is not one of"):
        ar._algorithm("three_shot")
    monkeypatch.setenv("PK_JAX_ALL_REDUCE_ALGORITHM", "two_shot")
    with pytest.raises(ValueError, match="changed after pk.init.*pk.shutdown"):
        ar._algorithm(None)


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma",
                         product(WORLD_SIZES, FLOAT_DTYPES, (True, False), (True, False)))
def test_exact_large(p, dtype, explicit, check_vma):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = small_ints(KEYS[0], (p * 7, 3, 9), dtype, lo=-8, hi=8)
    y = run(lambda a: pk.all_reduce(a, "tp"), mesh, (P("tp"),), P(), x, check_vma=check_vma)
    assert_same(y, _blocks_sum(x, p))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_spec, out_spec, global x shape, global y shape)."""
    if kind == "varying":
        return cpu_mesh((4,), ("tp",)), P("tp"), P(), (12, 5), (3, 5)
    if kind == "2d":
        return cpu_mesh((2, 4), ("dp", "tp")), P("tp", "dp"), P(None, "dp"), (12, 10), (3, 10)
    if kind == "invariant":  # psum of a replicated value: P times it
        return cpu_mesh((4,), ("tp",)), P(), P(), (3, 5), (3, 5)
    raise ValueError(kind)


VJP_KINDS = ("varying", "2d", "invariant")


# Value and VJP of the global function against a numpy model, on the reference path and on
# the kernel path's custom VJP; the gradients without check_vma against JAX's AD of plain lax.
test_vjp_matches_numpy_model = collective_vjp_test(
    VJP_KINDS, _vjp_case, KEYS, lambda a: pk.all_reduce(a, "tp"),
    lambda a: jax.lax.psum(a, "tp"), tp_blocks_sum_model)


@pytest.mark.parametrize("kind", ("varying", "2d"))
def test_check_grads_float32(kind):
    mesh, in_spec, out_spec, xs, _ = _vjp_case(kind)
    check_grads_sharded(lambda a: pk.all_reduce(a, "tp"), mesh, (in_spec,), out_spec,
                        (rand(KEYS[2], xs, jnp.float32),))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, *, axis="tp", init=True):
    with pytest.raises(exc, match=match):
        run(lambda a: pk.all_reduce(a, axis), cpu_mesh((4,), ("tp",)), (P(),), P(), x,
            init=init)


def test_error_init_not_called():
    _raises(ValueError, r"pk.all_reduce: pk.init\(mesh\) has not been called",
            jnp.ones(4), init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"pk.all_reduce: axis_name='dp' is not an axis of the mesh",
            jnp.ones(4), axis="dp")


def test_error_axis_name_not_a_str():
    _raises(TypeError, "pk.all_reduce: axis_name must be one mesh axis name", jnp.ones(4),
            axis=1)


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"pk.all_reduce: axis 'tp' is not bound here"):
        jax.jit(lambda a: pk.all_reduce(a, "tp"))(jnp.ones(4))


@pytest.mark.parametrize("dtype", (jnp.int32, jnp.int8, jnp.bool_))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"pk.all_reduce: x has dtype {name}; supported: bfloat16, float16, "
            "float32", jnp.ones(4, dtype))


# GPU tests

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,case", product(FLOAT_DTYPES, (
    ((3, 5), "auto", None), ((1,), "one_shot", None), ((257, 33), "two_shot", None),
    ((1000, 517), "one_shot", 1 << 20), ((1000, 517), "two_shot", 1 << 20))))
def test_gpu_p1_kernel_equals_reference(dtype, case):
    shape, algorithm, ws = case
    # P = 1: the sum is x itself, bit for bit; the 1 MiB workspace forces many chunked rounds.
    mesh = gpu_mesh("all_reduce", ws)
    x = small_ints(KEYS[0], shape, dtype, lo=-8, hi=8)
    f = lambda a: pk.all_reduce(a, "tp", algorithm=algorithm)
    for i in range(2):  # two calls in a row: the epoch counters carry over
        xi = x + i
        assert_same(run(f, mesh, (P(),), P(), xi, init=False), xi)


@pytest.mark.gpu
@pytest.mark.parametrize("check_vma", (True, False))
def test_gpu_p1_vjp_matches_reference(check_vma):
    mesh = gpu_mesh("all_reduce")
    x = small_ints(KEYS[1], (64, 24), jnp.float32, lo=-8, hi=8)
    dy = small_ints(KEYS[2], (64, 24), jnp.float32, lo=-8, hi=8)
    ours, ref = vjp_both(lambda a: pk.all_reduce(a, "tp"), lambda a: ar.reference(a, "tp"), mesh,
                         (P(),), P(), (x,), dy, check_vma=check_vma, init=False)
    for a, b in zip(ours, ref):
        assert_same(a, b)

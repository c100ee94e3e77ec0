"""all_gather_gemm against its reference `all_gather(x, tiled=True) @ w`: exact products on
integer inputs for P in {1,2,3,4,8} and on 2-D meshes, rows that name their sender, odd sizes,
both dtypes, explicit and Auto axes, the custom VJP (written with gemm_reduce_scatter) against
JAX's AD of the reference with check_vma on and off, check_grads, and the error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import (
    MATMUL_DTYPES,
    WORLD_SIZES,
    P,
    assert_error_within_xla,
    assert_same,
    check_gemm_p1,
    check_grads_sharded,
    cpu_mesh,
    gpu_mesh,
    grads_match_from_outside_shard_map,
    poison,
    product,
    rand,
    run,
    small_ints,
    vjp_both,
)

import pk_jax as pk
from pk_jax import cost_model
from pk_jax.ops import ag_gemm

KEYS = jax.random.split(jax.random.key(1), 4)
N = 5  # odd on purpose (per device)


def _global(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _op(x, w):
    return pk.all_gather_gemm(x, w, "tp")


def _ref(x, w):
    return ag_gemm.reference(x, w, "tp")


def _specs_1d():
    # x: rows sharded (sequence parallel), w: columns sharded (column-parallel weight).
    return (P("tp", None), P(None, "tp")), P(None, "tp")


def _assert_all_same(ours, ref):
    for a, b in zip(ours, ref):
        assert_same(a, b)


# ---------------------------------------------------------------- forward


FWD_CASES = [(p, jnp.bfloat16) for p in WORLD_SIZES] + [(3, jnp.float16)]


@pytest.mark.parametrize("p,dtype", FWD_CASES)
def test_exact_on_integers_with_vjp(p, dtype):
    mesh = cpu_mesh((p,), ("tp",))
    m, k = 3 * p, 16  # M/P = 3 rows per rank
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, N * p), dtype)
    dy = small_ints(KEYS[2], (m, N * p), dtype)
    ours, ref = vjp_both(_op, _ref, mesh, *_specs_1d(), (x, w), dy)
    assert ours[0].dtype == dtype and ours[0].shape == (m, N * p)
    assert_same(ours[0], _global(x, w))
    _assert_all_same(ours, ref)


@pytest.mark.parametrize("p,explicit", [(8, True)])
def test_random_within_tolerance(p, explicit):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = rand(KEYS[0], (5 * p, 264), jnp.bfloat16)
    w = rand(KEYS[1], (264, 7 * p), jnp.bfloat16)
    y = run(_op, mesh, *_specs_1d(), x, w)
    y_xla = run(_ref, mesh, *_specs_1d(), x, w, init=False)
    assert_error_within_xla(y, y_xla, _global(x, w))


@pytest.mark.parametrize("p", (3, 8))
def test_rows_name_their_sender(p):
    # x on rank r is all r, w = 1: row i of the result is (i // rows_per_rank) * K.
    mesh = cpu_mesh((p,), ("tp",))
    rows, k = 2, 8
    x = jnp.repeat(jnp.arange(p, dtype=jnp.bfloat16), rows)[:, None] * jnp.ones((1, k),
                                                                               jnp.bfloat16)
    w = jnp.ones((k, N), jnp.bfloat16)
    y = run(_op, mesh, (P("tp", None), P()), P("tp", None), x, w)  # out: P copies, stacked
    expect = np.repeat(np.arange(p), rows)[:, None] * k * np.ones((1, N))
    assert_same(y, np.tile(expect, (p, 1)))


def _mesh_2d_case(shape, axis):
    """x: rows sharded over both axes (the op's axis inner), w: columns over the op's axis."""
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    mesh = cpu_mesh(shape, names)
    return mesh, (P((other, axis), None), P(None, axis)), P(other, axis)


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    mesh, in_specs, out_spec = _mesh_2d_case(shape, axis)
    p = dict(zip(("dp", "tp"), shape))[axis]
    m, k = 3 * 8, 24
    x, w = small_ints(KEYS[0], (m, k), jnp.bfloat16), small_ints(KEYS[1], (k, N * p),
                                                                 jnp.bfloat16)
    dy = small_ints(KEYS[2], (m, N * p), jnp.bfloat16)
    ours, ref = vjp_both(lambda a, b: pk.all_gather_gemm(a, b, axis),
                         lambda a, b: ag_gemm.reference(a, b, axis), mesh, in_specs, out_spec,
                         (x, w), dy)
    assert_same(ours[0], _global(x, w))
    _assert_all_same(ours, ref)


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,mult",
                         product(WORLD_SIZES, MATMUL_DTYPES, (True, False), (True, False),
                                 (1, 7)))
def test_exact_on_integers_large(p, dtype, explicit, check_vma, mult):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    m, k = mult * p, 40
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, 3 * p), dtype)
    y = run(_op, mesh, *_specs_1d(), x, w, check_vma=check_vma)
    assert_same(y, _global(x, w))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_specs, out_spec, global x shape, global w shape, global y shape)."""
    tp4 = cpu_mesh((4,), ("tp",))
    if kind == "sharded":
        return tp4, (P("tp", None), P(None, "tp")), P(None, "tp"), (8, 16), (16, 4 * N), \
            (8, 4 * N)
    if kind == "2d_w_replicated_over_dp":
        return cpu_mesh((2, 4), ("dp", "tp")), (P(("dp", "tp"), None), P(None, "tp")), \
            P("dp", "tp"), (16, 16), (16, 4 * N), (16, 4 * N)
    if kind == "w_invariant":  # a full weight: every rank computes the same [M, N]
        return tp4, (P("tp", None), P()), P(None, "tp"), (8, 16), (16, N), (8, 4 * N)
    if kind == "x_invariant":
        return tp4, (P(), P(None, "tp")), P(None, "tp"), (2, 16), (16, 4 * N), (8, 4 * N)
    raise ValueError(kind)


VJP_KINDS = ("sharded", "2d_w_replicated_over_dp", "w_invariant", "x_invariant")


def _check_vjp(kind, dtype, check_vma, explicit=True):
    mesh, in_specs, out_spec, xs, ws, ys = _vjp_case(kind)
    if not explicit:
        mesh = cpu_mesh(mesh.devices.shape, mesh.axis_names, explicit=False)
    x, w = small_ints(KEYS[0], xs, dtype), small_ints(KEYS[1], ws, dtype)
    dy = small_ints(KEYS[2], ys, dtype)
    ours, ref = vjp_both(lambda a, b: ag_gemm._ag_gemm(a, b, "tp"), _ref, mesh, in_specs,
                         out_spec, (x, w), dy, check_vma=check_vma)
    _assert_all_same(ours, ref)


@pytest.mark.parametrize("kind,check_vma", product(VJP_KINDS, (True, False)))
def test_vjp_matches_jax_ad_of_reference(kind, check_vma):
    _check_vjp(kind, jnp.bfloat16, check_vma)


@pytest.mark.parametrize("check_vma", (True, False))
def test_vjp_auto_mesh(check_vma):
    _check_vjp("2d_w_replicated_over_dp", jnp.float16, check_vma, explicit=False)


@pytest.mark.large
@pytest.mark.parametrize("kind,dtype,check_vma,explicit",
                         product(VJP_KINDS, MATMUL_DTYPES + (jnp.float32,), (True, False),
                                 (True, False)))
def test_vjp_matches_jax_ad_of_reference_large(kind, dtype, check_vma, explicit):
    _check_vjp(kind, dtype, check_vma, explicit)


def test_vjp_backward_is_gemm_rs_and_forward_saves_the_gather():
    # The transpose pairing: the jaxpr of the backward pass holds one reduce-scatter and no
    # second all-gather (the gathered x is a residual).
    mesh = cpu_mesh((4,), ("tp",), explicit=False)
    pk.init(mesh)
    x, w = jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 4 * N), jnp.bfloat16)

    def body(a, b, g):
        _, pull = jax.vjp(_op, a, b)
        return pull(g)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp", None), P(None, "tp"), P(None, "tp")),
                      out_specs=(P("tp", None), P(None, "tp")))
    text = str(jax.make_jaxpr(f)(x, w, jnp.ones((8, 4 * N), jnp.bfloat16)))
    assert text.count("= all_gather[") == 1 and text.count("= reduce_scatter[") == 1, text


@pytest.mark.parametrize("check_vma", (True, False))
def test_grad_from_outside_shard_map(check_vma):
    grads_match_from_outside_shard_map(ag_gemm._ag_gemm, ag_gemm.reference,
                                       _vjp_case("w_invariant"), KEYS, check_vma=check_vma)


@pytest.mark.parametrize("kind", ("2d_w_replicated_over_dp",))
def test_check_grads_float32(kind):
    mesh, in_specs, out_spec, xs, ws, _ = _vjp_case(kind)
    x, w = rand(KEYS[0], xs, jnp.float32), rand(KEYS[1], ws, jnp.float32)
    check_grads_sharded(lambda a, b: ag_gemm._ag_gemm(a, b, "tp"), mesh, in_specs, out_spec,
                        (x, w))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, w, *, axis="tp", init=True, mesh=None):
    mesh = mesh or cpu_mesh((4,), ("tp",))
    with pytest.raises(exc, match=match):
        run(lambda a, b: pk.all_gather_gemm(a, b, axis), mesh, (P(), P()), P(), x, w,
            init=init)


def _ok(m=3, k=16, n=N, dtype=jnp.bfloat16):
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)


def test_error_init_not_called():
    _raises(ValueError, r"pk.all_gather_gemm: pk.init\(mesh\) has not been called", *_ok(),
            init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"axis_name='sp' is not an axis of the mesh .*\('tp',\)", *_ok(),
            axis="sp")


def test_error_axis_name_not_a_str():
    _raises(TypeError, "axis_name must be one mesh axis name", *_ok(), axis=("tp",))


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"inside jax.shard_map"):
        jax.jit(lambda a, b: pk.all_gather_gemm(a, b, "tp"))(*_ok())


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.int32))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"all_gather_gemm: x has dtype {name}; supported: bfloat16, float16",
            *_ok(dtype=dtype))


def test_error_mixed_dtypes():
    x, _ = _ok()
    _raises(TypeError, "x and w must have the same dtype, got bfloat16 and float16", x,
            jnp.ones((16, N), jnp.float16))


def test_error_k_not_multiple_of_8():
    _raises(ValueError, r"K \(x.shape\[1\]\) = 20 is not divisible by 8. Pad K", *_ok(k=20))


def test_error_mismatched_k():
    x, _ = _ok()
    _raises(ValueError, r"contraction dimensions differ: x has shape \(3, 16\)", x,
            jnp.ones((24, N), jnp.bfloat16))


def test_error_not_rank_2():
    _raises(ValueError, "w must have 2 dimensions", jnp.ones((3, 16), jnp.bfloat16),
            jnp.ones((16,), jnp.bfloat16))


# GPU tests

# P = 1 in one process. Modes (pk_jax/cost_model.py): "local" (the default at P = 1: pk.matmul,
# x itself is the gather), "fused" (the full kernel at P = 1: epoch, comm blocks meeting at
# their barriers with nothing to stage or pull, compute blocks reading every row from x and
# the loaders storing the A tiles of tile column 0 into x_full) and "serial" (pk.all_gather +
# pk.matmul), with 1, 4 and 16 communication SMs. Shapes: odd M (not a multiple of the
# 128-row tile), K from 64 to 8192, N not a multiple of 8 (padded), more tiles than SMs.

GPU_SHAPES = [(1000, 64, 520), (333, 1024, 264), (1000, 8192, 256), (2100, 512, 2600),
              (130, 4096, 517)]
GPU_MODES = (("local", None), ("fused", None), ("serial", None), ("fused", 1), ("fused", 16))
GPU_CASES = [  # the default set: every mode, both dtypes, K from 64 to 8192
    ((1000, 64, 520), jnp.bfloat16, ("local", None)),
    ((1000, 64, 520), jnp.bfloat16, ("fused", None)),
    ((1000, 64, 520), jnp.bfloat16, ("serial", None)),
    ((1000, 64, 520), jnp.bfloat16, ("fused", 1)),
    ((333, 1024, 264), jnp.float16, ("fused", None)),
    ((333, 1024, 264), jnp.float16, ("local", None)),
    ((130, 8192, 517), jnp.bfloat16, ("fused", 16)),
    ((2100, 512, 2600), jnp.bfloat16, ("fused", 4)),
]
INT_CASES = [((1000, 64, 520), jnp.bfloat16, ("fused", None)),
             ((333, 1024, 264), jnp.float16, ("fused", 16)),
             ((1000, 8192, 256), jnp.bfloat16, ("fused", 1))]


def _gpu_call(mesh, x, w, mode, sms=None):
    """(y, gathered x) of the op's implementation, after poisoning fresh memory."""
    poison((x.shape[0], w.shape[1] + x.shape[1]), x.dtype)
    (xs, ws), _ = _specs_1d()
    f = lambda a, b: ag_gemm.ag_gemm_impl(a, b, "tp", return_gathered=True)
    with cost_model.override(mode=mode, num_comm_sms=sms):
        return run(f, mesh, (xs, ws), (P(None, "tp"), P("tp", None)), x, w, init=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,mode", GPU_CASES)
def test_gpu_p1_random_within_xla_error(shape, dtype, mode):
    _check(shape, dtype, mode, integers=False)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape,dtype,mode", product(GPU_SHAPES, MATMUL_DTYPES, GPU_MODES))
def test_gpu_p1_random_within_xla_error_large(shape, dtype, mode):
    _check(shape, dtype, mode, integers=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,mode", INT_CASES)
def test_gpu_p1_exact_on_integers(shape, dtype, mode):
    _check(shape, dtype, mode, integers=True)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape,dtype,mode", product(GPU_SHAPES[:3], MATMUL_DTYPES, GPU_MODES))
def test_gpu_p1_exact_on_integers_large(shape, dtype, mode):
    _check(shape, dtype, mode, integers=True)


def _check(shape, dtype, mode, *, integers):
    mesh = gpu_mesh(ag_gemm.STEM)
    check_gemm_p1(lambda x, w: _gpu_call(mesh, x, w, *mode), _global, shape, dtype,
                  integers=integers)


@pytest.mark.gpu
def test_gpu_p1_public_op_and_vjp_fused():
    mesh = gpu_mesh(ag_gemm.STEM)
    x, w = small_ints(KEYS[0], (200, 64), jnp.bfloat16), small_ints(KEYS[1], (64, 72),
                                                                      jnp.bfloat16)
    dy = small_ints(KEYS[2], (200, 72), jnp.bfloat16)
    in_specs, out_spec = _specs_1d()
    with cost_model.override(mode="fused"):
        ours, ref = vjp_both(_op, _ref, mesh, in_specs, out_spec, (x, w), dy, init=False)
    _assert_all_same(ours, ref)


@pytest.mark.gpu
def test_gpu_error_workspace_too_small():
    mesh = gpu_mesh(ag_gemm.STEM, 1 << 20)
    x, w = jnp.ones((1024, 1024), jnp.bfloat16), jnp.ones((1024, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs 2097152 bytes of symmetric workspace.*"
                       r"workspace_bytes=2097152"):
        _gpu_call(mesh, x, w, "fused")

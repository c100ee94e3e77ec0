"""gemm_all_reduce against its reference `psum(x @ w)`: exact sums on integer inputs for P in
{1,2,3,4,8} and on 2-D meshes, odd sizes, both dtypes, explicit and Auto axes, the custom VJP
against JAX's AD of the reference with check_vma on and off, check_grads, and the error
messages."""

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
from pk_jax.ops import gemm_ar

KEYS = jax.random.split(jax.random.key(2), 4)
N = 5  # odd on purpose


def _global(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _op(x, w):
    return pk.gemm_all_reduce(x, w, "tp")


def _ref(x, w):
    return gemm_ar.reference(x, w, "tp")


def _specs_1d():
    return (P(None, "tp"), P("tp", None)), P()


def _assert_all_same(ours, ref):
    for a, b in zip(ours, ref):
        assert_same(a, b)


# ---------------------------------------------------------------- forward


FWD_CASES = [(p, jnp.bfloat16) for p in WORLD_SIZES] + [(3, jnp.float16)]


@pytest.mark.parametrize("p,dtype", FWD_CASES)
def test_exact_on_integers_with_vjp(p, dtype):
    mesh = cpu_mesh((p,), ("tp",))
    m, k = 7, 8 * p  # odd M, K/P = 8
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, N), dtype)
    dy = small_ints(KEYS[2], (m, N), dtype)
    ours, ref = vjp_both(_op, _ref, mesh, *_specs_1d(), (x, w), dy)
    assert ours[0].dtype == dtype and ours[0].shape == (m, N)
    assert_same(ours[0], _global(x, w))
    _assert_all_same(ours, ref)


@pytest.mark.parametrize("p,explicit", [(8, True)])
def test_random_within_tolerance(p, explicit):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = rand(KEYS[0], (9, 24 * p), jnp.bfloat16)
    w = rand(KEYS[1], (24 * p, 7), jnp.bfloat16)
    y = run(_op, mesh, *_specs_1d(), x, w)
    y_xla = run(_ref, mesh, *_specs_1d(), x, w, init=False)
    assert_error_within_xla(y, y_xla, _global(x, w))


def _mesh_2d_case(shape, axis):
    """x: rows over the other axis, K over the op's axis; the result is replicated over it."""
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    mesh = cpu_mesh(shape, names)
    return mesh, (P(other, axis), P(axis, None)), P(other, None)


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    mesh, in_specs, out_spec = _mesh_2d_case(shape, axis)
    p = dict(zip(("dp", "tp"), shape))[axis]
    m, k = 3 * 4, 8 * p
    x, w = small_ints(KEYS[0], (m, k), jnp.bfloat16), small_ints(KEYS[1], (k, N), jnp.bfloat16)
    dy = small_ints(KEYS[2], (m, N), jnp.bfloat16)
    ours, ref = vjp_both(lambda a, b: pk.gemm_all_reduce(a, b, axis),
                         lambda a, b: gemm_ar.reference(a, b, axis), mesh, in_specs, out_spec,
                         (x, w), dy)
    assert_same(ours[0], _global(x, w))
    _assert_all_same(ours, ref)


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,m",
                         product(WORLD_SIZES, MATMUL_DTYPES, (True, False), (True, False),
                                 (1, 13)))
def test_exact_on_integers_large(p, dtype, explicit, check_vma, m):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    k = 8 * p
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, 3), dtype)
    y = run(_op, mesh, *_specs_1d(), x, w, check_vma=check_vma)
    assert_same(y, _global(x, w))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_specs, out_spec, global x shape, global w shape, global y shape)."""
    tp4 = cpu_mesh((4,), ("tp",))
    if kind == "sharded":
        return tp4, (P(None, "tp"), P("tp", None)), P(), (8, 32), (32, N), (8, N)
    if kind == "2d_w_replicated_over_dp":
        return cpu_mesh((2, 4), ("dp", "tp")), (P("dp", "tp"), P("tp", None)), \
            P("dp", None), (16, 32), (32, N), (16, N)
    if kind == "w_invariant":  # psum of a product that varies only through x
        return tp4, (P(None, "tp"), P()), P(), (8, 32), (8, N), (8, N)
    if kind == "both_invariant":  # psum of an invariant value: P times it
        return tp4, (P(), P()), P(), (8, 8), (8, N), (8, N)
    raise ValueError(kind)


VJP_KINDS = ("sharded", "2d_w_replicated_over_dp", "w_invariant", "both_invariant")


def _check_vjp(kind, dtype, check_vma, explicit=True):
    mesh, in_specs, out_spec, xs, ws, ys = _vjp_case(kind)
    if not explicit:
        mesh = cpu_mesh(mesh.devices.shape, mesh.axis_names, explicit=False)
    x, w = small_ints(KEYS[0], xs, dtype), small_ints(KEYS[1], ws, dtype)
    dy = small_ints(KEYS[2], ys, dtype)
    ours, ref = vjp_both(lambda a, b: gemm_ar._gemm_ar(a, b, "tp"), _ref, mesh, in_specs,
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


@pytest.mark.parametrize("check_vma", (True, False))
def test_grad_from_outside_shard_map(check_vma):
    grads_match_from_outside_shard_map(gemm_ar._gemm_ar, gemm_ar.reference,
                                       _vjp_case("w_invariant"), KEYS, check_vma=check_vma)


@pytest.mark.parametrize("kind", ("2d_w_replicated_over_dp",))
def test_check_grads_float32(kind):
    mesh, in_specs, out_spec, xs, ws, _ = _vjp_case(kind)
    x, w = rand(KEYS[0], xs, jnp.float32), rand(KEYS[1], ws, jnp.float32)
    check_grads_sharded(lambda a, b: gemm_ar._gemm_ar(a, b, "tp"), mesh, in_specs, out_spec,
                        (x, w))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, w, *, axis="tp", init=True, mesh=None):
    mesh = mesh or cpu_mesh((4,), ("tp",))
    with pytest.raises(exc, match=match):
        run(lambda a, b: pk.gemm_all_reduce(a, b, axis), mesh, (P(), P()), P(), x, w,
            init=init)


def _ok(m=3, k=16, n=N, dtype=jnp.bfloat16):
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)


def test_error_init_not_called():
    _raises(ValueError, r"pk.gemm_all_reduce: pk.init\(mesh\) has not been called", *_ok(),
            init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"axis_name='sp' is not an axis of the mesh .*\('tp',\)", *_ok(),
            axis="sp")


def test_error_axis_name_not_a_str():
    _raises(TypeError, "axis_name must be one mesh axis name", *_ok(), axis=None)


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"inside jax.shard_map"):
        jax.jit(lambda a, b: pk.gemm_all_reduce(a, b, "tp"))(*_ok())


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.int32))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"gemm_all_reduce: x has dtype {name}; supported: bfloat16, float16",
            *_ok(dtype=dtype))


def test_error_mixed_dtypes():
    x, _ = _ok()
    _raises(TypeError, "x and w must have the same dtype, got bfloat16 and float16", x,
            jnp.ones((16, N), jnp.float16))


def test_error_k_not_multiple_of_8():
    _raises(ValueError, r"K/P \(the local K\) \(x.shape\[1\]\) = 4 is not divisible by 8",
            *_ok(k=4))


def test_error_mismatched_k():
    x, _ = _ok()
    _raises(ValueError, r"contraction dimensions differ: x has shape \(3, 16\)", x,
            jnp.ones((8, N), jnp.bfloat16))


def test_error_not_rank_2():
    _raises(ValueError, "x must have 2 dimensions", jnp.ones((16,), jnp.bfloat16),
            jnp.ones((16, N), jnp.bfloat16))


# GPU tests

# P = 1 in one process. Modes (pk_jax/cost_model.py): "local" (the default at P = 1: one
# matmul kernel writing y), "fused" (the fused kernels at P = 1: the epoch kernel, then the
# GEMM in direct mode, storing its tiles straight into y: no owner buffer, enter or leave
# kernel; the accumulation and gather run at P > 1, tests/gpu) and
# "serial" (pk.matmul + pk.all_reduce). Shapes: odd M (not a multiple of the 128-row tile), K
# from 64 to 8192, N not a multiple of 8 (padded), more tiles than SMs.

GPU_SHAPES = [(1000, 64, 520), (333, 1024, 264), (1000, 8192, 256), (2100, 512, 2600),
              (131, 4096, 517)]
GPU_MODES = ("local", "fused", "serial")
GPU_CASES = [  # the default set: every mode, both dtypes, K from 64 to 8192
    ((1000, 64, 520), jnp.bfloat16, "local"),
    ((1000, 64, 520), jnp.bfloat16, "fused"),
    ((1000, 64, 520), jnp.bfloat16, "serial"),
    ((333, 1024, 264), jnp.float16, "fused"),
    ((333, 1024, 264), jnp.float16, "local"),
    ((131, 8192, 517), jnp.bfloat16, "fused"),
    ((2100, 512, 2600), jnp.bfloat16, "fused"),
]
INT_CASES = [((1000, 64, 520), jnp.bfloat16, "fused"), ((333, 1024, 264), jnp.float16, "fused"),
             ((1000, 8192, 256), jnp.bfloat16, "fused")]


def _gpu_call(mesh, x, w, mode):
    in_specs, out_spec = _specs_1d()
    poison((x.shape[0], w.shape[1]), x.dtype)
    with cost_model.override(mode=mode):
        return run(_op, mesh, in_specs, out_spec, x, w, init=False)


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
    mesh = gpu_mesh(gemm_ar.STEM)
    check_gemm_p1(lambda x, w: _gpu_call(mesh, x, w, mode), _global, shape, dtype,
                  integers=integers)


@pytest.mark.gpu
def test_gpu_p1_fused_after_a_collective_reused_the_workspace():
    mesh = gpu_mesh(gemm_ar.STEM)
    x, w = small_ints(KEYS[0], (300, 128), jnp.bfloat16), small_ints(KEYS[1], (128, 200),
                                                                       jnp.bfloat16)
    want = jnp.asarray(_global(x, w)).astype(jnp.bfloat16)
    for _ in range(2):
        assert_same(_gpu_call(mesh, x, w, "fused"), want)
        junk = jnp.full((4096, 256), 3.0, jnp.float32)
        run(lambda a: pk.all_reduce(a, "tp"), mesh, (P(),), P(), junk, init=False)


@pytest.mark.gpu
def test_gpu_p1_vjp_fused():
    mesh = gpu_mesh(gemm_ar.STEM)
    x, w = small_ints(KEYS[0], (256, 64), jnp.bfloat16), small_ints(KEYS[1], (64, 72),
                                                                      jnp.bfloat16)
    dy = small_ints(KEYS[2], (256, 72), jnp.bfloat16)
    in_specs, out_spec = _specs_1d()
    with cost_model.override(mode="fused"):
        ours, ref = vjp_both(_op, _ref, mesh, in_specs, out_spec, (x, w), dy, init=False)
    _assert_all_same(ours, ref)


@pytest.mark.gpu
def test_gpu_error_workspace_too_small():
    mesh = gpu_mesh(gemm_ar.STEM, 1 << 20)
    x, w = jnp.ones((1024, 64), jnp.bfloat16), jnp.ones((64, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs 2097152 bytes of symmetric workspace.*"
                       r"workspace_bytes=2097152"):
        _gpu_call(mesh, x, w, "fused")

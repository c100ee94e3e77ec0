"""gemm_reduce_scatter against its reference `psum_scatter(x @ w, tiled=True)`: exact sums on
integer inputs for P in {1,2,3,4,8} and on 2-D meshes, odd sizes, both dtypes, explicit and Auto
axes, the custom VJP (written with all_gather_gemm) against JAX's AD of the reference with
check_vma on and off, check_grads, and the error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
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
    stand_in_kernels,
    vjp_both,
)

import pk_jax as pk
from pk_jax import cost_model
from pk_jax.ops import gemm_rs

KEYS = jax.random.split(jax.random.key(0), 4)
N = 5  # odd on purpose


def _global(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _op(x, w):
    return pk.gemm_reduce_scatter(x, w, "tp")


def _specs_1d():
    return (P(None, "tp"), P("tp", None)), P("tp", None)


# ---------------------------------------------------------------- forward


FWD_CASES = [(p, jnp.bfloat16) for p in WORLD_SIZES] + [(3, jnp.float16)]


@pytest.mark.parametrize("p,dtype", FWD_CASES)
def test_exact_on_integers_with_vjp(p, dtype):
    mesh = cpu_mesh((p,), ("tp",))
    m, k = 3 * p, 8 * p  # M/P = 3 rows per rank, K/P = 8
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, N), dtype)
    dy = small_ints(KEYS[2], (m, N), dtype)
    in_specs, out_spec = _specs_1d()
    ours, ref = vjp_both(_op, lambda a, b: gemm_rs.reference(a, b, "tp"), mesh, in_specs,
                         out_spec, (x, w), dy)
    assert ours[0].dtype == dtype and ours[0].shape == (m, N)
    assert_same(ours[0], _global(x, w))
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.parametrize("p,explicit", [(8, True)])
def test_random_within_tolerance(p, explicit):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    x = rand(KEYS[0], (5 * p, 24 * p), jnp.bfloat16)
    w = rand(KEYS[1], (24 * p, 7), jnp.bfloat16)
    y = run(_op, mesh, *_specs_1d(), x, w)
    y_xla = run(lambda a, b: gemm_rs.reference(a, b, "tp"), mesh, *_specs_1d(), x, w, init=False)
    assert_error_within_xla(y, y_xla, _global(x, w))


def test_rank_pattern_rows_land_on_their_rank():
    p = 4
    mesh = cpu_mesh((p,), ("tp",))
    # Row i of x is i in every K column of every rank, w = 1: y[i] = i * K on the rank owning i.
    m, k = 2 * p, 8 * p
    x = jnp.broadcast_to(jnp.arange(m, dtype=jnp.bfloat16)[:, None], (m, k))
    w = jnp.ones((k, N), jnp.bfloat16)
    y = run(_op, mesh, *_specs_1d(), x, w)
    assert_same(y, np.arange(m)[:, None] * k * np.ones((1, N)))


def _mesh_2d_case(shape, axis):
    """x: [M/other, K/P] per device; the op over `axis`, the other axis shards rows (dp)."""
    names = ("dp", "tp")
    other = names[1 - names.index(axis)]
    mesh = cpu_mesh(shape, names)
    in_specs = (P(other, axis), P(axis, None))
    out_spec = P((other, axis), None)
    return mesh, in_specs, out_spec


@pytest.mark.parametrize("shape,axis", product(((2, 4), (4, 2)), ("dp", "tp")))
def test_2d_mesh_over_either_axis(shape, axis):
    mesh, in_specs, out_spec = _mesh_2d_case(shape, axis)
    p = dict(zip(("dp", "tp"), shape))[axis]
    m, k = 3 * 8, 8 * p
    x, w = small_ints(KEYS[0], (m, k), jnp.bfloat16), small_ints(KEYS[1], (k, N), jnp.bfloat16)
    dy = small_ints(KEYS[2], (m, N), jnp.bfloat16)
    ours, ref = vjp_both(lambda a, b: pk.gemm_reduce_scatter(a, b, axis),
                         lambda a, b: gemm_rs.reference(a, b, axis), mesh, in_specs, out_spec,
                         (x, w), dy)
    assert_same(ours[0], _global(x, w))
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.large
@pytest.mark.parametrize("p,dtype,explicit,check_vma,mult",
                         product(WORLD_SIZES, MATMUL_DTYPES, (True, False), (True, False),
                                 (1, 7)))
def test_exact_on_integers_large(p, dtype, explicit, check_vma, mult):
    mesh = cpu_mesh((p,), ("tp",), explicit=explicit)
    m, k = mult * p, 8 * p
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, 3), dtype)
    y = run(_op, mesh, *_specs_1d(), x, w, check_vma=check_vma)
    assert_same(y, _global(x, w))


# ---------------------------------------------------------------- VJP


def _vjp_case(kind):
    """(mesh, in_specs, out_spec, global x shape, global w shape) for one typing of x and w."""
    if kind == "sharded":
        return cpu_mesh((4,), ("tp",)), (P(None, "tp"), P("tp", None)), P("tp", None), \
            (8, 32), (32, N)
    if kind == "2d_w_replicated_over_dp":
        return cpu_mesh((2, 4), ("dp", "tp")), (P("dp", "tp"), P("tp", None)), \
            P(("dp", "tp"), None), (16, 32), (32, N)
    if kind == "x_invariant":
        return cpu_mesh((4,), ("tp",)), (P(), P("tp", None)), P("tp", None), (8, 8), (32, N)
    if kind == "w_invariant":
        return cpu_mesh((4,), ("tp",)), (P(None, "tp"), P()), P("tp", None), (8, 32), (8, N)
    raise ValueError(kind)


VJP_KINDS = ("sharded", "2d_w_replicated_over_dp", "x_invariant", "w_invariant")


def _check_vjp(kind, dtype, check_vma, explicit=True):
    mesh, in_specs, out_spec, xs, ws = _vjp_case(kind)
    if not explicit:
        mesh = cpu_mesh(mesh.devices.shape, mesh.axis_names, explicit=False)
    x, w = small_ints(KEYS[0], xs, dtype), small_ints(KEYS[1], ws, dtype)
    dy = small_ints(KEYS[2], (xs[0], N), dtype)
    ours, ref = vjp_both(lambda a, b: gemm_rs._gemm_rs(a, b, "tp"),
                         lambda a, b: gemm_rs.reference(a, b, "tp"),
                         mesh, in_specs, out_spec, (x, w), dy, check_vma=check_vma)
    for a, b in zip(ours, ref):
        assert_same(a, b)


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


def test_vjp_backward_is_one_all_gather_shared_by_dx_and_dw():
    # The transpose pairing: the backward pass is an AG+GEMM whose gathered dy also feeds dw,
    # so the whole VJP holds one reduce-scatter (forward) and one all-gather (backward).
    mesh = cpu_mesh((4,), ("tp",), explicit=False)
    pk.init(mesh)
    x, w = jnp.ones((8, 32), jnp.bfloat16), jnp.ones((32, N), jnp.bfloat16)

    def body(a, b, g):
        _, pull = jax.vjp(_op, a, b)
        return pull(g)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P("tp", None)),
                      out_specs=(P(None, "tp"), P("tp", None)))
    text = str(jax.make_jaxpr(f)(x, w, jnp.ones((8, N), jnp.bfloat16)))
    assert text.count("= all_gather[") == 1 and text.count("= reduce_scatter[") == 1, text


@pytest.mark.parametrize("check_vma", (True, False))
def test_grad_from_outside_shard_map(check_vma):
    grads_match_from_outside_shard_map(gemm_rs._gemm_rs, gemm_rs.reference,
                                       _vjp_case("w_invariant"), KEYS, check_vma=check_vma)


@pytest.mark.parametrize("kind", ("2d_w_replicated_over_dp",))
def test_check_grads_float32(kind):
    mesh, in_specs, out_spec, xs, ws = _vjp_case(kind)
    x, w = rand(KEYS[0], xs, jnp.float32), rand(KEYS[1], ws, jnp.float32)
    check_grads_sharded(lambda a, b: gemm_rs._gemm_rs(a, b, "tp"), mesh, in_specs, out_spec,
                        (x, w))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, w, *, axis="tp", init=True, mesh=None, in_specs=None):
    mesh = mesh or cpu_mesh((4,), ("tp",))
    in_specs = in_specs or (P(), P())
    with pytest.raises(exc, match=match):
        run(lambda a, b: pk.gemm_reduce_scatter(a, b, axis), mesh, in_specs, P(), x, w,
            init=init)


def _ok(m=8, k=16, n=N, dtype=jnp.bfloat16):
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)


def test_error_init_not_called():
    _raises(ValueError, r"pk.gemm_reduce_scatter: pk.init\(mesh\) has not been called",
            *_ok(), init=False)


def test_error_axis_not_in_mesh():
    _raises(ValueError, r"axis_name='sp' is not an axis of the mesh .*\('tp',\)", *_ok(),
            axis="sp")


def test_error_axis_name_not_a_str():
    _raises(TypeError, "axis_name must be one mesh axis name", *_ok(), axis=0)


def test_error_not_inside_shard_map():
    pk.init(cpu_mesh((4,), ("tp",)))
    with pytest.raises(ValueError, match=r"inside jax.shard_map"):
        jax.jit(lambda a, b: pk.gemm_reduce_scatter(a, b, "tp"))(*_ok())


def test_error_init_with_another_mesh():
    pk.init(cpu_mesh((8,), ("tp",)))
    _raises(ValueError, r"the mesh of this shard_map is not one given to pk.init",
            *_ok(), init=False)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.int32))
def test_error_bad_dtype(dtype):
    name = np.dtype(dtype).name
    _raises(TypeError, f"x has dtype {name}; supported: bfloat16, float16", *_ok(dtype=dtype))


def test_error_mixed_dtypes():
    x, _ = _ok()
    _raises(TypeError, "x and w must have the same dtype, got bfloat16 and float16", x,
            jnp.ones((16, N), jnp.float16))


def test_error_rows_not_divisible_by_p():
    _raises(ValueError, r"M \(x.shape\[0\]\) = 6 is not divisible by 4. Pad the rows", *_ok(m=6))


def test_error_k_not_multiple_of_8():
    _raises(ValueError, r"K/P \(the local K\) \(x.shape\[1\]\) = 12 is not divisible by 8",
            *_ok(k=12))


def test_error_mismatched_k():
    x, _ = _ok()
    _raises(ValueError, r"contraction dimensions differ: x has shape \(8, 16\)", x,
            jnp.ones((24, N), jnp.bfloat16))


def test_error_not_rank_2():
    _raises(ValueError, "x must have 2 dimensions", jnp.ones((2, 8, 16), jnp.bfloat16),
            jnp.ones((16, N), jnp.bfloat16))


# GPU tests

# P = 1 in one process. The CUDA path has three modes (pk_jax/cost_model.py): "local" (the
# default at P = 1: one matmul kernel writing y), "fused" (the fused kernels at P = 1: the
# epoch kernel, then the GEMM in direct mode, storing its tiles straight into y; the owner
# buffer's zero-fill, reduce-adds and copy-out run at P > 1, tests/gpu) and "serial" (pk.matmul
# + pk.reduce_scatter). Shapes: odd M (not a multiple of the 128-row tile), K from 64 to 8192,
# N not a multiple of 8 (padded), more tiles than SMs.

GPU_SHAPES = [(1000, 64, 520), (333, 1024, 264), (1000, 8192, 256), (2100, 512, 2600),
              (130, 4096, 517)]
GPU_MODES = ("local", "fused", "serial")
GPU_CASES = [  # the default set: every mode, both dtypes, K from 64 to 8192
    ((1000, 64, 520), jnp.bfloat16, "local"),
    ((1000, 64, 520), jnp.bfloat16, "fused"),
    ((1000, 64, 520), jnp.bfloat16, "serial"),
    ((333, 1024, 264), jnp.float16, "fused"),
    ((333, 1024, 264), jnp.float16, "local"),
    ((130, 8192, 517), jnp.bfloat16, "fused"),
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
    mesh = gpu_mesh(gemm_rs.STEM)
    check_gemm_p1(lambda x, w: _gpu_call(mesh, x, w, mode), _global, shape, dtype,
                  integers=integers)


@pytest.mark.gpu
def test_gpu_p1_fused_after_a_collective_reused_the_workspace():
    """A collective between two calls scribbles on the workspace that holds the accumulation
    buffer: the fused op must not read what it left there (at P > 1 it zeroes the buffer at the
    start of every call; at P = 1 it never touches the workspace)."""
    mesh = gpu_mesh(gemm_rs.STEM)
    x, w = small_ints(KEYS[0], (300, 128), jnp.bfloat16), small_ints(KEYS[1], (128, 200),
                                                                       jnp.bfloat16)
    want = jnp.asarray(_global(x, w)).astype(jnp.bfloat16)
    for _ in range(2):
        assert_same(_gpu_call(mesh, x, w, "fused"), want)
        junk = jnp.full((4096, 256), 3.0, jnp.float32)
        run(lambda a: pk.all_reduce(a, "tp"), mesh, (P(),), P(), junk, init=False)


@pytest.mark.gpu
def test_gpu_p1_vjp_matches_reference():
    mesh = gpu_mesh(gemm_rs.STEM)
    x, w = small_ints(KEYS[0], (256, 64), jnp.bfloat16), small_ints(KEYS[1], (64, 72),
                                                                      jnp.bfloat16)
    dy = small_ints(KEYS[2], (256, 72), jnp.bfloat16)
    in_specs, out_spec = _specs_1d()
    with cost_model.override(mode="fused"):
        ours, ref = vjp_both(_op, lambda a, b: gemm_rs.reference(a, b, "tp"), mesh, in_specs,
                             out_spec, (x, w), dy, init=False)
    for a, b in zip(ours, ref):
        assert_same(a, b)


@pytest.mark.gpu
def test_gpu_error_workspace_too_small():
    mesh = gpu_mesh(gemm_rs.STEM, 1 << 20)
    x, w = jnp.ones((1024, 64), jnp.bfloat16), jnp.ones((64, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs 2097152 bytes of symmetric workspace.*"
                       r"workspace_bytes=2097152"):
        _gpu_call(mesh, x, w, "fused")


def _tp_mlp_matches_reference(mesh, sequence_parallel: bool, mode: str, *, dims, dtype,
                              check_vma: bool = True) -> None:
    """A TP MLP (pk_jax.nn's column + row layers: ag_gemm + gemm_rs with sequence parallelism,
    matmul + gemm_ar without) over axis "tp" with the cost model's mode forced, and its loss and
    gradients against the unsharded reference MLP."""
    from pk_jax import nn as pknn

    d, hdim, s = dims
    ks = jax.random.split(jax.random.key(5), 6)
    x = rand(ks[0], (s, d), jnp.float32) * 0.5
    w1 = rand(ks[1], (d, hdim), jnp.float32) / np.sqrt(d)
    w2 = rand(ks[2], (hdim, d), jnp.float32) / np.sqrt(hdim)
    b1, b2 = rand(ks[3], (hdim,), jnp.float32) / 10, rand(ks[4], (d,), jnp.float32) / 10
    xs = P("tp", None) if sequence_parallel else P()

    def local(x, w1, b1, w2, b2):
        h = pknn.column_parallel_linear(x, w1, b1, axis_name="tp",
                                        sequence_parallel=sequence_parallel)
        return pknn.row_parallel_linear(jax.nn.gelu(h), w2, b2, axis_name="tp",
                                        sequence_parallel=sequence_parallel)

    specs = (xs, P(None, "tp"), P("tp"), P("tp", None), P())
    tp = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=xs, check_vma=check_vma)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)

    args = [a.astype(dtype) for a in (x, w1, b1, w2, b2)]
    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]
    with cost_model.override(mode=mode):
        ours = jax.jit(jax.value_and_grad(loss(tp), argnums=(0, 1, 2, 3, 4)))(*placed)
    ref = jax.jit(jax.value_and_grad(loss(pknn.reference_mlp), argnums=(0, 1, 2, 3, 4)))(*args)
    np.testing.assert_allclose(float(ours[0]), float(ref[0]), rtol=2e-2)
    for a, b in zip(ours[1], ref[1]):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 3e-2 * np.max(np.abs(b)) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("sequence_parallel,mode", product((True, False), ("fused", "local")))
def test_gpu_p1_tp_mlp_gradients_match_reference(sequence_parallel, mode):
    _tp_mlp_matches_reference(gpu_mesh(gemm_rs.STEM), sequence_parallel, mode,
                              dims=(256, 512, 300), dtype=jnp.float32)


# ----------------------------------------------- the routes at P = 1 (stand-in kernels, CPU)


@pytest.mark.parametrize("sequence_parallel,mode,check_vma",
                         product((True, False), ("fused", "local"), (True, False)))
def test_p1_routes_keep_the_reference_types(monkeypatch, sequence_parallel, mode, check_vma):
    """Over a 1-device axis the TP layers take the route the cost model gives ("local":
    pk.matmul with XLA's no-op collective; "fused": the fused kernel): the results and their
    replication types are the reference's, forward and backward, with check_vma on or off."""
    from pk_jax import _backend

    calls = stand_in_kernels(monkeypatch)
    fused_targets = ("pk_gemm_rs", "pk_ag_gemm", "pk_gemm_ar")

    def fake_fused(target, results, *args, out_vma=None, **attrs):  # the fused kernels' math
        x, w = args[:2]
        axis = "tp"
        calls.append({"target": target})
        if target == "pk_ag_gemm":
            full = jax.lax.all_gather(x, axis, axis=0, tiled=True)
            return jnp.matmul(full, w).astype(x.dtype), full
        y = jnp.matmul(x, w).astype(x.dtype)
        if target == "pk_gemm_rs":
            return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, axis)

    stand_in = _ffi_module().call
    monkeypatch.setattr(_ffi_module(), "call", lambda t, *a, **k: (
        fake_fused if t in fused_targets else stand_in)(t, *a, **k))
    monkeypatch.setattr(_backend, "_gpu", lambda: cost_model.H200)
    mesh = cpu_mesh((1,), ("tp",), explicit=False)
    pk.init(mesh)
    _tp_mlp_matches_reference(mesh, sequence_parallel, mode, dims=(64, 128, 48),
                              dtype=jnp.bfloat16, check_vma=check_vma)
    targets = {c["target"] for c in calls}
    if mode == "local":
        assert "pk_matmul" in targets and not targets & set(fused_targets), targets
    else:
        assert targets & set(fused_targets), targets


def _ffi_module():
    from pk_jax import _ffi

    return _ffi

"""matmul against its reference `jnp.dot(x, w, preferred_element_type=float32)`: exact on
integer inputs, odd shapes, both dtypes, outside and inside shard_map (explicit and Auto axes),
the custom VJP against a numpy model with check_vma on and off (and against JAX's AD of plain
jnp), check_grads, and the error messages."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.test_util import check_grads
from util import (
    MATMUL_DTYPES,
    P,
    assert_error_within_xla,
    assert_same,
    check_grads_sharded,
    cpu_mesh,
    poison,
    product,
    rand,
    run,
    small_ints,
    vjp_equals_model,
)

import pk_jax as pk
from pk_jax.ops import matmul as mm

KEYS = jax.random.split(jax.random.key(3), 4)
SHAPES = ((1, 8, 1), (7, 24, 5), (33, 64, 17))  # (M, K, N): odd M and N, K a multiple of 8


def _global(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _model_vjp(x, w, dy, k_blocks: int = 1):
    """(y, dx, dw) in numpy of y = x @ w, or with k_blocks > 1 of the block-diagonal product
    that a shard_map with K split over k_blocks devices and N concatenated computes:
    y[:, block j of N] = x[:, block j of K] @ w[block j of K]."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    kb, nb = x.shape[1] // k_blocks, dy.shape[1] // k_blocks
    y, dx, dw = np.zeros(dy.shape), np.zeros(x.shape), np.zeros(w.shape)
    for j in range(k_blocks):
        ks, ns = slice(j * kb, (j + 1) * kb), slice(j * nb, (j + 1) * nb)
        y[:, ns] = x[:, ks] @ w[ks]
        dx[:, ks] = dy[:, ns] @ w[ks].T
        dw[ks] = x[:, ks].T @ dy[:, ns]
    return y, dx, dw


def _plain(a, b):
    """The product in plain jnp (no pk code), fp32 accumulation, as pk.matmul promises."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("shape,dtype", product(SHAPES, MATMUL_DTYPES))
def test_exact_on_integers_outside_shard_map(shape, dtype):
    m, k, n = shape
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, n), dtype)
    y = jax.jit(pk.matmul)(x, w)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_same(y, _global(x, w))
    assert_same(pk.matmul(x, w), y)  # eagerly too, and without pk.init


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_random_within_tolerance(dtype):
    x, w = rand(KEYS[0], (65, 264), dtype), rand(KEYS[1], (264, 37), dtype)
    y = jax.jit(pk.matmul)(x, w)
    assert_error_within_xla(y, jnp.dot(x, w), _global(x, w))
    assert_same(y, _plain(x, w))


@pytest.mark.parametrize("explicit,check_vma", product((True, False), (True, False)))
def test_inside_shard_map(explicit, check_vma):
    mesh = cpu_mesh((2, 4), ("dp", "tp"), explicit=explicit)
    x = small_ints(KEYS[0], (6, 16), jnp.bfloat16)
    w = small_ints(KEYS[1], (16, 4 * 3), jnp.bfloat16)
    y = run(pk.matmul, mesh, (P("dp", None), P(None, "tp")), P("dp", "tp"), x, w,
            check_vma=check_vma)
    assert_same(y, _global(x, w))


# ---------------------------------------------------------------- VJP


@pytest.mark.parametrize("dtype", MATMUL_DTYPES + (jnp.float32,))
def test_vjp_outside_shard_map_matches_jax_ad(dtype):
    m, k, n = SHAPES[1]
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (k, n), dtype)
    dy = small_ints(KEYS[2], (m, n), dtype)
    fn = mm._matmul if dtype == jnp.float32 else pk.matmul

    def value_and_grads(a, b, g):
        y, pull = jax.vjp(fn, a, b)
        return (y, *pull(g))

    for got, want in zip(jax.jit(value_and_grads)(x, w, dy), _model_vjp(x, w, dy)):
        assert got.dtype == dtype
        assert_same(got, want)


def _vjp_case(kind):
    """(mesh, in_specs, out_spec, global x, w, y shapes) for one typing of x and w."""
    mesh = cpu_mesh((2, 4), ("dp", "tp"))
    if kind == "x_rows_w_cols":  # x varies over dp, w over tp: each cotangent is summed
        return mesh, (P("dp", None), P(None, "tp")), P("dp", "tp"), (6, 16), (16, 12), (6, 12)
    if kind == "both_vary":
        return mesh, (P("dp", "tp"), P("tp", None)), P("dp", "tp"), (6, 32), (32, 5), (6, 20)
    if kind == "replicated":
        return mesh, (P(), P()), P(), (3, 8), (8, 5), (3, 5)
    raise ValueError(kind)


VJP_KINDS = ("x_rows_w_cols", "both_vary", "replicated")


@pytest.mark.parametrize("kind,check_vma", product(VJP_KINDS, (True, False)))
def test_vjp_inside_shard_map_matches_jax_ad(kind, check_vma):
    mesh, in_specs, out_spec, xs, ws, ys = _vjp_case(kind)
    x, w = small_ints(KEYS[0], xs, jnp.float16), small_ints(KEYS[1], ws, jnp.float16)
    dy = small_ints(KEYS[2], ys, jnp.float16)
    want = _model_vjp(x, w, dy, k_blocks=4 if kind == "both_vary" else 1)
    vjp_equals_model(pk.matmul, _plain, mesh, in_specs, out_spec, (x, w), dy, want,
                     check_vma=check_vma)


@pytest.mark.parametrize("check_vma", (True, False))
def test_vjp_auto_mesh(check_vma):
    _, in_specs, out_spec, xs, ws, ys = _vjp_case("x_rows_w_cols")
    mesh = cpu_mesh((2, 4), ("dp", "tp"), explicit=False)
    x, w = small_ints(KEYS[0], xs, jnp.bfloat16), small_ints(KEYS[1], ws, jnp.bfloat16)
    dy = small_ints(KEYS[2], ys, jnp.bfloat16)
    vjp_equals_model(pk.matmul, _plain, mesh, in_specs, out_spec, (x, w), dy,
                     _model_vjp(x, w, dy), check_vma=check_vma)


@pytest.mark.parametrize("explicit", (True, False))
def test_grad_outside_shard_map_on_sharded_arrays(explicit):
    # Global arrays sharded over a mesh (no shard_map): values and shardings of the result and
    # of the gradients match JAX's AD of the reference, whose transposes set out_sharding.
    mesh = cpu_mesh((2, 4), ("dp", "tp"), explicit=explicit)
    pk.init(mesh)
    x = jax.device_put(small_ints(KEYS[0], (8, 16), jnp.bfloat16), NamedSharding(mesh, P("dp")))
    w = jax.device_put(small_ints(KEYS[1], (16, 12), jnp.bfloat16),
                       NamedSharding(mesh, P(None, "tp")))
    g = small_ints(KEYS[2], (8, 12), jnp.float32)
    outs = []
    with jax.set_mesh(mesh):
        for fn in (pk.matmul, _plain):
            loss = lambda a, b, fn=fn: jnp.sum(fn(a, b).astype(jnp.float32) * g)
            outs.append((jax.jit(fn)(x, w), *jax.jit(jax.grad(loss, (0, 1)))(x, w)))
    for a, b, c in zip(*outs, _model_vjp(x, w, g)):
        assert a.sharding == b.sharding
        assert_same(a, c)
        assert_same(b, c)


def test_check_grads_float32():
    x, w = rand(KEYS[0], (5, 16), jnp.float32), rand(KEYS[1], (16, 3), jnp.float32)
    check_grads(mm._matmul, (x, w), order=1, modes=["rev"])
    mesh, in_specs, out_spec, xs, ws, _ = _vjp_case("x_rows_w_cols")
    x, w = rand(KEYS[0], xs, jnp.float32), rand(KEYS[1], ws, jnp.float32)
    check_grads_sharded(mm._matmul, mesh, in_specs, out_spec, (x, w))


# ---------------------------------------------------------------- errors


def _raises(exc, match, x, w):
    with pytest.raises(exc, match=match):
        jax.jit(pk.matmul)(x, w)


def test_error_bad_dtype():
    _raises(TypeError, "pk.matmul: x has dtype float32; supported: bfloat16, float16",
            jnp.ones((4, 8), jnp.float32), jnp.ones((8, 4), jnp.float32))


def test_error_mixed_dtypes():
    _raises(TypeError, "pk.matmul: x and w must have the same dtype, got float16 and bfloat16",
            jnp.ones((4, 8), jnp.float16), jnp.ones((8, 4), jnp.bfloat16))


def test_error_k_not_multiple_of_8():
    _raises(ValueError, r"pk.matmul: K \(x.shape\[1\]\) = 12 is not divisible by 8. Pad K",
            jnp.ones((4, 12), jnp.bfloat16), jnp.ones((12, 4), jnp.bfloat16))


def test_error_mismatched_k():
    _raises(ValueError, r"pk.matmul: contraction dimensions differ: x has shape \(4, 8\) "
            r"\(K=8\) and w has shape \(16, 4\)", jnp.ones((4, 8), jnp.bfloat16),
            jnp.ones((16, 4), jnp.bfloat16))


def test_error_not_rank_2():
    _raises(ValueError, r"pk.matmul: x must have 2 dimensions, got shape \(2, 4, 8\)",
            jnp.ones((2, 4, 8), jnp.bfloat16), jnp.ones((8, 4), jnp.bfloat16))


# GPU tests
# The CUDA kernel against float32 and same-dtype XLA references on one H200 (errors computed on
# the GPU: host float64 copies of 16384^2 outputs would be slow). Outputs are
# poisoned first: XLA owns the output buffer, so a NaN-filled array of the output's size is
# allocated and freed right before each call, and the allocator hands that memory back.

_GPU_SQUARE = (256, 512, 1024, 2048, 4096)
_GPU_SQUARE_LARGE = (8192, 16384)
_GPU_SKINNY = [(m, 4096, 4096) for m in (1, 8, 17, 64, 100, 127, 128)]
_GPU_ODD = [(129, 257, 72), (333, 1001, 520), (1000, 1000, 1000), (4095, 4097, 4096),
            (2049, 136, 8), (131, 5000, 136)]
_GPU_TRANSFORMER = [(8192, 28672, 8192), (16384, 8192, 3584)]


def _gpu_init():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    assert pk.backend_name("matmul") == "cuda"
    return mesh


def _gpu_operands(m, n, k, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed + 7919 * m + 31 * n + k))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
    return x, w


def _max_err(y, ref):
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))


def _check_gpu_matmul(m, n, k, dtype):
    _gpu_init()
    x, w = _gpu_operands(m, n, k, dtype)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    err_xla = _max_err(jax.jit(lambda a, b: a @ b)(x, w), ref)
    f = jax.jit(pk.matmul)
    outs = []
    for _ in range(2):  # two calls in a row
        poison((m, n), dtype)
        outs.append(jax.block_until_ready(f(x, w)))
    for y in outs:
        assert y.shape == (m, n) and y.dtype == dtype
        assert not bool(jnp.any(jnp.isnan(y))), "output not fully written"
        err = _max_err(y, ref)
        assert err <= 2 * err_xla + 1e-3 * np.sqrt(k), (err, err_xla)
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32),
                                  np.asarray(outs[1], np.float32))


def _gpu_id(v):
    if isinstance(v, tuple):
        return "x".join(map(str, v))
    return str(v) if isinstance(v, int) else jnp.dtype(v).name


@pytest.mark.gpu
@pytest.mark.parametrize("m,dtype", product(_GPU_SQUARE, (jnp.bfloat16, jnp.float16)),
                         ids=_gpu_id)
def test_gpu_matmul_square(m, dtype):
    _check_gpu_matmul(m, m, m, dtype)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("m,dtype", product(_GPU_SQUARE_LARGE, (jnp.bfloat16,)),
                         ids=_gpu_id)
def test_gpu_matmul_square_large(m, dtype):
    _check_gpu_matmul(m, m, m, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", product(
    _GPU_SKINNY + _GPU_ODD, (jnp.bfloat16, jnp.float16)), ids=_gpu_id)
def test_gpu_matmul_skinny_and_odd(shape, dtype):
    _check_gpu_matmul(*shape, dtype)


@pytest.mark.gpu
@pytest.mark.large
@pytest.mark.parametrize("shape,dtype", product(_GPU_TRANSFORMER, (jnp.bfloat16,)),
                         ids=_gpu_id)
def test_gpu_matmul_transformer(shape, dtype):
    _check_gpu_matmul(*shape, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", (mm._TILE_128x256, mm._TILE_128x128, mm._TILE_128x256_S3))
def test_gpu_matmul_each_tile_config(config):
    """Every row of the tile table, forced, on a shape with edges in M, N and K and more tiles
    than SMs (each persistent block runs several tiles)."""
    from pk_jax import _ffi

    _gpu_init()
    m, n, k = 2100, 2600, 1000
    x, w = _gpu_operands(m, n, k, jnp.bfloat16, seed=config)
    ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                  precision=jax.lax.Precision.HIGHEST)
    err_xla = _max_err(jax.jit(lambda a, b: a @ b)(x, w), ref)
    f = jax.jit(lambda a, b: _ffi.call("pk_matmul", jax.ShapeDtypeStruct((m, n), a.dtype), a, b,
                                       config=np.int64(config), group_m=np.int64(16)))
    poison((m, n), jnp.bfloat16)
    y = f(x, w)
    assert not bool(jnp.any(jnp.isnan(y)))
    assert _max_err(y, ref) <= 2 * err_xla + 1e-3 * np.sqrt(k)


@pytest.mark.gpu
def test_gpu_matmul_in_shard_map_and_vjp():
    mesh = _gpu_init()
    x, w = _gpu_operands(512, 384, 256, jnp.bfloat16)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) ** 2)

    f = jax.jit(jax.shard_map(pk.matmul, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    y = f(x, w)
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(_plain(x, w), np.float32), rtol=2e-2, atol=0.5)
    gx, gw = jax.jit(jax.grad(loss(pk.matmul), argnums=(0, 1)))(x, w)
    rx, rw = jax.jit(jax.grad(loss(_plain), argnums=(0, 1)))(x, w)
    for a, b in ((gx, rx), (gw, rw)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        assert _max_err(a, b.astype(jnp.float32)) <= 2e-2 * scale

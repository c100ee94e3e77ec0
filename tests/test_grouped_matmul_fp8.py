"""The fp8 grouped GEMM (the MoE experts' forward in fp8): pk.grouped_matmul with fp8 operands,
its kernel pk_grouped_matmul_fp8 (entry grouped_matmul._fp8_kernel) and its reference
grouped_matmul.fp8_reference, against float64 NumPy. On a CPU: the reference, the public op's
routing, gradient and errors, and how the Python side lays the operands out for the kernel
(per-expert transposed w, transposed x scales, the experts' w scales as [E * KB, NB]), checked
through a NumPy model of the kernel's walk over row tiles and its scale reads; on the GPU: the
kernel itself, and the public op calling it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8 import _id, _pow2_scales, _small_int_codes, _tolerance
from util import run_twice

import pk_jax as pk
from pk_jax import fp8
from pk_jax.ops import grouped_matmul as gm

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BM = 128  # the kernel's row tile


def _rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


def _w_scales(key, e, k, n, kind, wq_dtype=E4M3):
    """Weights [E, K, N] quantized per expert by current scaling, and their scales: "tensor" one
    per expert ([E]), "scalar" one for all (the per-expert codes then rescaled), "block" [E, KB,
    NB]."""
    w = _rand(key, (e, k, n), 0.05)
    if kind == "scalar":
        scale = jnp.max(jnp.abs(w)) / float(jnp.finfo(wq_dtype).max)
        return (w / scale).astype(wq_dtype), scale.astype(jnp.float32)
    pairs = [fp8.quantize(w[i], role="w", dtype=wq_dtype,
                          scaling="block" if kind == "block" else "tensor") for i in range(e)]
    return jnp.stack([q for q, _ in pairs]), jnp.stack([s for _, s in pairs])


def _groups(sizes, m):
    """(e, lo, hi) of every group by the kernel's rule: sizes clamped to >= 0, ranges cut at m."""
    out, lo = [], 0
    for e, s in enumerate(np.asarray(sizes)):
        s = max(int(s), 0)
        out.append((e, min(lo, m), min(lo + s, m)))
        lo += s
    return out, min(lo, m)


def _expanded_reference(xq, sx, wq, sw, sizes) -> np.ndarray:
    """float64 sum over each group's rows of (x * x_scale) @ (w[e] * w_scale[e]), the scales
    expanded by hand; rows past the groups zero (w [E, K, N])."""
    m, k = xq.shape
    e_count, _, n = wq.shape
    xs = np.asarray(sx, np.float64)
    xs = np.repeat(xs, 128, axis=1)[:, :k] if xs.ndim else np.full((m, k), float(xs))
    ws = np.asarray(sw, np.float64)
    if ws.ndim == 3:
        ws = np.repeat(np.repeat(ws, 128, axis=1), 128, axis=2)[:, :k, :n]
    else:
        ws = np.broadcast_to(ws.reshape(-1, 1, 1), (e_count, k, n))
    xf = np.asarray(xq, np.float64) * xs
    wf = np.asarray(wq, np.float64) * ws
    y = np.zeros((m, n))
    for e, lo, hi in _groups(sizes, m)[0]:
        y[lo:hi] = xf[lo:hi] @ wf[e]
    return y


def _kernel_model(x, wt, xs, ws, blockwise, n, sizes, bn) -> np.ndarray:
    """What pk_grouped_matmul_fp8 computes from fp8_grouped_operands' outputs, in float64, walking
    as the kernel walks (pk/grouped_walk.cuh): each group's row tiles of BM rows from its first
    row, each tile's k-blocks of 128 and BN-column tiles; per tensor the tile's product times
    x_scale * ws[e]; blockwise, per k-block kb, the block's product of the codes times xs[kb,
    row] (the x-scale box at the tile's first row) and ws[e * KB + kb, col // 128] (the 4-float
    box at the column tile's first w block), summed (fp8_layout.cuh's coordinates). A tile's
    rows past its group are computed but never stored; rows past the groups are zeros."""
    x64, w64 = np.asarray(x, np.float64), np.asarray(wt, np.float64)
    m, k = x64.shape
    n8 = w64.shape[1]
    kb_count = -(-k // 128)
    y = np.full((m, n8), np.nan)
    groups, total = _groups(sizes, m)
    for e, lo, hi in groups:
        for row0 in range(lo, hi, BM):
            rows = np.arange(row0, row0 + BM)
            a = np.zeros((BM, k))
            inside = rows < m  # TMA fills rows past M with zeros
            a[inside] = x64[rows[inside]]
            for nt in range(-(-n8 // bn)):
                cols = np.arange(nt * bn, min(nt * bn + bn, n8))
                b = w64[e, cols]  # [cols, K]
                if not blockwise:
                    acc = (a @ b.T) * float(xs) * float(np.asarray(ws)[e])
                else:
                    acc = np.zeros((BM, len(cols)))
                    xs_np, ws_np = np.asarray(xs, np.float64), np.asarray(ws, np.float64)
                    for kb in range(kb_count):
                        ks = slice(kb * 128, (kb + 1) * 128)
                        box_x = np.zeros(BM)  # x-scale box from inner coordinate row0
                        valid = rows < xs_np.shape[1]
                        box_x[valid] = xs_np[kb, rows[valid]]
                        w_row = e * kb_count + kb
                        box_w = ws_np[w_row, (nt * bn) // 128 + (cols - nt * bn) // 128]
                        acc += (a[:, ks] @ b[:, ks].T) * box_x[:, None] * box_w[None, :]
                stored = rows < hi
                y[rows[stored][:, None], cols[None, :]] = acc[stored]
    y[total:] = 0.0
    return y[:, :n]


_SIZES = {
    "even": (300, [100, 50, 150]),
    "empty_and_tail": (300, [100, 0, 150, 30]),          # an empty group; rows 280.. are zeros
    "negative": (200, [10, -5, 120, 3]),                 # -5 counts as 0
    "past_m": (150, [100, 90]),                          # the last group cut at M
    "one_row_groups": (9, [1] * 8),
}


@pytest.mark.parametrize("case", list(_SIZES))
@pytest.mark.parametrize("x_scaling,w_kind", [("tensor", "tensor"), ("tensor", "scalar"),
                                              ("block", "block"), ("tensor", "block"),
                                              ("block", "tensor")])
def test_fp8_reference_is_the_product_of_the_dequantized_operands(case, x_scaling, w_kind):
    m, sizes = _SIZES[case]
    e, k, n = len(sizes), 272, 136
    xq, sx = fp8.quantize(_rand(1, (m, k), 2.0), role="x", scaling=x_scaling)
    wq, sw = _w_scales(2, e, k, n, w_kind)
    gs = jnp.asarray(sizes, jnp.int32)
    y = gm.fp8_reference(xq, wq, gs, sx, sw, jnp.float32)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())
    # The "enk" layout (each expert's w transposed) is the same product.
    y_t = gm.fp8_reference(xq, jnp.swapaxes(wq, 1, 2), gs, sx, sw, jnp.float32, w_layout="enk")
    np.testing.assert_array_equal(np.asarray(y_t), np.asarray(y))


@pytest.mark.parametrize("case", list(_SIZES))
@pytest.mark.parametrize("x_scaling,w_kind", [("tensor", "tensor"), ("block", "block"),
                                              ("tensor", "block"), ("block", "tensor"),
                                              ("tensor", "scalar")])
@pytest.mark.parametrize("k,n", [(16, 3), (272, 250), (384, 129)])
@pytest.mark.parametrize("w_layout", ["ekn", "enk"])
def test_fp8_grouped_operands_lay_out_what_the_kernel_reads(case, x_scaling, w_kind, k, n,
                                                             w_layout):
    m, sizes = _SIZES[case]
    e = len(sizes)
    xq, sx = fp8.quantize(_rand(3, (m, k), 2.0), role="x", scaling=x_scaling)
    wq, sw = _w_scales(4, e, k, n, w_kind, E5M2)
    w_in = wq if w_layout == "ekn" else jnp.swapaxes(wq, 1, 2)
    x, wt, xs, ws, blockwise, n_out = gm.fp8_grouped_operands(xq, w_in, sx, sw,
                                                              w_layout=w_layout)
    n8, kb, nb = -(-n // 8) * 8, -(-k // 128), -(-n // 128)
    assert n_out == n and blockwise == ("block" in (x_scaling, w_kind))
    assert wt.dtype == E5M2 and wt.shape == (e, n8, k)
    np.testing.assert_array_equal(np.asarray(wt[:, :n], np.float32),
                                  np.asarray(jnp.swapaxes(wq, 1, 2), np.float32))
    np.testing.assert_array_equal(np.asarray(wt[:, n:], np.float32), 0.0)  # zero rows pad N
    if blockwise:
        assert xs.dtype == ws.dtype == jnp.float32
        assert xs.shape == (kb, -(-m // 4) * 4) and ws.shape == (e * kb, -(-nb // 4) * 4)
        np.testing.assert_array_equal(np.asarray(xs)[:, m:], 0.0)
        np.testing.assert_array_equal(np.asarray(ws)[:, nb:], 0.0)
    else:
        assert xs.shape == () and ws.shape == (e,)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    for bn in (128,) if blockwise else (128, 256):  # every tile width the kernel may take
        got = _kernel_model(x, wt, xs, ws, blockwise, n, sizes, bn)
        assert not np.isnan(got).any(), "a row the model never stored"
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_the_kernel_model_sees_a_wrong_scale_layout():
    """The model is no tautology: the experts' w scales laid out k-block-major ([KB, E, NB] read
    as [E * KB, NB]), x_scale untransposed, or one expert's per-tensor scale for all, each give
    another product."""
    m, sizes = 300, [100, 50, 150]
    e, k, n = 3, 384, 256
    xq, sx = fp8.quantize(_rand(5, (m, k), 2.0), role="x", scaling="block")
    wq, sw = _w_scales(6, e, k, n, "block")
    x, wt, xs, ws, _, _ = gm.fp8_grouped_operands(xq, wq, sx, sw)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    kb = xs.shape[0]
    ws_np = np.asarray(ws).reshape(e, kb, -1)
    wrong_w = np.ascontiguousarray(ws_np.transpose(1, 0, 2)).reshape(e * kb, -1)
    wrong_x = np.zeros_like(np.asarray(xs))
    wrong_x[:, :m] = np.asarray(sx).reshape(kb, -1)[:, :m]
    for bad_xs, bad_ws in ((xs, wrong_w), (wrong_x, ws)):
        got = _kernel_model(x, wt, bad_xs, bad_ws, True, n, sizes, 128)
        assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()
    wq_t, sw_t = _w_scales(7, e, k, n, "tensor")
    xq_t, sx_t = fp8.quantize(_rand(8, (m, k), 2.0), role="x")
    x, wt, xs, ws, _, _ = gm.fp8_grouped_operands(xq_t, wq_t, sx_t, sw_t)
    want = _expanded_reference(xq_t, sx_t, wq_t, sw_t, sizes)
    got = _kernel_model(x, wt, xs, jnp.broadcast_to(ws[0], ws.shape), False, n, sizes, 256)
    assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()


def test_fp8_tile_config():
    """Blockwise scaling and narrow outputs take 128x128 tiles, else 128x256; the op table's
    ids."""
    assert gm.fp8_tile_config(4096, True) == gm._FP8_TILE_128x128
    assert gm.fp8_tile_config(4096, False) == gm._FP8_TILE_128x256
    assert gm.fp8_tile_config(128, False) == gm._FP8_TILE_128x128
    assert gm.fp8_tile_config(136, False) == gm._FP8_TILE_128x256
    assert (gm._FP8_TILE_128x256, gm._FP8_TILE_128x128) == (0, 1)


def test_fp8_kernel_entry_refuses_what_it_cannot_take():
    m, e, k, n = 64, 4, 256, 64
    xq, sx = fp8.quantize(_rand(9, (m, k)), role="x", scaling="block")
    wq, sw = _w_scales(10, e, k, n, "block")
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    f = gm._fp8_kernel
    with pytest.raises(ValueError, match="w_layout must be 'ekn'"):
        f(xq, wq, gs, sx, sw, w_layout="kn")
    with pytest.raises(ValueError, match="contraction dimensions differ"):
        f(xq, wq, gs, sx, sw, w_layout="enk")  # wq is [E, K, N], not [E, N, K]
    with pytest.raises(ValueError, match="248 is not divisible by 16"):
        f(xq[:, :248], wq[:, :248], gs, jnp.float32(1), jnp.float32(1))
    with pytest.raises(TypeError, match="takes fp8 operands .* x is bfloat16"):
        f(xq.astype(jnp.bfloat16), wq, gs, sx, sw)
    with pytest.raises(TypeError, match="group_sizes must be int32"):
        f(xq, wq, gs.astype(jnp.int64) if jax.config.jax_enable_x64 else gs.astype(jnp.int16),
          sx, sw)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[E\] = \(4,\)"):
        f(xq, wq, gs[:3], sx, sw)
    with pytest.raises(ValueError, match=r"w_scale must be a scalar or \[4\] or \[4, 2, 1\]"):
        f(xq, wq, gs, sx, sw[0])
    with pytest.raises(ValueError, match=r"x_scale must be a scalar or \[64, 2\]"):
        f(xq, wq, gs, sx.T, sw)
    with pytest.raises(TypeError, match="fp8 operands need w_scale"):
        f(xq, wq, gs, sx, None)
    with pytest.raises(TypeError, match="x_scale must be float32"):
        f(xq, wq, gs, sx.astype(jnp.bfloat16), sw)
    with pytest.raises(TypeError, match="out_dtype must be bfloat16 or float32"):
        f(xq, wq, gs, sx, sw, jnp.float16)
    with pytest.raises(ValueError, match=r"w must be \[E, K, N\]"):
        f(xq, wq[0], gs, sx, sw)
    if not pk.HAS_CUDA or jax.devices()[0].platform != "gpu":
        with pytest.raises(RuntimeError, match="fp8 kernel .*cannot run here"):
            f(xq, wq, gs, sx, sw)


def test_public_fp8_grouped_matmul_routes_to_the_kernel_with_the_references_gradient(
        monkeypatch):
    """With the kernel available (forced here; the kernel entry stands in with the reference,
    since a CPU has no kernel): pk.grouped_matmul's fp8 product goes to the kernel entry, and
    its gradients (of x, w and both scales) are the reference's. Without it, the reference."""
    from pk_jax import _backend

    m, sizes, k, n = 40, [10, 0, 25, 5], 256, 24
    xq, sx = fp8.quantize(_rand(31, (m, k)), role="x", scaling="block")
    wq, sw = _w_scales(32, len(sizes), k, n, "tensor")
    gs = jnp.asarray(sizes, jnp.int32)
    plain = pk.grouped_matmul(xq, wq, gs, x_scale=sx, w_scale=sw, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(plain, np.float64),
                               _expanded_reference(xq, sx, wq, sw, sizes), rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(plain).max()))
    calls = []

    def stand_in(x, w, g, a, b, out_dtype=None, *, w_layout="ekn"):
        calls.append(x.shape)
        return gm.fp8_reference(x, w, g, a, b, out_dtype, w_layout=w_layout)

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    monkeypatch.setattr(gm, "_fp8_kernel", stand_in)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)
    ours = jax.grad(loss(lambda x, w, a, b: pk.grouped_matmul(x, w, gs, x_scale=a, w_scale=b)),
                    argnums=(0, 1, 2, 3))(xq, wq, sx, sw)
    assert calls == [(m, k)]
    want = jax.grad(loss(lambda x, w, a, b: gm.fp8_reference(x, w, gs, a, b)),
                    argnums=(0, 1, 2, 3))(xq, wq, sx, sw)
    # Each expert's w given transposed ("enk"): the same product, its w gradient transposed.
    wt = jnp.swapaxes(wq, 1, 2)
    enk = jax.grad(loss(lambda x, w, a, b: pk.grouped_matmul(x, w, gs, x_scale=a, w_scale=b,
                                                             w_layout="enk")),
                   argnums=(0, 1, 2, 3))(xq, wt, sx, sw)
    assert calls == [(m, k)] * 2
    for g, r, t in zip(ours, want, (*enk[:1], jnp.swapaxes(enk[1], 1, 2), *enk[2:])):
        assert g.dtype == r.dtype and g.shape == r.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
        np.testing.assert_array_equal(np.asarray(t, np.float32), np.asarray(r, np.float32))
    y_enk = pk.grouped_matmul(xq, wt, gs, x_scale=sx, w_scale=sw, out_dtype=jnp.float32,
                              w_layout="enk")
    np.testing.assert_array_equal(np.asarray(y_enk), np.asarray(plain))


def test_public_fp8_grouped_matmul_errors():
    m, e, k, n = 64, 4, 256, 64
    xq, sx = fp8.quantize(_rand(9, (m, k)), role="x", scaling="block")
    wq, sw = _w_scales(10, e, k, n, "block")
    gs = jnp.asarray([16] * e, jnp.int32)
    with pytest.raises(TypeError, match="pk.grouped_matmul: fp8 operands need w_scale"):
        pk.grouped_matmul(xq, wq, gs, x_scale=sx)
    with pytest.raises(TypeError, match="takes fp8 operands .* w is bfloat16"):
        pk.grouped_matmul(xq, wq.astype(jnp.bfloat16), gs, x_scale=sx, w_scale=sw)
    xb = xq.astype(jnp.bfloat16)
    for kw in ({"x_scale": sx}, {"out_dtype": jnp.float32}, {"w_layout": "enk"}):
        with pytest.raises(TypeError, match="x_scale, w_scale, out_dtype and w_layout are for"):
            pk.grouped_matmul(xb, wq.astype(jnp.bfloat16), gs, **kw)
    with pytest.raises(ValueError, match="pk.grouped_matmul: w_layout must be 'ekn'"):
        pk.grouped_matmul(xq, wq, gs, x_scale=sx, w_scale=sw, w_layout="kn")
    with pytest.raises(ValueError, match="contraction dimensions differ"):
        pk.grouped_matmul(xq, wq, gs, x_scale=sx, w_scale=sw, w_layout="enk")


# ------------------------------------------------------------------ the kernel on the GPU

# (M, K, N, group sizes): odd M, N and K edges, empty groups, rows past the sum (zeros),
# negative sizes, groups cut at M, one-row groups, many experts, groups across row tiles.
_GPU_CASES = {
    "tail": (300, 256, 200, [100, 0, 150, 30]),
    "odd": (129, 272, 72, [129]),
    "edges": (1000, 1008, 520, [0, 37, 300, 1, 0, 128, 255, 200]),
    "negative": (64, 16, 64, [10, -5, 20, 34]),
    "past_m": (513, 2048, 136, [500, 100]),
    "decode": (8, 512, 256, [1] * 8),
    "many": (4096, 512, 264, [16] * 256),
    "wide": (2100, 1024, 2600, [700, 0, 900, 500]),
}


def _gpu_setup():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    assert pk._backend.use_kernel(gm.FP8_STEM), "no pk_grouped_matmul_fp8 in this build"


def _int_operands(key, m, k, n, e, scaling, x_dtype=E4M3, w_dtype=E4M3):
    xq = _small_int_codes(key, (m, k), x_dtype)
    wq = _small_int_codes(key + 1, (e, k, n), w_dtype)
    if scaling == "tensor":
        sx, sw = jnp.float32(0.25), _pow2_scales(key + 2, (e,))
    else:
        sx = _pow2_scales(key + 2, fp8.block_shape("x", (m, k)))
        sw = _pow2_scales(key + 3, gm.w_scale_block_shape(e, k, n))
    return xq, wq, sx, sw


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_GPU_CASES))
@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=_id)
def test_gpu_fp8_grouped_exact_on_integers(case, scaling, out_dtype):
    """Integer codes in [-2, 2] and power-of-two scales: every partial sum is an integer of at
    most 2^13 (K <= 2048 per tensor; a 128-wide block blockwise), exact in the tensor cores'
    accumulation and fp32, so y equals float64 NumPy bit for bit (bf16: its one rounding)."""
    _gpu_setup()
    m, k, n, sizes = _GPU_CASES[case]
    xq, wq, sx, sw = _int_operands(20, m, k, n, len(sizes), scaling)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda *a: gm._fp8_kernel(*a, out_dtype=out_dtype))
    y = run_twice(f, (m, -(-n // 8) * 8), out_dtype, xq, wq, gs, sx, sw)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    want = np.asarray(jnp.asarray(want, jnp.float32).astype(out_dtype), np.float64)
    np.testing.assert_array_equal(y, want)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["edges", "past_m", "many", "wide"])
@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=_id)
def test_gpu_fp8_grouped_random_within_tolerance(case, scaling, out_dtype):
    """Normal data quantized by current scaling (x per tensor or 1x128, w per expert or
    128x128), against float64 NumPy of the dequantized operands within tests/test_fp8.py's
    accumulation model (_tolerance), relative to the largest |y|."""
    _gpu_setup()
    m, k, n, sizes = _GPU_CASES[case]
    e = len(sizes)
    xq, sx = fp8.quantize(_rand(30 + k, (m, k), 2.0), role="x", scaling=scaling)
    wq, sw = _w_scales(31 + k, e, k, n, scaling)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda *a: gm._fp8_kernel(*a, out_dtype=out_dtype))
    y = run_twice(f, (m, -(-n // 8) * 8), out_dtype, xq, wq, gs, sx, sw)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err <= _tolerance(k, scaling, out_dtype), (err, _tolerance(k, scaling, out_dtype))
    # The reference through XLA agrees within the same bound (the kernel is its stand-in).
    ref = np.asarray(gm.fp8_reference(xq, wq, gs, sx, sw, jnp.float32), np.float64)
    assert np.abs(ref - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", ["tensor", "block"])
@pytest.mark.parametrize("w_layout", ["ekn", "enk"])
def test_gpu_public_fp8_grouped_matmul_runs_the_kernel(scaling, w_layout):
    """pk.grouped_matmul with fp8 operands, w as [E, K, N] or [E, N, K]: the lowered program
    calls pk_grouped_matmul_fp8, and its product is within the accuracy model of float64
    NumPy, two calls alike."""
    _gpu_setup()
    m, k, n, sizes = _GPU_CASES["edges"]
    xq, sx = fp8.quantize(_rand(40, (m, k), 2.0), role="x", scaling=scaling)
    wq, sw = _w_scales(41, len(sizes), k, n, scaling)
    gs = jnp.asarray(sizes, jnp.int32)
    w_in = wq if w_layout == "ekn" else jnp.swapaxes(wq, 1, 2)
    f = jax.jit(lambda *a: pk.grouped_matmul(a[0], a[1], a[2], x_scale=a[3], w_scale=a[4],
                                             w_layout=w_layout))
    assert "pk_grouped_matmul_fp8" in f.lower(xq, w_in, gs, sx, sw).as_text()
    y = np.asarray(f(xq, w_in, gs, sx, sw), np.float64)
    np.testing.assert_array_equal(np.asarray(f(xq, w_in, gs, sx, sw), np.float64), y)
    want = _expanded_reference(xq, sx, wq, sw, sizes)
    assert np.abs(y - want).max() <= _tolerance(k, scaling, jnp.bfloat16) * np.abs(want).max()


@pytest.mark.gpu
@pytest.mark.parametrize("combo", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)],
                         ids=_id)
@pytest.mark.parametrize("scaling", ["tensor", "block"])
def test_gpu_fp8_grouped_every_format_pair(combo, scaling):
    """e4m3 and e5m2 on either side, exact on integer codes, odd M and N, empty groups."""
    _gpu_setup()
    m, k, n, sizes = _GPU_CASES["edges"]
    xq, wq, sx, sw = _int_operands(40, m, k, n, len(sizes), scaling, *combo)
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(lambda *a: gm._fp8_kernel(*a, out_dtype=jnp.float32))
    y = run_twice(f, (m, -(-n // 8) * 8), jnp.float32, xq, wq, gs, sx, sw)
    np.testing.assert_array_equal(y, _expanded_reference(xq, sx, wq, sw, sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("config,scaling", [(0, "tensor"), (1, "tensor"), (1, "block")])
def test_gpu_fp8_grouped_each_tile_config(config, scaling):
    """Every tile configuration forced, with the experts' weights given as [E, N, K]: more tiles
    than SMs (each persistent block runs several, across groups), edges in M, N and K."""
    from pk_jax import _ffi

    _gpu_setup()
    m, k, n, sizes = _GPU_CASES["wide"]
    xq, wq, sx, sw = _int_operands(50, m, k, n, len(sizes), scaling)
    gs = jnp.asarray(sizes, jnp.int32)

    def call(x, wt, g, a, b):
        x, wt, xs, ws, _, _ = gm.fp8_grouped_operands(x, wt, a, b, w_layout="enk")
        return _ffi.call("pk_grouped_matmul_fp8", jax.ShapeDtypeStruct((m, n), jnp.float32), x,
                         wt, xs, ws, g, config=np.int64(config), group_m=np.int64(16))

    wt = jnp.swapaxes(wq, 1, 2)
    y = run_twice(jax.jit(call), (m, n), jnp.float32, xq, wt, gs, sx, sw)
    np.testing.assert_array_equal(y, _expanded_reference(xq, sx, wq, sw, sizes))
    y_enk = gm._fp8_kernel(xq, wt, gs, sx, sw, jnp.float32, w_layout="enk")
    np.testing.assert_array_equal(np.asarray(y_enk, np.float64), y)


@pytest.mark.gpu
def test_gpu_fp8_grouped_sizes_change_without_a_recompile():
    """group_sizes are traced: one jitted function, three size vectors (one all-empty: y all
    zeros), each exact."""
    _gpu_setup()
    m, k, n, e = 384, 256, 256, 4
    xq, wq, sx, sw = _int_operands(60, m, k, n, e, "block")
    f = jax.jit(lambda *a: gm._fp8_kernel(*a, out_dtype=jnp.float32))
    for sizes in ([96, 96, 96, 96], [0, 0, 0, 0], [383, 0, 1, 0]):
        y = run_twice(f, (m, n), jnp.float32, xq, wq, jnp.asarray(sizes, jnp.int32), sx, sw)
        np.testing.assert_array_equal(y, _expanded_reference(xq, sx, wq, sw, sizes))
    assert f._cache_size() == 1

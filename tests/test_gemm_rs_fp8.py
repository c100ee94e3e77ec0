"""The fused TP GEMMs in fp8 (gemm_rs_fp8, gemm_ar_fp8: cuda/kernels/gemm_rs_fp8.cuh, private
entries gemm_rs._fp8_kernel and gemm_ar._fp8_kernel) against a float64 NumPy model of what each
rank gets: every rank's product of its fp8 values times its own two scales, rounded to bf16
once (the kernel's epilogue), summed over the ranks, then rows [r M/P, (r+1) M/P) on rank r
(reduce-scatter) or all rows everywhere (all-reduce).

CPU: the references (fp8_reference) and the emulator cases (pk_jax.testing.ops) against the
model; the entries traced with a stand-in for the FFI call that computes what the kernel would
from the operands and attributes it is given (the layout: w transposed, N padded; the scales
in order; the tile config; the slice); the errors. GPU (P = 1, the kernels' direct mode):
exact on integers, random within a bound, every format pair, twice on poisoned outputs.

The public ops with fp8 operands (pk.gemm_reduce_scatter, pk.gemm_all_reduce and
pk.all_gather_gemm, whose fp8 form gathers the fp8 rows and their scales, then runs the fp8
GEMM): the model without kernels, their routes and gradients with stand-in kernels, their
errors, and on a GPU over one device (tests/gpu/tp_fp8_mp.py runs them across processes)."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from util import P, cpu_mesh, poison, run, stand_in_kernels

import pk_jax as pk
from pk_jax import _op_table
from pk_jax.ops import gemm_ar, gemm_rs, matmul
from pk_jax.testing import ops as emu_ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FORMATS = (E4M3, E5M2)
OPS = {"rs": gemm_rs, "ar": gemm_ar}


def _dequantized(x, wt, a, b):
    """x [M, K] and wt [N, K] times their scales, float64: a scalar, or blocks (x's a [M, KB]
    per row and 128 columns; w's b [KB, NB] per 128 x 128 block of w [K, N])."""
    x, wt = np.asarray(x, np.float64), np.asarray(wt, np.float64)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    k = x.shape[1]
    xa = np.repeat(a, 128, axis=1)[:, :k] if a.ndim == 2 else a
    wb = np.kron(b, np.ones((128, 128)))[:k, :wt.shape[0]].T if b.ndim == 2 else b
    return x * xa, wt * wb


def _model(xs, wts, sx, sw, gather: bool) -> list[np.ndarray]:
    """What rank r holds after the call, from per-rank fp8 values x_p [M, K], wt_p [N, K] and
    scales: float64 products, one bf16 rounding per rank, the float64 sum, bf16 once more."""
    p = len(xs)
    partials = []
    for x, wt, a, b in zip(xs, wts, sx, sw):
        xd, wd = _dequantized(x, wt, a, b)
        prod = xd @ wd.T
        partials.append(prod.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64))
    total = np.sum(partials, axis=0).astype(np.float32).astype(ml_dtypes.bfloat16)
    m = total.shape[0]
    return [total if gather else total[r * m // p:(r + 1) * m // p] for r in range(p)]


def _exact_inputs(rng, p, m, k, n, fx, fw):
    """x, wt in {-1, 0, 1} and power-of-two scales with a product of 1 or 2 per rank, so every
    partial and sum is an integer below 2 P K <= 256: exact in bf16 in any order of adds."""
    xs = [rng.integers(-1, 2, (m, k)).astype(np.float32).astype(fx) for _ in range(p)]
    wts = [rng.integers(-1, 2, (n, k)).astype(np.float32).astype(fw) for _ in range(p)]
    a, b = rng.integers(-1, 3, p), rng.integers(0, 2, p)
    sx = np.array([2.0 ** int(v) for v in a], np.float32)
    sw = np.array([2.0 ** int(bv - av) for av, bv in zip(a, b)], np.float32)
    return xs, wts, sx, sw


def _block_inputs(rng, p, m, k, n, fx, fw):
    """As _exact_inputs with blockwise scales: x's [M, KB] in {1/2, 1, 2}, w's [KB, NB] in
    {1, 2}, values of x and w in {-1, 0, 1} with x zero but in columns 5 and 100 of each
    128-column block: every partial and sum a multiple of 1/2 below 8 KB P <= 128, exact in
    bf16 (so any order of rounding agrees); a scale applied to the wrong block changes it."""
    xs, wts, _, _ = _exact_inputs(rng, p, m, k, n, fx, fw)
    keep = np.isin(np.arange(k) % 128, (5, 100))
    xs = [np.where(keep, x.astype(np.float32), 0).astype(x.dtype) for x in xs]
    kb, nb = -(-k // 128), -(-n // 128)
    sx = [(2.0 ** rng.integers(-1, 2, (m, kb))).astype(np.float32) for _ in range(p)]
    sw = [(2.0 ** rng.integers(0, 2, (kb, nb))).astype(np.float32) for _ in range(p)]
    return xs, wts, sx, sw


def _global(xs, wts, sx, sw, w_layout):
    """The per-rank operands as the shard_map's global arrays: x [M, P K], w [P K, N] ("kn")
    or [N, P K] ("nk"), scales [P] (per tensor) or x's [M, P KB] and w's [P KB, NB]."""
    x = jnp.asarray(np.concatenate(xs, axis=1))
    wt = np.concatenate(wts, axis=1)
    w = jnp.asarray(wt.T if w_layout == "kn" else wt)
    if np.ndim(sx[0]) == 2:
        return x, w, jnp.asarray(np.concatenate(sx, axis=1)), jnp.asarray(np.concatenate(sw))
    return x, w, jnp.asarray(sx), jnp.asarray(sw)


def _specs(kind, w_layout, blockwise=False):
    w_spec = P("tp", None) if w_layout == "kn" else P(None, "tp")
    out = P("tp", None) if kind == "rs" else P(None, None)
    scales = (P(None, "tp"), P("tp", None)) if blockwise else (P("tp"), P("tp"))
    return (P(None, "tp"), w_spec, *scales), out


def _local(s):
    """A per-tensor scale's [1] shard as the scalar the ops take; blocks as they are."""
    return s.reshape(()) if s.ndim == 1 else s


def _per_rank(fn, w_layout):
    def body(x, w, sx, sw):
        return fn(x, w, _local(sx), _local(sw), "tp", w_layout=w_layout)
    return body


def _ref_body(kind):
    mod = OPS[kind]

    def body(x, w, sx, sw):
        return mod.fp8_reference(x, w, _local(sx), _local(sw), "tp")
    return body


def _rows(y, kind, p):
    """The model's per-rank results as the shard_map's global result."""
    return np.concatenate(y) if kind == "rs" else y[0]


# ---------------------------------------------------------------- references and the model


@pytest.mark.parametrize("kind,p,fx,fw", [(k, p, fx, fw) for k in OPS for p in (1, 2, 4, 8)
                                          for fx, fw in ((E4M3, E4M3), (E5M2, E4M3))])
def test_reference_is_the_model_on_integers(kind, p, fx, fw):
    """fp8_reference (float32 sum, one rounding) equals the model (bf16 partials) exactly
    where every partial is bf16-exact; a reference that dropped a rank's scales would be off
    by a power of two."""
    rng = np.random.default_rng(p)
    m, k, n = 3 * p, 16, 24
    xs, wts, sx, sw = _exact_inputs(rng, p, m, k, n, fx, fw)
    mesh = cpu_mesh((p,), ("tp",))
    in_specs, out_spec = _specs(kind, "kn")
    y = run(_ref_body(kind), mesh, in_specs, out_spec, *_global(xs, wts, sx, sw, "kn"))
    assert y.dtype == jnp.bfloat16
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, p)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want.astype(np.float64))
    if p > 1 and np.any(sx * sw != 1):
        wrong = _rows(_model(xs, wts, np.ones(p), np.ones(p), kind == "ar"), kind, p)
        assert not np.array_equal(wrong.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("kind,p", [("rs", 2), ("ar", 4)])
def test_blockwise_reference_is_the_model(kind, p):
    """Blockwise scales (x per row and 128 columns, w per 128 x 128 block, of each device's
    shard): fp8_reference equals the model on values float32 holds exactly, and a model that
    used the first k-block's scales everywhere differs."""
    rng = np.random.default_rng(p + 40)
    m, k, n = 2 * p, 272, 200
    xs, wts, sx, sw = _block_inputs(rng, p, m, k, n, E4M3, E5M2)
    mesh = cpu_mesh((p,), ("tp",))
    in_specs, out_spec = _specs(kind, "kn", blockwise=True)
    y = run(_ref_body(kind), mesh, in_specs, out_spec, *_global(xs, wts, sx, sw, "kn"))
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, p)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want.astype(np.float64))
    first = [np.repeat(a[:, :1], a.shape[1], axis=1) for a in sx]
    wrong = _rows(_model(xs, wts, first, sw, kind == "ar"), kind, p)
    assert not np.array_equal(wrong.astype(np.float64), want.astype(np.float64))


@pytest.mark.parametrize("kind", OPS)
def test_emulator_cases_expect_the_model(kind):
    """pk_jax.testing.ops' fp8 cases: the inputs are the fp8 values and scales given, the
    expected outputs the model's, and the launch fields the kernel's (x's format as dtype, wt's
    shape for n)."""
    rng = np.random.default_rng(7)
    p, m, k, n = 4, 8, 32, 40
    xs, wts, sx, sw = _exact_inputs(rng, p, m, k, n, E5M2, E4M3)
    make = emu_ops.gemm_rs_fp8 if kind == "rs" else emu_ops.gemm_ar_fp8
    case = make([x.astype(np.float64) for x in xs], [w.astype(np.float64) for w in wts],
                list(sx), list(sw), x_format="float8_e5m2", w_format="float8_e4m3fn")
    want = _model(xs, wts, sx, sw, kind == "ar")
    for r in range(p):
        np.testing.assert_array_equal(case.expected[r]["y"].astype(np.float64),
                                      want[r].astype(np.float64))
        assert case.inputs[r]["x"].dtype == np.dtype(ml_dtypes.float8_e5m2)
        assert case.inputs[r]["w"].shape == (n, k)
        assert case.inputs[r]["x_scale"].tolist() == [sx[r]]
    assert case.dtype == "float8_e5m2" and case.exact
    assert case.params["w_dtype"] == _op_table.DTYPES["float8_e4m3fn"]
    assert (case.params["m"], case.params["k"], case.params["n"]) == (m, k, n)
    assert case.params["y_rows"] == (m // p if kind == "rs" else m)


@pytest.mark.parametrize("kind", OPS)
def test_emulator_blockwise_case_in_the_kernels_layouts(kind):
    """A blockwise case's scale inputs are what the kernel reads (x's transposed [KB, M4], w's
    [KB, NB4], rows of 4 floats; 128x128 tiles): dequantized from those layouts, the case's
    inputs give its expected outputs, which are the model's."""
    rng = np.random.default_rng(21)
    p, m, k, n = 2, 6, 272, 300
    xs, wts, sx, sw = _block_inputs(rng, p, m, k, n, E4M3, E4M3)
    make = emu_ops.gemm_rs_fp8 if kind == "rs" else emu_ops.gemm_ar_fp8
    case = make([x.astype(np.float64) for x in xs], [w.astype(np.float64) for w in wts], sx,
                sw)
    kb = 3  # 272 columns; w has 3 blocks of 300 columns too (a row of 4 floats)
    assert case.params["blockwise"] is True and case.params["config"] == _op_table.TILES[
        "128x128"]
    assert (case.params["xs_rows"], case.params["xs_cols"], case.params["ws_rows"],
            case.params["ws_cols"]) == (kb, 8, kb, 4)
    total = 0
    for inp in case.inputs:
        x, wt = inp["x"].astype(np.float64), inp["w"].astype(np.float64)
        xd = x * inp["x_scale"][:, :m].T[:, np.arange(k) // 128]
        wd = wt * inp["w_scale"][np.arange(k) // 128][:, np.arange(n) // 128].T
        total = total + xd @ wd.T
    want = _model(xs, wts, sx, sw, kind == "ar")
    for r in range(p):
        got = case.expected[r]["y"].astype(np.float64)
        np.testing.assert_array_equal(got, want[r].astype(np.float64))
        rows = slice(r * m // p, (r + 1) * m // p) if kind == "rs" else slice(None)
        np.testing.assert_array_equal(got, total[rows])


def test_emulator_random_case_bound_holds_for_the_model_and_catches_a_dropped_rank():
    """The not-exact cases' bound (P 2^-8 of the largest partial) holds for the float32
    reference against the model, and a result missing one rank's partial breaks it."""
    rng = np.random.default_rng(11)
    p, m, k, n = 4, 64, 256, 48
    xs = [rng.standard_normal((m, k)) for _ in range(p)]
    wts = [rng.standard_normal((n, k)) for _ in range(p)]
    sx, sw = list(rng.uniform(0.25, 2, p)), list(rng.uniform(0.25, 2, p))
    case = emu_ops.gemm_ar_fp8(xs, wts, sx, sw, exact=False)
    xq = [emu_ops.fp8_values(x, "float8_e4m3fn").astype(np.float64) for x in xs]
    wq = [emu_ops.fp8_values(w, "float8_e4m3fn").astype(np.float64) for w in wts]
    prods = [x @ w.T * np.float32(a) * np.float32(b) for x, w, a, b in zip(xq, wq, sx, sw)]
    f32_ref = np.sum(prods, axis=0).astype(np.float32).astype(ml_dtypes.bfloat16)
    want = case.expected[0]["y"].astype(np.float64)
    assert np.allclose(f32_ref.astype(np.float64), want, case.rtol, case.atol)
    dropped = np.sum(prods[1:], axis=0)
    assert not np.allclose(dropped, want, case.rtol, case.atol)


# ---------------------------------------------------------------- the entries (stand-in kernel)


def _stand_in(monkeypatch):
    """stand_in_kernels with the fp8 TP targets: what the kernel computes from the operands it
    is given (x [M, K], wt [N8, K], this rank's scalar scales): each rank's bf16-rounded
    partial, summed over the axis in float32 (the model's sum), then bf16."""
    from pk_jax import _ffi

    calls = stand_in_kernels(monkeypatch)
    inner = _ffi.call

    def call(target, results, *args, out_vma=None, **attrs):
        if target not in ("pk_gemm_rs_fp8", "pk_gemm_ar_fp8"):
            return inner(target, results, *args, out_vma=out_vma, **attrs)
        x, wt, sx, sw, rank = args
        calls.append({"target": target, "x": (x.shape, x.dtype), "wt": (wt.shape, wt.dtype),
                      "scales": (sx.shape, sx.dtype, sw.shape, sw.dtype),
                      "rank": (rank.shape, rank.dtype), "results": results,
                      **{k: int(v) for k, v in attrs.items()}})
        xf, wf = x.astype(jnp.float32), wt.astype(jnp.float32)
        if sx.ndim == 2:  # blockwise, the kernel's layouts: sx [KB, >= M] (x's transposed)
            m, k = x.shape  # and sw [KB, >= NB], rows padded to 4 floats
            xf = xf * jnp.repeat(sx[:, :m].T, 128, axis=1)[:, :k]
            wf = wf * jnp.repeat(jnp.repeat(sw, 128, axis=0), 128, axis=1)[:k, :wt.shape[0]].T
            sx = sw = jnp.float32(1)
        part = jnp.dot(xf, wf.T, precision=jax.lax.Precision.HIGHEST) * sx * sw
        part = part.astype(jnp.bfloat16).astype(jnp.float32)
        if target == "pk_gemm_rs_fp8":
            y = jax.lax.psum_scatter(part, "tp", scatter_dimension=0, tiled=True)
        else:
            y = jax.lax.psum(part, "tp")
        y = y.astype(jnp.bfloat16)
        assert y.shape == results.shape and y.dtype == results.dtype
        return y if out_vma is None else _ffi._pcast_to(y, frozenset(out_vma))

    monkeypatch.setattr(_ffi, "call", call)
    return calls


CASES = [("rs", 4, 8, 32, 20, "kn", E4M3, E4M3, False),
         ("rs", 2, 6, 64, 24, "nk", E5M2, E4M3, False),
         ("ar", 4, 5, 16, 13, "kn", E4M3, E5M2, False),
         ("ar", 8, 9, 16, 16, "nk", E5M2, E5M2, False),
         ("rs", 1, 4, 48, 7, "kn", E4M3, E4M3, False),
         ("ar", 1, 3, 16, 8, "nk", E4M3, E4M3, False),
         ("rs", 2, 5, 272, 300, "kn", E4M3, E4M3, True),  # 3 k-blocks, 3 n-blocks, N padded
         ("ar", 4, 7, 256, 136, "nk", E5M2, E4M3, True),
         ("ar", 1, 130, 144, 8, "kn", E4M3, E5M2, True)]


@pytest.mark.parametrize("kind,p,m,k,n,w_layout,fx,fw,blockwise", CASES)
def test_entry_lowers_to_the_kernel_call_the_model_expects(monkeypatch, kind, p, m, k, n,
                                                           w_layout, fx, fw, blockwise):
    calls = _stand_in(monkeypatch)
    rng = np.random.default_rng(p * 100 + m)
    make = _block_inputs if blockwise else _exact_inputs
    xs, wts, sx, sw = make(rng, p, m * (p if kind == "rs" else 1), k, n, fx, fw)
    mesh = cpu_mesh((p,), ("tp",))
    in_specs, out_spec = _specs(kind, w_layout, blockwise)
    y = run(_per_rank(OPS[kind]._fp8_kernel, w_layout), mesh, in_specs, out_spec,
            *_global(xs, wts, sx, sw, w_layout))
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, p)
    assert y.dtype == jnp.bfloat16 and y.shape == want.shape
    np.testing.assert_array_equal(np.asarray(y, np.float64), want.astype(np.float64))
    fp8_calls = [c for c in calls if c["target"].endswith("_fp8")]
    assert len(fp8_calls) == 1, calls  # traced once, for every rank
    c = fp8_calls[0]
    n8 = -(-n // 8) * 8
    mm = xs[0].shape[0]
    assert c["target"] == f"pk_{OPS[kind].FP8_STEM}"
    assert c["x"] == ((mm, k), np.dtype(fx)) and c["wt"] == ((n8, k), np.dtype(fw))
    if blockwise:  # the kernel's layouts (matmul.fp8_operands): x's transposed, rows of 4
        kb, nb = -(-k // 128), -(-n // 128)
        m4, nb4 = -(-mm // 4) * 4, -(-nb // 4) * 4
        assert c["scales"] == ((kb, m4), np.dtype(np.float32), (kb, nb4), np.dtype(np.float32))
    else:
        assert c["scales"] == ((), np.dtype(np.float32), (), np.dtype(np.float32))
    assert c["rank"] == ((1,), np.dtype(np.int32))
    assert c["results"].shape == (mm // p if kind == "rs" else mm, n8)
    assert c["config"] == _op_table.TILES["128x128"] and c["group_m"] == matmul._GROUP_M  # small
    from pk_jax.runtime import state

    assert c["comm_id"] == state.comm_id("tp")


def test_entry_result_types_match_the_reference(monkeypatch):
    """Varying-axes types with check_vma: rs's result varies along the axis, ar's does not
    (out_specs P(None, None) would fail to type-check otherwise)."""
    _stand_in(monkeypatch)
    p = 2
    rng = np.random.default_rng(3)
    xs, wts, sx, sw = _exact_inputs(rng, p, 4, 16, 8, E4M3, E4M3)
    mesh = cpu_mesh((p,), ("tp",))
    pk.init(mesh)
    for kind, mod in OPS.items():
        in_specs, out_spec = _specs(kind, "kn")
        args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s))
                for a, s in zip(_global(xs, wts, sx, sw, "kn"), in_specs)]
        ours = jax.eval_shape(jax.shard_map(_per_rank(mod._fp8_kernel, "kn"), mesh=mesh,
                                            in_specs=in_specs, out_specs=out_spec), *args)
        ref = jax.eval_shape(jax.shard_map(_ref_body(kind), mesh=mesh, in_specs=in_specs,
                                           out_specs=out_spec), *args)
        assert ours.shape == ref.shape and ours.dtype == ref.dtype


@pytest.mark.needs_ext
def test_workspace_need_is_the_bf16_owner_buffer():
    from pk_jax import _ffi

    assert _ffi.workspace_need("gemm_rs_fp8", 4, m=1000, n=264) == 250 * 264 * 2
    assert _ffi.workspace_need("gemm_ar_fp8", 4, m=1001, n=264) == 251 * 264 * 2
    assert _ffi.workspace_need("gemm_ar_fp8", 3, m=7, n=8) == 3 * 8 * 2


@pytest.mark.needs_ext
def test_entry_refuses_a_workspace_too_small(monkeypatch):
    _stand_in(monkeypatch)
    p = 2
    rng = np.random.default_rng(5)
    xs, wts, sx, sw = _exact_inputs(rng, p, 512, 16, 1024, E4M3, E4M3)
    mesh = cpu_mesh((p,), ("tp",))
    pk.init(mesh, workspace_bytes=1 << 16)
    in_specs, out_spec = _specs("rs", "kn")
    with pytest.raises(ValueError, match=r"gemm_reduce_scatter: this call needs 524288 bytes"):
        run(_per_rank(gemm_rs._fp8_kernel, "kn"), mesh, in_specs, out_spec,
            *_global(xs, wts, sx, sw, "kn"), init=False)


# ---------------------------------------------------------------- errors


def _call_one(kind, x, w, sx, sw, *, w_layout="kn", p=2):
    mesh = cpu_mesh((p,), ("tp",))
    pk.init(mesh)
    fn = OPS[kind]._fp8_kernel
    f = jax.shard_map(lambda a, b: fn(a, b, sx, sw, "tp", w_layout=w_layout), mesh=mesh,
                      in_specs=(P(), P()), out_specs=P(), check_vma=False)
    return jax.eval_shape(f, x, w)


ONE = jnp.float32(1.0)
X = jax.ShapeDtypeStruct((8, 32), E4M3)
W = jax.ShapeDtypeStruct((32, 16), E4M3)


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("x,w,sx,sw,layout,err,match", [
    (jax.ShapeDtypeStruct((8, 32), jnp.bfloat16), W, ONE, ONE, "kn", TypeError,
     "x and w must be fp8"),
    (X, jax.ShapeDtypeStruct((32, 16), jnp.bfloat16), ONE, ONE, "kn", TypeError,
     "w is bfloat16"),
    (jax.ShapeDtypeStruct((8, 24), E4M3), jax.ShapeDtypeStruct((24, 16), E4M3), ONE, ONE,
     "kn", ValueError, "not divisible by 16. fp8 rows need 16-byte strides"),
    (X, jax.ShapeDtypeStruct((48, 16), E4M3), ONE, ONE, "kn", ValueError,
     "contraction dimensions differ"),
    (X, jax.ShapeDtypeStruct((16, 48), E4M3), ONE, ONE, "nk", ValueError,
     r"\[N, K/P\] \(w_layout='nk'\)"),
    (X, W, jnp.ones((8, 2), jnp.float32), ONE, "kn", ValueError,
     r"x_scale must be a scalar or \[8, 1\] \(blockwise, of this device's x \[8, 32\]\)"),
    (X, W, ONE, jnp.ones((1, 2), jnp.float32), "kn", ValueError,
     r"w_scale must be a scalar or \[1, 1\]"),
    (X, W, ONE, jnp.bfloat16(1), "kn", TypeError, "w_scale must be float32"),
    (X, W, None, ONE, "kn", TypeError, "x_scale must be float32.*got None"),
    (X, W, ONE, ONE, "kk", ValueError, "w_layout must be 'kn'"),
    (jax.ShapeDtypeStruct((8, 32, 1), E4M3), W, ONE, ONE, "kn", ValueError,
     "x must have 2 dimensions"),
])
def test_entry_errors(kind, x, w, sx, sw, layout, err, match):
    name = "gemm_reduce_scatter" if kind == "rs" else "gemm_all_reduce"
    with pytest.raises(err, match=match) as info:
        _call_one(kind, x, w, sx, sw, w_layout=layout)
    assert f"pk.{name}" in str(info.value)


def test_rs_entry_refuses_rows_not_divisible_by_p():
    with pytest.raises(ValueError, match="M .* divisible|multiple of the size of axis"):
        _call_one("rs", jax.ShapeDtypeStruct((7, 32), E4M3), W, ONE, ONE)


@pytest.mark.parametrize("kind", OPS)
def test_entry_refuses_where_the_kernel_cannot_run(kind):
    """On a CPU mesh (no stand-in) the entry says the kernel cannot run, rather than running
    something else."""
    with pytest.raises(RuntimeError, match=r"cannot run here"):
        _call_one(kind, X, W, ONE, ONE)


def test_entry_refuses_outside_init():
    with pytest.raises(ValueError, match=r"pk.gemm_reduce_scatter: pk.init\(mesh\) has not"):
        gemm_rs._fp8_kernel(jnp.zeros((8, 32), E4M3), jnp.zeros((32, 16), E4M3), ONE, ONE, "tp")


# ---------------------------------------------------------------- the public ops in fp8


def _public_body(kind):
    fn = pk.gemm_reduce_scatter if kind == "rs" else pk.gemm_all_reduce

    def body(x, w, sx, sw):
        return fn(x, w, "tp", x_scale=_local(sx), w_scale=_local(sw))
    return body


@pytest.mark.parametrize("kind,p,blockwise", [("rs", 2, False), ("ar", 4, True), ("rs", 1, True)])
def test_public_op_is_the_model_without_kernels(kind, p, blockwise):
    """pk.gemm_reduce_scatter / gemm_all_reduce with fp8 operands on a CPU (the reference):
    exactly the model on exact inputs, P = 1, 2, 4, per tensor and blockwise."""
    rng = np.random.default_rng(50 + p)
    make = _block_inputs if blockwise else _exact_inputs
    xs, wts, sx, sw = make(rng, p, 8 * p, 256 if blockwise else 32, 24, E4M3, E5M2)
    mesh = cpu_mesh((p,), ("tp",))
    in_specs, out_spec = _specs(kind, "kn", blockwise)
    y = run(_public_body(kind), mesh, in_specs, out_spec, *_global(xs, wts, sx, sw, "kn"))
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, p)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float64), want.astype(np.float64))


@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("p,mode,targets", [
    (1, None, ["pk_matmul_fp8"]),
    (2, "fused", ["pk_{stem}"]),
    (2, "serial", ["pk_matmul_fp8", "pk_{collective}"]),
])
def test_public_op_routes_and_takes_the_references_gradient(monkeypatch, kind, p, mode,
                                                             targets):
    """With the kernels available (stand-ins: the fused kernel's math, the fp8 GEMM's
    reference, the collectives' jax.lax forms): P = 1 runs the fp8 GEMM alone ("local"), P = 2
    the fused kernel or the fp8 GEMM then the pk collective as forced; every route gives the
    model on exact inputs, and its gradients (x, w, both scales) are the reference's."""
    from pk_jax import cost_model

    calls = _stand_in(monkeypatch)
    monkeypatch.setattr(matmul, "_fp8_kernel", lambda x, w, a, b, out_dtype=None, **kw: (
        calls.append({"target": "pk_matmul_fp8"}) or matmul.fp8_reference(x, w, a, b,
                                                                           out_dtype)))
    rng = np.random.default_rng(7 + p)
    xs, wts, sx, sw = _exact_inputs(rng, p, 4 * p, 32, 16, E4M3, E4M3)
    mesh = cpu_mesh((p,), ("tp",))
    in_specs, out_spec = _specs(kind, "kn")
    args = _global(xs, wts, sx, sw, "kn")

    def grads(body):
        loss = lambda *a: jnp.sum(body(*a).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2, 3))

    with cost_model.override(mode=mode):
        y = run(_public_body(kind), mesh, in_specs, out_spec, *args)
        traced = [c["target"] for c in calls]
        ours = run(lambda *a: grads(_public_body(kind))(*a), mesh, in_specs, in_specs, *args)
    collective = "reduce_scatter" if kind == "rs" else "all_reduce"
    want_targets = [t.format(stem=OPS[kind].FP8_STEM, collective=collective) for t in targets]
    assert traced == want_targets, traced
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, p)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want.astype(np.float64))
    ref = run(lambda *a: grads(_ref_body(kind))(*a), mesh, in_specs, in_specs, *args)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("kind", OPS)
def test_public_op_scale_errors(kind):
    mesh = cpu_mesh((2,), ("tp",))
    pk.init(mesh)
    fn = pk.gemm_reduce_scatter if kind == "rs" else pk.gemm_all_reduce
    name = "gemm_reduce_scatter" if kind == "rs" else "gemm_all_reduce"

    def trace(x, w, **kw):
        f = jax.shard_map(lambda a, b: fn(a, b, "tp", **kw), mesh=mesh, in_specs=(P(), P()),
                          out_specs=P(), check_vma=False)
        return jax.eval_shape(f, x, w)

    xb = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16)
    wb = jax.ShapeDtypeStruct((32, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match=f"pk.{name}: x_scale and w_scale are for fp8"):
        trace(xb, wb, x_scale=ONE)
    with pytest.raises(TypeError, match=f"pk.{name}: x_scale must be float32.*got None"):
        trace(X, W, w_scale=ONE)
    with pytest.raises(TypeError, match=f"pk.{name}: x and w must be fp8"):
        trace(xb, W, x_scale=ONE, w_scale=ONE)


# ---------------------------------------------------------------- GPU (P = 1: direct mode)


def _gpu_call(kind, x, w, sx, sw, w_layout="kn"):
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    blockwise = jnp.ndim(sx) == 2
    in_specs, out_spec = _specs(kind, w_layout, blockwise)
    if not blockwise:
        sx, sw = jnp.reshape(sx, (1,)), jnp.reshape(sw, (1,))
    return run(_per_rank(OPS[kind]._fp8_kernel, w_layout), mesh, in_specs, out_spec,
               x, w, sx, sw, init=False)


GPU_SHAPES = [(128, 128, 128), (300, 272, 200), (1000, 1024, 1032), (2048, 2048, 4096),
              (1, 16, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape,formats", list(itertools.product(
    OPS, GPU_SHAPES, ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2), (E5M2, E5M2)))))
def test_gpu_p1_exact_on_integers_twice(kind, shape, formats):
    m, k, n = shape
    rng = np.random.default_rng(m + k + n)
    xs, wts, sx, sw = _exact_inputs(rng, 1, m, min(k, 128), n, *formats)
    want = _model(xs, wts, sx, sw, kind == "ar")[0].astype(np.float64)
    for w_layout in ("kn", "nk"):
        for _ in range(2):  # the second call finds the first one's epoch
            poison((m, n), jnp.bfloat16)
            y = _gpu_call(kind, *_global(xs, wts, sx, sw, w_layout), w_layout)
            np.testing.assert_array_equal(np.asarray(y, np.float64), want)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape", list(itertools.product(OPS, GPU_SHAPES[:4])))
def test_gpu_p1_random_within_bound(kind, shape):
    """Normal values, quantized per tensor: within 2^-6 of the largest |y| of the model (a
    bf16 ulp is at most 2^-7 of the value, so this allows the fp32 accumulation's small
    difference from float64 to move a rounding by one ulp; a wrong scale is far outside)."""
    m, k, n = shape
    rng = np.random.default_rng(k)
    xq, sx = pk.fp8.quantize(jnp.asarray(rng.standard_normal((m, k)), jnp.float32), role="x")
    wq, sw = pk.fp8.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), role="w")
    want = _model([np.asarray(xq)], [np.asarray(wq).T], [sx], [sw], kind == "ar")[0]
    want = want.astype(np.float64)
    poison((m, n), jnp.bfloat16)
    y = np.asarray(_gpu_call(kind, xq, wq, sx, sw), np.float64)
    bound = 2.0 ** -6 * np.max(np.abs(want))
    assert np.max(np.abs(y - want)) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("kind,shape,formats", list(itertools.product(
    OPS, [(128, 272, 128), (300, 400, 200), (1000, 1040, 1032)], ((E4M3, E4M3), (E5M2, E4M3)))))
def test_gpu_p1_blockwise_exact_twice(kind, shape, formats):
    """Blockwise scales over several k-blocks (the last partial) and w blocks: exact
    (_block_inputs), with w as [K, N] and as [N, K], twice on poisoned outputs."""
    m, k, n = shape
    rng = np.random.default_rng(m + k)
    xs, wts, sx, sw = _block_inputs(rng, 1, m, k, n, *formats)
    want = _model(xs, wts, sx, sw, kind == "ar")[0].astype(np.float64)
    for w_layout in ("kn", "nk"):
        for _ in range(2):
            poison((m, n), jnp.bfloat16)
            y = _gpu_call(kind, *_global(xs, wts, sx, sw, w_layout), w_layout)
            np.testing.assert_array_equal(np.asarray(y, np.float64), want)


def _placed(mesh, specs, args) -> list:
    """The global arrays on `mesh` as the shard_map's in_specs lay them out."""
    from jax.sharding import NamedSharding

    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", OPS)
@pytest.mark.parametrize("blockwise", [False, True], ids=["tensor", "block"])
def test_gpu_public_op_at_p1_runs_the_fp8_gemm(kind, blockwise):
    """pk.gemm_reduce_scatter / gemm_all_reduce with fp8 operands over a 1-device axis, as a
    user calls them: the jitted program calls pk_matmul_fp8 and no fused kernel or collective,
    and the result is the model's exactly on exact inputs, twice on poisoned outputs."""
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    rng = np.random.default_rng(31 + blockwise)
    make = _block_inputs if blockwise else _exact_inputs
    xs, wts, sx, sw = make(rng, 1, 300, 400 if blockwise else 128, 200, E4M3, E5M2)
    in_specs, out_spec = _specs(kind, "kn", blockwise)
    args = _placed(mesh, in_specs, _global(xs, wts, sx, sw, "kn"))
    body = jax.jit(jax.shard_map(_public_body(kind), mesh=mesh, in_specs=in_specs,
                                 out_specs=out_spec, check_vma=False))
    lowered = body.lower(*args).as_text()
    assert lowered.count("custom_call @pk_matmul_fp8") == 1
    assert "@pk_gemm" not in lowered and "@pk_reduce_scatter" not in lowered
    assert "@pk_all_reduce" not in lowered
    want = _rows(_model(xs, wts, sx, sw, kind == "ar"), kind, 1).astype(np.float64)
    for _ in range(2):
        poison((300, 200), jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(body(*args), np.float64), want)


# ---------------------------------------------------------------- all_gather_gemm's fp8 form
# pk.all_gather_gemm with fp8 operands: "local" (P = 1: the fp8 GEMM), "serial" (the pk
# all_gather of the fp8 rows and of their scales, then the fp8 GEMM) or "fused"
# (pk_ag_gemm_fp8, cuda/kernels/ag_gemm_fp8.cuh), as the cost model or an override picks.


def _ag_model(xs, wts, sx, sw) -> list[np.ndarray]:
    """Rank r's result: every rank's rows dequantized with its own scales, gathered, times
    rank r's dequantized w, float64, rounded to bf16 once."""
    x_full = np.concatenate([_dequantized(x, wts[0], a, sw[0])[0] for x, a in zip(xs, sx)])
    return [(x_full @ _dequantized(xs[0], wt, sx[0], b)[1].T).astype(np.float32)
            .astype(ml_dtypes.bfloat16) for wt, b in zip(wts, sw)]


def _ag_global(xs, wts, sx, sw):
    """x [M, K] by rows, w [K, P N] by columns, scales [P] or x's [M, KB] / w's [KB, P NB]."""
    x, w = np.concatenate(xs), np.concatenate([wt.T for wt in wts], axis=1)
    sx = np.concatenate(sx) if np.ndim(sx[0]) == 2 else np.asarray(sx)
    sw = np.concatenate(sw, axis=1) if np.ndim(sw[0]) == 2 else np.asarray(sw)
    return tuple(jnp.asarray(a) for a in (x, w, sx, sw))


def _ag_specs(blockwise):
    scales = (P("tp", None), P(None, "tp")) if blockwise else (P("tp"), P("tp"))
    return (P("tp", None), P(None, "tp"), *scales), P(None, "tp")


def _ag_body(fn):
    return lambda x, w, sx, sw: fn(x, w, "tp", x_scale=_local(sx), w_scale=_local(sw))


def _ag_inputs(blockwise, rng, p, m, k, n, fx, fw):
    """_block_inputs, or values in {-1, 0, 1} with x scales in {1/2, 1, 2} and w scales in
    {1, 2} per rank (a row of rank p meets rank r's w: any pair of scales; sums of K <= 128
    terms stay exact in bf16)."""
    if blockwise:
        return _block_inputs(rng, p, m, k, n, fx, fw)
    xs, wts, _, _ = _exact_inputs(rng, p, m, k, n, fx, fw)
    sx = (2.0 ** rng.integers(-1, 2, p)).astype(np.float32)
    sw = (2.0 ** rng.integers(0, 2, p)).astype(np.float32)
    return xs, wts, sx, sw


def _ag_stand_ins(monkeypatch, seen: list | None = None) -> list[dict]:
    """stand_in_kernels, with the fp8 GEMM's reference standing in for pk_matmul_fp8 (its calls
    recorded among the others; `seen` receives (x's dtype, x_scale's shape, out_dtype) of
    each)."""
    calls = stand_in_kernels(monkeypatch)

    def fp8_gemm(x, w, a, b, out_dtype=None, **kw):
        calls.append({"target": "pk_matmul_fp8"})
        if seen is not None:
            seen.append((x.dtype, a.shape, out_dtype))
        return matmul.fp8_reference(x, w, a, b, out_dtype)

    monkeypatch.setattr(matmul, "_fp8_kernel", fp8_gemm)
    return calls


def _ag_problem(rng, p, m, scaling, fw):
    """One all_gather_gemm fp8 problem on a CPU mesh of p: (xs, wts, sx, sw), mesh, in_specs,
    out_spec, the global arguments. scaling "tensor", "block" or "mixed" (x per tensor beside
    blockwise w: x's scalar broadcast to its blocks); m rows per device, e4m3 x, w in fw."""
    blockwise = scaling != "tensor"
    xs, wts, sx, sw = _ag_inputs(blockwise, rng, p, m, 272 if blockwise else 32, 24, E4M3, fw)
    in_specs, out_spec = _ag_specs(blockwise)
    if scaling == "mixed":
        sx = np.array([s[0, 0] for s in sx], np.float32)
        in_specs = (in_specs[0], in_specs[1], P("tp"), in_specs[3])
    return ((xs, wts, sx, sw), cpu_mesh((p,), ("tp",)), in_specs, out_spec,
            _ag_global(xs, wts, sx, sw))


def _ag_grads(body, mesh, in_specs, args):
    """The gradients of sum(body(x, w, sx, sw)^2) in float32 with respect to all four."""
    loss = lambda *a: jnp.sum(body(*a).astype(jnp.float32) ** 2)
    return run(jax.grad(loss, argnums=(0, 1, 2, 3)), mesh, in_specs, in_specs, *args)


def _assert_reference_grads(ours, mesh, in_specs, args) -> None:
    """`ours` (_ag_grads of the public op) equal the fp8 reference's, dtype, shape and value."""
    from pk_jax.ops import ag_gemm

    ref = _ag_grads(lambda x, w, c, d: ag_gemm.fp8_reference(x, w, _local(c), _local(d), "tp"),
                    mesh, in_specs, args)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("p,blockwise", [(1, False), (2, False), (4, True), (2, True)])
def test_ag_public_op_is_the_model_without_kernels(p, blockwise):
    """On a CPU (the reference): exactly the model on exact inputs."""
    rng = np.random.default_rng(80 + p)
    xs, wts, sx, sw = _ag_inputs(blockwise, rng, p, 6, 272 if blockwise else 48, 20, E5M2,
                                 E4M3)
    in_specs, out_spec = _ag_specs(blockwise)
    y = run(_ag_body(pk.all_gather_gemm), cpu_mesh((p,), ("tp",)), in_specs, out_spec,
            *_ag_global(xs, wts, sx, sw))
    assert y.dtype == jnp.bfloat16 and y.shape == (6 * p, 20 * p)
    want = np.concatenate(_ag_model(xs, wts, sx, sw), axis=1).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want)


@pytest.mark.parametrize("p,scaling,targets", [
    (1, "tensor", ["pk_matmul_fp8"]),
    (2, "tensor", ["pk_all_gather", "pk_all_gather", "pk_matmul_fp8"]),
    (4, "block", ["pk_all_gather", "pk_all_gather", "pk_matmul_fp8"]),
    (2, "mixed", ["pk_all_gather", "pk_all_gather", "pk_matmul_fp8"]),
])
def test_ag_public_op_routes_and_takes_the_references_gradient(monkeypatch, p, scaling,
                                                               targets):
    """With the kernels available (stand-ins: the collectives' jax.lax forms, the fp8 GEMM's
    reference) and serial forced (at these sizes the model prefers the fused kernel, whose route
    test_ag_public_op_fused_route checks): P = 1 runs the fp8 GEMM alone, P > 1 gathers x's fp8
    rows (as bf16 pairs) and its scales, then the fp8 GEMM (per tensor: x's scale 1 into
    float32, each rank's rows then scaled). Every route gives the model on exact inputs, and
    its gradients (x, w, both scales) are the reference's."""
    from pk_jax import cost_model

    seen = []
    calls = _ag_stand_ins(monkeypatch, seen)
    (xs, wts, sx, sw), mesh, in_specs, out_spec, args = _ag_problem(
        np.random.default_rng(90 + p), p, 5, scaling, E4M3)
    with cost_model.override(mode="serial"):
        y = run(_ag_body(pk.all_gather_gemm), mesh, in_specs, out_spec, *args)
        ours = _ag_grads(_ag_body(pk.all_gather_gemm), mesh, in_specs, args)
    assert [c["target"] for c in calls][:len(targets)] == targets
    assert seen[0][0] == E4M3  # the gathered rows stay fp8
    if p > 1:
        assert seen[0][1] == (() if scaling == "tensor" else (5 * p, 3))
        assert seen[0][2] == (jnp.float32 if scaling == "tensor" else jnp.bfloat16)
    want = np.concatenate(_ag_model(xs, wts, sx, sw), axis=1).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want)
    _assert_reference_grads(ours, mesh, in_specs, args)


@pytest.mark.parametrize("p,scaling,m", [(2, "tensor", 5), (4, "block", 8), (2, "mixed", 4),
                                         (2, "block", 6)])
def test_ag_public_op_fused_route(monkeypatch, p, scaling, m):
    """Forced fused (stand-ins as above; pk_ag_gemm_fp8's: tests/util.py): one call of the fused
    fp8 kernel with the override's num_comm_sms, the model's result on exact inputs, the
    reference's gradients. Blockwise with M/P not a multiple of 4 (6), which the kernel does
    not take, runs the serial form instead."""
    from pk_jax import cost_model

    calls = _ag_stand_ins(monkeypatch)
    (xs, wts, sx, sw), mesh, in_specs, out_spec, args = _ag_problem(
        np.random.default_rng(70 + p + m), p, m, scaling, E5M2)
    with cost_model.override(mode="fused", num_comm_sms=3):
        y = run(_ag_body(pk.all_gather_gemm), mesh, in_specs, out_spec, *args)
        ours = _ag_grads(_ag_body(pk.all_gather_gemm), mesh, in_specs, args)
    targets = [c["target"] for c in calls]
    if scaling == "tensor" or m % 4 == 0:
        assert targets[0] == "pk_ag_gemm_fp8" and calls[0]["num_comm_sms"] == 3
        assert set(targets) == {"pk_ag_gemm_fp8"}
    else:
        assert targets[:3] == ["pk_all_gather", "pk_all_gather", "pk_matmul_fp8"]
        assert "pk_ag_gemm_fp8" not in targets
    want = np.concatenate(_ag_model(xs, wts, sx, sw), axis=1).astype(np.float64)
    np.testing.assert_array_equal(np.asarray(y, np.float64), want)
    _assert_reference_grads(ours, mesh, in_specs, args)


def test_ag_auto_route_runs_the_fused_fp8_kernel(monkeypatch):
    """"auto" at P > 1 runs the fused fp8 kernel (cost_model.FP8_GATHER_FUSED), and the serial
    form where the kernel does not take the operands (blockwise M/P not a multiple of 4)."""
    for scaling, m, first in (("tensor", 5, "pk_ag_gemm_fp8"), ("block", 8, "pk_ag_gemm_fp8"),
                              ("block", 6, "pk_all_gather")):
        calls = _ag_stand_ins(monkeypatch)
        (xs, wts, sx, sw), mesh, in_specs, out_spec, args = _ag_problem(
            np.random.default_rng(5 + m), 2, m, scaling, E4M3)
        y = run(_ag_body(pk.all_gather_gemm), mesh, in_specs, out_spec, *args)
        assert calls[0]["target"] == first
        want = np.concatenate(_ag_model(xs, wts, sx, sw), axis=1).astype(np.float64)
        np.testing.assert_array_equal(np.asarray(y, np.float64), want)


def test_ag_public_op_errors():
    mesh = cpu_mesh((2,), ("tp",))
    pk.init(mesh)

    def trace(x, w, **kw):
        f = jax.shard_map(lambda a, b: pk.all_gather_gemm(a, b, "tp", **kw), mesh=mesh,
                          in_specs=(P(), P()), out_specs=P(), check_vma=False)
        return jax.eval_shape(f, x, w)

    xb = jax.ShapeDtypeStruct((8, 32), jnp.bfloat16)
    wb = jax.ShapeDtypeStruct((32, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match="pk.all_gather_gemm: x_scale and w_scale are for fp8"):
        trace(xb, wb, x_scale=ONE)
    with pytest.raises(TypeError, match="pk.all_gather_gemm: x_scale must be float32.*got None"):
        trace(X, W, w_scale=ONE)
    with pytest.raises(ValueError, match=r"w must be \[K, N\] for x \[M/P, K\]"):
        trace(X, jax.ShapeDtypeStruct((48, 16), E4M3), x_scale=ONE, w_scale=ONE)
    with pytest.raises(ValueError, match=r"K \(x.shape\[1\]\) = 24 is not divisible by 16"):
        trace(jax.ShapeDtypeStruct((8, 24), E4M3), jax.ShapeDtypeStruct((24, 16), E4M3),
              x_scale=ONE, w_scale=ONE)
    with pytest.raises(ValueError, match=r"x_scale must be a scalar or \[8, 1\]"):
        trace(X, W, x_scale=jnp.ones((16, 1), jnp.float32), w_scale=ONE)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["local", "fused"])
@pytest.mark.parametrize("blockwise", [False, True], ids=["tensor", "block"])
def test_gpu_ag_public_op_at_p1(blockwise, route):
    """pk.all_gather_gemm with fp8 operands over a 1-device axis: by default the program calls
    pk_matmul_fp8 alone; forced fused, pk_ag_gemm_fp8 once (the gather's comm blocks copy every
    row: all are this device's). Either way the result is the model's exactly, twice on
    poisoned outputs, at 300 rows (three row blocks, the last partial) and N past one
    256-column tile."""
    from pk_jax import cost_model

    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    rng = np.random.default_rng(41 + blockwise)
    xs, wts, sx, sw = _ag_inputs(blockwise, rng, 1, 300, 400 if blockwise else 128, 264, E4M3,
                                 E5M2)
    in_specs, out_spec = _ag_specs(blockwise)
    args = _placed(mesh, in_specs, _ag_global(xs, wts, sx, sw))
    forced = {"mode": "fused", "num_comm_sms": 2} if route == "fused" else {}
    with cost_model.override(**forced):
        body = jax.jit(jax.shard_map(_ag_body(pk.all_gather_gemm), mesh=mesh,
                                     in_specs=in_specs, out_specs=out_spec, check_vma=False))
        lowered = body.lower(*args).as_text()
        target = "pk_ag_gemm_fp8" if route == "fused" else "pk_matmul_fp8"
        assert lowered.count(f"custom_call @{target}") == 1 and "@pk_all_gather" not in lowered
        want = _ag_model(xs, wts, sx, sw)[0].astype(np.float64)
        for _ in range(2):
            poison((300, 264), jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(body(*args), np.float64), want)


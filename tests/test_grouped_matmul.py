"""grouped_matmul against its reference `jax.lax.ragged_dot`: exact on integer inputs, empty
groups, rows past sum(group_sizes), group sizes as traced values (no recompile), inside
shard_map, the VJP against ragged_dot's, sizes outside the contract (negative, summing past M)
against a numpy model of the kernel's rule, the error messages; on the GPU the kernel (forward
by both schedules, dx and dw modes) with boundaries anywhere, poisoned outputs, two calls in a
row, under jit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from util import (
    MATMUL_DTYPES,
    P,
    assert_error_within_xla,
    assert_same,
    cpu_mesh,
    poison,
    product,
    rand,
    run,
    small_ints,
)

import pk_jax as pk
from pk_jax.ops import grouped_matmul as gm

KEYS = jax.random.split(jax.random.key(12), 4)


def _ranges(gs, m):
    """Each group's rows [lo, hi): sizes clamped to >= 0, their cumulative sums cut at M (the
    kernel's rule for sizes outside the contract, grouped_matmul.cuh's scan_groups)."""
    off, out = 0, []
    for size in np.asarray(gs, np.int64):
        end = off + max(int(size), 0)
        out.append((min(off, m), min(end, m)))
        off = end
    return out


def _exact(x, w, gs):
    """float64 ragged product on the host; rows in no group zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros((x.shape[0], w.shape[2]))
    for e, (lo, hi) in enumerate(_ranges(gs, x.shape[0])):
        y[lo:hi] = x[lo:hi] @ w[e]
    return y


def _exact_grads(x, w, gs, dy):
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for e, (lo, hi) in enumerate(_ranges(gs, x.shape[0])):
        dx[lo:hi] = dy[lo:hi] @ w[e].T
        dw[e] = x[lo:hi].T @ dy[lo:hi]
    return dx, dw


# Sizes outside the contract (M = 40, E = 4): negative sizes, a sum past M, both.
INVALID_SIZES = ([10, -5, 20, 7], [-3, 15, -1, 10], [30, 25, 5, 5], [-40, 50, -1, 3],
                 [0, -2**31, 2**31 - 1, 4], [41, 0, 0, 0])


def _ragged_dot(x, w, gs):
    """XLA's own ragged product (no pk code), for valid sizes."""
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(x.dtype)


def _sizes(kind, m, e, seed=0):
    """Group sizes summing to m (or less for 'short'), with odd boundaries."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        s = np.full(e, m // e)
        s[: m - s.sum()] += 1
    elif kind == "random":
        cuts = np.sort(rng.integers(0, m + 1, e - 1))
        s = np.diff(np.concatenate([[0], cuts, [m]]))
    elif kind == "empty":  # every other group empty
        s = np.zeros(e, np.int64)
        live = np.arange(0, e, 2)
        s[live] = m // len(live)
        s[live[0]] += m - s.sum()
    elif kind == "one":  # everything in the last group
        s = np.zeros(e, np.int64)
        s[-1] = m
    elif kind == "short":  # rows past the sum stay zero
        s = np.full(e, (m * 2 // 3) // e)
        s[0] += 3
    elif kind == "zipf":
        p = 1.0 / np.arange(1, e + 1) ** 1.2
        s = np.floor(p / p.sum() * m).astype(np.int64)
        s[0] += m - s.sum()
    else:
        raise ValueError(kind)
    return jnp.asarray(s, jnp.int32)


# ---------------------------------------------------------------- CPU: the reference path

CPU_CASES = ((40, 16, 24, 3), (33, 8, 5, 4), (64, 24, 17, 1))  # (M, K, N, E)


@pytest.mark.parametrize("case,kind,dtype", product(CPU_CASES, ("random", "empty", "short"),
                                                    MATMUL_DTYPES))
def test_exact_on_integers(case, kind, dtype):
    m, k, n, e = case
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    gs = _sizes(kind, m, e)
    y = jax.jit(pk.grouped_matmul)(x, w, gs)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_same(y, _exact(x, w, gs))
    assert_same(pk.grouped_matmul(x, w, gs), y)  # eagerly too
    assert_same(y, _ragged_dot(x, w, gs))


def test_group_sizes_are_traced_no_recompile():
    traces = []

    @jax.jit
    def f(x, w, gs):
        traces.append(1)
        return pk.grouped_matmul(x, w, gs)

    x, w = small_ints(KEYS[0], (48, 8), jnp.bfloat16), small_ints(KEYS[1], (4, 8, 16),
                                                                 jnp.bfloat16)
    for kind in ("uniform", "random", "empty", "one", "short"):
        gs = _sizes(kind, 48, 4, seed=3)
        assert_same(f(x, w, gs), _exact(x, w, gs))
    assert len(traces) == 1


@pytest.mark.parametrize("check_vma", (True, False))
def test_inside_shard_map(check_vma):
    mesh = cpu_mesh((2,), ("x",))
    x, w = small_ints(KEYS[0], (2 * 40, 16), jnp.bfloat16), small_ints(KEYS[1], (3, 16, 8),
                                                                         jnp.bfloat16)
    gs = jnp.concatenate([_sizes("random", 40, 3), _sizes("short", 40, 3)])
    y = run(pk.grouped_matmul, mesh, (P("x"), P(), P("x")), P("x"), x, w, gs,
            check_vma=check_vma)
    y = np.asarray(y, np.float32)
    assert_same(y[:40], _exact(x[:40], w, gs[:3]))
    assert_same(y[40:], _exact(x[40:], w, gs[3:]))


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_vjp_matches_ragged_dot(dtype):
    m, k, n, e = 50, 16, 24, 4
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    dy = small_ints(KEYS[2], (m, n), dtype)
    gs = _sizes("short", m, e)
    _, pull = jax.vjp(lambda a, b: pk.grouped_matmul(a, b, gs), x, w)
    _, pullr = jax.vjp(lambda a, b: _ragged_dot(a, b, gs), x, w)
    (dx, dw), (rx, rw) = jax.jit(pull)(dy), pullr(dy)
    ex, ew = _exact_grads(x, w, gs, dy)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_same(dx, rx)
    assert_same(dw, rw)
    assert_same(dx, ex)
    assert_same(dw, ew)


@pytest.mark.parametrize("gs,dtype", product(INVALID_SIZES, MATMUL_DTYPES), ids=str)
def test_sizes_outside_the_contract_follow_the_kernel(gs, dtype):
    """Negative sizes count as 0 and ranges are cut at M, forward and VJP (the numpy model of
    the kernel's rule); ragged_dot alone puts rows in two groups for a negative size."""
    m, k, n, e = 40, 16, 12, 4
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    dy = small_ints(KEYS[2], (m, n), dtype)
    gs = jnp.asarray(gs, jnp.int32)
    y, pull = jax.vjp(lambda a, b: pk.grouped_matmul(a, b, gs), x, w)
    dx, dw = jax.jit(pull)(dy)
    assert_same(y, _exact(x, w, gs))
    assert_same(jax.jit(pk.grouped_matmul)(x, w, gs), _exact(x, w, gs))
    ex, ew = _exact_grads(x, w, gs, dy)
    assert_same(dx, ex)
    assert_same(dw, ew)


def test_errors_name_the_fix():
    x, w = jnp.zeros((16, 8), jnp.bfloat16), jnp.zeros((2, 8, 8), jnp.bfloat16)
    gs = jnp.array([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        pk.grouped_matmul(x[None], w, gs)
    with pytest.raises(ValueError, match=r"w must be \[E, K, N\]"):
        pk.grouped_matmul(x, w[0], gs)
    with pytest.raises(TypeError, match="same dtype"):
        pk.grouped_matmul(x, w.astype(jnp.float16), gs)
    with pytest.raises(TypeError, match="supported"):
        pk.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    with pytest.raises(ValueError, match="contraction dimensions differ"):
        pk.grouped_matmul(x, jnp.zeros((2, 16, 8), jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="Pad K to a multiple of 8"):
        pk.grouped_matmul(jnp.zeros((16, 12), jnp.bfloat16), jnp.zeros((2, 12, 8), jnp.bfloat16),
                          gs)
    with pytest.raises(TypeError, match="astype\\(jnp.int32\\)"):
        pk.grouped_matmul(x, w, gs.astype(jnp.int64) if jax.config.x64_enabled
                          else gs.astype(jnp.uint32))
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[E\]"):
        pk.grouped_matmul(x, w, jnp.array([8, 4, 4], jnp.int32))


# ---------------------------------------------------------------- GPU: the kernel

# (M, K, N, E): edges inside a tile in every dimension (K not a multiple of 64, N not of 256),
# many groups smaller than a tile, more tiles than SMs, N not a multiple of 8 (padded).
GPU_CASES = ((1000, 256, 384, 5), (777, 136, 200, 7), (4096, 512, 1024, 16),
             (300, 64, 72, 64), (2100, 1000, 2600, 3), (513, 128, 61, 2))
GPU_KINDS = ("uniform", "random", "empty", "one", "short", "zipf")


def _max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _operands(m, k, n, e, dtype, seed):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    return rand(kx, (m, k), dtype), rand(kw, (e, k, n), dtype) * 0.25, rand(kd, (m, n), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", product(GPU_CASES, MATMUL_DTYPES), ids=str)
def test_gpu_forward(case, dtype):
    m, k, n, e = case
    assert pk.backend_name(gm.STEM) == "cuda"
    traces = []

    @jax.jit
    def f(x, w, gs):
        traces.append(1)
        return pk.grouped_matmul(x, w, gs)

    xla = jax.jit(_ragged_dot)
    for i, kind in enumerate(GPU_KINDS):  # new sizes every call: same executable
        x, w, _ = _operands(m, k, n, e, dtype, seed=i)
        gs = _sizes(kind, m, e, seed=i)
        poison((m, n), dtype)
        y = f(x, w, gs)
        exact = _exact(x, w, gs)
        assert not bool(jnp.any(jnp.isnan(y))), f"{kind}: output not fully written"
        total = int(gs.sum())
        assert not bool(jnp.any(y[total:] != 0)), f"{kind}: rows past sum(group_sizes) not zero"
        assert_error_within_xla(y, xla(x, w, gs), exact, atol=1e-3 * np.sqrt(k))
        assert_same(f(x, w, gs), y)  # a second call on the same inputs
    assert len(traces) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_gpu_exact_on_integers(dtype):
    m, k, n, e = 1500, 192, 320, 9
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    for kind in ("random", "empty", "short"):
        gs = _sizes(kind, m, e, seed=5)
        assert_same(jax.jit(pk.grouped_matmul)(x, w, gs), _exact(x, w, gs))


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", product(GPU_CASES[:4] + GPU_CASES[5:], MATMUL_DTYPES),
                         ids=str)
def test_gpu_vjp(case, dtype):
    """dx and dw of the kernel against ragged_dot's grads, against a float64 reference."""
    m, k, n, e = case
    for i, kind in enumerate(("random", "empty", "short", "zipf")):
        x, w, dy = _operands(m, k, n, e, dtype, seed=10 + i)
        gs = _sizes(kind, m, e, seed=i)
        poison((m, k), dtype)
        poison((e, k, n), dtype)
        _, pull = jax.vjp(lambda a, b, gs=gs: pk.grouped_matmul(a, b, gs), x, w)
        _, pullr = jax.vjp(lambda a, b, gs=gs: _ragged_dot(a, b, gs), x, w)
        dx, dw = jax.jit(pull)(dy)
        rx, rw = jax.jit(pullr)(dy)
        ex, ew = _exact_grads(x, w, gs, dy)
        for got, xla, exact, name in ((dx, rx, ex, "dx"), (dw, rw, ew, "dw")):
            assert got.dtype == dtype and got.shape == exact.shape, name
            assert not bool(jnp.any(jnp.isnan(got))), f"{kind}: {name} not fully written"
            assert_error_within_xla(got, xla, exact, atol=1e-3 * np.sqrt(max(m, n)))
        assert not bool(jnp.any(dx[int(gs.sum()):] != 0)), kind
        for g in np.nonzero(np.asarray(gs) == 0)[0]:
            assert not bool(jnp.any(dw[g] != 0)), f"{kind}: dw of empty group {g}"


@pytest.mark.gpu
def test_gpu_in_shard_map_and_grad():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    m, k, n, e = 640, 128, 256, 4
    x, w, _ = _operands(m, k, n, e, jnp.bfloat16, seed=3)
    gs = _sizes("random", m, e, seed=3)
    f = jax.jit(jax.shard_map(pk.grouped_matmul, mesh=mesh, in_specs=(P(), P(), P()),
                              out_specs=P()))
    assert_error_within_xla(f(x, w, gs), _ragged_dot(x, w, gs), _exact(x, w, gs),
                            atol=1e-3 * np.sqrt(k))

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, gs).astype(jnp.float32) ** 2)

    gx, gw = jax.jit(jax.grad(loss(pk.grouped_matmul), argnums=(0, 1)))(x, w)
    rx, rw = jax.jit(jax.grad(loss(_ragged_dot), argnums=(0, 1)))(x, w)
    for a, b in ((gx, rx), (gw, rw)):
        scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        assert _max_err(a, b) <= 2e-2 * scale


@pytest.mark.gpu
def test_gpu_small_all_modes():
    """One small case through the forward, dx and dw kernels (also the compute-sanitizer
    target): empty groups, rows past the sum, K not a multiple of 64, N padded to 8. Widths
    this narrow take the ping-pong forward and dx (pingpong_width)."""
    m, k, n = 300, 72, 61
    gs = jnp.array([0, 50, 0, 130, 7, 20], jnp.int32)  # sum 207 < 300
    x, w, dy = _operands(m, k, n, 6, jnp.bfloat16, seed=21)
    y, pull = jax.vjp(lambda a, b: pk.grouped_matmul(a, b, gs), x, w)
    dx, dw = jax.jit(pull)(dy)
    ex, ew = _exact_grads(x, w, gs, dy)
    yr, pullr = jax.vjp(lambda a, b: _ragged_dot(a, b, gs), x, w)
    rx, rw = pullr(dy)
    for got, xla, exact in ((y, yr, _exact(x, w, gs)), (dx, rx, ex), (dw, rw, ew)):
        assert_error_within_xla(got, xla, exact, atol=1e-3 * np.sqrt(m))
    assert not bool(jnp.any(y[207:] != 0)) and not bool(jnp.any(dx[207:] != 0))
    assert not bool(jnp.any(dw[0] != 0)) and not bool(jnp.any(dw[2] != 0))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_gpu_sizes_outside_the_contract_equal_the_model(dtype):
    """The kernel (forward, dx, dw) on negative sizes and sums past M equals the numpy model
    of its rule (_ranges), exactly on integers, on poisoned outputs; groups of odd sizes
    across tile edges (M = 300, K = 136, N = 72)."""
    assert pk.backend_name("grouped_matmul") == "cuda"
    m, k, n, e = 300, 136, 72, 6
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    dy = small_ints(KEYS[2], (m, n), dtype)
    for sizes in ([50, -7, 130, 0, -1, 20], [-300, 129, 1, 500, -2, 3], [200, 150, 1, 0, 0, 9],
                  [0, 0, 0, 0, 0, 301], [-1, -1, -1, -1, -1, -1]):
        gs = jnp.asarray(sizes, jnp.int32)
        poison((m, n), dtype)
        poison((m, k), dtype)
        poison((e, k, n), dtype)
        y, pull = jax.vjp(lambda a, b, gs=gs: pk.grouped_matmul(a, b, gs), x, w)
        dx, dw = jax.jit(pull)(dy)
        ex, ew = _exact_grads(x, w, gs, dy)
        for got, want in ((y, _exact(x, w, gs)), (dx, ex), (dw, ew)):
            assert_same(got, jnp.asarray(want, jnp.float32).astype(dtype))  # one rounding


@pytest.mark.parametrize("m,e,mode", [(8, 8, gm._FEW), (9, 8, gm._FWD), (1, 1, gm._FEW),
                                      (64, 256, gm._FEW), (65, 256, gm._FWD)])
def test_decode_sizes_take_the_few_rows_kernel(monkeypatch, m, e, mode):
    """With the kernels forced (the CPU has none): the forward runs the few-rows kernel where
    M <= E and M <= FEW_MAX_ROWS, else the tiled one; the VJP keeps the dx and dw kernels."""
    from test_ring_attn import ffi_calls

    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    # Widths of whole 256-column tiles (K, N = 256): the cooperative schedule where tiled.
    x, w = jnp.zeros((m, 256), jnp.bfloat16), jnp.zeros((e, 256, 256), jnp.bfloat16)
    gs = jnp.zeros((e,), jnp.int32)
    loss = lambda x, w: jnp.sum(pk.grouped_matmul(x, w, gs).astype(jnp.float32))
    calls = ffi_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert [e_.params["target_name"] for e_ in calls] == ["pk_grouped_matmul"] * 3
    assert [dict(e_.params["attributes"])["mode"] for e_ in calls] == [mode, gm._DX, gm._DW]


@pytest.mark.parametrize("m,k,n,modes", [(256, 64, 48, (gm._FWD_PP, gm._DX_PP)),
                                         (256, 2048, 1408, (gm._FWD_PP, gm._DX)),
                                         (256, 640, 2880, (gm._FWD, gm._DX_PP)),
                                         (256, 1024, 7168, (gm._FWD, gm._DX)),
                                         (8, 384, 1000, (gm._FEW, gm._DX_PP))])
def test_padded_widths_take_the_pingpong_schedule(monkeypatch, m, k, n, modes):
    """With the kernels forced (the CPU has none): the tiled forward and dx run their ping-pong
    schedule (128-wide tiles) where their output width (N, K) pads 256-wide tiles by more than
    PINGPONG_WASTE (48, 64, 384, 640, 1408), their cooperative one elsewhere (1024, 2048,
    2880: 4.4%, 7168); decode sizes keep the few-rows kernel, dw its own."""
    from test_ring_attn import ffi_calls

    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    x, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((8, k, n), jnp.bfloat16)
    gs = jnp.zeros((8,), jnp.int32)
    loss = lambda x, w: jnp.sum(pk.grouped_matmul(x, w, gs).astype(jnp.float32))
    calls = ffi_calls(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, w))
    assert [dict(e_.params["attributes"])["mode"] for e_ in calls] == [*modes, gm._DW]


def test_few_rows_entry_refuses_what_it_cannot_take():
    """The few-rows kernel's entry checks at trace time: more rows than it takes, and
    operands no kernel takes (fp32)."""
    m = gm.FEW_MAX_ROWS + 1
    x, w = jnp.zeros((m, 64), jnp.bfloat16), jnp.zeros((4, 64, 32), jnp.bfloat16)
    gs = jnp.array([m, 0, 0, 0], jnp.int32)
    with pytest.raises(ValueError, match=f"at most {gm.FEW_MAX_ROWS} rows"):
        jax.eval_shape(gm.few_rows_forward, x, w, gs)
    with pytest.raises(TypeError, match="x"):
        jax.eval_shape(gm.few_rows_forward, x[:8].astype(jnp.float32), w.astype(jnp.float32),
                       gs)


# The few-rows kernel (mode FEW, M <= FEW_MAX_ROWS): decode (a row per expert), a few rows per
# expert with passes of 1, 2, 3 and 4 rows and more than one pass, empty groups and rows past
# the sum, N not a multiple of its 128-column chunks (and not of 8: padded), K not of 64.
FEW_CASES = ((8, 4096, 4096, 8, [1] * 8), (64, 512, 1000, 8, [9, 0, 17, 1, 2, 3, 4, 20]),
             (5, 136, 72, 4, [0, 3, 0, 1]), (64, 2048, 384, 256, None),
             (1, 8, 8, 1, [1]), (33, 1024, 61, 3, [11, -2, 40]))


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", product(FEW_CASES, MATMUL_DTYPES), ids=str)
def test_gpu_few_rows(case, dtype):
    m, k, n, e, sizes = case
    if sizes is None:  # 256 experts, a row for each of 64 random ones
        sizes = np.zeros(e, np.int32)
        sizes[np.random.default_rng(4).choice(e, m, replace=False)] = 1
    gs = jnp.asarray(sizes, jnp.int32)
    f = jax.jit(gm.few_rows_forward)
    for seed in range(2):  # two calls in a row, on new inputs, into poisoned memory
        x, w, _ = _operands(m, k, n, e, dtype, seed=30 + seed)
        poison((m, n), dtype)
        y = f(x, w, gs)
        assert y.shape == (m, n) and y.dtype == dtype
        assert not bool(jnp.any(jnp.isnan(y))), "output not fully written"
        total = min(int(np.maximum(np.asarray(sizes), 0).sum()), m)
        assert not bool(jnp.any(y[total:] != 0)), "rows past sum(group_sizes) not zero"
        exact = _exact(x, w, gs)
        # ragged_dot has no meaning for a negative size: there the same-dtype reference is the exact
        # result rounded once to the output dtype, the least error any kernel can have.
        xla = (_ragged_dot(x, w, jnp.maximum(gs, 0)) if min(sizes) >= 0
               else np.asarray(exact, np.float32).astype(dtype))
        assert_error_within_xla(y, xla, exact, atol=1e-3 * np.sqrt(k))
        assert_same(f(x, w, gs), y)  # the same inputs again: the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_gpu_few_rows_exact_on_integers(dtype):
    """fp32 sums of small integers are exact, so the kernel must equal the float64 product
    after its one rounding to the dtype, at every row and column."""
    m, k, n, e = 40, 264, 200, 6
    x, w = small_ints(KEYS[0], (m, k), dtype), small_ints(KEYS[1], (e, k, n), dtype)
    for sizes in ([7, 0, 13, 1, 4, 15], [40, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 3]):
        gs = jnp.asarray(sizes, jnp.int32)
        want = jnp.asarray(_exact(x, w, gs), jnp.float32).astype(dtype)
        assert_same(jax.jit(gm.few_rows_forward)(x, w, gs), want)


# The tiled forward's ping-pong schedule (mode FWD_PP: 128 x 128 tiles, each consumer a whole
# tile, the two taking turns): GPU_CASES, K below one 64-wide k step, and many tiles per block
# (every block through several turns).
PINGPONG_CASES = GPU_CASES + ((1025, 24, 136, 4), (8192, 256, 2048, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", product(PINGPONG_CASES, MATMUL_DTYPES), ids=str)
def test_gpu_pingpong_forward(case, dtype):
    m, k, n, e = case
    f = jax.jit(functools.partial(gm.tiled_forward, pingpong=True))
    xla = jax.jit(_ragged_dot)
    for i, kind in enumerate(GPU_KINDS):  # new sizes every call, into poisoned memory
        x, w, _ = _operands(m, k, n, e, dtype, seed=40 + i)
        gs = _sizes(kind, m, e, seed=i)
        poison((m, n), dtype)
        y = f(x, w, gs)
        assert not bool(jnp.any(jnp.isnan(y))), f"{kind}: output not fully written"
        total = int(gs.sum())
        assert not bool(jnp.any(y[total:] != 0)), f"{kind}: rows past sum(group_sizes) not zero"
        exact = _exact(x, w, gs)
        assert_error_within_xla(y, xla(x, w, gs), exact, atol=1e-3 * np.sqrt(k))
        assert_same(f(x, w, gs), y)  # a second call on the same inputs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_gpu_pingpong_exact_on_integers(dtype):
    """fp32 sums of small integers are exact: both schedules equal the float64 product after
    one rounding, at every row and column, whatever the group boundaries."""
    m, k, n, e = 3000, 320, 392, 9
    x, w = small_ints(KEYS[2], (m, k), dtype), small_ints(KEYS[3], (e, k, n), dtype)
    for kind in ("random", "empty", "short", "one"):
        gs = _sizes(kind, m, e, seed=7)
        want = jnp.asarray(_exact(x, w, gs), jnp.float32).astype(dtype)
        for pingpong in (True, False):
            assert_same(jax.jit(functools.partial(gm.tiled_forward, pingpong=pingpong))(x, w, gs),
                        want)


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype", product(PINGPONG_CASES, MATMUL_DTYPES), ids=str)
def test_gpu_pingpong_dx(case, dtype):
    """dx by the ping-pong schedule (mode DX_PP, contraction N) against ragged_dot's dx and the
    float64 one, into poisoned memory, twice."""
    m, k, n, e = case
    f = jax.jit(functools.partial(gm._dx, pingpong=True))
    for i, kind in enumerate(("random", "empty", "short", "zipf")):
        x, w, dy = _operands(m, k, n, e, dtype, seed=50 + i)
        gs = _sizes(kind, m, e, seed=i)
        poison((m, k), dtype)
        dx = f(dy, w, gs)
        _, pullr = jax.vjp(lambda a, b, gs=gs: _ragged_dot(a, b, gs), x, w)
        rx, _ = jax.jit(pullr)(dy)
        ex, _ = _exact_grads(x, w, gs, dy)
        assert dx.dtype == dtype and dx.shape == (m, k)
        assert not bool(jnp.any(jnp.isnan(dx))), f"{kind}: dx not fully written"
        assert not bool(jnp.any(dx[int(gs.sum()):] != 0)), kind
        assert_error_within_xla(dx, rx, ex, atol=1e-3 * np.sqrt(max(m, n)))
        assert_same(f(dy, w, gs), dx)

"""pk.moe_dispatch / pk.moe_combine (jax.lax references) against an independent NumPy model,
on 1, 2, 4 and 8 CPU host devices: skewed and empty experts, capacity overflow (dropped and
counted), the combine of the dispatch, and gradients through both."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.ops.moe import MoeHandle


def _mesh(p: int):
    mesh = jax.make_mesh((p,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:p])
    pk.init(mesh)
    return mesh


def model(xs, ids, num_experts, capacity):
    """Loops over (dest rank, local expert, source rank, token, slot), as the API promises: an
    id outside [0, E) matches no expert, so it is placed nowhere (position -1, dest -1).

    Returns (bufs [P, C, H], sizes [P, E/P], pos [P, T, k], dest [P, T, k], received dropped
    [P])."""
    p, t, k = ids.shape
    el = num_experts // p
    bufs = np.zeros((p, capacity, xs.shape[-1]), np.float64)
    sizes = np.zeros((p, el), np.int64)
    pos = -np.ones((p, t, k), np.int64)
    dest = -np.ones((p, t, k), np.int64)
    received_dropped = np.zeros(p, np.int64)
    for d in range(p):
        row = 0
        for le in range(el):
            for s, tt, j in itertools.product(range(p), range(t), range(k)):
                if ids[s, tt, j] == d * el + le:
                    dest[s, tt, j] = d
                    if row < capacity:
                        bufs[d, row] = xs[s, tt]
                        pos[s, tt, j] = row
                        sizes[d, le] += 1
                    else:
                        received_dropped[d] += 1
                    row += 1
    return bufs, sizes, pos, dest, received_dropped


# Expert ids outside [0, E) that a router bug could produce (E is added to the "past" ones).
BAD_IDS = (-1, -7, -2**31)
BAD_IDS_PAST = (0, 5, 2**31 - 1)


def with_invalid_ids(ids, num_experts, rng, fraction=0.25):
    """ids with about `fraction` of the slots replaced by ids outside [0, num_experts)."""
    bad = np.array([b for b in BAD_IDS] + [min(num_experts + b, 2**31 - 1)
                                           for b in BAD_IDS_PAST], np.int64)
    hit = rng.random(ids.shape) < fraction
    return np.where(hit, rng.choice(bad, ids.shape), ids).astype(np.int32)


def run(p, t, k, h, num_experts, capacity, seed, *, skew=False, invalid=False):
    rng = np.random.default_rng(seed)
    xs = rng.integers(-4, 5, (p, t, h)).astype(np.float32)
    if skew:  # Zipf-like: most slots on a few experts, many experts empty
        ids = np.minimum(rng.zipf(1.5, (p, t, k)) - 1, num_experts - 1).astype(np.int32)
    else:
        ids = rng.integers(0, num_experts, (p, t, k)).astype(np.int32)
    if invalid:
        ids = with_invalid_ids(ids, num_experts, rng)
    weights = rng.integers(0, 4, (p, t, k)).astype(np.float32) / 4
    mesh = _mesh(p)

    def body(x, e, w):
        tokens, sizes, handle = pk.moe_dispatch(x[0], e[0], "ep", num_experts=num_experts,
                                                capacity=capacity)
        out = pk.moe_combine(tokens * 2, w[0], handle, "ep")
        return (out[None], tokens[None], sizes[None], handle.position[None], handle.dropped,
                handle.dest_rank[None], handle.received_dropped, handle.group_sizes[None])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 8))
    out, tokens, sizes, pos, dropped, dest, received, handle_sizes = (
        np.asarray(v) for v in f(xs, ids, weights))
    bufs, want_sizes, want_pos, want_dest, want_received = model(xs, ids, num_experts, capacity)
    np.testing.assert_array_equal(tokens, bufs)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(handle_sizes, want_sizes)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(dest, want_dest)
    np.testing.assert_array_equal(dropped, (want_pos < 0).sum(axis=(1, 2)))
    np.testing.assert_array_equal(received, want_received)
    kept = (want_pos >= 0).astype(np.float64)
    want_out = 2 * np.einsum("ptk,ptk,pth->pth", weights, kept, xs)
    np.testing.assert_array_equal(out, want_out)
    for d in range(p):  # rows past the kept ones are zero (grouped_matmul's contract)
        assert not tokens[d, want_sizes[d].sum():].any()

    def loss(x, w):
        return jnp.sum(f(x, ids, w)[0] * jnp.arange(h, dtype=jnp.float32))

    gx, gw = jax.grad(loss, argnums=(0, 1))(xs, weights)
    g = np.arange(h, dtype=np.float64)
    np.testing.assert_allclose(gx, 2 * np.einsum("ptk,ptk->pt", weights, kept)[..., None] * g)
    np.testing.assert_allclose(gw, 2 * kept * (xs @ g)[..., None])
    return int((want_pos < 0).sum())


CASES = [  # p, t, k, h, experts, capacity, skew
    (1, 16, 2, 8, 4, 32, False),
    (2, 16, 2, 8, 8, 64, False),
    (4, 12, 3, 8, 8, 40, True),
    (8, 8, 2, 16, 16, 16, False),
    (8, 10, 4, 8, 32, 200, True),
]


@pytest.mark.parametrize("p,t,k,h,experts,capacity,skew", CASES)
def test_dispatch_combine_against_model(p, t, k, h, experts, capacity, skew):
    run(p, t, k, h, experts, capacity, seed=p * 100 + t, skew=skew)


def test_capacity_overflow_drops_and_counts():
    # 2 ranks x 16 tokens x 2 slots = 64 assignments, 8 rows per rank: most are dropped.
    assert run(2, 16, 2, 8, 4, 8, seed=1) > 0


@pytest.mark.parametrize("p,t,k,h,experts,capacity,skew", [CASES[0], CASES[2], CASES[3]])
def test_invalid_expert_ids_are_dropped_and_counted(p, t, k, h, experts, capacity, skew):
    """Ids outside [0, E) (negative, E, past E, int32's extremes) are dropped as the kernel
    drops them: no row, in no group size, dest and position -1, counted in the sender's
    `dropped` (with the capacity drops) and in no rank's `received_dropped`."""
    assert run(p, t, k, h, experts, capacity, seed=p * 31 + t, skew=skew, invalid=True) > 0


def test_invalid_expert_ids_by_hand():
    """The issue's two cases at P = 2, E = 4 (rank 0 owns experts 0 and 1): id 7 (rank 3 does
    not exist) goes nowhere, id -1 is not counted in expert 0's group size, and the valid slots
    keep the rows they would have without them (worked out by hand)."""
    mesh = _mesh(2)
    ids = np.array([[[7, 0], [-1, 0], [0, 1]], [[0, -1], [3, 7], [2, 0]]], np.int32)
    xs = np.arange(1, 2 * 3 * 4 + 1, dtype=np.float32).reshape(2, 3, 4)

    def body(x, e):
        tok, sizes, hd = pk.moe_dispatch(x[0], e[0], "ep", num_experts=4, capacity=8)
        return (tok[None], sizes[None], hd.dest_rank[None], hd.position[None], hd.dropped,
                hd.received_dropped)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 2,
                              out_specs=(P("ep"),) * 6))
    tok, sizes, dest, pos, dropped, received = (np.asarray(v) for v in f(xs, ids))
    np.testing.assert_array_equal(sizes, [[5, 1], [1, 1]])
    np.testing.assert_array_equal(dest, [[[-1, 0], [-1, 0], [0, 0]], [[0, -1], [1, -1], [1, 0]]])
    np.testing.assert_array_equal(pos, [[[-1, 0], [-1, 1], [2, 5]], [[3, -1], [1, -1], [0, 4]]])
    np.testing.assert_array_equal(dropped, [2, 2])
    np.testing.assert_array_equal(received, [0, 0])
    rows = {0: [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (0, 2)], 1: [(1, 2), (1, 1)]}
    for d, src in rows.items():
        np.testing.assert_array_equal(tok[d, :len(src)], [xs[s, t] for s, t in src])
        assert not tok[d, len(src):].any()


def test_combine_reads_no_row_of_a_dropped_slot():
    """A dropped slot (capacity, or an id outside [0, E)) contributes zero to the combine and
    to the weights' gradient even where y holds NaN (the pull kernel never reads its row)."""
    mesh = _mesh(2)
    # Rank 0 owns experts 0, 1 (capacity 2): expert 0 gets rank 0's slot 0 (row 0) and rank
    # 1's slot 1 (row 1); rank 1's slot 0 (expert 1) falls at row 2, dropped; 9 goes nowhere.
    ids = np.array([[[0, 9]], [[1, 0]]], np.int32)
    xs = np.array([[[1.0, 2.0]], [[3.0, 4.0]]], np.float32)
    w = np.full((2, 1, 2), 0.5, np.float32)

    def body(x, e, wt):
        tok, _, hd = pk.moe_dispatch(x[0], e[0], "ep", num_experts=4, capacity=2)
        y = jnp.where(jax.lax.axis_index("ep") == 0, 2 * tok, jnp.nan)  # rank 1: all NaN
        return pk.moe_combine(y, wt[0], hd, "ep")[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    np.testing.assert_array_equal(np.asarray(f(xs, ids, w)), xs)
    gw = jax.grad(lambda wt: jnp.sum(f(xs, ids, wt)))(w)
    np.testing.assert_array_equal(np.asarray(gw), [[[6.0, 0.0]], [[0.0, 14.0]]])


def test_errors_name_the_fix():
    mesh = _mesh(2)
    x = jnp.zeros((2, 4, 8))
    bad = [
        ({"num_experts": 3, "capacity": 8}, jnp.zeros((2, 4, 2), jnp.int32), "divisible"),
        ({"num_experts": 4, "capacity": 0}, jnp.zeros((2, 4, 2), jnp.int32), "capacity"),
        ({"num_experts": 4, "capacity": 8}, jnp.zeros((2, 4, 2), jnp.float32), "int32"),
        ({"num_experts": 4, "capacity": 8}, jnp.zeros((2, 3, 2), jnp.int32), "expert_ids"),
    ]
    for kw, ids, words in bad:
        f = jax.shard_map(lambda a, e, kw=kw: pk.moe_dispatch(a[0], e[0], "ep", **kw)[0][None],
                          mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
        with pytest.raises((ValueError, TypeError), match=words):
            f(x, ids)


def test_fused_forms_equal_the_numpy_model():
    p, t, k, h, f, experts, capacity = 4, 8, 2, 16, 24, 8, 24
    mesh = _mesh(p)
    rng = np.random.default_rng(7)
    xs = jnp.asarray(rng.integers(-2, 3, (p, t, h)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, experts, (p, t, k)), jnp.int32)
    w = jnp.asarray(rng.integers(0, 3, (p, t, k)) / 2, jnp.float32)
    w1 = jnp.asarray(rng.integers(-1, 2, (experts, h, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.integers(-1, 2, (experts, f, h)), jnp.bfloat16)

    def fused(x, e, wt, a, b):
        hid, _, handle = pk.moe_dispatch_gemm(x[0], e[0], a, "ep", num_experts=experts,
                                              capacity=capacity)
        return pk.moe_gemm_combine(hid, b, wt[0], handle, "ep")[None]

    def unfused(x, e, wt, a, b):
        tok, sizes, handle = pk.moe_dispatch(x[0], e[0], "ep", num_experts=experts,
                                             capacity=capacity)
        y = pk.grouped_matmul(pk.grouped_matmul(tok, a, sizes), b, sizes)
        return pk.moe_combine(y, wt[0], handle, "ep")[None]

    specs = (P("ep"), P("ep"), P("ep"), P("ep"), P("ep"))
    got, composed = (jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("ep")))(
        xs, ids, w, w1, w2) for fn in (fused, unfused))
    # numpy: the model's rows, each expert's two GEMMs (fp32 sums of integers, exact, rounded
    # once to bf16 as the ops round), then the weighted sum of each token's kept slots.
    def bf16(a):
        return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16), np.float64)

    el = experts // p
    bufs, sizes, pos, dest, _ = model(np.asarray(xs, np.float64), np.asarray(ids), experts,
                                      capacity)
    w1n, w2n = np.asarray(w1, np.float64), np.asarray(w2, np.float64)
    ys = np.zeros((p, capacity, h))
    for d in range(p):
        off = 0
        for le, size in enumerate(sizes[d]):
            rows = slice(off, off + size)
            hid = bf16(bufs[d, rows] @ w1n[d * el + le])
            ys[d, rows] = bf16(hid @ w2n[d * el + le])
            off += size
    want = np.zeros((p, t, h))
    for s, tt, j in zip(*np.nonzero(pos >= 0)):
        want[s, tt] += float(w[s, tt, j]) * ys[dest[s, tt, j], pos[s, tt, j]]
    want = bf16(want)
    assert np.abs(want).sum() > 0
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    np.testing.assert_array_equal(np.asarray(composed, np.float64), want)


# ---------------------------------------------------------------------------------------------
# The kernel path's Python side on CPU: the CUDA calls replaced by lax stand-ins with the same
# contracts (pk_moe_dispatch, pk_moe_scatter, pk_moe_combine), so the custom VJPs (dispatch's
# transpose = combine with unit weights; combine's = scatter of weighted rows + gathered rows
# for the weights) are checked against the model's forward and gradients.

def _stand_in_dispatch(x, ids, axis_name, num_experts, capacity):
    from pk_jax.ops import moe

    tokens, sizes, h = moe.dispatch_reference(x, ids, axis_name, num_experts=num_experts,
                                              capacity=capacity)
    return tokens, sizes, h.dest_rank, h.position, h.dropped, h.received_dropped


def _stand_in_scatter(rows, dest, pos, group_sizes, axis_name, capacity):
    me = jax.lax.axis_index(axis_name)
    rows_all = jax.lax.all_gather(rows, axis_name).reshape(-1, rows.shape[1])
    d = jax.lax.all_gather(dest, axis_name).reshape(-1)
    q = jax.lax.all_gather(pos, axis_name).reshape(-1)
    at = jnp.where((d == me) & (q >= 0), q, capacity)
    return jnp.zeros((capacity + 1, rows.shape[1]), rows.dtype).at[at].set(rows_all)[:capacity]


def _stand_in_combine(y, weights, dest, pos, axis_name, *, gather=False):
    y_all = jax.lax.all_gather(y, axis_name)
    rows = y_all[dest, jnp.clip(pos, 0, y.shape[0] - 1)].astype(jnp.float32)
    rows = jnp.where((pos >= 0)[..., None], rows, 0.0)
    if gather:
        return rows.astype(y.dtype)
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), rows).astype(y.dtype)


@pytest.fixture
def kernel_path(monkeypatch):
    from pk_jax.ops import moe

    calls = []

    def use(stem, axis_name=None):  # the fused ops' own targets too: _backend.route asks
        calls.append(stem)
        return stem in ("moe_dispatch", "moe_combine", "moe_dispatch_gemm", "moe_gemm_combine")

    monkeypatch.setattr(moe._backend, "use_kernel", use)
    monkeypatch.setattr(moe, "_dispatch_call", _stand_in_dispatch)
    monkeypatch.setattr(moe, "_scatter_call", _stand_in_scatter)
    monkeypatch.setattr(moe, "_combine_call", _stand_in_combine)
    monkeypatch.setattr(moe, "_gemm_combine_call", _stand_in_gemm_combine)
    return calls


def _stand_in_gemm_combine(h, w2, weights, dest, pos, group_sizes, axis_name):
    """pk_moe_gemm_combine's contract in lax: the grouped GEMM (y rounded to h's dtype), then
    the combine."""
    y = pk.grouped_matmul(h, w2, group_sizes)
    return _stand_in_combine(y, weights, dest, pos, axis_name)


@pytest.mark.parametrize("p,t,k,h,experts,capacity,skew", CASES[1:4])
def test_kernel_path_vjps_against_model(kernel_path, p, t, k, h, experts, capacity, skew):
    run(p, t, k, h, experts, capacity, seed=p * 7 + t, skew=skew)
    assert "moe_dispatch" in kernel_path and "moe_combine" in kernel_path


@pytest.mark.needs_ext  # the workspace need is the extension's (ffi/launch.h)
def test_kernel_path_workspace_too_small_names_the_setting(kernel_path, monkeypatch):
    from pk_jax.runtime import state

    mesh = _mesh(2)
    monkeypatch.setattr(state, "workspace_bytes", lambda: 1024)
    f = jax.shard_map(lambda a, e: pk.moe_dispatch(a[0], e[0], "ep", num_experts=4,
                                                   capacity=64)[0][None],
                      mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"))
    with pytest.raises(ValueError, match="workspace_bytes="):
        f(jnp.zeros((2, 4, 8)), jnp.zeros((2, 4, 2), jnp.int32))


# ---------------------------------------------------------------------------------------------
# The numpy cases of the rank-emulator tests (pk_jax.testing.ops, tests/gpu/emu_cases.py) equal
# the lax references, so the GPU tests check the kernels against the API's contract.

@pytest.mark.parametrize("p,seed", [(2, 0), (3, 1), (4, 2), (8, 3), (8, 4)])
def test_emulator_cases_match_the_references(p, seed):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
    import emu_cases

    rng = np.random.default_rng(seed)
    mesh = _mesh(p)
    for _ in range(3):
        d = emu_cases.moe_case("moe_dispatch", p, rng, dtype="float32")
        c = emu_cases.moe_case("moe_combine", p, rng, dtype="float32")
        prm = d.params
        xs = np.stack([d.inputs[r]["x"] for r in range(p)])
        ids = np.stack([d.inputs[r]["ids"] for r in range(p)])

        def disp(x, e, prm=prm):
            tok, sizes, h = pk.moe_dispatch(x[0], e[0], "ep", num_experts=prm["num_experts"],
                                            capacity=prm["capacity"])
            return (tok[None], sizes[None], h.dest_rank[None], h.position[None], h.dropped,
                    h.received_dropped)

        got = jax.jit(jax.shard_map(disp, mesh=mesh, in_specs=(P("ep"),) * 2,
                                    out_specs=(P("ep"),) * 6))(xs, ids)
        names = ("tokens", "group_sizes", "dest", "pos", "dropped", "recv_dropped")
        for name, g in zip(names, got):
            want = np.stack([d.expected[r][name] for r in range(p)])
            np.testing.assert_array_equal(np.asarray(g).reshape(want.shape), want, name)

        # The combine case's handle is the routing of its (hidden) ids: rebuild it by dest/pos.
        ys = np.stack([c.inputs[r]["y"] for r in range(p)])
        w = np.stack([c.inputs[r]["weights"] for r in range(p)])
        dest = np.stack([c.inputs[r]["dest"] for r in range(p)])
        pos = np.stack([c.inputs[r]["pos"] for r in range(p)])

        def comb(y, wt, de, po):  # group_sizes: only the combine's VJP reads them
            h = MoeHandle(de[0], po[0], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                          jnp.zeros(1, jnp.int32))
            return pk.moe_combine(y[0], wt[0], h, "ep")[None]

        out = jax.jit(jax.shard_map(comb, mesh=mesh, in_specs=(P("ep"),) * 4,
                                    out_specs=P("ep")))(ys, w, dest, pos)
        want = np.stack([c.expected[r]["out"] for r in range(p)])
        np.testing.assert_array_equal(np.asarray(out), want)


def _gemm_combine_body(el: int):
    def body(hh, w, wt, de, po, gs):
        handle = MoeHandle(de[0], po[0], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                           gs[0])
        return pk.moe_gemm_combine(hh[0], w[0], wt[0], handle, "ep")[None]

    return body


@pytest.mark.parametrize("p,seed", [(2, 5), (4, 6), (8, 7)])
def test_emulator_gemm_combine_cases_match_the_references(p, seed):
    """The moe_gemm_combine cases of the fused emulator tests (skewed, empty experts, tight
    capacity, x = rank) equal grouped_matmul then moe_combine's lax references."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
    import emu_cases

    rng = np.random.default_rng(seed)
    mesh = _mesh(p)
    cases = [emu_cases.gemm_combine_case(p, rng, dtype="bfloat16", rank_valued=True),
             emu_cases.gemm_combine_case(p, rng, skew=True, capacity="tight"),
             emu_cases.gemm_combine_case(p, rng, empty_odd=True, capacity="exact")]
    for c in cases:
        stack = [np.stack([c.inputs[r][name] for r in range(p)])
                 for name in ("h", "w", "weights", "dest", "pos", "group_sizes")]
        dt = jnp.bfloat16 if c.dtype == "bfloat16" else jnp.float16
        stack[0], stack[1] = jnp.asarray(stack[0], dt), jnp.asarray(stack[1], dt)
        out = jax.jit(jax.shard_map(_gemm_combine_body(c.params["groups"]), mesh=mesh,
                                    in_specs=(P("ep"),) * 6, out_specs=P("ep")))(*stack)
        want = np.stack([c.expected[r]["out"] for r in range(p)])
        np.testing.assert_array_equal(np.asarray(out, np.float32), want.astype(np.float32))


def _gemm_combine_loss_case(p: int = 4):
    """Inputs and a jitted value-and-grad of a dispatch + moe_gemm_combine loss at P = p."""
    t, k, f, h, el, capacity = 9, 2, 16, 24, 2, 20
    mesh = _mesh(p)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, p * el, (p, t, k)).astype(np.int32)
    x = jnp.asarray(rng.integers(-2, 3, (p, t, 8)), jnp.bfloat16)
    hh = jnp.asarray(rng.integers(-2, 3, (p, capacity, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.integers(-1, 2, (p, el, f, h)), jnp.bfloat16)
    wt = jnp.asarray(rng.integers(0, 5, (p, t, k)) / 4, jnp.float32)
    g = jnp.asarray(rng.integers(-1, 2, (p, t, h)), jnp.float32)

    def loss(x_, e_, h_, w_, wt_):
        def body(xx, ee, a, b, c):
            _, _, hd = pk.moe_dispatch(xx[0], ee[0], "ep", num_experts=p * el,
                                       capacity=capacity)
            return pk.moe_gemm_combine(a[0], b[0], c[0], hd, "ep")[None]

        out = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))(
            x_, e_, h_, w_, wt_)
        return jnp.sum(out.astype(jnp.float32) * g), out

    return jax.jit(jax.value_and_grad(loss, argnums=(2, 3, 4), has_aux=True)), (x, ids, hh,
                                                                                 w2, wt)


def _counting_gemm_combine(monkeypatch) -> list:
    from pk_jax.ops import moe

    taken = []

    def stand_in(*args):
        taken.append(1)
        return _stand_in_gemm_combine(*args)

    monkeypatch.setattr(moe, "_gemm_combine_call", stand_in)
    return taken


@pytest.mark.needs_ext  # the workspace need is the extension's (ffi/launch.h)
@pytest.mark.parametrize("mode,decided,fused", [("auto", "fused", True), ("auto", "serial", False),
                                                ("1", "serial", True), ("0", "fused", False)])
def test_gemm_combine_default_is_the_deciders(kernel_path, monkeypatch, mode, decided, fused):
    """PK_JAX_MOE_FUSED "auto" (the default) runs the fused moe_gemm_combine where it applies
    and the one decider (cost_model.choose) picks it, "1" wherever it applies, "0" never;
    "auto" composes where the workspace cannot hold its rows, while "1" raises the error that
    names workspace_bytes."""
    from pk_jax import cost_model
    from pk_jax.runtime import state

    assert state.Settings().moe_fused == "auto"
    monkeypatch.setattr(state, "settings", lambda: state.Settings(moe_fused=mode))
    asked = []

    def choose(op, shape, p, **kw):
        asked.append((op, shape, p))
        return decided

    monkeypatch.setattr(cost_model, "choose", choose)
    taken = _counting_gemm_combine(monkeypatch)
    f, args = _gemm_combine_loss_case()
    f(*args)
    assert bool(taken) == fused, (mode, len(taken))
    if mode == "auto":  # the decider saw the call's shape: per device, E from the experts
        assert asked and all(op == "moe_gemm_combine" and set(shape) == {
            "t", "k", "experts", "h", "hidden"} for op, shape, _ in asked), asked
    del taken[:]
    monkeypatch.setattr(state, "workspace_bytes", lambda: 1024)
    f, args = _gemm_combine_loss_case()
    if mode == "1":
        with pytest.raises(ValueError, match="workspace_bytes="):
            f(*args)
    else:
        f(*args)
        assert not taken, "the fused path was taken with a workspace too small for it"


def test_fused_gemm_combine_path_forward_and_vjp(kernel_path, monkeypatch):
    """fused_kernels() (as PK_JAX_MOE_FUSED=1) with the kernel path on (pk_moe_gemm_combine
    replaced by a lax stand-in with its contract): the fused path is taken inside the block,
    never inside fused_kernels(False), and by default outside a block (one jitted function: the
    block is part of jit's cache key); its forward and custom VJP (the composition's) equal the
    composition's."""
    from pk_jax import cost_model
    from pk_jax.ops import moe
    from pk_jax.runtime import state

    monkeypatch.setattr(state, "settings", lambda: state.Settings())  # PK_JAX_MOE_FUSED unset
    # the decider picks fused here (it would not at this toy size: launches dominate)
    monkeypatch.setattr(cost_model, "choose", lambda *a, **kw: "fused")
    taken = _counting_gemm_combine(monkeypatch)
    f, (x, ids, hh, w2, wt) = _gemm_combine_loss_case()
    results = {}
    for fused in (True, False):  # one jitted function: the block is part of its cache key
        with moe.fused_kernels(fused):
            (_val, out), grads = f(x, ids, hh, w2, wt)
        results[fused] = (out, grads)
        if fused:
            assert taken, "the fused path was not taken inside fused_kernels()"
            traced = len(taken)
        assert len(taken) == traced, "the fused path was taken inside fused_kernels(False)"
    f(x, ids, hh, w2, wt)  # outside a block: PK_JAX_MOE_FUSED unset ("auto"): the decider's
    assert len(taken) > traced, "the fused path was not taken by default"
    np.testing.assert_array_equal(np.asarray(results[True][0], np.float32),
                                  np.asarray(results[False][0], np.float32))
    for a, b in zip(results[True][1], results[False][1]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("p,t,k,h,experts,capacity,skew", CASES[2:4])
def test_kernel_path_vjps_with_invalid_ids(kernel_path, p, t, k, h, experts, capacity, skew):
    """The custom VJPs (dispatch's transpose a unit-weight combine, combine's a scatter) on a
    handle with dest -1 and position -1 slots: the model's forward and gradients."""
    assert run(p, t, k, h, experts, capacity, seed=p * 13 + t, skew=skew, invalid=True) > 0


# ---------------------------------------------------------------------------------------------
# GPU: the dispatch, fused dispatch + GEMM and combine kernels on invalid expert ids, in the
# rank emulator (P ranks on SM partitions of one GPU, launched as the FFI handlers launch them),
# against `model`. Run with CUDA_MODULE_LOADING=EAGER in the environment (the emulator needs it:
# pk_jax.testing.require_eager_loading), e.g.
#   CUDA_MODULE_LOADING=EAGER python -m pytest -q -m gpu tests/test_moe.py


def _emulator_cases(p: int, rng: np.random.Generator, dtype: str) -> list:
    """moe_dispatch, moe_dispatch_gemm and moe_combine cases whose expert ids are ~25%
    outside [0, E), with their expected outputs from `model` (not pk_jax.testing.ops, whose
    routing takes valid ids only)."""
    from pk_jax.testing import ops
    from pk_jax.testing.emulator import np_dtype

    dt, i32 = np_dtype(dtype), np.int32
    cases = []
    for t, k, el, h, n, cap_kind in ((37, 2, 2, 24, 16, "generous"), (61, 4, 3, 64, 8, "tight"),
                                     (1, 1, 1, 8, 8, "generous")):
        experts = el * p
        ids = with_invalid_ids(rng.integers(0, experts, (p, t, k)).astype(i32), experts, rng)
        ids[0, 0, 0] = -1  # at least one on rank 0, and one past E on the last rank
        ids[p - 1, -1, -1] = experts
        capacity = p * t * k + 3 if cap_kind == "generous" else max(1, p * t * k // (2 * p))
        xs = rng.integers(-1, 2, (p, t, h)).astype(np.float64)
        ws = rng.integers(-1, 2, (p, el, h, n)).astype(np.float64)
        bufs, sizes, pos, dest, received = model(xs, ids, experts, capacity)
        handle = [{"group_sizes": sizes[r].astype(i32), "dest": dest[r].astype(i32),
                   "pos": pos[r].astype(i32),
                   "dropped": np.array([(pos[r] < 0).sum()], i32),
                   "recv_dropped": np.array([received[r]], i32)} for r in range(p)]
        params = {"t": t, "k": k, "h": h, "num_experts": experts, "capacity": capacity}
        inputs = [{"x": xs[r].astype(dt), "ids": ids[r]} for r in range(p)]
        cases.append(ops.Case("moe_dispatch", dtype, inputs,
                              [{"tokens": bufs[r].astype(dt), **handle[r]} for r in range(p)],
                              params))
        ys = []
        for r in range(p):  # the grouped GEMM of the kept rows, expert after expert
            y, off = np.zeros((capacity, n)), 0
            for e, size in enumerate(sizes[r]):
                y[off:off + size] = bufs[r, off:off + size] @ ws[r, e]
                off += size
            ys.append(y)
        fused_inputs = [{**inputs[r], "w": ws[r].astype(dt), "order": np.zeros(t * k, i32),
                         "order_off": np.zeros(experts + 1, i32)} for r in range(p)]
        cases.append(ops.Case("moe_dispatch_gemm", dtype, fused_inputs,
                              [{"y": ys[r].astype(dt), **handle[r]} for r in range(p)],
                              {**params, "n": n, "num_comm_sms": 0}))
        # The combine of the handle: y rows in {-1, 0, 1}, weights in quarters (exact sums).
        yc = rng.integers(-1, 2, (p, capacity, h)).astype(np.float64)
        wt = (rng.integers(0, 5, (p, t, k)) / 4).astype(np.float32)
        outs = np.zeros((p, t, h))
        for s, tt, j in zip(*np.nonzero(pos >= 0)):
            outs[s, tt] += wt[s, tt, j] * yc[dest[s, tt, j], pos[s, tt, j]]
        cases.append(ops.Case("moe_combine", dtype,
                              [{"y": yc[r].astype(dt), "weights": wt[r],
                                "dest": handle[r]["dest"], "pos": handle[r]["pos"]}
                               for r in range(p)],
                              [{"out": outs[r].astype(dt)} for r in range(p)], params))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("p,dtype", [(2, "bfloat16"), (4, "float16"), (8, "bfloat16")])
def test_gpu_kernels_on_invalid_ids_equal_the_model(p, dtype):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "gpu"))
    import emu_cases

    from pk_jax.testing import World

    rng = np.random.default_rng(60 + p)
    cases = _emulator_cases(p, rng, dtype)
    world = World(p, timeout_s=10.0, workspace_bytes=64 << 20)
    try:  # twice, on two poisons (0xFF reads -1 in int32 outputs, a legal value here)
        assert emu_cases.run_calls(world, cases, rng, skew_ns=0, poison=0x7F) == []
        assert emu_cases.run_calls(world, cases[::-1], rng, skew_ns=20_000) == []
    finally:
        world.close()


@pytest.mark.parametrize("p,dtype", [(2, "bfloat16"), (4, "float16")])
def test_gpu_invalid_id_cases_equal_the_references(p, dtype):
    """The GPU test's cases (above) hold what the lax references give: its expectations are
    right, so a failure on the GPU is the kernel's."""
    mesh = _mesh(p)
    dt = jnp.bfloat16 if dtype == "bfloat16" else jnp.float16
    cases = _emulator_cases(p, np.random.default_rng(60 + p), dtype)
    handle_names = ("group_sizes", "dest", "pos", "dropped", "recv_dropped")
    for c in cases:
        prm = c.params
        stack = {name: np.stack([c.inputs[r][name] for r in range(p)]) for name in c.inputs[0]}
        want = {name: np.stack([c.expected[r][name] for r in range(p)])
                for name in c.expected[0]}
        if c.op == "moe_combine":
            def comb(y, wt, de, po, el=prm["num_experts"] // p):
                hd = MoeHandle(de[0], po[0], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                               jnp.zeros(el, jnp.int32))
                return pk.moe_combine(y[0], wt[0], hd, "ep")[None]

            got = {"out": jax.jit(jax.shard_map(comb, mesh=mesh, in_specs=(P("ep"),) * 4,
                                                out_specs=P("ep")))(
                jnp.asarray(stack["y"], dt), stack["weights"], stack["dest"], stack["pos"])}
        else:
            def disp(x, e, w=None, op=c.op, prm=prm):
                kw = {"num_experts": prm["num_experts"], "capacity": prm["capacity"]}
                if op == "moe_dispatch":
                    first, sizes, hd = pk.moe_dispatch(x[0], e[0], "ep", **kw)
                else:
                    first, sizes, hd = pk.moe_dispatch_gemm(x[0], e[0], w[0], "ep", **kw)
                return (first[None], sizes[None], hd.dest_rank[None], hd.position[None],
                        hd.dropped, hd.received_dropped)

            args = [jnp.asarray(stack["x"], dt), stack["ids"]]
            if c.op == "moe_dispatch_gemm":
                args.append(jnp.asarray(stack["w"], dt))
            outs = jax.jit(jax.shard_map(disp, mesh=mesh, in_specs=(P("ep"),) * len(args),
                                         out_specs=(P("ep"),) * 6))(*args)
            first = "tokens" if c.op == "moe_dispatch" else "y"
            got = dict(zip((first,) + handle_names, outs))
        assert set(got) == set(want), c.op
        for name, g in got.items():
            np.testing.assert_array_equal(np.asarray(g, np.float64).reshape(want[name].shape),
                                          want[name].astype(np.float64), f"{c.op} {name}")

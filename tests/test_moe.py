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
    """Loops over (dest rank, local expert, source rank, token, slot), as the API promises."""
    p, t, k = ids.shape
    el = num_experts // p
    bufs = np.zeros((p, capacity, xs.shape[-1]), np.float64)
    sizes = np.zeros((p, el), np.int64)
    pos = -np.ones((p, t, k), np.int64)
    for d in range(p):
        row = 0
        for le in range(el):
            for s, tt, j in itertools.product(range(p), range(t), range(k)):
                if ids[s, tt, j] == d * el + le:
                    if row < capacity:
                        bufs[d, row] = xs[s, tt]
                        pos[s, tt, j] = row
                        sizes[d, le] += 1
                    row += 1
    return bufs, sizes, pos


def run(p, t, k, h, num_experts, capacity, seed, *, skew=False):
    rng = np.random.default_rng(seed)
    xs = rng.integers(-4, 5, (p, t, h)).astype(np.float32)
    if skew:  # Zipf-like: most slots on a few experts, many experts empty
        ids = np.minimum(rng.zipf(1.5, (p, t, k)) - 1, num_experts - 1).astype(np.int32)
    else:
        ids = rng.integers(0, num_experts, (p, t, k)).astype(np.int32)
    weights = rng.integers(0, 4, (p, t, k)).astype(np.float32) / 4
    mesh = _mesh(p)

    def body(x, e, w):
        tokens, sizes, handle = pk.moe_dispatch(x[0], e[0], "ep", num_experts=num_experts,
                                                capacity=capacity)
        out = pk.moe_combine(tokens * 2, w[0], handle, "ep")
        return tokens[None], sizes[None], handle.position[None], handle.dropped, out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                              out_specs=(P("ep"),) * 5))
    tokens, sizes, pos, dropped, out = (np.asarray(v) for v in f(xs, ids, weights))
    bufs, want_sizes, want_pos = model(xs, ids, num_experts, capacity)
    np.testing.assert_array_equal(tokens, bufs)
    np.testing.assert_array_equal(sizes, want_sizes)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(dropped, (want_pos < 0).sum(axis=(1, 2)))
    kept = (want_pos >= 0).astype(np.float64)
    want_out = 2 * np.einsum("ptk,ptk,pth->pth", weights, kept, xs)
    np.testing.assert_array_equal(out, want_out)
    for d in range(p):  # rows past the kept ones are zero (grouped_matmul's contract)
        assert not tokens[d, want_sizes[d].sum():].any()

    def loss(x, w):
        return jnp.sum(f(x, ids, w)[4] * jnp.arange(h, dtype=jnp.float32))

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


def test_fused_forms_equal_dispatch_grouped_matmul_combine():
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
    got, want = (jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("ep")))(
        xs, ids, w, w1, w2) for fn in (fused, unfused))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.abs(np.asarray(got, np.float32)).sum() > 0


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

    def use(stem, axis_name=None):
        calls.append(stem)
        return stem in ("moe_dispatch", "moe_combine")

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
        prm, cp = d.params, c.params
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

        def comb(y, wt, de, po, el=cp["num_experts"] // p):
            h = MoeHandle(de[0], po[0], jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                          jnp.zeros(el, jnp.int32))
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
    from pk_jax.ops import moe
    from pk_jax.runtime import state

    monkeypatch.setattr(state, "settings", lambda: state.Settings())  # PK_JAX_MOE_FUSED unset
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
    f(x, ids, hh, w2, wt)  # outside a block: PK_JAX_MOE_FUSED unset ("auto"), fused
    assert len(taken) > traced, "the fused path was not taken by default"
    np.testing.assert_array_equal(np.asarray(results[True][0], np.float32),
                                  np.asarray(results[False][0], np.float32))
    for a, b in zip(results[True][1], results[False][1]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

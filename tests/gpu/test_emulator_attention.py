"""The fused ring attention forward (pk.ring_attention at P > 1, kernels/ring_attn.cuh) under
true concurrency: P emulated ranks on disjoint SM partitions of one GPU (pk_jax.testing.World),
started through the launch function the FFI handler calls, against a float32 numpy reference
over the whole sequence (pk_jax.testing.ops.ring_attn), with bf16/fp16 tolerances.

Run on the H200: `bash tests/gpu/run_all.sh ring` (or, with CUDA_MODULE_LOADING=EAGER,
`python -m pytest -m gpu tests/gpu/test_emulator_attention.py`). The dead-rank cases trap the
CUDA context, so they run in subprocesses (tests/gpu/emu_failures.py).
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(__file__))
import emu_cases

from pk_jax.runtime import vmm
from pk_jax.testing import ops

CALLS = int(os.environ.get("PK_JAX_EMU_RING_CALLS", "100"))  # back-to-back calls per P
BATCH = 20                                                   # calls in flight between syncs
SKEW_NS = 20_000                                             # random per-rank start skew
WORKSPACE = 64 << 20
PS = (2, 4, 8)
LAYOUTS = ((False, False), (True, False), (True, True))      # (causal, zigzag)


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache(workspace_bytes=WORKSPACE)


def _run(world, cases, rng, *, skew_ns: int = 0, poison: int = 0xFF) -> list[str]:
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns, poison=poison)


@pytest.mark.parametrize("p,layout", list(itertools.product(PS, LAYOUTS)))
def test_random_against_the_float32_reference(worlds, p, layout):
    """Random inputs, causal or not, zigzag or contiguous, D 64 and 128, bf16 and fp16, S/P a
    multiple of the tile and not (non-causal D = 64 runs 192-row blocks: S/P 200 and 256 end
    in a partial one); every case called twice in a row on poisoned outputs."""
    causal, zigzag = layout
    rng = np.random.default_rng(100 * p + 10 * causal + zigzag)
    w = worlds(p)
    cases = [emu_cases.ring_case(p, rng, causal=causal, zigzag=zigzag, s_local=sl, d=d,
                                 dtype=dt, h=4, hkv=4)
             for sl, d, dt in ((128, 128, "bfloat16"), (200, 64, "float16"),
                               (256, 64, "bfloat16"), (130, 128, "float16"))]
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p", PS)
def test_grouped_query_attention(worlds, p):
    """GQA 4:1 and MQA (Hkv = 1), batch 2, causal zigzag and contiguous, odd S/P tails."""
    rng = np.random.default_rng(7 + p)
    w = worlds(p)
    cases = [emu_cases.ring_case(p, rng, h=8, hkv=2, b=2, s_local=192, causal=True,
                                 zigzag=True),
             emu_cases.ring_case(p, rng, h=4, hkv=1, b=1, s_local=66, causal=True,
                                 zigzag=False),
             emu_cases.ring_case(p, rng, h=8, hkv=2, b=2, s_local=300, causal=False)]
    assert _run(w, cases, rng) == []


@pytest.mark.parametrize("p", PS)
def test_tiny_and_comm_block_counts(worlds, p):
    """S/P = 2 (one partial tile), and 1, 3 and 16 communication blocks."""
    rng = np.random.default_rng(300 + p)
    w = worlds(p)
    cases = [emu_cases.ring_case(p, rng, s_local=2, causal=True, zigzag=True),
             emu_cases.ring_case(p, rng, num_comm_sms=1),
             emu_cases.ring_case(p, rng, num_comm_sms=3),
             emu_cases.ring_case(p, rng, num_comm_sms=16)]
    assert _run(w, cases, rng) == []


def test_chunks_of_several_tiles(worlds):
    """S/P = 8500 (67 128-row tiles): chunks of 5 tiles (at most 16 chunks per K/V block), the
    last one of 2 tiles, the last tile partial; causal zigzag and not, GQA, D = 64 and 128; and
    S/P = 2048 (16 chunks of one tile) at D = 128. Non-causal at D = 128 the kernel streams
    176-key tiles, which straddle two or three 128-row chunks (ring_attn::acquire_rows)."""
    rng = np.random.default_rng(17)
    w = worlds(2)
    cases = [emu_cases.ring_case(2, rng, s_local=8500, h=2, hkv=1, d=64, b=1, causal=True,
                                 zigzag=True),
             emu_cases.ring_case(2, rng, s_local=8500, h=2, hkv=1, d=64, b=1, causal=False),
             emu_cases.ring_case(2, rng, s_local=8500, h=2, hkv=1, d=128, b=1, causal=False),
             emu_cases.ring_case(2, rng, s_local=2048, h=2, hkv=2, d=128, b=1, causal=False)]
    assert _run(w, cases, rng) == []


def _step_group_flags(world, prm: dict) -> tuple[int, int]:
    """Where the flags of the states that step group 0 saves lie in each rank's workspace (one
    per compute item and warp), as (offset, count), at ring_attn.cu's layout recomputed here:
    the states follow the 2 (P - 1) K/V slots (rounded up to 256 bytes), D / 8 + 1 float4 per
    lane of each warp's record, then the flags."""
    p, d = world.world, prm["d"]
    rows = 192 if d == 64 and not prm["causal"] else 128
    warps = rows // 16
    items = -(-prm["s"] // rows) * prm["h"] * prm["b"]
    block = prm["b"] * prm["s"] * prm["hkv"] * d * 2
    states_at = -(-2 * (p - 1) * block // 256) * 256
    return states_at + items * warps * (d // 8 + 1) * 32 * 16, items * warps


@pytest.mark.parametrize("p", PS)
def test_step_groups(worlds, p):
    """Non-causal calls of 2-16 waves of compute blocks: at P = 4 and 8 step groups
    (ring_attn.cuh step_groups) split each query tile, group 0 streaming steps [0, P/2) and
    saving its softmax state, group 1 the rest and folding it in; at P = 2 one group. Against
    float32, D 64 (192-row blocks) and 128, GQA, batch 2, S/P tails; the flags say which path
    ran (poisoned before each call: at P >= 4 every one raised after it, at P = 2 none
    touched); twice, then back to back with skew."""
    rng = np.random.default_rng(900 + p)
    w = worlds(p)
    grouped = p >= 4
    cases = [emu_cases.ring_case(p, rng, causal=False, zigzag=False, num_comm_sms=2,
                                 s_local=sl, h=h, hkv=hkv, d=d, b=b, dtype=dt)
             for sl, h, hkv, d, b, dt in ((520, 16, 4, 128, 1, "bfloat16"),
                                          (600, 16, 8, 64, 1, "float16"),
                                          (400, 8, 8, 128, 2, "float16"))]
    for case in cases:
        at, n = _step_group_flags(w, case.params)
        for poison in (0xFF, 0x7F):
            c = ops.Call(w, case, poison=poison)
            try:
                for r in range(p):
                    vmm.memset_d8(w.workspace_ptr(r) + at, 0xAB, n * 8)
                c.launch()
                w.synchronize()
                assert c.check() == []
                want = 1 if grouped else int.from_bytes(b"\xab" * 8, "little")
                for r in range(p):
                    flags = np.frombuffer(vmm.copy_to_host(w.workspace_ptr(r) + at, n * 8),
                                          np.uint64)
                    assert np.all(flags == want), (r, np.unique(flags)[:4])
            finally:
                c.free()
    assert _run(w, cases * 3, rng, skew_ns=SKEW_NS) == []


def test_a_late_rank(worlds):
    """One rank starts 200 ms after the others (well inside the timeout): still correct."""
    rng = np.random.default_rng(5)
    w = worlds(4)
    for layout in LAYOUTS:
        c = ops.Call(w, emu_cases.ring_case(4, rng, causal=layout[0], zigzag=layout[1]))
        try:
            c.launch(delays_ns=[0, 0, 200_000_000, 0])
            w.synchronize()
            assert c.check() == []
        finally:
            c.free()


@pytest.mark.parametrize("p", PS)
def test_back_to_back_with_skew(worlds, p):
    """CALLS calls, BATCH at a time without host synchronisation, each rank starting each call
    after a random delay, shapes and layouts changing every call."""
    rng = np.random.default_rng(1000 + p)
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        n = min(BATCH, CALLS - done)
        cases = [emu_cases.ring_case(p, rng, s_local=int(rng.choice([2, 64, 130, 256])))
                 for _ in range(n)]
        problems += _run(w, cases, rng, skew_ns=SKEW_NS,
                         poison=0xFF if done % 40 == 0 else 0x7F)
        done += n
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", PS)
def test_interleaved_with_the_other_ops_on_one_workspace(worlds, p):
    """Ring attention mixed with the collectives and the fused GEMMs on the same workspace and
    pads (each op's entry barrier keeps the others' deferred reads safe), with skew; the
    forward with step groups among them (its states and flags lie where the others stage)."""
    rng = np.random.default_rng(77 + p)
    w = worlds(p)
    every = ops.ATTENTION + ops.OPS + ("ring_attn:groups",) * 3
    seq = [str(rng.choice(every)).partition(":") for _ in range(BATCH)]
    cases = [emu_cases.case(op, p, rng, size=size or "small") for op, _, size in seq]
    assert _run(w, cases, rng, skew_ns=SKEW_NS) == []


_failure = emu_cases.failure


@pytest.mark.parametrize("p", PS)
def test_a_rank_that_never_arrives(p):
    """The others fail within timeout + 1 s with the record naming op, rank and missing peer;
    a fresh world (a new process) runs the op."""
    r = _failure("dead", "ring_attn", str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert "ring_attn" in r["message"], r
    assert _failure("fresh", "ring_attn", str(p))["fresh_world_ok"]


# ---------------------------------------------------------------------------------------------
# The fused backward (ring_attn_bwd, kernels/ring_attn_bwd.cuh): dq, dk, dv against the float32
# reference gradients over the whole sequence (pk_jax.testing.ops.ring_attn_bwd).

def _bwd_case(p, rng, **kw):
    return emu_cases.ring_case(p, rng, backward=True, **kw)


@pytest.mark.parametrize("p,layout", list(itertools.product(PS, LAYOUTS)))
def test_backward_against_the_float32_reference(worlds, p, layout):
    """Random inputs and dO, causal or not, zigzag or contiguous, D 64 and 128, bf16 and fp16,
    S/P a multiple of the tile and not; every case called twice on poisoned gradients."""
    causal, zigzag = layout
    rng = np.random.default_rng(500 + 100 * p + 10 * causal + zigzag)
    w = worlds(p)
    cases = [_bwd_case(p, rng, causal=causal, zigzag=zigzag, s_local=sl, d=d, dtype=dt, h=4,
                       hkv=4)
             for sl, d, dt in ((128, 128, "bfloat16"), (200, 64, "float16"),
                               (256, 64, "bfloat16"), (130, 128, "float16"))]
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p", PS)
def test_backward_grouped_query_attention(worlds, p):
    """GQA 4:1 and MQA (Hkv = 1), batch 2, causal zigzag and contiguous, odd S/P tails (two of
    them with 8 communication blocks, the op's count), and S/P = 2 with one."""
    rng = np.random.default_rng(70 + p)
    w = worlds(p)
    cases = [_bwd_case(p, rng, h=8, hkv=2, b=2, s_local=192, causal=True, zigzag=True,
                       num_comm_sms=8),
             _bwd_case(p, rng, h=4, hkv=1, b=1, s_local=66, causal=True, zigzag=False),
             _bwd_case(p, rng, h=8, hkv=2, b=2, s_local=300, causal=False, num_comm_sms=8),
             _bwd_case(p, rng, h=2, hkv=1, b=1, s_local=2, causal=True, zigzag=True,
                       num_comm_sms=1)]
    assert _run(w, cases, rng) == []


def test_backward_chunks_and_more_items_than_lanes(worlds):
    """P = 2. S/P = 8500 (67 key tiles): chunks of 5 tiles, the last one of 2, causal zigzag and
    not. S/P = 130 with 8 K/V heads and batch 17: 272 work items on 112 lanes (lanes take two
    or three items), causal contiguous and not."""
    rng = np.random.default_rng(23)
    w = worlds(2)
    cases = [_bwd_case(2, rng, s_local=8500, h=2, hkv=1, d=64, b=1, causal=True, zigzag=True),
             _bwd_case(2, rng, s_local=8500, h=2, hkv=1, d=64, b=1, causal=False),
             _bwd_case(2, rng, s_local=130, h=8, hkv=8, d=64, b=17, causal=True, zigzag=False),
             _bwd_case(2, rng, s_local=130, h=8, hkv=8, d=64, b=17, causal=False)]
    assert _run(w, cases, rng) == []


def test_backward_a_late_rank(worlds):
    """One rank starts 200 ms after the others: still correct."""
    rng = np.random.default_rng(6)
    w = worlds(4)
    for layout in LAYOUTS:
        c = ops.Call(w, _bwd_case(4, rng, causal=layout[0], zigzag=layout[1]))
        try:
            c.launch(delays_ns=[0, 0, 200_000_000, 0])
            w.synchronize()
            assert c.check() == []
        finally:
            c.free()


@pytest.mark.parametrize("p", PS)
def test_backward_back_to_back_with_skew(worlds, p):
    """Forward and backward calls mixed, BATCH at a time without host synchronisation, each
    rank starting each call after a random delay (the two share one slot range and epoch)."""
    rng = np.random.default_rng(2000 + p)
    w = worlds(p)
    cases = [emu_cases.ring_case(p, rng, s_local=int(rng.choice([2, 64, 130, 256])),
                                 backward=bool(i % 2)) for i in range(BATCH)]
    assert _run(w, cases, rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("p", PS)
def test_backward_a_rank_that_never_arrives(p):
    """The others fail within timeout + 1 s with the record naming ring_attn_bwd, rank and the
    missing peer; a fresh world runs the op."""
    r = _failure("dead", "ring_attn_bwd", str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert "ring_attn_bwd" in r["message"], r
    assert _failure("fresh", "ring_attn_bwd", str(p))["fresh_world_ok"]

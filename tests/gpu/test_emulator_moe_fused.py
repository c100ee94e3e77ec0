"""pk.moe_dispatch_gemm's fused kernel (cuda/kernels/moe_dispatch_gemm.cuh, work in progress:
pk.moe_dispatch_gemm still composes moe_dispatch and grouped_matmul) under true concurrency:
P emulated ranks on disjoint SM partitions of one GPU (pk_jax.testing.World), against the
numpy reference of pk_jax.testing.ops (moe_dispatch's outputs, then the grouped GEMM).

Run on the H200: `bash tests/gpu/run_all.sh moe_fused` (or, with CUDA_MODULE_LOADING=EAGER,
`python -m pytest -m gpu tests/gpu/test_emulator_moe_fused.py`).
"""

from __future__ import annotations

import itertools
import os
import sys
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(__file__))
import emu_cases

from pk_jax.testing import ops

CALLS = int(os.environ.get("PK_JAX_EMU_MOE_CALLS", "400")) // 4  # back-to-back calls per P
BATCH = 25
SKEW_NS = 20_000
WORKSPACE = 256 << 20


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache(workspace_bytes=WORKSPACE)


def _run(world, cases, rng, *, skew_ns: int = SKEW_NS, poison: int = 0xFF) -> list[str]:
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns, poison=poison)


@pytest.mark.parametrize("p", (2, 4, 8))
def test_exact_twice(worlds, p):
    """Random exact cases at odd T and N, one token, 1 and several comm blocks, twice on
    poisoned outputs, without and with skew."""
    rng = np.random.default_rng(zlib.crc32(f"fused{p}".encode()))
    w = worlds(p)
    cases = [emu_cases.fused_case(p, rng), emu_cases.fused_case(p, rng, num_comm_sms=1),
             emu_cases.fused_case(p, rng, t=1), emu_cases.fused_case(p, rng, num_comm_sms=3)]
    assert _run(w, cases, rng, skew_ns=0) == []
    assert _run(w, cases[::-1], rng, poison=0x7F) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_skewed_empty_experts_and_capacity_overflow(worlds, p):
    """Zipf routing (hot experts, many empty ones) with tight, exact and generous capacity."""
    rng = np.random.default_rng(40 + p)
    w = worlds(p)
    cases = [emu_cases.fused_case(p, rng, skew=True, capacity=cap)
             for cap in ("tight", "exact", "generous", "tight")]
    assert any(sum(int(c.expected[r]["recv_dropped"][0]) for r in range(p)) > 0
               for c in cases)
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_back_to_back_with_skew_and_the_other_moe_ops(worlds, p):
    """CALLS calls in batches without host synchronisation, random per-rank skew, mixed with
    moe_dispatch and moe_combine (the same epochs and workspace)."""
    rng = np.random.default_rng(1000 + p)
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        cases = []
        for _ in range(BATCH):
            op = str(rng.choice(["moe_dispatch_gemm", "moe_dispatch_gemm", "moe_dispatch",
                                 "moe_combine"]))
            cases.append(emu_cases.fused_case(p, rng) if op == "moe_dispatch_gemm"
                         else emu_cases.moe_case(op, p, rng))
        problems += _run(w, cases, rng)
        done += BATCH
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", (2, 4, 8))
def test_a_straggler(worlds, p):
    """One rank 1, 20 or 200 ms late, each rank in turn: exact."""
    rng = np.random.default_rng(500 + p)
    w = worlds(p)
    problems: list[str] = []
    for late, ns in itertools.product(range(p), (1_000_000, 20_000_000, 200_000_000)):
        c = ops.Call(w, emu_cases.fused_case(p, rng))
        try:
            c.launch(delays_ns=[ns if r == late else 0 for r in range(p)])
            w.synchronize()
            problems += [f"rank {late} {ns / 1e6:g} ms late: {m}" for m in c.check()]
        finally:
            c.free()
    assert problems == [], problems[:5]


def test_big_and_unequal_partitions(worlds):
    """T 1024, top-8 of 128 experts, H 256 -> N 512 on ranks of 48, 16, 32 and 16 SMs."""
    rng = np.random.default_rng(11)
    w = worlds(4, sms_per_rank=(48, 16, 32, 16))
    assert _run(w, [emu_cases.fused_case(4, rng, size="big") for _ in range(3)], rng) == []

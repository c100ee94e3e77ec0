"""The fused MoE kernels under true concurrency: P emulated ranks on disjoint SM partitions of
one GPU (pk_jax.testing.World), against the numpy references of pk_jax.testing.ops.

- pk.moe_dispatch_gemm's kernel (cuda/kernels/moe_dispatch_gemm.cuh): moe_dispatch's outputs,
  then the grouped GEMM;
- pk.moe_gemm_combine's kernels (cuda/kernels/moe_gemm_combine.cuh, the tests named
  test_gemm_combine_*): the grouped GEMM, then moe_combine.
Each op runs its kernel where the one decider (cost_model.choose) picks it (PK_JAX_MOE_FUSED
unset or "auto"), wherever it applies with PK_JAX_MOE_FUSED=1 (or inside
pk_jax.ops.moe.fused_kernels()), and composes the proven kernels otherwise.
PK_JAX_EMU_MOE_CALLS / 4 sets the back-to-back calls per P (default 100); the dead-rank cases
trap the CUDA context, so they run in subprocesses (tests/gpu/emu_failures.py).

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


@pytest.mark.parametrize("p", (2, 4, 8))
def test_many_rows_per_expert(worlds, p):
    """One expert per rank and 4096 slots of each source per expert: exact, tight capacity,
    twice on poisoned outputs, with skew."""
    rng = np.random.default_rng(700 + p)
    w = worlds(p)
    cases = [emu_cases.fused_case(p, rng, size="many", capacity=cap, skew=False,
                                  num_comm_sms=m)
             for cap, m in (("exact", 0), ("tight", 1), ("exact", 2))]
    assert _run(w, cases, rng) == []
    assert _run(w, cases[::-1], rng, poison=0x7F) == []


def test_big_and_unequal_partitions(worlds):
    """T 1024, top-8 of 128 experts, H 256 -> N 512 on ranks of 48, 16, 32 and 16 SMs."""
    rng = np.random.default_rng(11)
    w = worlds(4, sms_per_rank=(48, 16, 32, 16))
    assert _run(w, [emu_cases.fused_case(4, rng, size="big") for _ in range(3)], rng) == []


# ---------------------------------------------------------------------------------------------
# moe_gemm_combine (cuda/kernels/moe_gemm_combine.cuh)


@pytest.mark.parametrize("p", (2, 4, 8))
def test_gemm_combine_exact_twice(worlds, p):
    """h = rank + 1 (every output names the experts' ranks) and random exact cases at odd T
    and H, one token, both dtypes, twice on poisoned outputs, without and with skew."""
    rng = np.random.default_rng(zlib.crc32(f"gemm_combine{p}".encode()))
    w = worlds(p)
    cases = [emu_cases.gemm_combine_case(p, rng, rank_valued=True, dtype="bfloat16"),
             emu_cases.gemm_combine_case(p, rng, dtype="bfloat16"),
             emu_cases.gemm_combine_case(p, rng, dtype="float16"),
             emu_cases.gemm_combine_case(p, rng, t=1)]
    assert _run(w, cases, rng, skew_ns=0) == []
    assert _run(w, cases[::-1], rng, poison=0x7F) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_gemm_combine_skewed_empty_experts_and_capacity_overflow(worlds, p):
    """Zipf routing with tight, exact and generous capacity (slots dropped: they add zero), and
    only even experts chosen (every odd expert empty on every rank)."""
    rng = np.random.default_rng(60 + p)
    w = worlds(p)
    cases = [emu_cases.gemm_combine_case(p, rng, skew=True, capacity=cap)
             for cap in ("tight", "exact", "generous", "tight")]
    assert any(int((c.inputs[r]["pos"] < 0).sum()) > 0 for c in cases for r in range(p))
    cases += [emu_cases.gemm_combine_case(p, rng, empty_odd=True, capacity=cap)
              for cap in ("generous", "tight")]
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_gemm_combine_back_to_back_with_the_other_moe_ops(worlds, p):
    """CALLS calls in batches without host synchronisation, random per-rank skew, mixed with
    moe_combine (the same epoch, entry row and STAGED row), moe_dispatch and the fused
    dispatch (the same workspace)."""
    rng = np.random.default_rng(2000 + p)
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        cases = []
        for _ in range(BATCH):
            op = str(rng.choice(["moe_gemm_combine", "moe_gemm_combine", "moe_combine",
                                 "moe_dispatch", "moe_dispatch_gemm"]))
            cases.append(emu_cases.gemm_combine_case(p, rng) if op == "moe_gemm_combine"
                         else emu_cases.fused_case(p, rng) if op == "moe_dispatch_gemm"
                         else emu_cases.moe_case(op, p, rng))
        problems += _run(w, cases, rng)
        done += BATCH
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", (2, 4, 8))
def test_gemm_combine_a_straggler(worlds, p):
    """One rank 1, 20 or 200 ms late, each rank in turn: exact."""
    rng = np.random.default_rng(700 + p)
    w = worlds(p)
    problems: list[str] = []
    for late, ns in itertools.product(range(p), (1_000_000, 20_000_000, 200_000_000)):
        c = ops.Call(w, emu_cases.gemm_combine_case(p, rng), poison=0x7F if late % 2 else 0xFF)
        try:
            c.launch(delays_ns=[ns if r == late else 0 for r in range(p)])
            w.synchronize()
            problems += [f"rank {late} {ns / 1e6:g} ms late: {m}" for m in c.check()]
        finally:
            c.free()
    assert problems == [], problems[:5]


def test_gemm_combine_big_and_unequal_partitions(worlds):
    """T 1024, top-8 of 128 experts, F 256 -> H 512 on ranks of 48, 16, 32 and 16 SMs (the
    GEMM grids differ between ranks; nothing pairs them)."""
    rng = np.random.default_rng(12)
    w = worlds(4, sms_per_rank=(48, 16, 32, 16))
    assert _run(w, [emu_cases.gemm_combine_case(4, rng, size="big") for _ in range(3)],
                rng) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_gemm_combine_a_rank_that_never_arrives(p):
    """The others fail within timeout + 1 s with the record naming moe_gemm_combine, their
    rank and the dead rank as the missing peer (the entry barrier); a fresh world (a new
    process) runs the op."""
    r = emu_cases.failure("dead", "moe_gemm_combine", str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert "moe_gemm_combine" in r["message"], r
    assert emu_cases.failure("fresh", "moe_gemm_combine", str(p))["fresh_world_ok"]

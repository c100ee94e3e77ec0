"""The expert-parallel MoE kernels (pk.moe_dispatch, its per-slot transpose, pk.moe_combine and
its gather) under true concurrency: P emulated ranks on disjoint SM partitions of one GPU
(pk_jax.testing.World), started through the launch functions the FFI handlers call, against the
numpy references of pk_jax.testing.ops.

Run on the H200: `bash tests/gpu/run_all.sh moe` (or, with CUDA_MODULE_LOADING=EAGER,
`python -m pytest -m gpu tests/gpu/test_emulator_moe.py`). The dead-rank cases trap the CUDA
context, so they run in subprocesses (tests/gpu/emu_failures.py).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import zlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(__file__))
import emu_cases

from pk_jax.runtime import vmm
from pk_jax.testing import ops

CALLS = int(os.environ.get("PK_JAX_EMU_MOE_CALLS", "400"))  # back-to-back calls per (op, P)
BATCH = 50                                                  # calls in flight between syncs
SKEW_NS = 20_000                                            # random per-rank start skew
WORKSPACE = 256 << 20                                       # the big cases' rows fit


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache(workspace_bytes=WORKSPACE)


def _run(world, cases, rng, *, skew_ns: int = SKEW_NS, poison: int = 0xFF) -> list[str]:
    """NOTES: the 0xFF poison reads -1 in int32 outputs, a legal position; callers run with a
    second poison (0x7F) so an unwritten position shows too."""
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns, poison=poison)


@pytest.mark.parametrize("op,p", list(itertools.product(ops.MOE, emu_cases.WORLDS)))
def test_exact_twice(worlds, op, p):
    """x = rank (each row names its sender) and random exact cases at odd sizes, called back to
    back twice on poisoned outputs, without and with skew."""
    rng = np.random.default_rng(zlib.crc32(f"{op}{p}".encode()))
    w = worlds(p)
    cases = [emu_cases.moe_case(op, p, rng, rank_valued=True),
             emu_cases.moe_case(op, p, rng), emu_cases.moe_case(op, p, rng, t=1)]
    assert _run(w, cases, rng, skew_ns=0) == []
    assert _run(w, cases[::-1], rng, poison=0x7F) == []


@pytest.mark.parametrize("p", (2, 4, 8))
def test_skewed_routing_empty_experts_and_capacity_overflow(worlds, p):
    """Zipf routing (hot experts, many empty ones) with a tight capacity: rows are dropped and
    counted on both sides; and exactly full buffers."""
    rng = np.random.default_rng(40 + p)
    w = worlds(p)
    tight = [emu_cases.moe_case("moe_dispatch", p, rng, skew=True, capacity="tight", t=97)
             for _ in range(4)]
    assert all(sum(int(c.expected[r]["recv_dropped"][0]) for r in range(p)) > 0
               for c in tight)
    # Only even experts chosen: every odd expert is empty on every rank.
    t, k, experts = 61, 3, 4 * p
    ids = 2 * rng.integers(0, experts // 2, (p, t, k)).astype(np.int32)
    xs = [ops.integers(rng, (t, 24)) for _ in range(p)]
    empty = [ops.moe_dispatch(xs, ids, "bfloat16", num_experts=experts, capacity=cap)
             for cap in (p * t * k, t * k // 2)]
    assert all((c.expected[r]["group_sizes"][1::2] == 0).all() for c in empty
               for r in range(p))
    exact = [emu_cases.moe_case(op, p, rng, skew=True, capacity="exact") for op in ops.MOE]
    assert _run(w, tight + empty + exact, rng) == []
    assert _run(w, tight + empty + exact, rng, poison=0x7F) == []


@pytest.mark.parametrize("op,p", list(itertools.product(ops.MOE, (2, 4, 8))))
def test_back_to_back_with_skew(worlds, op, p):
    """CALLS calls, BATCH at a time without host synchronisation, each rank starting each call
    after a random delay, inputs (and shapes, capacity, routing) changing every call."""
    rng = np.random.default_rng(1000 + zlib.crc32(f"{op}{p}".encode()))
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        n = min(BATCH, CALLS - done)
        problems += _run(w, [emu_cases.moe_case(op, p, rng) for _ in range(n)], rng,
                         poison=0xFF if done % 100 == 0 else 0x7F)
        done += n
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", (2, 4, 8))
def test_interleaved_with_the_other_ops_on_one_workspace(worlds, p):
    """MoE calls mixed with the collectives and the fused GEMMs on the same workspace and pads
    (each op's entry barrier and exit wait keep the others' deferred reads safe), with skew."""
    rng = np.random.default_rng(77 + p)
    w = worlds(p)
    every = ops.MOE + ops.OPS
    problems: list[str] = []
    for _ in range(4):
        seq = [str(rng.choice(every)) for _ in range(BATCH)]
        problems += _run(w, [emu_cases.case(op, p, rng) for op in seq], rng)
    assert problems == [], problems[:5]


def test_big_and_unequal_partitions(worlds):
    """Ranks with 48, 16, 32 and 16 SMs and big calls (T 1024, top-8, H 1024; full grids):
    the paired grids come from the problem, so every op is exact."""
    rng = np.random.default_rng(11)
    w = worlds(4, sms_per_rank=(48, 16, 32, 16))
    assert w.sms == [48, 16, 32, 16]
    for op in ops.MOE:
        assert _run(w, [emu_cases.moe_case(op, 4, rng, size="big") for _ in range(3)], rng) == []
        assert _run(w, [emu_cases.moe_case(op, 4, rng) for _ in range(20)], rng) == []


LATE_NS = (1_000_000, 20_000_000, 200_000_000)  # the late-rank sweep's delays


@pytest.mark.parametrize("p", (2, 4, 8))
def test_a_late_rank_each_rank_in_turn(worlds, p):
    """Every MoE op with one rank starting 1, 20 or 200 ms after the others, each rank in turn
    (well inside the timeout): exact. moe_dispatch at P = 4 once lost the last rank's rows with
    rank 2 200 ms late (cuda/kernels/moe.cuh NOTES)."""
    rng = np.random.default_rng(500 + p)
    w = worlds(p)
    problems: list[str] = []
    for op, late, ns in itertools.product(ops.MOE, range(p), LATE_NS):
        c = ops.Call(w, emu_cases.moe_case(op, p, rng), poison=0x7F if late % 2 else 0xFF)
        try:
            c.launch(delays_ns=[ns if r == late else 0 for r in range(p)])
            w.synchronize()
            problems += [f"rank {late} {ns / 1e6:g} ms late: {m}" for m in c.check()]
        finally:
            c.free()
    assert problems == [], problems[:5]


# NOTES: not at P = 8: there the 8 partitions hold 128 of the 132 SMs and the unordered memset
# landed only after the late rank released the others (measured: bench/results/moe_notes.md,
# "Measurements moved from code comments (issue 37)"), so it cannot race the exchange; the
# test's own first assert says so instead of passing vacuously.
@pytest.mark.parametrize("p", (2, 4))
def test_dispatch_outputs_written_only_after_the_exchange(worlds, p):
    """While the on-time ranks of a dispatch wait 400 ms in the count exchange for the last
    rank, their dest and pos outputs are poisoned again by an unordered memset (what the
    emulator's poison fills once did): the route kernel writes them once, after the
    exchange, so the call is still exact. (It used to keep each slot's local index in pos
    across that wait.)"""
    rng = np.random.default_rng(600 + p)
    w = worlds(p)
    cu = vmm.driver()
    late = p - 1
    c = ops.Call(w, emu_cases.moe_case("moe_dispatch", p, rng, t=157))
    try:
        start = time.monotonic()
        c.launch(delays_ns=[400_000_000 if r == late else 0 for r in range(p)])
        time.sleep(0.05)
        for r in range(p):
            if r != late:
                for name in ("dest", "pos"):
                    c.buffers[r][name].fill_async(0x7F)
        while cu.cuStreamQuery(cu.CUstream(0))[0] == cu.CUresult.CUDA_ERROR_NOT_READY:
            time.sleep(0.001)
        landed_s = time.monotonic() - start
        w.synchronize()
        # Else the memset cannot have raced the exchange, and moe.cuh's diagnosis of the lost
        # rows (legacy-stream work landing while the green contexts' kernels wait) is wrong.
        assert landed_s < 0.3, f"the unordered memset finished {landed_s:.3f} s after launch"
        assert c.check() == []
    finally:
        c.free()


_failure = emu_cases.failure


@pytest.mark.parametrize("op,p", list(itertools.product(("moe_dispatch", "moe_combine"),
                                                        (2, 4, 8))))
def test_a_rank_that_never_arrives(op, p):
    """The others fail within timeout + 1 s with the record naming op, rank and missing peer;
    a fresh world (a new process) runs the op."""
    r = _failure("dead", op, str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert op in r["message"], r
    assert _failure("fresh", op, str(p))["fresh_world_ok"]

"""Every cross-rank kernel under true concurrency: P emulated ranks on disjoint SM partitions of
one GPU (pk_jax.testing.World), started through the launch functions the FFI handlers call.

Run on the H200: `python -m pytest -m gpu tests/gpu/test_emulator.py` (tests/gpu/run_all.sh
section `emulator`). The failure cases that trap the CUDA context run in subprocesses
(tests/gpu/emu_failures.py).
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

from pk_jax.testing import ops

CALLS = int(os.environ.get("PK_JAX_EMU_CALLS", "1000"))  # back-to-back calls per (op, P)
BATCH = 50                                                # calls in flight between host syncs
SKEW_NS = 20_000                                          # random per-rank start skew


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache()


def _run(world, cases, rng, *, skew_ns: int = SKEW_NS) -> list[str]:
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns)


def test_partitions_are_disjoint_and_sized(worlds):
    from pk_jax.testing import max_partitions

    assert max_partitions(0, 16) >= 8
    for p in (2, 4, 8):
        w = worlds(p)
        assert len(w.sms) == p and all(s >= 16 for s in w.sms), w.sms
        assert sum(w.sms) <= 132


@pytest.mark.parametrize("op,p", list(itertools.product(ops.OPS, emu_cases.WORLDS)))
def test_exact_twice(worlds, op, p):
    """Exact integer inputs and x = rank at odd sizes; two calls in a row on poisoned outputs."""
    rng = np.random.default_rng(zlib.crc32(f"{op}{p}".encode()))
    w = worlds(p)
    cases = [emu_cases.case(op, p, rng, rank_valued=True), emu_cases.case(op, p, rng),
             emu_cases.case(op, p, rng)]
    assert _run(w, cases, rng, skew_ns=0) == []
    assert _run(w, cases[::-1], rng) == []


@pytest.mark.parametrize("op,p", list(itertools.product(ops.OPS, (2, 4, 8))))
def test_back_to_back_with_skew(worlds, op, p):
    """CALLS calls, BATCH at a time without host synchronisation, each rank starting each call
    after a random delay, inputs changing every call; every result checked."""
    rng = np.random.default_rng(1000 + zlib.crc32(f"{op}{p}".encode()))
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        n = min(BATCH, CALLS - done)
        problems += _run(w, [emu_cases.case(op, p, rng) for _ in range(n)], rng)
        done += n
    assert problems == [], problems[:5]


def test_back_to_back_world_of_3(worlds):
    rng = np.random.default_rng(3)
    w = worlds(3)
    problems: list[str] = []
    for op in ops.OPS:
        problems += _run(w, [emu_cases.case(op, 3, rng) for _ in range(BATCH)], rng)
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", (2, 4, 8))
def test_ops_interleaved_on_one_workspace(worlds, p):
    """Different ops back to back on the same workspace and pads, with skew."""
    rng = np.random.default_rng(77 + p)
    w = worlds(p)
    problems: list[str] = []
    for _ in range(4):
        seq = [str(rng.choice(ops.OPS)) for _ in range(BATCH)]
        problems += _run(w, [emu_cases.case(op, p, rng) for op in seq], rng)
    assert problems == [], problems[:5]


def test_a_late_rank(worlds):
    """One rank starts 200 ms after the others (well inside the timeout): still exact, for
    every cross-rank op (the MoE ops too)."""
    rng = np.random.default_rng(5)
    w = worlds(4)
    for op in ops.OPS + ops.MOE:
        c = ops.Call(w, emu_cases.case(op, 4, rng))
        try:
            c.launch(delays_ns=[0, 0, 200_000_000, 0])
            w.synchronize()
            assert c.check() == []
        finally:
            c.free()


def test_unequal_partitions(worlds):
    """Ranks with 48, 16, 32 and 16 SMs: grids derived from the problem, so every op is exact
    (big cases: the helper kernels of gemm_rs/gemm_ar run more blocks than a small rank has
    SMs, and ag_gemm's compute grids differ between ranks)."""
    rng = np.random.default_rng(11)
    w = worlds(4, sms_per_rank=(48, 16, 32, 16))
    assert w.sms == [48, 16, 32, 16]
    for op in ops.OPS:
        assert _run(w, [emu_cases.case(op, 4, rng, size="big") for _ in range(3)], rng) == []
        assert _run(w, [emu_cases.case(op, 4, rng) for _ in range(20)], rng) == []


def test_a_refused_call_leaves_every_pad_as_it_was():
    """Every launcher runs all its checks before its first kernel (the epoch kernel). So a call
    refused on every rank, here at the workspace check, leaves every signal pad byte for byte
    as it was, and the next calls are exact. A check after the epoch kernel would bump the
    epoch of whichever ranks reached it: when a rank-dependent check refused the call on
    some ranks before the epoch kernel and on the others after it, no kernel would run, nothing
    would time out, and the ranks would stay out of step for every later call."""
    from pk_jax.runtime import vmm
    from pk_jax.testing import World

    rng = np.random.default_rng(17)
    w = World(4, workspace_bytes=256 << 20, timeout_s=10.0)

    def pads() -> list[bytes]:
        w.synchronize()
        return [vmm.copy_to_host(w.signal_ptr(r), w.signal_count * 8) for r in range(4)]

    def any_case(op):
        return emu_cases.fused_case(4, rng) if op == "moe_dispatch_gemm" else \
            emu_cases.case(op, 4, rng)

    try:
        for op in ops.OPS + ops.MOE + ops.FUSED_MOE + ops.ATTENTION:
            assert _run(w, [any_case(op)], rng) == [], op  # epochs already past zero
            before = pads()
            c = ops.Call(w, any_case(op))
            try:
                w.limit_workspace(16)
                for r in range(4):
                    with pytest.raises(ValueError, match="symmetric workspace"):
                        w.launch(op, r, c.args[r])
            finally:
                w.limit_workspace(None)
                c.free()
            assert pads() == before, f"{op}: a refused call changed a signal pad"
            assert _run(w, [any_case(op) for _ in range(3)], rng) == [], op
    finally:
        w.close()


def test_ag_gemm_comm_blocks_resident_when_sms_are_held(worlds):
    """Another kernel holds 12 of rank 0's 16 SMs for longer than the timeout while ag_gemm
    runs: its communication blocks come first in the grid, so they are resident and the call
    completes on the free SMs (with them last, compute blocks spin on flags that no resident
    block will ever set, until the timeout traps)."""
    from pk_jax import _ffi

    rng = np.random.default_rng(13)
    w = worlds(2, sms_per_rank=16)
    hold_ns = int((w.timeout_s + 2.0) * 1e9)
    c = ops.Call(w, emu_cases.case("ag_gemm", 2, rng, size="big"))
    try:
        _ffi._pk_ffi.emu_occupy(w.parts[0].side_stream, 12, 200 * 1024, hold_ns)
        time.sleep(0.2)  # the holder is resident before the op starts
        start = time.monotonic()
        c.launch()
        w.synchronize(timeout_s=w.timeout_s + 10.0)
        assert c.check() == []
        assert time.monotonic() - start >= w.timeout_s  # the holder really outlasted the bound
    finally:
        c.free()


_failure = emu_cases.failure


@pytest.mark.parametrize("op,p", [(op, p) for op in ops.OPS for p in (2, 4, 8)
                                  if p != 8 or op in ("all_reduce", "gemm_rs", "ag_gemm")])
def test_a_rank_that_never_arrives(op, p):
    """The others fail within timeout + 1 s with the record naming op, rank and missing peer;
    a fresh world (in a new process: the trap leaves the old context unusable) runs the op."""
    r = _failure("dead", op, str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert _failure("fresh", op, str(p))["fresh_world_ok"]


def test_mbarrier_wait_is_bounded():
    """A TMA/bulk byte count that never arrives records code 3 and traps after the bound."""
    r = _failure("mbar")
    assert r["failed"] and r["code"] == 3 and r["op"] == 6 and r["rank"] == 1, r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r

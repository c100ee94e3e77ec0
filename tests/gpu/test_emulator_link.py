"""The rank emulator's link throttle (pk_jax.testing.World(link_gbps=...), cuda/include/pk/
link.cuh): each rank's cross-rank bytes are paced at the cap, and results stay exact.

Run on the H200: `CUDA_MODULE_LOADING=EAGER python -m pytest -m gpu tests/gpu/test_emulator_link.py`
(tests/gpu/run_all.sh section `emulator`).
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

from pk_jax.testing import ops, real_node_link_gbps

CAP_GBPS = 2.0  # slow enough that the paced time dominates every op below (5.0 was too fast
#                 for reduce_scatter, all_to_all and ag_gemm on the H200: floor < 3x unthrottled)


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache()


def _bf16_ints(rng, shape):
    return ops.integers(rng, shape, -1, 2)


def paced_case(op: str, p: int, rng) -> tuple[ops.Case, int]:
    """A bf16 case of `op` with aligned sizes and the bytes each rank moves across ranks
    (what the throttle paces: loads from and stores into other ranks' workspaces)."""
    bf = "bfloat16"
    if op == "all_reduce":  # one-shot at P = 2, two-shot above 512 KiB (sum + gather)
        n = 2 << 20
        case = ops.all_reduce([_bf16_ints(rng, n) for _ in range(p)], bf)
        moved = (p - 1) * n * 2 if p <= 2 else 2 * (p - 1) * (n // p) * 2
        return case, moved
    if op == "all_gather":
        n = 2 << 20
        return ops.all_gather([_bf16_ints(rng, n) for _ in range(p)], bf), (p - 1) * n * 2
    if op == "reduce_scatter":
        n = p << 20
        case = ops.reduce_scatter([_bf16_ints(rng, n) for _ in range(p)], bf)
        return case, (p - 1) * (n // p) * 2
    if op == "all_to_all":
        n = p << 20
        case = ops.all_to_all([_bf16_ints(rng, (p * 64, n // (p * 64))) for _ in range(p)], bf,
                              0, 0)
        return case, (p - 1) * (n // p) * 2
    # x, w in {-1, 0, 1} and K = 256: every partial and total sum is an integer of at most
    # 256 in magnitude, exact in bf16.
    m, n, k = 4096, 1024, 256
    if op == "ag_gemm":
        m, n = 8192, 256
        mp = m // p
        xs = [_bf16_ints(rng, (mp, k)) for _ in range(p)]
        ws = [_bf16_ints(rng, (k, n)) for _ in range(p)]
        return ops.ag_gemm(xs, ws, bf, num_comm_sms=4), (p - 1) * mp * k * 2
    xs = [_bf16_ints(rng, (m, k // p)) for _ in range(p)]
    ws = [_bf16_ints(rng, (k // p, n)) for _ in range(p)]
    pushed = (p - 1) * (m // p) * n * 2  # tiles reduce-added into the other owners' buffers
    if op == "gemm_rs":
        return ops.gemm_rs(xs, ws, bf), pushed
    return ops.gemm_ar(xs, ws, bf), 2 * pushed  # and the gather of the other owners' rows


def _time_call(world, call, iters: int = 5) -> float:
    """Seconds per call of `call` (queued back to back on every rank), after one warm call."""
    call.launch()
    world.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call.launch()
    world.synchronize()
    return (time.perf_counter() - start) / iters


@pytest.mark.parametrize("op,p", list(itertools.product(ops.OPS, (2, 4))))
def test_throttle_paces(worlds, op, p):
    """With a cap of C GB/s, a call whose ranks each move B bytes across ranks takes at least
    B / C (within 5%), and not much more than that plus its unthrottled time (it paces, it does
    not stall); with the cap removed it is fast again."""
    rng = np.random.default_rng(zlib.crc32(f"link{op}{p}".encode()))
    w = worlds(p)
    case, moved = paced_case(op, p, rng)
    call = ops.Call(w, case)
    try:
        w.set_link(None)
        t_free = _time_call(w, call)
        w.set_link(CAP_GBPS)
        t_capped = _time_call(w, call)
        assert call.check() == []
        w.set_link(None)
        t_again = _time_call(w, call)
    finally:
        w.set_link(None)
        call.free()
    floor = moved / (CAP_GBPS * 1e9)
    detail = (f"{op} P={p}: {moved} bytes per rank, floor {floor * 1e6:.0f} us; unthrottled "
              f"{t_free * 1e6:.0f} us, capped {t_capped * 1e6:.0f} us, off again "
              f"{t_again * 1e6:.0f} us")
    print(detail)
    assert floor > 3 * t_free, "the case is too small to see the cap: " + detail
    assert t_capped >= 0.95 * floor, detail
    assert t_capped <= 1.6 * floor + 2 * t_free + 300e-6, detail
    assert t_again < 0.5 * floor, detail


def test_link_is_asynchronous(worlds):
    """A compute-bound fused GEMM+RS whose tile pushes need a quarter of the cap runs at its
    unthrottled speed (plus the last wave's drain): issuing a transfer reserves link time and
    the storer goes on computing, as on a real link; only the reuse of its staging buffer, the
    signal and the kernel's end wait for the bytes (cuda/include/pk/link.cuh)."""
    p, m, n, kr = 4, 4096, 4096, 2048
    rng = np.random.default_rng(7)
    w = worlds(p)
    xs = [_bf16_ints(rng, (m, kr)) for _ in range(p)]
    wts = [_bf16_ints(rng, (kr, n)) for _ in range(p)]
    call = ops.Call(w, ops.gemm_rs(xs, wts, "bfloat16", exact=False))
    moved = (p - 1) * (m // p) * n * 2  # tiles reduce-added into the other owners' buffers
    try:
        w.set_link(None)
        t_free = min(_time_call(w, call) for _ in range(3))
        cap = moved / (0.25 * t_free) / 1e9
        w.set_link(cap)
        t_capped = min(_time_call(w, call) for _ in range(3))
        assert call.check() == []
    finally:
        w.set_link(None)
        call.free()
    detail = (f"gemm_rs P={p} {m}x{n}x{kr}/rank: unthrottled {t_free * 1e6:.0f} us, at "
              f"{cap:.0f} GB/s (pushes need 25% of it) {t_capped * 1e6:.0f} us")
    print(detail)
    # the last wave's pushes (one tile per consumer) drain after the GEMM: at most a few us
    assert t_capped <= 1.05 * t_free + 50e-6, detail


@pytest.mark.parametrize("op,p", list(itertools.product(
    ops.OPS + ops.MOE + ops.FUSED_MOE + ops.ATTENTION, (2, 4))))
def test_results_exact_with_throttle(worlds, op, p):
    """Random cases (odd sizes, every path) with the throttle on, ranks skewed: every result is
    exact (within the case's tolerance for attention)."""
    rng = np.random.default_rng(zlib.crc32(f"linkexact{op}{p}".encode()))
    w = worlds(p, link_gbps=50.0)
    assert w.link_gbps == 50.0
    cases = [emu_cases.case(op, p, rng, rank_valued=True)] + \
        [emu_cases.case(op, p, rng) for _ in range(5)]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=20_000) == []


def test_real_node_cap_arithmetic():
    """The real-node cap: 1750 FLOP per byte, e.g. a rank of 100 TFLOP/s links at 57 GB/s."""
    assert abs(real_node_link_gbps(100.0) - 100e12 / 1750 / 1e9) < 1e-9
    assert abs(real_node_link_gbps(790.0) - 451.4) < 0.1  # one H200 against NVLink's 450

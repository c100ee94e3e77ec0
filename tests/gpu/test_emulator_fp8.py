"""The fused TP GEMMs in fp8 (gemm_rs_fp8, gemm_ar_fp8: cuda/kernels/gemm_rs_fp8.cuh;
ag_gemm_fp8: cuda/kernels/ag_gemm_fp8.cuh) under true
concurrency: P = 2, 4, 8 emulated ranks on disjoint SM partitions of one GPU
(pk_jax.testing.World), started through the launch functions the FFI handlers call.

Exact cases (tests/gpu/emu_cases.py fp8_case): x, wt in {-1, 0, 1} with per-rank power-of-two
scales, so every result is an integer the bf16 adds hold exactly and a wrong scale is off by a
power of two; random cases within the bound of pk_jax.testing.ops._gemm_fp8.

Run on the H200: `python -m pytest -m gpu tests/gpu/test_emulator_fp8.py` (tests/gpu/run_all.sh
section `fp8_tp`).
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

CALLS = int(os.environ.get("PK_JAX_EMU_CALLS", "1000")) // 10  # back-to-back calls per (op, P)
BATCH = 25
SKEW_NS = 20_000
WORLDS = (2, 4, 8)
PAIRS = list(itertools.product(emu_cases.FP8_FORMATS, emu_cases.FP8_FORMATS))


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache()


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


@pytest.mark.parametrize("op,p,formats", list(itertools.product(ops.FP8_GEMMS, WORLDS, PAIRS)))
def test_exact_twice(worlds, op, p, formats):
    """Exact integer results for every format pair at odd sizes, x = rank parity first; the
    same calls twice in a row (reversed, skewed) on poisoned outputs: stale epochs or owner
    buffers not zeroed show as wrong sums."""
    rng = _rng(op, p, formats)
    w = worlds(p)
    cases = [emu_cases.fp8_case(op, p, rng, formats=formats, rank_valued=True),
             emu_cases.fp8_case(op, p, rng, formats=formats),
             emu_cases.fp8_case(op, p, rng, formats=formats)]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=0) == []
    assert emu_cases.run_calls(w, cases[::-1], rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("op,p,config", list(itertools.product(
    ops.FP8_GEMMS, WORLDS, (ops.TILE_128x128, ops.TILE_128x256))))
def test_big_both_tiles(worlds, op, p, config):
    """Several 128-row tiles per owner and N past one 256-column tile (1032: a partial last
    panel), with either tile config: the owner placement and every panel's reduce-add."""
    rng = _rng(op, p, config, "big")
    w = worlds(p)
    cases = [emu_cases.fp8_case(op, p, rng, size="big", config=config) for _ in range(2)]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("op,p", list(itertools.product(ops.FP8_GEMMS, WORLDS)))
def test_random_within_bound(worlds, op, p):
    """Normal values and scales: within P 2^-8 of the largest partial of the float64 sum of the
    ranks' bf16-rounded partials (pk_jax.testing.ops._gemm_fp8)."""
    rng = _rng(op, p, "random")
    w = worlds(p)
    cases = [emu_cases.fp8_case(op, p, rng, exact=False) for _ in range(4)]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("op,p,formats", list(itertools.product(ops.FP8_GEMMS, WORLDS,
                                                                PAIRS[:2])))
def test_blockwise_exact_twice(worlds, op, p, formats):
    """Blockwise scales (x 1 x 128 per row, w 128 x 128, over 2+ k-blocks, the last partial):
    exact (emu_cases.fp8_case blockwise), at odd sizes and big ones, twice, skewed."""
    rng = _rng(op, p, formats, "block")
    w = worlds(p)
    cases = [emu_cases.fp8_case(op, p, rng, formats=formats, blockwise=True),
             emu_cases.fp8_case(op, p, rng, formats=formats, blockwise=True, size="big")]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=0) == []
    assert emu_cases.run_calls(w, cases[::-1], rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("op,p", list(itertools.product(ops.FP8_GEMMS, WORLDS)))
def test_blockwise_random_within_bound(worlds, op, p):
    rng = _rng(op, p, "block random")
    w = worlds(p)
    cases = [emu_cases.fp8_case(op, p, rng, exact=False, blockwise=True) for _ in range(3)]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("op,p", list(itertools.product(ops.FP8_GEMMS, WORLDS)))
def test_back_to_back_with_skew(worlds, op, p):
    """CALLS calls, BATCH at a time without host synchronisation, each rank starting each call
    after a random delay, inputs changing every call; every result checked."""
    rng = _rng(op, p, "soak")
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        n = min(BATCH, CALLS - done)
        problems += emu_cases.run_calls(w, [emu_cases.fp8_case(op, p, rng) for _ in range(n)],
                                        rng, skew_ns=SKEW_NS)
        done += n
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", WORLDS)
def test_interleaved_with_the_bf16_ops(worlds, p):
    """gemm_rs_fp8, gemm_ar_fp8 and ag_gemm_fp8 share gemm_rs's, gemm_ar's and ag_gemm's slot
    ranges and epoch counters: calls of all six in one batch, skewed, all exact."""
    rng = _rng(p, "interleaved")
    w = worlds(p)
    order = ["gemm_rs", "gemm_rs_fp8", "ag_gemm", "gemm_ar_fp8", "ag_gemm_fp8", "gemm_ar"] * 3
    cases = [emu_cases.case(op, p, rng) for op in order]
    assert emu_cases.run_calls(w, cases, rng, skew_ns=SKEW_NS) == []

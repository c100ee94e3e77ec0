"""The masked fused ring attention forward (kernels/ring_attn.cuh masked_kernel: pk_ring_attn
with masked = 1, the kernel of ring_attn._kernel_ring_masked; issue 38 section 3) under true
concurrency: P = 2, 4, 8 emulated ranks on disjoint SM partitions of one GPU
(pk_jax.testing.World), started through the launch function the FFI handler calls, against
the float32 numpy reference over the whole sequence with every mask on global positions
(pk_jax.testing.ops.ring_attn_masked), at bf16/fp16 tolerance; rows that no key is visible to
must give o = 0 and lse = +inf exactly.

Cases: every mask alone and combined (segment ids of packed documents that cross the chunk
and rank boundaries, a causal sliding window, a two-sided window, the soft cap, query and key
lengths, a batch row with no visible key), both layouts (zigzag with causal, and with a window
or lengths without causal: the masked kernel takes zigzag with any mask by position), S/P a
multiple of the tile and not (zigzag halves that split a tile), D 64 and 128, GQA, several
chunks per K/V block; each called twice in a row on poisoned outputs, and back to back with
random per-rank skew.

Run on the H200: `bash tests/gpu/run_all.sh ring` (or, with CUDA_MODULE_LOADING=EAGER,
`python -m pytest -m gpu tests/gpu/test_emulator_ring_masks.py`).
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

from pk_jax.testing import ops

WORKSPACE = 64 << 20
PS = (2, 4, 8)
LAYOUTS = ("contiguous", "zigzag")
SKEW_NS = 20_000


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache(workspace_bytes=WORKSPACE)


def packed(rng, b: int, s: int, mean: int) -> np.ndarray:
    """int32 [B, S]: documents of random lengths 1 .. 2 mean packed back to back."""
    ids = np.zeros((b, s), np.int32)
    for r in range(b):
        pos, doc = 0, 0
        while pos < s:
            n = int(rng.integers(1, 2 * mean + 1))
            ids[r, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids


def masked_case(p, rng, *, layout, sl, mask, b=1, h=4, hkv=2, d=64, dtype="bfloat16",
                num_comm_sms=None):
    """A masked ring case: random normal q, k, v per rank; mask: a dict of causal, window,
    softcap, segments (mean document length), q_len, kv_len (per batch row)."""
    s = sl * p
    causal = bool(mask.get("causal", False))
    positional = causal or any(n in mask for n in ("window", "q_len", "kv_len"))
    qs = [rng.standard_normal((b, sl, h, d)) for _ in range(p)]
    ks = [rng.standard_normal((b, sl, hkv, d)) for _ in range(p)]
    vs = [rng.standard_normal((b, sl, hkv, d)) for _ in range(p)]
    ids = None
    if "segments" in mask:
        ids = packed(rng, b, s, mask["segments"])
        # A document crosses every boundary of the zigzag chunks (and so of the ranks): the
        # first position after one joins the document before it (ids stay non-decreasing).
        for c in range(sl // 2, s, sl // 2):
            ids[:, c] = ids[:, c - 1]
    return ops.ring_attn_masked(
        qs, ks, vs, dtype, causal=causal, zigzag=layout == "zigzag" and positional,
        window=mask.get("window"), softcap=mask.get("softcap"), ids=ids,
        q_len=mask.get("q_len"), kv_len=mask.get("kv_len"),
        num_comm_sms=num_comm_sms or int(rng.integers(1, 5)))


def _run(world, cases, rng, *, skew_ns=0, poison=0xFF):
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns, poison=poison)


MASKS = {
    "segments": {"segments": 90},
    "segments+causal": {"segments": 150, "causal": True},
    "window+causal": {"window": (200, 0), "causal": True},
    "window": {"window": (70, 150)},
    "softcap": {"softcap": 20.0},
    "softcap+segments+causal": {"softcap": 30.0, "segments": 120, "causal": True},
    "lengths": {"q_len": [500, 0], "kv_len": [333, 700]},
    "kv_len+causal": {"kv_len": [260, 1], "causal": True},
}


@pytest.mark.parametrize("p,layout,name", list(itertools.product(PS, LAYOUTS, MASKS)))
def test_each_mask_against_the_float32_reference(worlds, p, layout, name):
    """Every mask alone and in the combinations training uses, both layouts, S/P 256 (whole
    tiles) and 200 (a partial tile; zigzag halves of 100 split the first tile), batch 2 for
    the lengths, D 64 and 128; each case twice (poison 0xFF, then 0x7F)."""
    rng = np.random.default_rng(1000 * p + 10 * LAYOUTS.index(layout) + list(MASKS).index(name))
    w = worlds(p)
    mask = dict(MASKS[name])
    b = 2 if any(n in mask for n in ("q_len", "kv_len")) else 1
    for n in ("q_len", "kv_len"):  # lengths within the whole sequence of S/P * P
        if n in mask:
            mask[n] = [min(x, 200 * p) for x in mask[n]]
    cases = [masked_case(p, rng, layout=layout, sl=sl, mask=mask, b=b, d=d, dtype=dt)
             for sl, d, dt in ((256, 64, "bfloat16"), (200, 128, "float16"))]
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p,layout", list(itertools.product(PS, LAYOUTS)))
def test_everything_combined_and_gqa(worlds, p, layout):
    """Segments, a causal window, the cap and both lengths at once; GQA 8:2 and MQA; a batch
    row no key is visible to (kv_len 0: o = 0, lse = +inf)."""
    rng = np.random.default_rng(77 + 10 * p + LAYOUTS.index(layout))
    w = worlds(p)
    s = 130 * p
    mask = {"segments": 100, "causal": True, "window": (150, 0), "softcap": 25.0,
            "q_len": [s - 7, s], "kv_len": [s - 40, 0]}
    cases = [masked_case(p, rng, layout=layout, sl=130, mask=mask, b=2, h=8, hkv=2, d=128),
             masked_case(p, rng, layout=layout, sl=130, mask=mask, b=2, h=4, hkv=1, d=64,
                         dtype="float16")]
    assert _run(w, cases, rng) == []


def test_chunks_of_several_tiles(worlds):
    """S/P = 4300 (34 key tiles: chunks of 3 tiles): a sliding window and packed documents
    skip most tiles and most chunks' waits, both layouts."""
    rng = np.random.default_rng(5)
    w = worlds(2)
    cases = [masked_case(2, rng, layout=layout, sl=4300, h=2, hkv=1, d=64,
                         mask={"causal": True, "window": (300, 0)})
             for layout in LAYOUTS]
    cases += [masked_case(2, rng, layout="contiguous", sl=4300, h=2, hkv=1, d=128,
                          mask={"segments": 700})]
    assert _run(w, cases, rng) == []


@pytest.mark.parametrize("p", PS)
def test_back_to_back_with_skew(worlds, p):
    """20 masked calls of changing masks, layouts and shapes without host synchronisation, each
    rank starting each call after a random delay, interleaved with unmasked ring calls."""
    rng = np.random.default_rng(500 + p)
    w = worlds(p)
    names = list(MASKS)
    cases = []
    for i in range(20):
        if i % 4 == 3:
            cases.append(emu_cases.ring_case(p, rng, s_local=130))
            continue
        mask = dict(MASKS[names[int(rng.integers(len(names)))]])
        b = 2 if any(n in mask for n in ("q_len", "kv_len")) else 1
        for n in ("q_len", "kv_len"):
            if n in mask:
                mask[n] = [min(x, 130 * p) for x in mask[n]]
        cases.append(masked_case(p, rng, layout=LAYOUTS[i % 2], sl=int(rng.choice([130, 256])),
                                 mask=mask, b=b))
    assert _run(w, cases, rng, skew_ns=SKEW_NS) == []

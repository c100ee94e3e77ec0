"""The fused Ulysses attention forward (pk.ulysses_attention at P > 1 with
PK_JAX_ULYSSES_FUSED=1, kernels/ulysses_attn.cuh), its kernel-backed composed backward (pk
all_to_all, the pk.attention backward on head shards, all_to_all back:
pk_jax.testing.ulysses_bwd.UlyssesBackward) and its fused backward (kernels/ulysses_attn_bwd.cuh,
op ulysses_attn_bwd: pk_jax.testing.ulysses_bwd.FusedUlyssesBackward; tests named
test_fused_backward_*), under true concurrency: P emulated ranks on disjoint SM partitions of
one GPU (pk_jax.testing.World), started through the launch function the FFI handler calls,
against a float32 numpy reference over the whole sequence (pk_jax.testing.ops.ulysses_attn,
ring_attn_bwd), with bf16/fp16 tolerances.

Run on the H200: `bash tests/gpu/run_all.sh ulysses` (or, with CUDA_MODULE_LOADING=EAGER,
`python -m pytest -m gpu tests/gpu/test_emulator_ulysses.py`). The dead-rank cases trap the
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
from pk_jax.testing.emulator import DTYPES
from pk_jax.testing.ulysses_bwd import (
    FusedUlyssesBackward,
    UlyssesBackward,
    fused_workspace_bytes,
    reference_inputs,
)

CALLS = int(os.environ.get("PK_JAX_EMU_ULYSSES_CALLS", "100"))  # back-to-back calls per P
# back-to-back fused backward calls per P (each with a float32 reference: fewer)
BWD_CALLS = int(os.environ.get("PK_JAX_EMU_ULYSSES_BWD_CALLS", "40"))
BATCH = 20                                                      # calls in flight between syncs
SKEW_NS = 20_000                                                # random per-rank start skew
WORKSPACE = 64 << 20
PS = (2, 4, 8)


@pytest.fixture(scope="module")
def worlds():
    yield from emu_cases.world_cache(workspace_bytes=WORKSPACE)


def _run(world, cases, rng, *, skew_ns: int = 0, poison: int = 0xFF) -> list[str]:
    return emu_cases.run_calls(world, cases, rng, skew_ns=skew_ns, poison=poison)


@pytest.mark.parametrize("p,causal", list(itertools.product(PS, (False, True))))
def test_random_against_the_float32_reference(worlds, p, causal):
    """Random inputs, causal or not, D 64 and 128, bf16 and fp16, S/P a multiple of the tile
    and not; every case called twice in a row on poisoned outputs."""
    rng = np.random.default_rng(200 * p + causal)
    w = worlds(p)
    cases = [emu_cases.ulysses_case(p, rng, causal=causal, s_local=sl, d=d, dtype=dt, h=h,
                                    hkv=h)
             for sl, d, dt, h in ((128, 128, "bfloat16", p), (200, 64, "float16", 2 * p),
                                  (256, 64, "bfloat16", p), (130, 128, "float16", 2 * p))]
    assert _run(w, cases, rng) == []
    assert _run(w, cases, rng, poison=0x7F) == []


@pytest.mark.parametrize("p", PS)
def test_grouped_query_attention(worlds, p):
    """GQA 4:1 and 2:1 (Hkv = P, 2P: the smallest K/V head count P divides, so one K/V head
    per rank is the MQA of a head group), batch 2, causal and not, odd S/P tails."""
    rng = np.random.default_rng(17 + p)
    w = worlds(p)
    cases = [emu_cases.ulysses_case(p, rng, h=4 * p, hkv=p, b=2, s_local=192, causal=True),
             emu_cases.ulysses_case(p, rng, h=4 * p, hkv=2 * p, b=1, s_local=66,
                                    causal=True),
             emu_cases.ulysses_case(p, rng, h=2 * p, hkv=p, b=2, s_local=300, causal=False)]
    assert _run(w, cases, rng) == []


def _backward_case(w, p, rng, b, sl, h, hkv, d, dt, causal, *, fused: bool = False,
                   num_comm_sms: int = 2):
    """A composed (or, with `fused`, the fused) backward on world w with random inputs, and
    its float32 reference (ops.ring_attn_bwd, contiguous: the same function, with the
    reference lse and delta)."""
    xs = [[rng.standard_normal(shape) for _ in range(p)]
          for shape in ((b, sl, h, d), (b, sl, hkv, d), (b, sl, hkv, d), (b, sl, h, d))]
    ref = ops.ring_attn_bwd(*xs, dt, causal=causal)
    kw = {"num_comm_sms": num_comm_sms} if fused else {}
    bwd = (FusedUlyssesBackward if fused else UlyssesBackward)(
        w, dt, *reference_inputs(ref), causal=causal, scale=ref.params["scale"], **kw)
    return bwd, ref


def _backward_problems(bwd, ref, what: str) -> list[str]:
    problems = []
    for r in range(ref.world):
        for name, got in bwd.grads(r).items():
            g = got.astype(np.float64)
            want = ref.expected[r][name].astype(np.float64)
            if not (np.all(np.isfinite(g)) and np.allclose(g, want, atol=ref.atol,
                                                           rtol=ref.rtol)):
                problems.append(f"{what} rank {r} {name}: max error "
                                f"{np.nanmax(np.abs(g - want))}")
    return problems


def _twice_on_poison(w, bwd, ref, what: str) -> list[str]:
    """Two calls in a row, the gradients poisoned before each (0xFF: NaNs, then 0x7F), each
    checked against the reference."""
    problems: list[str] = []
    for call, byte in enumerate((0xFF, 0x7F)):
        bwd.fill(byte)
        bwd.launch()
        w.synchronize()
        problems += _backward_problems(bwd, ref, f"{what} call {call}")
    return problems


@pytest.mark.parametrize("p", PS)
def test_backward_against_the_float32_reference(worlds, p):
    """The kernel-backed backward against the float32 reference gradients over the whole
    sequence, at the ring backward's tolerance: causal or not, GQA (Hkv = P, 2P), S a multiple
    of the 128-row tile and not (lse/delta padded), B = 2, D 64 and 128, bf16 and fp16; every
    case called twice on poisoned gradients."""
    rng = np.random.default_rng(300 + p)
    w = worlds(p)
    problems: list[str] = []
    for b, sl, h, hkv, d, dt, causal in ((1, 128, p, p, 128, "bfloat16", False),
                                         (2, 130, 2 * p, p, 64, "float16", True),
                                         (1, 200, 4 * p, 2 * p, 128, "bfloat16", True),
                                         (1, 64, 2 * p, 2 * p, 64, "float16", False)):
        bwd, ref = _backward_case(w, p, rng, b, sl, h, hkv, d, dt, causal)
        try:
            problems += _twice_on_poison(w, bwd, ref, f"P={p} b={b} S/P={sl} h={h} hkv={hkv} "
                                         f"d={d} {dt} causal={causal}")
        finally:
            bwd.free()
    assert problems == [], problems[:5]


def _late_rank(w, rng, *, fused: bool) -> None:
    for causal in (False, True):
        bwd, ref = _backward_case(w, 4, rng, 1, 192, 8, 4, 128, "bfloat16", causal,
                                  fused=fused)
        try:
            bwd.launch(delays_ns=[0, 0, 200_000_000, 0])
            w.synchronize()
            assert _backward_problems(bwd, ref, f"late rank, causal={causal}") == []
        finally:
            bwd.free()


def test_backward_with_a_late_rank(worlds):
    """One rank starts the backward 200 ms after the others (well inside the timeout): still
    correct."""
    _late_rank(worlds(4), np.random.default_rng(7), fused=False)


@pytest.mark.parametrize("p", PS)
def test_tiny_and_comm_block_counts(worlds, p):
    """S/P = 1 and 2 (one partial tile per source), and 1, 3 and 16 communication blocks."""
    rng = np.random.default_rng(400 + p)
    w = worlds(p)
    cases = [emu_cases.ulysses_case(p, rng, s_local=1, causal=True),
             emu_cases.ulysses_case(p, rng, s_local=2, causal=False),
             emu_cases.ulysses_case(p, rng, num_comm_sms=1),
             emu_cases.ulysses_case(p, rng, num_comm_sms=3),
             emu_cases.ulysses_case(p, rng, num_comm_sms=16)]
    assert _run(w, cases, rng) == []


def test_a_late_rank(worlds):
    """One rank starts 200 ms after the others (well inside the timeout): still correct."""
    rng = np.random.default_rng(6)
    w = worlds(4)
    for causal in (False, True):
        c = ops.Call(w, emu_cases.ulysses_case(4, rng, causal=causal))
        try:
            c.launch(delays_ns=[0, 0, 200_000_000, 0])
            w.synchronize()
            assert c.check() == []
        finally:
            c.free()


@pytest.mark.parametrize("p", PS)
def test_back_to_back_with_skew(worlds, p):
    """CALLS calls, BATCH at a time without host synchronisation, each rank starting each call
    after a random delay, shapes changing every call."""
    rng = np.random.default_rng(2000 + p)
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < CALLS:
        n = min(BATCH, CALLS - done)
        cases = [emu_cases.ulysses_case(p, rng, s_local=int(rng.choice([1, 64, 130, 256])))
                 for _ in range(n)]
        problems += _run(w, cases, rng, skew_ns=SKEW_NS,
                         poison=0xFF if done % 40 == 0 else 0x7F)
        done += n
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", PS)
def test_interleaved_with_the_other_ops_on_one_workspace(worlds, p):
    """Ulysses attention mixed with ring attention, the collectives and the fused GEMMs on the
    same workspace and pads (each op's entry barrier keeps the others' deferred reads safe),
    with skew; every other call is Ulysses."""
    rng = np.random.default_rng(88 + p)
    w = worlds(p)
    others = ("ring_attn",) + ops.OPS
    seq = [("ulysses_attn" if i % 2 == 0 else str(rng.choice(others))) for i in range(BATCH)]
    assert _run(w, [emu_cases.case(op, p, rng) for op in seq], rng, skew_ns=SKEW_NS) == []


_failure = emu_cases.failure


def _dead_rank(op: str, p: int) -> None:
    """The others fail within timeout + 1 s with the record naming op, rank and missing peer;
    a fresh world (a new process) runs the op."""
    r = _failure("dead", op, str(p))
    assert r["failed"], r
    assert r["elapsed_s"] < r["timeout_s"] + 1.0, r
    assert r["code"] == 1 and r["op"] == r["expected_op"], r
    assert r["peer"] == r["dead"] and r["rank"] != r["dead"], r
    assert op in r["message"], r
    assert _failure("fresh", op, str(p))["fresh_world_ok"]


@pytest.mark.parametrize("p", PS)
def test_a_rank_that_never_arrives(p):
    """The others fail within timeout + 1 s with the record naming op, rank and missing peer;
    a fresh world (a new process) runs the op."""
    _dead_rank("ulysses_attn", p)


# ---------------------------------------------------------------------------------------------
# The fused backward (op ulysses_attn_bwd, kernels/ulysses_attn_bwd.cuh): dq, dk, dv against
# the float32 reference gradients over the whole sequence, at the composed backward's tolerance.

def _fused_shapes(p: int):
    """(B, S/P, H, Hkv, D, dtype, num_comm_sms) at world p: GQA with Hkv = P and 2P, H = P..4P,
    S/P a multiple of the 128-row tile and not (down to 1), B = 2, D 64 and 128, bf16 and fp16,
    1-3 and 8 communication blocks."""
    return ((1, 128, p, p, 128, "bfloat16", 8),
            (2, 130, 2 * p, p, 64, "float16", 1),
            (1, 200, 4 * p, 2 * p, 128, "bfloat16", 3),
            (2, 64, 2 * p, 2 * p, 64, "float16", 2),
            (2, 1, 4 * p, p, 128, "float16", 3),
            (1, 256, 3 * p, p, 64, "bfloat16", 1))


@pytest.mark.parametrize("p,causal", list(itertools.product(PS, (False, True))))
def test_fused_backward_against_the_float32_reference(worlds, p, causal):
    """Every shape of _fused_shapes, causal or not, called twice in a row on poisoned
    gradients (0xFF, then 0x7F)."""
    rng = np.random.default_rng(600 + 10 * p + causal)
    w = worlds(p)
    problems: list[str] = []
    for b, sl, h, hkv, d, dt, nc in _fused_shapes(p):
        bwd, ref = _backward_case(w, p, rng, b, sl, h, hkv, d, dt, causal, fused=True,
                                  num_comm_sms=nc)
        try:
            problems += _twice_on_poison(w, bwd, ref, f"fused P={p} b={b} S/P={sl} h={h} "
                                         f"hkv={hkv} d={d} {dt} causal={causal} comm={nc}")
        finally:
            bwd.free()
    assert problems == [], problems[:5]


def test_fused_backward_with_a_late_rank(worlds):
    """One rank starts the fused backward 200 ms after the others (well inside the timeout):
    still correct."""
    _late_rank(worlds(4), np.random.default_rng(8), fused=True)


@pytest.mark.parametrize("p", PS)
def test_fused_backward_back_to_back_with_skew(worlds, p):
    """BWD_CALLS calls, BATCH at a time without host synchronisation, forward (ulysses_attn)
    and fused backward calls alternating (one slot range and epoch for both), each rank
    starting each call after a random delay, shapes changing every call; each call has its own
    buffers, so every one is checked."""
    rng = np.random.default_rng(2100 + p)
    w = worlds(p)
    problems: list[str] = []
    done = 0
    while done < BWD_CALLS:
        n = min(BATCH, BWD_CALLS - done)
        sls = [int(rng.choice([1, 64, 130, 256])) for _ in range(n)]
        cases = [emu_cases.ulysses_bwd_case(p, rng, s_local=sl) if i % 2 == 0 else
                 emu_cases.ulysses_case(p, rng, s_local=sl) for i, sl in enumerate(sls)]
        problems += _run(w, cases, rng, skew_ns=SKEW_NS, poison=0xFF if done == 0 else 0x7F)
        done += n
    assert problems == [], problems[:5]


@pytest.mark.parametrize("p", PS)
def test_fused_backward_interleaved_with_the_other_ops_on_one_workspace(worlds, p):
    """The fused backward mixed with both attention forwards, the ring backward, the
    collectives and the fused GEMMs on the same workspace and pads, with skew; every other
    call is the fused backward."""
    rng = np.random.default_rng(99 + p)
    w = worlds(p)
    others = ops.ATTENTION + ops.OPS
    seq = [("ulysses_attn_bwd" if i % 2 == 0 else str(rng.choice(others))) for i in range(BATCH)]
    assert _run(w, [emu_cases.case(op, p, rng) for op in seq], rng, skew_ns=SKEW_NS) == []


@pytest.mark.parametrize("p", (2, 4))
def test_fused_backward_refuses_bad_calls(worlds, p):
    """Shapes, head dims, dtypes and communication block counts the kernel does not take, and a
    workspace one byte short of the call's need, are refused with a ValueError on every rank,
    leaving the signal pads as they were; with exactly the need the call runs and is right."""
    rng = np.random.default_rng(40 + p)
    w = worlds(p)
    case = emu_cases.ulysses_bwd_case(p, rng, s_local=130, h=2 * p, hkv=p, d=64, b=2,
                                      num_comm_sms=2)
    c = ops.Call(w, case)

    def pads() -> list[bytes]:
        w.synchronize()
        return [vmm.copy_to_host(w.signal_ptr(r), w.signal_count * 8) for r in range(p)]

    bad = (({"d": 96}, "head_dim"), ({"num_comm_sms": 0}, "num_comm_sms"),
           ({"num_comm_sms": 17}, "num_comm_sms"), ({"hkv": 1}, "world size"),
           ({"dtype": DTYPES["float32"]}, "bf16"))
    need = fused_workspace_bytes(p, 2, 130, 2 * p, p, 64)
    try:
        before = pads()
        for fields, what in bad:
            for r in range(p):
                with pytest.raises(ValueError, match=what):
                    w.launch("ulysses_attn_bwd", r, {**c.args[r], **fields})
        try:
            w.limit_workspace(need - 1)
            for r in range(p):
                with pytest.raises(ValueError, match="symmetric workspace"):
                    w.launch("ulysses_attn_bwd", r, c.args[r])
            assert pads() == before, "a refused call changed a signal pad"
            w.limit_workspace(need)
            c.launch()
            w.synchronize()
            assert c.check() == []
        finally:
            w.limit_workspace(None)
    finally:
        c.free()


@pytest.mark.parametrize("p", PS)
def test_fused_backward_a_rank_that_never_arrives(p):
    """The others fail within timeout + 1 s with the record naming ulysses_attn_bwd, rank and
    the missing peer; a fresh world (a new process) runs the op."""
    _dead_rank("ulysses_attn_bwd", p)

"""Case builders shared by the emulator tests, benchmarks and scripts (tests/gpu/): random
exact-integer calls of every cross-rank op at a given P, with odd sizes; and the tests' shared
plumbing (a cache of worlds, a batch of skewed calls checked, a failure run in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from pk_jax.testing import ops
from pk_jax.testing.ulysses_bwd import fused_reference

# Ops and the world sizes they run at (3 wherever the op allows a world of 3).
WORLDS = (2, 3, 4, 8)


def case(op: str, p: int, rng: np.random.Generator, *, size: str = "small",
         dtype: str | None = None, rank_valued: bool = False) -> ops.Case:
    """A random exact case of `op` at world p. size: "small" (fast, odd), "big" (helper grids
    above 16 blocks, several tiles per owner). rank_valued: x = rank everywhere."""
    if op in ops.MOE:
        return moe_case(op, p, rng, size=size, dtype=dtype, rank_valued=rank_valued)
    if op == "moe_gemm_combine":
        return gemm_combine_case(p, rng, size=size, dtype=dtype, rank_valued=rank_valued)
    if op == "moe_dispatch_gemm":
        return fused_case(p, rng, size=size, dtype=dtype)
    if op == "ulysses_attn":
        return ulysses_case(p, rng, dtype=dtype, size=size)
    if op == "ulysses_attn_bwd":
        return ulysses_bwd_case(p, rng, dtype=dtype, size=size)
    if op in ops.ATTENTION:
        return ring_case(p, rng, dtype=dtype, size=size, backward=op == "ring_attn_bwd")
    if op in ops.FP8_GEMMS:
        return fp8_case(op, p, rng, size=size, rank_valued=rank_valued)
    big = size == "big"

    def ints(shape, r):
        return np.full(shape, float(r)) if rank_valued else ops.integers(rng, shape)

    if op == "all_reduce":
        n = int(rng.integers(1, 3000)) if not big else 1 << 21
        dt = dtype or str(rng.choice(["float32", "bfloat16", "float16"]))
        algo = int(rng.integers(0, 3))
        return ops.all_reduce([ints(n, r) for r in range(p)], dt, algo=algo)
    if op == "all_gather":
        n = int(rng.integers(1, 3000)) if not big else 1 << 20
        dt = dtype or str(rng.choice(["float32", "bfloat16", "int32"]))
        return ops.all_gather([ints(n, r) + 10 * r for r in range(p)], dt)
    if op == "reduce_scatter":
        n = p * (int(rng.integers(1, 1500)) if not big else 1 << 19)
        dt = dtype or str(rng.choice(["float32", "bfloat16", "float16"]))
        return ops.reduce_scatter([ints(n, r) for r in range(p)], dt)
    if op == "all_to_all":
        rows = p * int(rng.integers(1, 40)) if not big else p * 512
        heads = p * int(rng.integers(1, 4))
        d = int(rng.choice([1, 3, 8, 64]))
        dt = dtype or str(rng.choice(["float32", "bfloat16", "int32"]))
        xs = [ints((rows, heads, d), r) + 100 * r for r in range(p)]
        split, concat = [(1, 0), (0, 1), (0, 0)][int(rng.integers(0, 3))]
        return ops.all_to_all(xs, dt, split, concat)
    # GEMMs: x, w in {-1, 0, 1}, so every partial and total sum is an integer of size at most
    # P K: exact in fp16 up to 2048 and in bf16 up to 256 (the cross-rank adds are in T).
    dt = dtype or str(rng.choice(["float16", "bfloat16"]))
    lim = 2
    kmax = max(8, (256 if dt == "bfloat16" else 2048) // p // 8 * 8)
    n = 8 * int(rng.integers(1, 40)) if not big else 1024
    k = 8 * int(rng.integers(1, kmax // 8 + 1)) if not big else kmax
    if op == "ag_gemm":
        mp = int(rng.integers(1, 300)) if not big else 512
        xs = [np.full((mp, k), float(r)) if rank_valued else ops.integers(rng, (mp, k), -1, lim)
              for r in range(p)]
        ws = [ops.integers(rng, (k, n), -1, 2) for _ in range(p)]
        return ops.ag_gemm(xs, ws, dt, num_comm_sms=int(rng.integers(1, 5)))
    m = (p * int(rng.integers(1, 120)) if op == "gemm_rs" else int(rng.integers(1, 400))) \
        if not big else p * 512
    xs = [np.full((m, k), float(r % 2)) if rank_valued else ops.integers(rng, (m, k), -1, lim)
          for r in range(p)]
    ws = [ops.integers(rng, (k, n), -1, 2) for _ in range(p)]
    return (ops.gemm_rs if op == "gemm_rs" else ops.gemm_ar)(xs, ws, dt)


# ---------------------------------------------------------------------------------------------
# The fused TP GEMMs in fp8 (pk_jax.testing.ops.FP8_GEMMS)

FP8_FORMATS = ("float8_e4m3fn", "float8_e5m2")


def fp8_case(op: str, p: int, rng: np.random.Generator, *, size: str = "small",
             formats: tuple[str, str] | None = None, rank_valued: bool = False,
             exact: bool = True, config: int | None = None,
             blockwise: bool = False) -> ops.Case:
    """A random case of gemm_rs_fp8 / gemm_ar_fp8 / ag_gemm_fp8 at world p, x [M, K] and
    wt [N, K] per rank (ag_gemm_fp8: M is each rank's rows, Mp; blockwise a multiple of 4, as
    the fused kernel takes it).

    exact: x, wt in {-1, 0, 1} (exact in both formats) and per-rank scales x_scale = 2^a (a in
    -1..2), w_scale = 2^(b - a) (b in 0..1), so every partial is an integer of size at most 2 K
    and every sum one of at most 2 P K <= 256: exact in bf16, whatever order the adds land in,
    and a kernel that drops or swaps either scale is off by a power of two. rank_valued: x = 1
    on odd ranks, 0 on even ones (whose rows must then add nothing). Not exact: normal values
    and scales, checked within the case's tolerance. size "big": several tiles per owner and
    128-column panels past the first tile.

    blockwise: x's scales per row and 128 columns, w's per 128 x 128 block, K over 2 or more
    k-blocks (the last one partial). Exact: x zero but in columns 5 and 100 of each k-block, x
    scales in {1/2, 1, 2} and w scales in {1, 2}, so every sum is a multiple of 1/2 of size at
    most 8 KB P <= 128, exact in bf16; a scale of the wrong block or row changes it."""
    if blockwise:
        return _fp8_block_case(op, p, rng, size=size, formats=formats, exact=exact)
    big = size == "big"
    xf, wf = formats or tuple(str(f) for f in rng.choice(FP8_FORMATS, 2))
    kmax = max(16, 128 // p // 16 * 16) if exact else 512
    k = 16 * int(rng.integers(1, kmax // 16 + 1)) if not big else kmax
    n = 8 * int(rng.integers(1, 60)) if not big else 1032
    m = _fp8_rows(op, p, rng, big, blockwise=False)
    if exact:
        xs = [np.full((m, k), float(r % 2)) if rank_valued else ops.integers(rng, (m, k), -1, 2)
              for r in range(p)]
        wts = [ops.integers(rng, (n, k), -1, 2) for _ in range(p)]
        a = rng.integers(-1, 3, p)
        b = rng.integers(0, 2, p)
        x_scales = [2.0 ** int(v) for v in a]
        w_scales = [2.0 ** int(bv - av) for av, bv in zip(a, b)]
    else:
        xs = [rng.standard_normal((m, k)) for _ in range(p)]
        wts = [rng.standard_normal((n, k)) for _ in range(p)]
        x_scales = [float(v) for v in rng.uniform(0.25, 2.0, p)]
        w_scales = [float(v) for v in rng.uniform(0.25, 2.0, p)]
    return _fp8_make(op, xs, wts, x_scales, w_scales, xf, wf, config, exact)


def _fp8_block_case(op, p, rng, *, size, formats, exact) -> ops.Case:
    big = size == "big"
    xf, wf = formats or tuple(str(f) for f in rng.choice(FP8_FORMATS, 2))
    kb = int(rng.integers(2, max(2, 16 // p) + 1)) if exact else int(rng.integers(2, 5))
    k = 128 * (kb - 1) + 16 * int(rng.integers(1, 9))
    n = 8 * int(rng.integers(1, 60)) if not big else 1032
    m = _fp8_rows(op, p, rng, big, blockwise=True)
    nb = -(-n // 128)
    if exact:
        keep = np.isin(np.arange(k) % 128, (5, 100))
        xs = [ops.integers(rng, (m, k), -1, 2) * keep for _ in range(p)]
        wts = [ops.integers(rng, (n, k), -1, 2) for _ in range(p)]
        x_scales = [2.0 ** rng.integers(-1, 2, (m, kb)) for _ in range(p)]
        w_scales = [2.0 ** rng.integers(0, 2, (kb, nb)) for _ in range(p)]
    else:
        xs = [rng.standard_normal((m, k)) for _ in range(p)]
        wts = [rng.standard_normal((n, k)) for _ in range(p)]
        x_scales = [rng.uniform(0.25, 2.0, (m, kb)) for _ in range(p)]
        w_scales = [rng.uniform(0.25, 2.0, (kb, nb)) for _ in range(p)]
    return _fp8_make(op, xs, wts, x_scales, w_scales, xf, wf, None, exact)


def _fp8_rows(op, p, rng, big, *, blockwise) -> int:
    """x's rows: M (gemm_rs_fp8: P x an odd count; gemm_ar_fp8: any), or ag_gemm_fp8's Mp
    (odd per tensor, where row blocks straddle owners; blockwise a multiple of 4)."""
    if op == "gemm_rs_fp8":
        return p * int(rng.integers(1, 120)) if not big else p * 300
    if op == "ag_gemm_fp8":
        if blockwise:
            return 4 * int(rng.integers(1, 60)) if not big else 300
        return int(rng.integers(1, 150)) if not big else 301
    return int(rng.integers(1, 400)) if not big else 8 * 300 + 5


def _fp8_make(op, xs, wts, x_scales, w_scales, xf, wf, config, exact) -> ops.Case:
    if op == "ag_gemm_fp8":
        return ops.ag_gemm_fp8(xs, wts, x_scales, w_scales, x_format=xf, w_format=wf,
                               config=config, exact=exact)
    make = ops.gemm_rs_fp8 if op == "gemm_rs_fp8" else ops.gemm_ar_fp8
    return make(xs, wts, x_scales, w_scales, x_format=xf, w_format=wf, config=config,
                exact=exact)


# ---------------------------------------------------------------------------------------------
# Expert-parallel MoE (pk_jax.testing.ops.MOE)

def moe_ids(rng: np.random.Generator, p: int, t: int, k: int, num_experts: int,
            skew: bool) -> np.ndarray:
    """[P, T, k] expert ids: uniform, or Zipf-like (a few hot experts, many empty ones)."""
    if skew:
        return np.minimum(rng.zipf(1.4, (p, t, k)) - 1, num_experts - 1).astype(np.int32)
    return rng.integers(0, num_experts, (p, t, k)).astype(np.int32)


def moe_case(op: str, p: int, rng: np.random.Generator, *, size: str = "small",
             dtype: str | None = None, rank_valued: bool = False, t: int | None = None,
             capacity: str | None = None, skew: bool | None = None) -> ops.Case:
    """A random exact case of a MoE op at world p: odd T and H, k in 1..8, skewed or uniform
    routing, capacity generous, exact or tight (overflow: drops). x = rank + 0 when
    rank_valued (every received row names its sender)."""
    big = size == "big"
    t = t if t is not None else (int(rng.integers(1, 160)) if not big else 1024)
    k = int(rng.choice([1, 2, 3, 4, 8])) if not big else 8
    num_experts = p * int(rng.integers(1, 9)) if not big else 32 * p
    h = int(rng.choice([1, 3, 8, 24, 64, 200])) if not big else 1024
    dt = dtype or str(rng.choice(["bfloat16", "float16", "float32"]))
    skew = bool(rng.integers(0, 2)) if skew is None else skew
    ids = moe_ids(rng, p, t, k, num_experts, skew)
    total = p * t * k
    kind = capacity or ("exact" if big else str(rng.choice(["generous", "exact", "tight"])))
    cap = {"generous": total + int(rng.integers(0, 9)),
           "exact": max(1, int(np.bincount(ids.reshape(-1) // (num_experts // p),
                                           minlength=p).max())),
           "tight": max(1, total // (2 * p))}[kind]
    if op == "moe_dispatch":
        xs = [np.full((t, h), float(r)) if rank_valued else ops.integers(rng, (t, h))
              for r in range(p)]
        return ops.moe_dispatch(xs, ids, dt, num_experts=num_experts, capacity=cap)
    if op == "moe_scatter":
        rows = [np.full((t * k, h), float(r)) if rank_valued else ops.integers(rng, (t * k, h))
                for r in range(p)]
        return ops.moe_scatter(rows, ids, dt, num_experts=num_experts, capacity=cap)
    ys = [np.full((cap, h), float(r + 1)) if rank_valued else ops.integers(rng, (cap, h))
          for r in range(p)]
    weights = rng.integers(0, 5, (p, t, k)).astype(np.float32) / 4
    return ops.moe_combine(ys, weights, ids, dt, num_experts=num_experts,
                           gather=op == "moe_gather")


# ---------------------------------------------------------------------------------------------
# Sequence-parallel attention (pk_jax.testing.ops.ATTENTION)

def ring_case(p: int, rng: np.random.Generator, *, dtype: str | None = None,
              size: str = "small", s_local: int | None = None, causal: bool | None = None,
              zigzag: bool | None = None, h: int | None = None, hkv: int | None = None,
              d: int | None = None, b: int | None = None, num_comm_sms: int | None = None,
              backward: bool = False) -> ops.Case:
    """A random ring attention case at world p: normal inputs, S/P often not a multiple of the
    128-row tile (even, so zigzag applies), GQA or not, causal or not, zigzag or contiguous.
    size "groups": a non-causal forward of 2-16 waves of compute blocks on a default partition
    at P = 4 and 8 (128 items, two communication blocks), so it takes step groups there
    (ring_attn.cuh step_groups; P = 2 takes none), and fits the default 16 MiB workspace."""
    if size == "groups" and not backward:
        return ring_case(p, rng, dtype=dtype, s_local=512, causal=False, zigzag=False, h=32,
                         hkv=2, d=128, b=1, num_comm_sms=2)
    big = size == "big"
    dt = dtype or str(rng.choice(["bfloat16", "float16"]))
    d = d or int(rng.choice([64, 128]))
    sl = s_local or (int(rng.choice([2, 64, 128, 130, 200, 256, 384])) if not big else 1024)
    hkv = hkv or int(rng.choice([1, 2]))
    h = h or hkv * int(rng.choice([1, 2, 4]))
    b = b or (1 if backward else int(rng.integers(1, 3)))  # backward: P fp32 dK/dV blocks
    causal = bool(rng.integers(0, 2)) if causal is None else causal
    zigzag = bool(rng.integers(0, 2)) if zigzag is None else zigzag
    nc = num_comm_sms or int(rng.integers(1, 5))

    def normal(shape):
        return rng.standard_normal(shape)

    qs = [normal((b, sl, h, d)) for _ in range(p)]
    ks = [normal((b, sl, hkv, d)) for _ in range(p)]
    vs = [normal((b, sl, hkv, d)) for _ in range(p)]
    if backward:  # the fused backward (ring_attn_bwd): dO random as well
        dos = [normal((b, sl, h, d)) for _ in range(p)]
        return ops.ring_attn_bwd(qs, ks, vs, dos, dt, causal=causal, zigzag=zigzag,
                                 num_comm_sms=nc)
    return ops.ring_attn(qs, ks, vs, dt, causal=causal, zigzag=zigzag, num_comm_sms=nc)


def fused_case(p: int, rng: np.random.Generator, *, size: str = "small",
               dtype: str | None = None, t: int | None = None, capacity: str | None = None,
               skew: bool | None = None, num_comm_sms: int = 0) -> ops.Case:
    """A random exact case of moe_dispatch_gemm at world p: x in {-1, 0, 1}, w in {-1, 0, 1}
    and H <= 256, so every product is an integer exact in bf16 and fp16. size "many": one
    expert per rank and T k / E = 4096 slots of each source per expert (2 MiB of rows)."""
    big = size == "big"
    many = size == "many"
    t = t if t is not None else (1024 if big else 4096 if many else int(rng.integers(1, 160)))
    k = 8 if big else p if many else int(rng.choice([1, 2, 4, 8]))
    num_experts = 32 * p if big else p if many else p * int(rng.integers(1, 9))
    h = 256 if big or many else int(rng.choice([64, 128, 256]))
    n = 512 if big else 64 if many else int(rng.choice([8, 64, 264, 512]))
    dt = dtype or str(rng.choice(["bfloat16", "float16"]))
    skew = bool(rng.integers(0, 2)) if skew is None else skew
    ids = moe_ids(rng, p, t, k, num_experts, skew)
    total = p * t * k
    kind = capacity or ("exact" if big else str(rng.choice(["generous", "exact", "tight"])))
    cap = {"generous": total + int(rng.integers(0, 9)),
           "exact": max(1, int(np.bincount(ids.reshape(-1) // (num_experts // p),
                                           minlength=p).max())),
           "tight": max(1, total // (2 * p))}[kind]
    xs = [ops.integers(rng, (t, h), -1, 2) for _ in range(p)]
    ws = [ops.integers(rng, (num_experts // p, h, n), -1, 2) for _ in range(p)]
    return ops.moe_dispatch_gemm(xs, ids, ws, dt, num_experts=num_experts, capacity=cap,
                                 num_comm_sms=num_comm_sms)


def gemm_combine_case(p: int, rng: np.random.Generator, *, size: str = "small",
                      dtype: str | None = None, t: int | None = None,
                      capacity: str | None = None, skew: bool | None = None,
                      rank_valued: bool = False, empty_odd: bool = False) -> ops.Case:
    """A random exact case of moe_gemm_combine at world p: h and w in {-1, 0, 1}, F <= 256, so
    every product is an integer exact in bf16 and fp16, and weights in quarters (exact fp32
    sums). rank_valued: h = rank + 1 and one 1 per column of w, so every expert output row is
    its rank + 1 and out[t] = sum_j w[t, j] (dest + 1) names the ranks. Rows of h past the kept
    ones are random (the kernel must not read them). empty_odd: only even experts chosen."""
    big = size == "big"
    t = t if t is not None else (int(rng.integers(1, 160)) if not big else 1024)
    k = int(rng.choice([1, 2, 4, 8])) if not big else 8
    num_experts = p * int(rng.integers(1, 9)) if not big else 32 * p
    f = int(rng.choice([64, 128, 256])) if not big else 256
    n = int(rng.choice([8, 64, 264, 512])) if not big else 512
    dt = dtype or str(rng.choice(["bfloat16", "float16"]))
    skew = bool(rng.integers(0, 2)) if skew is None else skew
    ids = moe_ids(rng, p, t, k, num_experts, skew)
    if empty_odd:
        num_experts = max(num_experts, 2 * p)
        ids = 2 * rng.integers(0, num_experts // 2, (p, t, k)).astype(np.int32)
    total = p * t * k
    kind = capacity or ("exact" if big else str(rng.choice(["generous", "exact", "tight"])))
    cap = {"generous": total + int(rng.integers(0, 9)),
           "exact": max(1, int(np.bincount(ids.reshape(-1) // (num_experts // p),
                                           minlength=p).max())),
           "tight": max(1, total // (2 * p))}[kind]
    el = num_experts // p
    if rank_valued:
        hs = [np.full((cap, f), float(r + 1)) for r in range(p)]
        ws = []
        for _ in range(p):
            w = np.zeros((el, f, n))
            w[np.arange(el)[:, None], rng.integers(0, f, (el, n)), np.arange(n)[None, :]] = 1.0
            ws.append(w)
    else:
        hs = [ops.integers(rng, (cap, f), -1, 2) for _ in range(p)]
        ws = [ops.integers(rng, (el, f, n), -1, 2) for _ in range(p)]
    weights = rng.integers(0, 5, (p, t, k)).astype(np.float32) / 4
    return ops.moe_gemm_combine(hs, ws, weights, ids, dt, num_experts=num_experts, capacity=cap)


def ulysses_case(p: int, rng: np.random.Generator, *, dtype: str | None = None,
                 size: str = "small", s_local: int | None = None, causal: bool | None = None,
                 h: int | None = None, hkv: int | None = None, d: int | None = None,
                 b: int | None = None, num_comm_sms: int | None = None) -> ops.Case:
    """A random Ulysses attention case at world p: normal inputs, S/P often not a multiple of
    the 128-row tile, P dividing H and Hkv (1 or 2 K/V heads per rank), GQA or not, causal or
    not."""
    big = size == "big"
    dt = dtype or str(rng.choice(["bfloat16", "float16"]))
    d = d or int(rng.choice([64, 128]))
    sl = s_local or (int(rng.choice([1, 2, 64, 128, 130, 200, 256])) if not big else 1024)
    hkv = hkv or p * int(rng.choice([1, 2]))
    h = h or hkv * int(rng.choice([1, 2]))
    b = b or int(rng.integers(1, 3))
    causal = bool(rng.integers(0, 2)) if causal is None else causal
    nc = num_comm_sms or int(rng.integers(1, 5))

    def normal(shape):
        return rng.standard_normal(shape)

    qs = [normal((b, sl, h, d)) for _ in range(p)]
    ks = [normal((b, sl, hkv, d)) for _ in range(p)]
    vs = [normal((b, sl, hkv, d)) for _ in range(p)]
    return ops.ulysses_attn(qs, ks, vs, dt, causal=causal, num_comm_sms=nc)


def ulysses_bwd_case(p: int, rng: np.random.Generator, *, dtype: str | None = None,
                     size: str = "small", s_local: int | None = None,
                     causal: bool | None = None, h: int | None = None, hkv: int | None = None,
                     d: int | None = None, b: int | None = None,
                     num_comm_sms: int | None = None) -> ops.Case:
    """A random case of the fused Ulysses backward (ulysses_attn_bwd) at world p: the float32
    reference of ops.ring_attn_bwd (contiguous) over normal q, k, v, dO, laid out for the fused
    call (pk_jax.testing.ulysses_bwd.fused_reference); S/P often not a multiple of the 128-row
    tile, P dividing H and Hkv, GQA or not, causal or not, batch 1 unless asked."""
    hkv = hkv or p * int(rng.choice([1, 2]))
    sl = s_local or (int(rng.choice([1, 2, 64, 128, 130, 200, 256])) if size != "big" else 1024)
    ref = ring_case(p, rng, dtype=dtype, size=size, s_local=sl, causal=causal, zigzag=False,
                    h=h or hkv * int(rng.choice([1, 2])), hkv=hkv, d=d, b=b, backward=True)
    return fused_reference(ref, num_comm_sms=num_comm_sms or int(rng.integers(1, 5)))


def world_cache(**world_kw):
    """A generator for a module-scoped pytest fixture: yields get(p, **kw), one World per (P,
    options) reused by the module's tests (creating one takes ~100 ms), closed at the end."""
    from pk_jax.testing import World

    made: dict = {}

    def get(p: int, **kw):
        key = (p, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = World(p, timeout_s=10.0, **world_kw, **kw)
        return made[key]

    yield get
    for w in made.values():
        w.close()


def run_calls(world, cases, rng, *, skew_ns: int, poison: int = 0xFF) -> list[str]:
    """Queues every case on poisoned outputs (each rank after a random delay up to skew_ns),
    synchronizes once, and returns every output's problems."""
    calls = [ops.Call(world, c, poison=poison) for c in cases]
    try:
        for c in calls:
            delays = ([int(d) for d in rng.integers(0, skew_ns + 1, world.world)]
                      if skew_ns else None)
            c.launch(delays_ns=delays)
        world.synchronize()
        return [p for c in calls for p in c.check()]
    finally:
        for c in calls:
            c.free()


def failure(mode: str, *args: str) -> dict:
    """tests/gpu/emu_failures.py MODE ARGS in a subprocess (a trap leaves its CUDA context
    unusable); its last JSON line."""
    script = os.path.join(os.path.dirname(__file__), "emu_failures.py")
    out = subprocess.run([sys.executable, script, mode, *args], capture_output=True, text=True,
                         timeout=120, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result from {mode} {args}: rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    return json.loads(lines[-1])

"""The masked pk.attention kernels against the issue 38 speed targets with masks, on one GPU:
packed documents no slower than the same documents one call each, and a sliding window of W
keys costing O(S W).

The masked calls run the masked kernels through their entry
`pk_jax.ops.attention._kernel_attention_masked` (where pk.attention's masked calls go on the
GPU); the unmasked calls are pk.attention's kernels.

Modes (`--mode`, default both):
- `packed`: B rows of S = 16K tokens (`--seq`), each packed with documents of mixed lengths
  (64 .. 4K, seeded), causal within each document through segment ids, against the same
  documents as one causal pk.attention call each, all calls in one jitted function (the
  documents sliced beforehand). Goal: ratio = per-document time / packed time >= 1.0.
  `tflops` counts the FLOPs of the visible pairs only (4 H D per pair forward, 3.5 times that
  forward+backward), the same for both sides; `tile_tflops` counts the FLOPs of the key tiles
  the masked forward computes (every tile with a visible pair, 128 or 192 query rows by 128
  keys), the work it does.
- `window`: a causal sliding window of W keys (local_window_size=(W - 1, 0)) at S in 4K .. 32K,
  against pk.attention's causal kernel at the same S (`ratio` = causal time / window time).
  Goal: time per S W flat in S (`us_per_mega_sw`; the summary prints the growth from the
  smallest S to the largest over the growth of S, 1.0 for O(S W)).

First a correctness check of every masked configuration (and of the per-document calls): the
forward output and, with the backward, dq, dk and dv on the first K/V head group against the
float32 reference (pk_jax's blockwise attention with the same masks); an error within twice the
reference's own error in q's dtype plus 2e-3 of its largest value plus 1e-3 passes. A failing
configuration is reported and left out, and the run exits 1 at the end. Then the timing:
batches of back-to-back jitted calls, the two sides' batches interleaved (bench/common.py),
median per call. Rows go to bench/results/attention_masks.jsonl: `op` "attention", `mask`
"segments" | "window", `baseline` "per_document" | "causal", `pass` "forward" |
"forward+backward", `ratio` = baseline time / ours, plus the mode's fields above.

On the H200, from the repository root with the extension built:

    python bench/bench_attention_masks.py [--mode packed|window] [--quick] [--no-bwd]

`--smoke` runs the script's paths on tiny shapes on any machine (the reference stands in for
the masked kernels where they do not run; rows go to --out only).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

import common
import jax
import jax.numpy as jnp
import numpy as np

import pk_jax as pk
from pk_jax.ops import _attention
from pk_jax.ops import attention as att

PASSES = (("forward", 1.0), ("forward+backward", 3.5))  # FLOPs relative to the forward's
KEYS = 128  # the masked forward's key tile (cuda/kernels/attention.cuh fwd_masked_keys)


def rows_per_block(d: int, softcap: bool = False) -> int:
    """The masked forward's query rows per block (attention.cuh fwd_masked_rows)."""
    return 64 * (2 if softcap or d != 64 else 3)


def document_lengths(total: int, seed: int, lo: int = 64, hi: int = 4096) -> list[int]:
    """Lengths of mixed sizes (log-uniform in [lo, hi], seeded) filling `total` exactly."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < total:
        n = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
        out.append(min(n, total - sum(out)))
    return out


def packed_ids(lengths_per_row: list[list[int]]) -> np.ndarray:
    return np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row]).astype(
        np.int32)


def visible_pairs_causal_docs(lengths_per_row) -> int:
    return sum(n * (n + 1) // 2 for ls in lengths_per_row for n in ls)


def _tile_pairs_docs(ids: np.ndarray, bm: int) -> int:
    """Pairs of the tiles the masked forward computes for causal documents `ids` [B, S]:
    every (bm rows, KEYS keys) tile with a visible pair (the tile ranges are exact for packed
    documents)."""
    b, s = ids.shape
    total = 0
    for r in range(b):
        for q0 in range(0, s, bm):
            rows = ids[r, q0:q0 + bm]
            for k0 in range(0, min(s, q0 + bm), KEYS):
                keys = ids[r, k0:k0 + KEYS]
                qi = np.arange(q0, q0 + len(rows))[:, None]
                kj = np.arange(k0, k0 + len(keys))[None, :]
                if ((rows[:, None] == keys[None, :]) & (kj <= qi)).any():
                    total += bm * KEYS
    return total


def _inputs(b, s, h, hkv, d, dtype, seed):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
    return mk(kq, h), mk(kk, hkv), mk(kv, hkv), mk(kd, h)


def _vjp(fn):
    def f(q, k, v, do):
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(do)
    return f


def _first_group(x, heads):
    return x[:, :, :heads]


def check(fn, ref, inputs, bwd: bool) -> tuple[float, str]:
    """(largest error / tolerance, its quantity) of `fn` against the float32 `ref` on the first
    K/V head group; tolerance 2 * (ref's error in q's dtype) + 2e-3 * scale + 1e-3."""
    q, k = inputs[:2]
    g = q.shape[2] // k.shape[2]
    heads = {"out": g, "dq": g, "dk": 1, "dv": 1}
    f32 = [x.astype(jnp.float32) for x in inputs]

    def run(f, args):
        if bwd:
            o, (dq, dk, dv) = jax.jit(_vjp(f))(*args)
            got = {"out": o, "dq": dq, "dk": dk, "dv": dv}
        else:
            got = {"out": jax.jit(f)(*args[:3])}
        return {n: _first_group(x, heads[n]).astype(jnp.float32) for n, x in got.items()}

    want, got, same = run(ref, f32), run(fn, inputs), run(ref, inputs)
    worst = (0.0, "")
    for n, w in want.items():
        err = float(jnp.max(jnp.abs(got[n] - w)))
        yard = float(jnp.max(jnp.abs(same[n] - w)))
        tol = 2 * yard + 2e-3 * float(jnp.max(jnp.abs(w))) + 1e-3
        worst = max(worst, (err / tol if math.isfinite(err) else math.inf, n))
    return worst


def masked_fn(masks, scale, causal, window=None, softcap=None, *, kernel: bool):
    """The masked kernels' entry, or (kernel False: --smoke off the GPU) the reference."""
    if kernel:
        return lambda q, k, v: att._kernel_attention_masked(q, k, v, masks, scale, causal,
                                                            window, softcap)
    return lambda q, k, v: att.reference(q, k, v, causal=causal, scale=scale, window=window,
                                         softcap=softcap, masks=masks)


def time_pair(ours, base, args, bwd: bool, iters: int, reps: int) -> dict:
    """pass -> (ours us, baseline us), interleaved."""
    out = {}
    for name, _ in PASSES:
        if name == "forward+backward" and not bwd:
            continue
        if name == "forward":
            fns = {"ours": jax.jit(lambda q, k, v, do, *r: ours(q, k, v, *r)),
                   "base": jax.jit(lambda q, k, v, do, *r: base(q, k, v, *r))}
        else:
            fns = {"ours": jax.jit(lambda q, k, v, do, *r: _vjp(
                       lambda a, b, c: ours(a, b, c, *r))(q, k, v, do)),
                   "base": jax.jit(lambda q, k, v, do, *r: _vjp(
                       lambda a, b, c: base(a, b, c, *r))(q, k, v, do))}
        t = common.time_us_interleaved(fns, args, iters=iters, reps=reps)
        out[name] = (t["ours"][0], t["base"][0])
    return out


def run_packed(a, kernel: bool, wrong: list, summary: list) -> None:
    b, s, h, hkv, d = a.batch, a.seq, a.heads, a.kv_heads, a.head_dim
    lengths = [document_lengths(s, seed=17 + r, hi=min(4096, s // 4)) for r in range(b)]
    ids = jnp.asarray(packed_ids(lengths))
    masks = _attention.Masks(ids, ids, None, None)
    scale = 1 / math.sqrt(d)
    q, k, v, do = _inputs(b, s, h, hkv, d, a.dtype, seed=s + d)
    bounds = [(r, sum(ls[:i]), sum(ls[:i + 1])) for r, ls in enumerate(lengths)
              for i in range(len(ls))]
    packed = masked_fn(masks, scale, True, kernel=kernel)

    def per_doc(q, k, v):  # the same documents, one causal call each, back in packed layout
        outs = [pk.attention(q[r:r + 1, lo:hi], k[r:r + 1, lo:hi], v[r:r + 1, lo:hi],
                             causal=True, scale=scale) for r, lo, hi in bounds]
        rows = [jnp.concatenate([o for (r2, _, _), o in zip(bounds, outs) if r2 == r], axis=1)
                for r in range(b)]
        return jnp.concatenate(rows, axis=0)

    ref = lambda q, k, v: att.reference(q, k, v, causal=True, scale=scale, masks=masks)
    bwd = not a.no_bwd
    for name, fn in (("packed", packed), ("per_document", per_doc)):
        ratio, qty = check(fn, ref, (q, k, v, do), bwd)
        print(f"check {name}: worst {qty} at {ratio:.2f} of the tolerance")
        if ratio > 1:
            wrong.append(f"packed {name}")
            return
    # The documents sliced beforehand, as a user of per-document calls holds them.
    docs = jax.block_until_ready([tuple(x[r:r + 1, lo:hi] for x in (q, k, v, do))
                                  for r, lo, hi in bounds])
    one = lambda x, y, z: pk.attention(x, y, z, causal=True, scale=scale)
    times = {}
    for name, _ in PASSES:
        if name == "forward+backward" and not bwd:
            continue
        if name == "forward":
            fns = {"ours": jax.jit(lambda q, k, v, do, docs: packed(q, k, v)),
                   "base": jax.jit(lambda q, k, v, do, docs: [one(*x[:3]) for x in docs])}
        else:
            fns = {"ours": jax.jit(lambda q, k, v, do, docs: _vjp(packed)(q, k, v, do)),
                   "base": jax.jit(lambda q, k, v, do, docs: [_vjp(one)(*x) for x in docs])}
        t = common.time_us_interleaved(fns, [(q, k, v, do, docs)], iters=a.iters, reps=a.reps)
        times[name] = (t["ours"][0], t["base"][0])
    pairs = visible_pairs_causal_docs(lengths)
    tile_pairs = _tile_pairs_docs(np.asarray(ids), rows_per_block(d))
    docs_n = sum(len(ls) for ls in lengths)
    for name, mult in PASSES:
        if name not in times:
            continue
        us, base_us = times[name]
        flops = 4 * h * d * pairs * mult
        tile_flops = 4 * h * d * tile_pairs * mult
        row = common.record(
            op="attention", shape={"b": b, "s": s, "h": h, "hkv": hkv, "d": d,
                                   "documents": docs_n},
            dtype=np.dtype(a.dtype).name, world=1, processes=1, median_us=us,
            baseline="per_document", baseline_median_us=base_us, tflops=flops / us / 1e6,
            path=a.out, mask="segments", causal=True, **{"pass": name},
            tile_tflops=round(tile_flops / us / 1e6, 2),
            baseline_tflops=round(flops / base_us / 1e6, 2), kernel=kernel)
        summary.append(("packed", name, row["ratio"]))
        print(f"packed B={b} S={s} H={h}/{hkv} D={d} {docs_n} documents, {name}: "
              f"{us:9.1f} us ({row['tflops']} TF/s visible, {row['tile_tflops']} TF/s of "
              f"tiles) vs per-document {base_us:9.1f} us: {row['ratio']:.3f}x")


def run_window(a, kernel: bool, wrong: list, summary: list) -> None:
    h, hkv, d = a.heads, a.kv_heads, a.head_dim
    scale = 1 / math.sqrt(d)
    seqs = [s for s in (4096, 8192, 16384, 32768) if s <= a.max_seq] or [a.max_seq]
    bwd = not a.no_bwd
    for w in a.windows:
        per_sw = {}
        for s in seqs:
            q, k, v, do = _inputs(1, s, h, hkv, d, a.dtype, seed=s + w)
            window = (w - 1, 0)
            fn = masked_fn(None, scale, True, window, kernel=kernel)
            ref = lambda q, k, v, window=window: att.reference(q, k, v, causal=True,
                                                               scale=scale, window=window)
            ratio, qty = check(fn, ref, (q, k, v, do), bwd)
            print(f"check window W={w} S={s}: worst {qty} at {ratio:.2f} of the tolerance")
            if ratio > 1:
                wrong.append(f"window W={w} S={s}")
                continue
            causal = lambda q, k, v: pk.attention(q, k, v, causal=True, scale=scale)
            times = time_pair(fn, causal, [(q, k, v, do)], bwd, a.iters, a.reps)
            pairs = sum(min(i + 1, w) for i in range(s))
            for name, mult in PASSES:
                if name not in times:
                    continue
                us, base_us = times[name]
                row = common.record(
                    op="attention", shape={"b": 1, "s": s, "h": h, "hkv": hkv, "d": d,
                                           "window": w},
                    dtype=np.dtype(a.dtype).name, world=1, processes=1, median_us=us,
                    baseline="causal", baseline_median_us=base_us,
                    tflops=4 * h * d * pairs * mult / us / 1e6, path=a.out, mask="window",
                    causal=True, **{"pass": name},
                    us_per_mega_sw=round(us / (s * w / 1e6), 3), kernel=kernel)
                per_sw.setdefault(name, []).append((s, us))
                print(f"window W={w} S={s} H={h}/{hkv} D={d}, {name}: {us:9.1f} us "
                      f"({row['us_per_mega_sw']} us per M S*W, {row['tflops']} TF/s) vs causal "
                      f"{base_us:9.1f} us: {row['ratio']:.3f}x")
        for name, pts in per_sw.items():
            if len(pts) > 1:
                (s0, t0), (s1, t1) = pts[0], pts[-1]
                growth = (t1 / t0) / (s1 / s0)
                summary.append((f"window W={w} growth", name, growth))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("packed", "window", "both"), default="both")
    ap.add_argument("--seq", type=int, default=16384, help="packed: tokens per row")
    ap.add_argument("--batch", type=int, default=2, help="packed: rows")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--windows", default="256,1024", help="window: W values")
    ap.add_argument("--max-seq", type=int, default=32768, help="window: the largest S")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, S up to 16K")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on any machine (the reference where the kernels do not "
                         "run); rows to --out only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=pathlib.Path, default=common.RESULTS / "attention_masks.jsonl")
    a = ap.parse_args()
    a.kv_heads = a.kv_heads or a.heads
    a.dtype = jnp.dtype(a.dtype)
    a.windows = [int(x) for x in a.windows.split(",")]
    if a.quick:
        a.reps, a.max_seq = 5, min(a.max_seq, 16384)
    if a.smoke:
        a.seq, a.batch, a.heads, a.kv_heads, a.head_dim = 512, 1, 2, 1, 64
        a.windows, a.max_seq, a.iters, a.reps = [64], 4096, 2, 2
        if a.out == common.RESULTS / "attention_masks.jsonl":
            a.out = pathlib.Path("/tmp/attention_masks_smoke.jsonl")
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices()[:1])
    pk.init(mesh)
    kernel = pk.backend_name(att.NAME) == "cuda"
    if not kernel and not a.smoke:
        print("the masked kernels need an sm_90 GPU and the pk_jax extension (--smoke runs the "
              "reference instead)")
        return 2
    wrong, summary = [], []
    if a.mode in ("packed", "both"):
        run_packed(a, kernel, wrong, summary)
    if a.mode in ("window", "both"):
        run_window(a, kernel, wrong, summary)
    for what, name, value in summary:
        goal = "goal >= 1.0" if what == "packed" else "1.0 is O(S W)"
        print(f"{what} {name}: {value:.3f} ({goal})")
    if wrong:
        print("FAILED the correctness check:", ", ".join(wrong))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fused Ulysses attention forward (pk_ulysses_attn), emulated at P = 2, 4, 8 (pk_jax.testing.World:
P green-context partitions of one GPU, the FFI handler's launcher), against the unfused
all-to-all / attention / all-to-all in the same run.

Per shape (per rank: B = 1, S/P local positions, H = 8 P heads (8 per head group), Hkv = H,
D = 128, bf16; causal and not):
- fused: one pk_ulysses_attn call on every rank (communication blocks, the op's
  FWD_COMM_SMS unless --num-comm-sms, push the head-group slices of q, k, v to their owners
  while the attention blocks start on the rows that have landed; a tail kernel pulls the
  output rows back);
- baseline (unfused, serial on each rank's stream): the pk all_to_all kernel for q, k and v
  (inputs already laid out head-group-major, so each is one contiguous all-to-all), the
  pk.attention forward over the whole sequence for the rank's head group, and the pk
  all_to_all of the output back. The layout transposes around the all-to-alls are not
  counted, which favours the baseline. `attention_only_us` is the baseline's attention alone
  (its compute floor: unfused minus attention alone is what its exchanges cost).

What the numbers mean: each emulated rank has 1/P of the SMs, and all ranks share one HBM, so
"links" run at the shared-HBM rate, not NVLink's; every row says `"emulated": true`.

Correctness first: before timing, ranks 0 and P - 1 of the fused call are compared (head 0 and
head H - 1, all rows) with a float32 numpy reference over the whole sequence (bf16 tolerance),
and the baseline's attention output with the fused one. Timing: back-to-back calls on every
rank's stream, no host synchronisation inside a batch, wall clock per call, median of 5
batches of 10.

Backward (run_shape_bwd): the kernel-backed composed backward that pk.ulysses_attention's VJP
runs on GPUs (pk_jax.testing.ulysses_bwd.UlyssesBackward: pk all_to_all of q, dO, k, v and
(lse, delta) to head shards, the pk.attention backward for the head group, all_to_all of dq,
dk, dv back; delta's XLA reduction not counted) against the fused ring backward
(pk_ring_attn_bwd) at the same shape, the other sequence-parallel backward, in the same run;
`attention_only_us` is the head-group attention backward alone (the composed path's compute
floor). Then the fused Ulysses backward (pk_ulysses_attn_bwd, FusedUlyssesBackward: q, k, v
and lse already in head shards, as the composed forward keeps them; dO and delta exchanged
inside the kernel, dq, dk, dv pulled back by its tail kernel) against the composed backward,
rows in bench/results/ulysses_attention_bwd_fused.jsonl (ratio = composed / fused). Before
timing, heads 0 and H - 1 (their lse and delta exact, the other heads' random finite
stand-ins) are compared on ranks 0 and P - 1 with a float32 numpy reference over the whole
sequence (the ring backward's tolerance) for both Ulysses backwards, the fused backward's
gradients with the composed one's at every head of those ranks, and the ring backward's
gradients must come out finite. 2.5 x the forward's FLOPs; median of 3 batches of 5.

    CUDA_MODULE_LOADING=EAGER python bench/bench_ulysses_attn.py [--quick] [--forward-only]
        [--num-comm-sms C] [--bwd-comm-sms C] [--worlds 2,4,8]

--quick: S/P = 2048 only, the backward causal only (about 2 min on the H200, estimated).
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax.ops import ring_attn, ulysses_attn
from pk_jax.testing import DeviceBuffer, World, ops
from pk_jax.testing.emulator import DTYPES, np_dtype
from pk_jax.testing.ulysses_bwd import (
    FusedUlyssesBackward,
    UlyssesBackward,
    fused_workspace_bytes,
)

MACHINE = "h200-emulated"
LINK = "shared HBM (unthrottled)"
BF16 = "bfloat16"
B, GROUP, D = 1, 8, 128  # GROUP: query (and K/V) heads per rank
NUM_COMM_SMS = ulysses_attn.NUM_COMM_SMS  # the fused backward's (the op's default)
FWD_COMM_SMS = ulysses_attn.FWD_COMM_SMS  # the fused forward's (the op's default; --num-comm-sms)


def _reference_head(q, k_all, v_all, hh: int, q_pos, causal: bool, scale: float):
    """o [S/P, D] of head hh (batch 0) in float32."""
    sc = (q[0, :, hh].astype(np.float32) @ k_all[0, :, hh].T.astype(np.float32)) * scale
    if causal:
        sc = np.where(np.arange(k_all.shape[1])[None, :] > q_pos[:, None], -np.inf, sc)
    e = np.exp(sc - sc.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v_all[0, :, hh].astype(np.float32)


def _group_major(x: np.ndarray, p: int) -> np.ndarray:
    """[1, Sl, H, D] -> [P, Sl, G, D]: head group j contiguous (the all-to-all's chunk j)."""
    _, sl, h, d = x.shape
    return np.ascontiguousarray(x[0].reshape(sl, p, h // p, d).transpose(1, 0, 2, 3))


def run_shape(world: World, p: int, sl: int, causal: bool, rng, rows: list) -> None:
    dt = np_dtype(BF16)
    h = GROUP * p
    qs, ks, vs = ([rng.standard_normal((B, sl, h, D)).astype(np.float32).astype(dt)
                   for _ in range(p)] for _ in range(3))
    scale = float(1.0 / np.sqrt(D))
    params = {"b": B, "s": sl, "h": h, "hkv": h, "d": D, "scale": scale,
              "causal": int(causal), "num_comm_sms": FWD_COMM_SMS}
    # Expected outputs are placeholders (shapes for the poisoned buffers); the check below
    # computes the reference for the rows it compares.
    case = ops.Case("ulysses_attn", BF16,
                    [{"q": qs[r], "k": ks[r], "v": vs[r]} for r in range(p)],
                    [{"o": np.zeros((B, sl, h, D), dt), "lse": np.zeros((B, h, sl), np.float32)}
                     for _ in range(p)], params, exact=False)
    fused = ops.Call(world, case)
    fused.launch()
    world.synchronize()
    k_all = np.concatenate(ks, axis=1)
    v_all = np.concatenate(vs, axis=1)
    for r in (0, p - 1):
        for hh in (0, h - 1):
            got = fused.outputs(r)["o"][0, :, hh].astype(np.float32)
            want = _reference_head(qs[r], k_all, v_all, hh, r * sl + np.arange(sl), causal,
                                   scale)
            if not np.allclose(got, want, atol=2e-2, rtol=2e-2):
                raise SystemExit(f"bench_ulysses_attention: wrong result before timing (P={p}, "
                                 f"S/P={sl}, causal={causal}, rank {r}, head {hh}): max error "
                                 f"{np.abs(got - want).max()}")

    # The unfused baseline: all_to_all of q, k, v (head-group-major), attention over the whole
    # sequence of the rank's head group, all_to_all of the output back.
    a2a = [ops.Call(world, ops.all_to_all([_group_major(x, p) for x in xs], BF16, 0, 0))
           for xs in (qs, ks, vs)]
    out_back = ops.Call(world, ops.all_to_all(
        [np.zeros((p, sl, GROUP, D), dt) for _ in range(p)], BF16, 0, 0))
    lse_tmp = [DeviceBuffer(B * GROUP * sl * p * 4) for _ in range(p)]

    def attention_only():
        for r in range(p):
            world.launch("attention", r, {
                "dtype": DTYPES[BF16], "q": a2a[0].buffers[r]["y"], "k": a2a[1].buffers[r]["y"],
                "v": a2a[2].buffers[r]["y"], "o": out_back.buffers[r]["x"], "lse": lse_tmp[r],
                "b": B, "s": sl * p, "h": GROUP, "hkv": GROUP, "d": D, "scale": scale,
                "causal": int(causal)})

    def unfused():
        for c in a2a:
            c.launch()
        attention_only()
        out_back.launch()

    unfused()
    world.synchronize()
    for r in (0, p - 1):  # rank r's rows of head group g come back in chunk g: [P, Sl, G, D]
        got = out_back.buffers[r]["y"].read(dt, (p, sl, GROUP, D)).astype(np.float32)
        want = fused.outputs(r)["o"][0].astype(np.float32).reshape(sl, p, GROUP, D)
        if not np.allclose(got, want.transpose(1, 0, 2, 3), atol=2e-2, rtol=2e-2):
            raise SystemExit(f"bench_ulysses_attention: the baseline disagrees with the fused "
                             f"call (P={p}, S/P={sl}, causal={causal}, rank {r})")

    t_fused = common.emulated_us(world, fused.launch)
    t_base = common.emulated_us(world, unfused)
    t_attn = common.emulated_us(world, attention_only)
    s_total = sl * p
    flops = 4 * B * h * D * s_total * s_total * (0.5 if causal else 1.0)  # all ranks
    shape = {"b": B, "s": s_total, "s_local": sl, "h": h, "hkv": h, "d": D,
             "causal": causal, "num_comm_sms": FWD_COMM_SMS}
    rows.append(common.record(
        op="ulysses_attention", shape=shape, dtype=BF16, world=p, processes=1,
        median_us=t_fused, tflops=flops / t_fused / 1e6,
        baseline="unfused: all_to_all of q, k, v, pk.attention, all_to_all back (emulated)",
        baseline_median_us=t_base, emulated=True, machine=MACHINE, link=LINK,
        sms_per_rank=world.sms[0], attention_only_us=round(t_attn, 3),
        path=common.RESULTS / "ulysses_attention.jsonl"))
    print(f"P={p} S/P={sl:5d} causal={causal!s:5s}: fused {t_fused:9.1f} us "
          f"({flops / t_fused / 1e6:6.1f} TFLOP/s over all ranks)  unfused {t_base:9.1f} us  "
          f"{t_base / t_fused:5.2f}x  (attention alone {t_attn:9.1f} us)", flush=True)
    for buf in lse_tmp:
        buf.free()
    for c in (fused, out_back, *a2a):
        c.free()


def _reference_grads_head(q, k, v, do, causal: bool, scale: float, chunk: int = 2048):
    """lse, delta [S] and dq, dk, dv [S, D] of one head over the whole sequence (float32
    numpy, query rows in chunks)."""
    s = q.shape[0]
    lse, delta = np.empty(s, np.float32), np.empty(s, np.float32)
    dq, dk, dv = (np.zeros_like(q) for _ in range(3))
    for a in range(0, s, chunk):
        sc = (q[a:a + chunk] @ k.T) * scale
        if causal:
            sc = np.where(np.arange(s)[None, :] > np.arange(a, a + sc.shape[0])[:, None],
                          -np.inf, sc)
        m = sc.max(axis=-1, keepdims=True)
        e = np.exp(sc - m)
        den = e.sum(axis=-1, keepdims=True)
        pr = e / den
        dl = np.sum(do[a:a + chunk] * (pr @ v), axis=-1)
        ds = pr * ((do[a:a + chunk] @ v.T) - dl[:, None])
        lse[a:a + chunk], delta[a:a + chunk] = (m + np.log(den))[:, 0], dl
        dq[a:a + chunk] = scale * (ds @ k)
        dk += scale * (ds.T @ q[a:a + chunk])
        dv += pr.T @ do[a:a + chunk]
    return lse, delta, dq, dk, dv


def run_shape_bwd(world: World, p: int, sl: int, causal: bool, rng, rows: list) -> None:
    """The composed Ulysses backward against the fused ring backward, and the fused Ulysses
    backward against the composed one (module docstring)."""
    dt = np_dtype(BF16)
    h = GROUP * p
    s_total = sl * p
    scale = float(1.0 / np.sqrt(D))

    def normal(shape):
        return rng.standard_normal(shape, np.float32).astype(dt)

    qs, ks, vs, dos = ([normal((B, sl, h, D)) for _ in range(p)] for _ in range(4))
    sp = -(-sl // 128) * 128
    lses = [(np.log(s_total) + rng.standard_normal((B, h, sp))).astype(np.float32)
            for _ in range(p)]
    deltas = [rng.standard_normal((B, h, sp)).astype(np.float32) for _ in range(p)]
    checked = (0, h - 1)
    want = {}
    for hh in checked:  # exact lse and delta for the checked heads
        full = [np.concatenate([x[0, :, hh] for x in xs]).astype(np.float32)
                for xs in (qs, ks, vs, dos)]
        lse, dl, *grads = _reference_grads_head(*full, causal, scale)
        want[hh] = grads
        for r in range(p):
            lses[r][0, hh, :sl] = lse[r * sl:(r + 1) * sl]
            deltas[r][0, hh, :sl] = dl[r * sl:(r + 1) * sl]

    what = f"P={p}, S/P={sl}, causal={causal}"

    def check(bwd, path: str) -> None:  # the checked heads against the float32 reference
        bwd.launch()
        world.synchronize()
        for r in (0, p - 1):
            got = bwd.grads(r)
            for hh in checked:
                for name, ref in zip(("dq", "dk", "dv"), want[hh]):
                    g = got[name][0, :, hh].astype(np.float32)
                    w = ref[r * sl:(r + 1) * sl]
                    big = max(1.0, float(np.abs(w).max()))
                    if not (np.all(np.isfinite(g)) and np.allclose(g, w, atol=1.5e-2 * big,
                                                                   rtol=1.5e-2)):
                        raise SystemExit(f"bench_ulysses_attention: wrong {name} before timing "
                                         f"({path} backward, {what}, rank {r}, head {hh}): max "
                                         f"error {np.abs(g - w).max()}")

    ulysses = UlyssesBackward(world, BF16, qs, ks, vs, dos, lses, deltas, causal=causal,
                              scale=scale)
    check(ulysses, "composed")
    fused = FusedUlyssesBackward(world, BF16, qs, ks, vs, dos, lses, deltas, causal=causal,
                                 scale=scale, num_comm_sms=NUM_COMM_SMS)
    check(fused, "fused")
    for r in (0, p - 1):  # every head, the stand-ins' too: the same inputs, the same gradients
        mine, theirs = fused.grads(r), ulysses.grads(r)
        for name, y in mine.items():
            g, w = y.astype(np.float32), theirs[name].astype(np.float32)
            big = max(1.0, float(np.abs(w).max()))
            if not (np.all(np.isfinite(g)) and np.allclose(g, w, atol=2e-2 * big, rtol=2e-2)):
                raise SystemExit(f"bench_ulysses_attention: the fused backward's {name} "
                                 f"disagrees with the composed one's before timing ({what}, "
                                 f"rank {r}): max error {np.abs(g - w).max()}")

    params = {"b": B, "s": sl, "h": h, "hkv": h, "d": D, "scale": scale,
              "causal": int(causal), "zigzag": 0, "num_comm_sms": ring_attn.NUM_COMM_SMS}
    ring = ops.Call(world, ops.Case(
        "ring_attn_bwd", BF16,
        [{"q": qs[r], "k": ks[r], "v": vs[r], "do": dos[r], "lse": lses[r], "delta": deltas[r]}
         for r in range(p)],
        [{n: np.zeros((B, sl, h, D), dt) for n in ("dq", "dk", "dv")} for _ in range(p)],
        params, exact=False))
    ring.launch()
    world.synchronize()
    for r in (0, p - 1):
        for name, y in ring.outputs(r).items():
            if not np.all(np.isfinite(y.astype(np.float32))):
                raise SystemExit(f"bench_ulysses_attention: non-finite {name} from the fused "
                                 f"ring backward (P={p}, S/P={sl}, causal={causal}, rank {r})")

    # Median of 3 batches of 5 (a call is 2.5 forwards: the quick run stays short).
    t_ours = common.emulated_us(world, ulysses.launch, iters=5, reps=3)
    t_ring = common.emulated_us(world, ring.launch, iters=5, reps=3)
    t_attn = common.emulated_us(world, ulysses.launch_attention, iters=5, reps=3)
    t_fused = common.emulated_us(world, fused.launch, iters=5, reps=3)
    flops = 10 * B * h * D * s_total * s_total * (0.5 if causal else 1.0)  # all ranks
    shape = {"b": B, "s": s_total, "s_local": sl, "h": h, "hkv": h, "d": D,
             "causal": causal, "num_comm_sms": NUM_COMM_SMS,
             "ring_comm_sms": ring_attn.NUM_COMM_SMS, "pass": "backward",
             "path": "composed"}
    rows.append(common.record(
        op="ulysses_attention", shape=shape, dtype=BF16, world=p, processes=1,
        median_us=t_ours, tflops=flops / t_ours / 1e6,
        baseline="fused ring attention backward (pk_ring_attn_bwd), same shape (emulated)",
        baseline_median_us=t_ring, attention_only_us=round(t_attn, 3), emulated=True,
        machine=MACHINE, link=LINK, sms_per_rank=world.sms[0],
        path=common.RESULTS / "ulysses_attention.jsonl"))
    print(f"P={p} S/P={sl:5d} causal={causal!s:5s} backward: composed {t_ours:9.1f} us "
          f"({flops / t_ours / 1e6:6.1f} TFLOP/s over all ranks; attention alone "
          f"{t_attn:9.1f} us)  ring fused {t_ring:9.1f} us  {t_ring / t_ours:5.2f}x",
          flush=True)
    rows.append(common.record(
        op="ulysses_attention_bwd_fused", shape={**shape, "path": "fused"}, dtype=BF16,
        world=p, processes=1, median_us=t_fused, tflops=flops / t_fused / 1e6,
        baseline="composed (pk all_to_all + pk.attention backward + all_to_all)",
        baseline_median_us=t_ours, emulated=True, machine=MACHINE, link=LINK,
        sms_per_rank=world.sms[0]))
    print(f"P={p} S/P={sl:5d} causal={causal!s:5s} backward: fused {t_fused:9.1f} us "
          f"({flops / t_fused / 1e6:6.1f} TFLOP/s over all ranks)  composed {t_ours:9.1f} us  "
          f"{t_ours / t_fused:5.2f}x", flush=True)
    for c in (ulysses, fused, ring):
        c.free()


def _workspace_bytes(p: int, sl: int) -> int:
    """The largest need of one world: the fused ring backward's (ring_attn.workspace_need_bwd:
    P - 1 K/V blocks, P fp32 dK/dV blocks and an fp32 dQ) at H = GROUP P, or the fused Ulysses
    backward's sections, else 512 MiB (the forward's sections and the all_to_alls' staging)."""
    h = GROUP * p
    qk = SimpleNamespace(shape=(B, sl, h, D), dtype=np.dtype(np.float16))  # 2 bytes, as bf16
    ring = ring_attn.workspace_need_bwd(qk, qk, p)
    need = max(ring, fused_workspace_bytes(p, B, sl, h, h, D))
    return max(512 << 20, -(-(need + (64 << 20)) // (64 << 20)) * (64 << 20))


def main() -> None:
    global FWD_COMM_SMS, NUM_COMM_SMS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="S/P = 2048 only, the backward causal only")
    parser.add_argument("--forward-only", action="store_true", help="skip the backward")
    parser.add_argument("--num-comm-sms", type=int, default=FWD_COMM_SMS,
                        help="communication blocks of the fused forward (default: the op's)")
    parser.add_argument("--bwd-comm-sms", type=int, default=NUM_COMM_SMS,
                        help="communication blocks of the fused backward (default: the op's)")
    parser.add_argument("--worlds", default="2,4,8", help="emulated world sizes, e.g. 2,4")
    args = parser.parse_args()
    FWD_COMM_SMS = args.num_comm_sms
    NUM_COMM_SMS = args.bwd_comm_sms
    rng = np.random.default_rng(0)
    rows: list = []
    for p in (int(w) for w in args.worlds.split(",")):
        sls = (2048,) if args.quick else (2048, 4096)
        # Ulysses: 2 q-sized + 2 k-sized sections (+ lse); the all_to_alls' staging the rest;
        # the ring backward (the backward's baseline) more.
        ws = 512 << 20 if args.forward_only else _workspace_bytes(p, max(sls))
        with World(p, timeout_s=30.0, workspace_bytes=ws) as world:
            for sl in sls:
                for causal in (False, True):
                    run_shape(world, p, sl, causal, rng, rows)
                    if not args.forward_only and (causal or not args.quick):
                        run_shape_bwd(world, p, sl, causal, rng, rows)
    for name, path in (("forward, fused vs unfused", None),
                       ("backward, composed vs fused ring", "composed"),
                       ("backward, fused vs composed", "fused")):
        ratios = [r["ratio"] for r in rows if r["ratio"] and r["shape"].get("path") == path]
        if ratios:
            print(f"geomean {name}: {common.geomean(ratios):.2f}x ({len(ratios)} rows, "
                  "emulated)")


if __name__ == "__main__":
    main()

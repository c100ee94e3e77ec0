"""Fused ring attention forward (pk_ring_attn) and backward (pk_ring_attn_bwd), emulated at P = 2, 4, 8 (pk_jax.testing.World:
P green-context partitions of one GPU, the FFI handler's launcher), against the unfused ring in
the same run.

Per shape (per rank: B = 1, S/P local positions, H = 8 heads, D = 128, bf16; causal contiguous
and not):
- fused: one pk_ring_attn call on every rank (K/V pushed around the ring by communication
  blocks, the op's count (ring_attn.fwd_comm_sms) unless --num-comm-sms, while the compute
  blocks fold each arriving block into their online softmax);
- baseline (unfused, no overlap): the pk all_gather kernel of every rank's [k | v] (the same
  P - 1 blocks each rank receives in the ring), then, serially on each rank's stream, one
  pk.attention forward per K/V block that causal masking does not hide (the diagonal block
  masked). The merge of the P partial results is not counted, which favours the baseline.

What the numbers mean: each emulated rank has 1/P of the SMs, and all ranks share one HBM, so
"links" run at the shared-HBM rate, not NVLink's; every row says `"emulated": true`.

Backward (run_shape_bwd): the fused pk_ring_attn_bwd call (the op's NUM_COMM_SMS communication
blocks unless --bwd-comm-sms) against all_gather of [k | v] plus
one pk.attention backward per visible block (dq and dk/dv sums not counted); 2.5 x the
forward's FLOPs.

Correctness first: before timing, ranks 0 and P - 1 of the fused call are compared (head 0, all
rows) with a float32 numpy reference over the whole sequence (bf16 tolerance), and the
baseline's gathered K/V with the inputs. Timing: back-to-back calls on every rank's stream, no
host synchronisation inside a batch, wall clock per call, median of 5 batches of 10.

    CUDA_MODULE_LOADING=EAGER python bench/bench_ring_attn.py [--quick] [--forward-only]
        [--num-comm-sms C] [--bwd-comm-sms C]
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax.ops import ring_attn
from pk_jax.testing import DeviceBuffer, World, ops
from pk_jax.testing.emulator import DTYPES, np_dtype

MACHINE = "h200-emulated"
LINK = "shared HBM (unthrottled)"
BF16 = "bfloat16"
B, H, HKV, D = 1, 8, 8, 128
FWD_COMM_SMS = None  # the op's per shape (ring_attn.fwd_comm_sms) unless --num-comm-sms
NUM_COMM_SMS = ring_attn.NUM_COMM_SMS  # the fused backward's (--bwd-comm-sms)


def _reference_head0(q, k_all, v_all, q_pos, k_pos, causal: bool, scale: float):
    """o [S/P, D] of head 0 (batch 0) in float32."""
    sc = (q[0, :, 0].astype(np.float32) @ k_all[0, :, 0].T.astype(np.float32)) * scale
    if causal:
        sc = np.where(k_pos[None, :] > q_pos[:, None], -np.inf, sc)
    e = np.exp(sc - sc.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v_all[0, :, 0].astype(np.float32)


def run_shape(world: World, p: int, sl: int, causal: bool, rng, rows: list) -> None:
    dt = np_dtype(BF16)
    qs = [rng.standard_normal((B, sl, H, D)).astype(np.float32).astype(dt) for _ in range(p)]
    ks = [rng.standard_normal((B, sl, HKV, D)).astype(np.float32).astype(dt) for _ in range(p)]
    vs = [rng.standard_normal((B, sl, HKV, D)).astype(np.float32).astype(dt) for _ in range(p)]
    scale = float(1.0 / np.sqrt(D))
    comm = FWD_COMM_SMS or ring_attn.fwd_comm_sms(causal, False)
    params = {"b": B, "s": sl, "h": H, "hkv": HKV, "d": D, "scale": scale,
              "causal": int(causal), "zigzag": 0, "num_comm_sms": comm}
    # Expected outputs are placeholders (shapes for the poisoned buffers); the check below
    # computes the reference for the rows it compares.
    case = ops.Case("ring_attn", BF16, [{"q": qs[r], "k": ks[r], "v": vs[r]} for r in range(p)],
                    [{"o": np.zeros((B, sl, H, D), dt), "lse": np.zeros((B, H, sl), np.float32)}
                     for _ in range(p)], params, exact=False)
    fused = ops.Call(world, case)
    fused.launch()
    world.synchronize()
    k_all = np.concatenate(ks, axis=1)
    v_all = np.concatenate(vs, axis=1)
    k_pos = np.arange(sl * p)
    for r in (0, p - 1):
        got = fused.outputs(r)["o"][0, :, 0].astype(np.float32)
        want = _reference_head0(qs[r], k_all, v_all, r * sl + np.arange(sl), k_pos, causal,
                                scale)
        if not np.allclose(got, want, atol=2e-2, rtol=2e-2):
            raise SystemExit(f"bench_ring_attention: wrong result before timing (P={p}, "
                             f"S/P={sl}, causal={causal}, rank {r}): max error "
                             f"{np.abs(got - want).max()}")

    # The unfused baseline: all_gather of [k | v], then one pk.attention per visible block.
    kv = [np.concatenate([k.reshape(-1), v.reshape(-1)]) for k, v in zip(ks, vs)]
    gather = ops.Call(world, ops.all_gather(kv, BF16))
    gather.launch()
    world.synchronize()
    if gather.check([0]):
        raise SystemExit("bench_ring_attention: the baseline's all_gather is wrong")
    block = B * sl * HKV * D * 2
    o_tmp = [DeviceBuffer(B * sl * H * D * 2) for _ in range(p)]
    lse_tmp = [DeviceBuffer(B * H * sl * 4) for _ in range(p)]

    def unfused():
        gather.launch()
        for r in range(p):
            y = gather.buffers[r]["y"].ptr
            for t in range(p):
                j = (r - t) % p
                if causal and j > r:
                    continue
                world.launch("attention", r, {
                    "dtype": DTYPES[BF16], "q": fused.buffers[r]["q"],
                    "k": y + 2 * j * block, "v": y + (2 * j + 1) * block, "o": o_tmp[r],
                    "lse": lse_tmp[r], "b": B, "s": sl, "h": H, "hkv": HKV, "d": D,
                    "scale": scale, "causal": int(causal and j == r)})

    t_fused = common.emulated_us(world, fused.launch)
    t_base = common.emulated_us(world, unfused)
    s_total = sl * p
    flops = 4 * B * H * D * s_total * s_total * (0.5 if causal else 1.0)  # all ranks
    shape = {"b": B, "s": s_total, "s_local": sl, "h": H, "hkv": HKV, "d": D,
             "causal": causal, "layout": "contiguous", "num_comm_sms": comm}
    rows.append(common.record(
        op="ring_attention", shape=shape, dtype=BF16, world=p, processes=1,
        median_us=t_fused, tflops=flops / t_fused / 1e6,
        baseline="unfused: all_gather of K/V, then pk.attention per block (emulated)",
        baseline_median_us=t_base, emulated=True, machine=MACHINE, link=LINK,
        sms_per_rank=world.sms[0], path=common.RESULTS / "ring_attention.jsonl"))
    print(f"P={p} S/P={sl:5d} causal={causal!s:5s}: fused {t_fused:9.1f} us "
          f"({flops / t_fused / 1e6:6.1f} TFLOP/s over all ranks)  unfused {t_base:9.1f} us  "
          f"{t_base / t_fused:5.2f}x", flush=True)
    for buf in o_tmp + lse_tmp:
        buf.free()
    fused.free()
    gather.free()


def run_shape_bwd(world: World, p: int, sl: int, causal: bool, rng, rows: list) -> None:
    """The fused backward (pk_ring_attn_bwd) against the unfused one: all_gather of [k | v],
    then one pk.attention backward (dq, dk, dv of the block) per visible block on each rank's
    stream; the sums of the blocks' dq and the reduce-scatter of dk/dv are not counted (which
    favours the baseline). lse and delta are random finite stand-ins (timing only; the
    emulator tests check the values); the fused gradients must come out finite."""
    dt = np_dtype(BF16)

    def normal(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(dt)

    qs, dos = ([normal((B, sl, H, D)) for _ in range(p)] for _ in range(2))
    ks, vs = ([normal((B, sl, HKV, D)) for _ in range(p)] for _ in range(2))
    sp = -(-sl // 128) * 128
    lse = [(np.log(sl * p) + rng.standard_normal((B, H, sp))).astype(np.float32)
           for _ in range(p)]
    delta = [rng.standard_normal((B, H, sp)).astype(np.float32) for _ in range(p)]
    scale = float(1.0 / np.sqrt(D))
    params = {"b": B, "s": sl, "h": H, "hkv": HKV, "d": D, "scale": scale,
              "causal": int(causal), "zigzag": 0, "num_comm_sms": NUM_COMM_SMS}
    case = ops.Case("ring_attn_bwd", BF16,
                    [{"q": qs[r], "k": ks[r], "v": vs[r], "do": dos[r], "lse": lse[r],
                      "delta": delta[r]} for r in range(p)],
                    [{"dq": np.zeros((B, sl, H, D), dt), "dk": np.zeros((B, sl, HKV, D), dt),
                      "dv": np.zeros((B, sl, HKV, D), dt)} for _ in range(p)], params,
                    exact=False)
    fused = ops.Call(world, case)
    fused.launch()
    world.synchronize()
    for r in (0, p - 1):
        for name, y in fused.outputs(r).items():
            if not np.all(np.isfinite(y.astype(np.float32))):
                raise SystemExit(f"bench_ring_attention: non-finite {name} from the fused "
                                 f"backward (P={p}, S/P={sl}, causal={causal}, rank {r})")

    kv = [np.concatenate([k.reshape(-1), v.reshape(-1)]) for k, v in zip(ks, vs)]
    gather = ops.Call(world, ops.all_gather(kv, BF16))
    block = B * sl * HKV * D * 2
    # dq, dk, dv and the one-pass backward's float32 dq scratch (as pk.attention passes it).
    grads = [[DeviceBuffer(n) for n in (B * sl * H * D * 2, block, block, B * sl * H * D * 4)]
             for _ in range(p)]

    def unfused():
        gather.launch()
        for r in range(p):
            y = gather.buffers[r]["y"].ptr
            bufs = fused.buffers[r]
            for t in range(p):
                j = (r - t) % p
                if causal and j > r:
                    continue
                world.launch("attention", r, {
                    "dtype": DTYPES[BF16], "q": bufs["q"], "k": y + 2 * j * block,
                    "v": y + (2 * j + 1) * block, "b": B, "s": sl, "h": H, "hkv": HKV,
                    "d": D, "scale": scale, "causal": int(causal and j == r),
                    "backward": 1, "do": bufs["do"], "lse_in": bufs["lse"],
                    "delta": bufs["delta"], "dq": grads[r][0], "dk": grads[r][1],
                    "dv": grads[r][2], "dq_acc": grads[r][3], "sp": sp})

    t_fused = common.emulated_us(world, fused.launch)
    t_base = common.emulated_us(world, unfused)
    s_total = sl * p
    flops = 10 * B * H * D * s_total * s_total * (0.5 if causal else 1.0)  # all ranks
    shape = {"b": B, "s": s_total, "s_local": sl, "h": H, "hkv": HKV, "d": D,
             "causal": causal, "layout": "contiguous", "num_comm_sms": NUM_COMM_SMS,
             "pass": "backward"}
    rows.append(common.record(
        op="ring_attention", shape=shape, dtype=BF16, world=p, processes=1,
        median_us=t_fused, tflops=flops / t_fused / 1e6,
        baseline="unfused: all_gather of K/V, then pk.attention backward per block (emulated)",
        baseline_median_us=t_base, emulated=True, machine=MACHINE, link=LINK,
        sms_per_rank=world.sms[0], path=common.RESULTS / "ring_attention.jsonl"))
    print(f"P={p} S/P={sl:5d} causal={causal!s:5s} backward: fused {t_fused:9.1f} us "
          f"({flops / t_fused / 1e6:6.1f} TFLOP/s over all ranks)  unfused {t_base:9.1f} us  "
          f"{t_base / t_fused:5.2f}x", flush=True)
    for bufs in grads:
        for buf in bufs:
            buf.free()
    fused.free()
    gather.free()


def main() -> None:
    global FWD_COMM_SMS, NUM_COMM_SMS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S/P = 2048 only")
    parser.add_argument("--forward-only", action="store_true", help="skip the backward")
    parser.add_argument("--num-comm-sms", type=int, default=FWD_COMM_SMS,
                        help="communication blocks of the fused forward (default: the op's)")
    parser.add_argument("--bwd-comm-sms", type=int, default=NUM_COMM_SMS,
                        help="communication blocks of the fused backward (default: the op's)")
    args = parser.parse_args()
    FWD_COMM_SMS, NUM_COMM_SMS = args.num_comm_sms, args.bwd_comm_sms
    rng = np.random.default_rng(0)
    rows: list = []
    for p in (2, 4, 8):
        # Ring slots 2 (P-1) blocks; the all_gather's staging holds the rest.
        with World(p, timeout_s=30.0, workspace_bytes=512 << 20) as world:
            for sl in ((2048,) if args.quick else (2048, 4096)):
                for causal in (False, True):
                    run_shape(world, p, sl, causal, rng, rows)
                    if not args.forward_only:
                        run_shape_bwd(world, p, sl, causal, rng, rows)
    for name, sel in (("forward", False), ("backward", True)):
        ratios = [r["ratio"] for r in rows
                  if r["ratio"] and (r["shape"].get("pass") == "backward") == sel]
        if ratios:
            print(f"geomean fused vs unfused, {name}: {common.geomean(ratios):.2f}x "
                  f"({len(ratios)} rows, emulated)")


if __name__ == "__main__":
    main()

"""Overlap at the scale model: every fused op against its serial form, emulated at P = 2, 4, 8.

Each emulated rank is a 1/P scale model of one GPU of an 8-GPU NVLink node
(`pk_jax.testing.World(P, scale_model=True)`: its SM partition for compute, HBM and L2; the
link throttled to the node's 1750 FLOP per byte of the partition's measured matmul rate, and
asynchronous as a real link; communication SMs scaled from the node's count). Per-rank shapes
are per-GPU shapes of the node.

Nine op/pass pairs, each against the serial form pk_jax would otherwise run, with everything
that form needs:
- gemm_rs: pk.matmul, then the pk reduce_scatter;     ag_gemm: all_gather, then pk.matmul;
- gemm_ar: pk.matmul, then the pk all_reduce;
- ring forward: all_gather of K/V, pk.attention per visible block, and the merge of the
  partial results (a device copy of the partials' bytes, standing in for the merge's memory
  traffic: pk_jax has no merge kernel of its own to launch here);
- ring backward: all_gather of K/V, the pk.attention backward per visible block, and the
  reduce-scatter of the blocks' dK/dV (the pk reduce_scatter of P blocks of dK/dV);
- Ulysses forward / backward: all_to_all, pk.attention (forward / backward), all_to_all;
- moe_dispatch_gemm: moe_dispatch, then grouped_matmul; moe_gemm_combine: grouped_matmul,
  then moe_combine;
- and the fp8 forms gemm_rs_fp8 / gemm_ar_fp8 (issue 40; shape["scaling"] "tensor" or
  "block"): the fp8 GEMM (matmul_fp8) into bf16, then the pk reduce_scatter / all_reduce;
  ag_gemm_fp8: the pk all_gather of the fp8 rows and of their scales, then the fp8 GEMM. That
  serial form leaves out the XLA passes pk.all_gather_gemm's serial path adds (per tensor: each
  device's rows scaled by its own x scale; blockwise: the gathered scales transposed): the
  ranks' per-tensor x scales are equal here, so the fp8 GEMM applies them, and the blockwise
  GEMM reads the gathered scales from a buffer laid out before timing. A lower bound of the
  serial time, so the fused kernel's ratio is not flattered.
Both forms are checked against a float32 or exact numpy reference on sampled rows before
anything is timed. Then fused and serial are timed interleaved (5 alternating repeats of a
batch each, medians), and the serial form's compute and communication parts alone at the same
scale. Each row (bench/results/overlap.jsonl) carries the scale model's constants and
fused_us, serial_us, ratio = serial / fused, t_compute_us, t_comm_us, comm_fraction =
t_comm / serial, overlap_efficiency = (serial - fused) / (serial - max(t_compute, t_comm)),
exposed_comm = (fused - t_compute) / t_comm, and projected_tflops (the rank's rate x 132 /
sms_per_rank: a projection to one GPU of the node, labelled so).

    CUDA_MODULE_LOADING=EAGER python bench/bench_overlap.py [--worlds 2,4,8] [--ops ...]
        [--quick] [--cases FILE] [--tag TAG] [--workspace-mib 1024]

--cases reads a JSON list of {"op", "pass", "world", "shape"} (bench/results/decider_cases.json,
decider_cases_2.json, decider_cases_3.json) and runs exactly those, rows tagged with --tag, by
default the file's "tag" (else "overlap"). With --dry-run it starts no GPU work: it checks each
case's shape (`check_shape`), prints the decider's pick and an estimate of the run's wall time
(`estimate_s`), and exits non-zero on a bad case.
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_emulated
import bench_moe
import common
import numpy as np

from pk_jax import cost_model
from pk_jax.ops import ring_attn, ulysses_attn
from pk_jax.runtime import vmm
from pk_jax.testing import DeviceBuffer, World, ops
from pk_jax.testing.emulator import DTYPES, NODE_SMS, np_dtype
from pk_jax.testing.ulysses_bwd import FusedUlyssesBackward, UlyssesBackward

BF16 = "bfloat16"
FP8 = "float8_e4m3fn"
RESULTS = common.RESULTS / "overlap.jsonl"
PASSES = {"gemm_rs": "forward", "ag_gemm": "forward", "gemm_ar": "forward",
          "ring_attn": "forward", "ring_attn_bwd": "backward", "ulysses_attn": "forward",
          "ulysses_attn_bwd": "backward", "moe_dispatch_gemm": "forward",
          "moe_gemm_combine": "forward", "gemm_rs_fp8": "forward", "gemm_ar_fp8": "forward",
          "ag_gemm_fp8": "forward"}


@dataclasses.dataclass
class Bench:
    """One op at one shape on a world: launchers that queue one call on every rank."""

    fused: Callable[[], None]
    serial: Callable[[], None]
    compute: Callable[[], None]
    comm: Callable[[], None]
    check: Callable[[], None]      # runs both forms once and raises on a wrong result
    flops: float                   # one rank's FLOPs per call
    comm_sms_on_node: int
    baseline: str
    free: Callable[[], None]


class WrongResult(RuntimeError):
    pass


def normal(rng, shape):
    return rng.standard_normal(shape, np.float32).astype(np_dtype(BF16))


def sync_all(world: World, *fns) -> None:
    for f in fns:
        f()
    world.synchronize()


def copy_on_ranks(world: World, dst: list, src: list, nbytes: int) -> None:
    cu = vmm.driver()
    for r in range(world.world):
        vmm.call("cuMemcpyDtoDAsync", dst[r].ptr, src[r].ptr, nbytes,
                 cu.CUstream(world.parts[r].stream))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: M = N = 8192 per rank, K per rank from the shape

def check_rows(op: str, calls: dict, r: int, pick: np.ndarray, want: np.ndarray) -> None:
    """Rows `pick` of y on rank r of each call (fused, serial) against float64 `want`. bf16
    partial sums past 256 round, each rank's and each add's: a tolerance scaled by the rows'
    magnitude, not exactness (issue 36)."""
    tol = 2e-2 * np.abs(want).max() + 1
    for name, c in calls.items():
        got = c.outputs(r)["y"][pick].astype(np.float64)
        if not (np.all(np.isfinite(got)) and np.all(np.abs(got - want) <= tol)):
            raise WrongResult(f"{op} {name} rank {r}: max error {np.abs(got - want).max()}")


def tp_bench(world: World, op: str, shape: dict, rng) -> Bench:
    p = world.world
    m, n, kr = shape["m"], shape["n"], shape["k_per_rank"]
    dt = np_dtype(BF16)
    ints = lambda s: rng.integers(-1, 2, s).astype(np.float32).astype(dt)
    if op == "ag_gemm":  # x [M/P, K], w [K, N]: each rank's GEMM is [M, K] x [K, N]
        xs = [ints((m // p, kr)) for _ in range(p)]
        ws = [ints((kr, n)) for _ in range(p)]
        outs = [{"y": np.zeros((m, n), dt), "x_full": np.zeros((m, kr), dt)} for _ in range(p)]
    else:  # x [M, K/P], w [K/P, N]
        xs = [ints((m, kr)) for _ in range(p)]
        ws = [ints((kr, n)) for _ in range(p)]
        rows = m // p if op == "gemm_rs" else m
        outs = [{"y": np.zeros((rows, n), dt)} for _ in range(p)]
    params = {"config": ops.TILE_128x256_S3, "group_m": 8}
    comm_node = 0
    if op == "ag_gemm":  # the comm SMs the model picks for the whole node
        comm_node = cost_model.plan(op, m, n, kr, p).num_comm_sms or 8
        params["num_comm_sms"] = comm_node
    case = ops.Case(op, BF16, [{"x": x, "w": w} for x, w in zip(xs, ws)], outs, params,
                    exact=False)
    fused = ops.Call(world, case)
    serial = ops.Call(world, case)
    b = {"case": case, "fused": fused, "serial": serial,
         "tmp": [DeviceBuffer(m * n * 2) for _ in range(p)] if op != "ag_gemm" else []}

    def check() -> None:
        for c in (fused, serial):
            for bufs in c.buffers:
                for name in c.case.expected[0]:
                    bufs[name].fill(0xFF)
        sync_all(world, fused.launch, lambda: bench_emulated.serial_launch(world, op, b))
        pick = np.unique(np.concatenate([[0, outs[0]["y"].shape[0] - 1],
                                         rng.integers(0, outs[0]["y"].shape[0], 30)]))
        for r in (0, p - 1):
            if op == "ag_gemm":
                full = np.concatenate(xs).astype(np.float64)
                want = full[pick] @ ws[r].astype(np.float64)
            else:
                lo = r * (m // p) if op == "gemm_rs" else 0
                want = sum(x[lo + pick].astype(np.float64) @ w.astype(np.float64)
                           for x, w in zip(xs, ws))
            check_rows(op, {"fused": fused, "serial": serial}, r, pick, want)

    def free() -> None:
        for c in (fused, serial):
            c.free()
        for t in b["tmp"]:
            t.free()

    flops = 2.0 * m * n * kr  # one rank's GEMM
    what = {"gemm_rs": "pk.matmul, then pk reduce_scatter",
            "ag_gemm": "pk all_gather, then pk.matmul",
            "gemm_ar": "pk.matmul, then pk all_reduce"}[op]
    return Bench(fused.launch, lambda: bench_emulated.serial_launch(world, op, b),
                 lambda: bench_emulated.serial_launch(world, op, b, parts=("compute",)),
                 lambda: bench_emulated.serial_launch(world, op, b, parts=("comm",)),
                 check, flops, comm_node, f"serial: {what} (scale model)", free)


def _fp8_codes(rng, shape) -> np.ndarray:
    """e4m3 values in {-1, 0, 1}, drawn as their bytes (ml_dtypes' conversion of a float array
    takes seconds at the node's shapes)."""
    import ml_dtypes

    codes = np.array([0xB8, 0x00, 0x38], np.uint8)  # -1, 0, 1 in float8_e4m3fn
    return codes[rng.integers(0, 3, shape, dtype=np.uint8)].view(ml_dtypes.float8_e4m3fn)


def tp_fp8_bench(world: World, op: str, shape: dict, rng) -> Bench:
    """gemm_rs_fp8 / gemm_ar_fp8 (x [M, K/P], wt [N, K/P] e4m3, each rank's own scales, per
    tensor or blockwise) against the fp8 GEMM into bf16 then the pk collective; ag_gemm_fp8
    (x [M/P, K], wt [N, K]) against the pk all_gather of the rows and scales, then the fp8
    GEMM (the module docstring says what that serial form leaves out)."""
    p = world.world
    m, n, kr, scaling = shape["m"], shape["n"], shape["k_per_rank"], shape["scaling"]
    ag = op == "ag_gemm_fp8"
    xr = m // p if ag else m  # x's rows on each rank
    xs = [_fp8_codes(rng, (xr, kr)) for _ in range(p)]
    wts = [_fp8_codes(rng, (n, kr)) for _ in range(p)]
    kb, nb = -(-kr // 128), -(-n // 128)
    if scaling == "block":
        sx = [(2.0 ** rng.integers(-1, 2, (xr, kb))).astype(np.float32) for _ in range(p)]
        sw = [(2.0 ** rng.integers(0, 2, (kb, nb))).astype(np.float32) for _ in range(p)]
    else:
        sx = [np.float32(2.0 ** rng.integers(-1, 2)) for _ in range(p)]
        sw = [np.float32(2.0 ** rng.integers(0, 2)) for _ in range(p)]
        if ag:
            sx = [sx[0]] * p
    rows = m // p if op == "gemm_rs_fp8" else m
    params, scales = ops.fp8_gemm_fields(xr, kr, n, sx, sw, FP8, rows)
    bf16 = np_dtype(BF16)
    outs = [{"y": np.zeros((rows, n), bf16)} for _ in range(p)]
    comm_node = 0
    if ag:  # the comm SMs the model picks for the whole node
        comm_node = cost_model.plan("ag_gemm", m, n, kr, p, fp8=scaling).num_comm_sms or 8
        params["num_comm_sms"] = comm_node
        full_scales = (np.concatenate([a[:, :xr] for a, _ in scales], axis=1)
                       if scaling == "block" else np.concatenate([a for a, _ in scales]))
        for o in outs:
            o.update(x_full=np.zeros((m, kr), xs[0].dtype), xs_full=np.zeros_like(full_scales))
    case = ops.Case(op, FP8, [{"x": x, "w": wt, "x_scale": a, "w_scale": b}
                              for x, wt, (a, b) in zip(xs, wts, scales)], outs, params,
                    exact=False)
    fused, serial = ops.Call(world, case), ops.Call(world, case)
    dt, f32 = DTYPES[BF16], DTYPES["float32"]
    if ag:  # the gathered rows, the scales' gather, and the scales as the GEMM reads them
        tmp = [DeviceBuffer(m * kr) for _ in range(p)]
        # the scales' gather moves 16-byte units: per tensor a device's scale in 4 floats
        scale_src = [DeviceBuffer.from_array(a if scaling == "block" else np.repeat(a, 4))
                     for a, _ in scales]
        scale_tmp = [DeviceBuffer(scale_src[0].nbytes * p) for _ in range(p)]
        gemm_scales = [DeviceBuffer.from_array(full_scales if scaling == "block" else a)
                       for a, _ in scales]
        gemm = {"dtype": DTYPES[FP8], **params, "m": m, "y_rows": m}
        if scaling == "block":
            gemm["xs_cols"] = m
    else:
        tmp = [DeviceBuffer(m * n * 2) for _ in range(p)]
        scale_src = scale_tmp = gemm_scales = []
        gemm = {"dtype": DTYPES[FP8], **params, "y_rows": m}
    gemm.pop("num_comm_sms", None)

    def serial_launch(parts=("compute", "comm")) -> None:
        for r in range(p):
            bufs = serial.buffers[r]
            if ag:
                if "comm" in parts:  # fp8 rows as bf16 pairs (K is even), the scales as floats
                    world.launch("all_gather", r, {"dtype": dt, "x": bufs["x"], "y": tmp[r],
                                                   "n": xr * kr // 2, "n_out": m * kr // 2,
                                                   "p0": xr * kr // 2})
                    ns = scale_src[r].nbytes // 4
                    world.launch("all_gather", r, {"dtype": f32, "x": scale_src[r],
                                                   "y": scale_tmp[r], "n": ns,
                                                   "n_out": ns * p, "p0": ns})
                if "compute" in parts:
                    world.launch("matmul_fp8", r, {**gemm, "x": tmp[r], "w": bufs["w"],
                                                   "x_scale": gemm_scales[r],
                                                   "w_scale": bufs["w_scale"],
                                                   "y": bufs["y"]})
                continue
            if "compute" in parts:
                world.launch("matmul_fp8", r, {**gemm, "x": bufs["x"], "w": bufs["w"],
                                               "x_scale": bufs["x_scale"],
                                               "w_scale": bufs["w_scale"], "y": tmp[r]})
            if "comm" not in parts:
                continue
            if op == "gemm_rs_fp8":
                world.launch("reduce_scatter", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"],
                                                   "n": m * n, "n_out": rows * n,
                                                   "p0": rows * n})
            else:
                world.launch("all_reduce", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"],
                                               "n": m * n, "n_out": m * n})

    def dequantized_rows(q: int, pick: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows `pick` of rank q's x and rank r's w (gemm_rs / gemm_ar: q == r), dequantized."""
        x = xs[q][pick].astype(np.float64)
        w = wts[r].astype(np.float64).T  # [K/P, N]
        if scaling == "block":
            x = x * np.repeat(sx[q][pick], 128, axis=1)[:, :kr]
            w = w * np.kron(sw[r], np.ones((128, 128)))[:kr, :n]
        else:
            x, w = x * float(sx[q]), w * float(sw[r])
        return x, w

    def check() -> None:
        for c in (fused, serial):
            for bufs in c.buffers:
                bufs["y"].fill(0xFF)
        sync_all(world, fused.launch, serial_launch)
        pick = np.unique(np.concatenate([[0, rows - 1], rng.integers(0, rows, 30)]))
        for r in (0, p - 1):
            if ag:  # row i of y is row i % Mp of rank i // Mp's x
                want = np.concatenate([np.matmul(*dequantized_rows(q, pick[pick // xr == q] % xr,
                                                                   r)) for q in range(p)])
            else:
                lo = r * rows if op == "gemm_rs_fp8" else 0
                want = sum(np.matmul(*dequantized_rows(q, lo + pick, q)) for q in range(p))
            check_rows(op, {"fused": fused, "serial": serial}, r, pick, want)

    def free() -> None:
        for c in (fused, serial):
            c.free()
        for t in [*tmp, *scale_src, *scale_tmp, *gemm_scales]:
            t.free()

    serial_what = {"gemm_rs_fp8": "the fp8 GEMM into bf16, then pk reduce_scatter",
                   "gemm_ar_fp8": "the fp8 GEMM into bf16, then pk all_reduce",
                   "ag_gemm_fp8": "pk all_gather of the fp8 rows and scales, then the fp8 GEMM"}
    return Bench(fused.launch, serial_launch, lambda: serial_launch(("compute",)),
                 lambda: serial_launch(("comm",)), check, 2.0 * m * n * kr, comm_node,
                 f"serial: {serial_what[op]} (scale model)", free)


# ---------------------------------------------------------------------------------------------
# Ring attention: per rank q [B, S/P, H, D], k/v [B, S/P, Hkv, D]

def _attn_ref_rows(q, k_all, v_all, rows, hh: int, hkv_of: int, q0: int, causal: bool,
                   scale: float):
    """o[rows] of head hh (batch 0) in float32 against the whole sequence's K/V."""
    qq = q[0, rows, hh].astype(np.float32)
    kk = k_all[0, :, hkv_of].astype(np.float32)
    sc = (qq @ kk.T) * scale
    if causal:
        sc = np.where(np.arange(kk.shape[0])[None, :] > (q0 + rows)[:, None], -np.inf, sc)
    e = np.exp(sc - sc.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)) @ v_all[0, :, hkv_of].astype(np.float32)


def ring_bench(world: World, shape: dict, rng, backward: bool) -> Bench:
    p = world.world
    b, sl, h, hkv, d = 1, shape["s"] // p, shape["h"], shape["hkv"], shape["d"]
    causal = shape["causal"]
    dt = np_dtype(BF16)
    qs = [normal(rng, (b, sl, h, d)) for _ in range(p)]
    ks = [normal(rng, (b, sl, hkv, d)) for _ in range(p)]
    vs = [normal(rng, (b, sl, hkv, d)) for _ in range(p)]
    scale = float(1.0 / np.sqrt(d))
    comm_node = ring_attn.NUM_COMM_SMS if backward else ring_attn.fwd_comm_sms(causal, False)
    params = {"b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": scale,
              "causal": int(causal), "zigzag": 0, "num_comm_sms": comm_node}
    sp = -(-sl // 128) * 128
    if backward:
        dos = [normal(rng, (b, sl, h, d)) for _ in range(p)]
        lse = [(np.log(sl * p) + rng.standard_normal((b, h, sp))).astype(np.float32)
               for _ in range(p)]
        delta = [rng.standard_normal((b, h, sp)).astype(np.float32) for _ in range(p)]
        case = ops.Case("ring_attn_bwd", BF16,
                        [{"q": qs[r], "k": ks[r], "v": vs[r], "do": dos[r], "lse": lse[r],
                          "delta": delta[r]} for r in range(p)],
                        [{"dq": np.zeros((b, sl, h, d), dt), "dk": np.zeros((b, sl, hkv, d), dt),
                          "dv": np.zeros((b, sl, hkv, d), dt)} for _ in range(p)], params,
                        exact=False)
    else:
        case = ops.Case("ring_attn", BF16, [{"q": qs[r], "k": ks[r], "v": vs[r]}
                                            for r in range(p)],
                        [{"o": np.zeros((b, sl, h, d), dt),
                          "lse": np.zeros((b, h, sl), np.float32)} for _ in range(p)], params,
                        exact=False)
    fused = ops.Call(world, case)
    kv = [np.concatenate([k.reshape(-1), v.reshape(-1)]) for k, v in zip(ks, vs)]
    gather = ops.Call(world, ops.all_gather(kv, BF16))
    block = b * sl * hkv * d * 2
    o_bytes = b * sl * h * d * 2
    vis = [[(r - t) % p for t in range(p) if not (causal and (r - t) % p > r)] for r in range(p)]
    o_tmp = [DeviceBuffer(o_bytes) for _ in range(p)]
    lse_tmp = [DeviceBuffer(b * h * sl * 4) for _ in range(p)]
    # merge stand-in: read every visible block's partial (o, lse), write o: a copy of half that
    most = max(len(v) for v in vis)
    merge_bytes = ((most + 1) * (o_bytes + b * h * sl * 4) // 2 + 15) // 16 * 16
    m_src = [DeviceBuffer(merge_bytes) for _ in range(p)]
    m_dst = [DeviceBuffer(merge_bytes) for _ in range(p)]
    grads = []
    rs = None
    if backward:
        grads = [[DeviceBuffer(n) for n in (o_bytes, block, block, b * sl * h * d * 4)]
                 for _ in range(p)]
        # the blocks' dK/dV go home: a reduce-scatter of P blocks of [dk | dv] per rank
        rs = ops.Call(world, ops.reduce_scatter([np.zeros(2 * block // 2 * p)] * p, BF16))

    def attention_all() -> None:
        for r in range(p):
            y = gather.buffers[r]["y"].ptr
            for j in vis[r]:
                a = {"dtype": DTYPES[BF16], "q": fused.buffers[r]["q"],
                     "k": y + 2 * j * block, "v": y + (2 * j + 1) * block,
                     "b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": scale,
                     "causal": int(causal and j == r)}
                if backward:
                    bufs = fused.buffers[r]
                    a.update(backward=1, do=bufs["do"], lse_in=bufs["lse"],
                             delta=bufs["delta"], dq=grads[r][0], dk=grads[r][1],
                             dv=grads[r][2], dq_acc=grads[r][3], sp=sp)
                else:
                    a.update(o=o_tmp[r], lse=lse_tmp[r])
                world.launch("attention", r, a)

    def comm_all() -> None:
        gather.launch()
        if rs is not None:
            rs.launch()

    def compute_all() -> None:
        attention_all()
        if not backward:
            copy_on_ranks(world, m_dst, m_src, merge_bytes)

    def serial_all() -> None:
        gather.launch()
        compute_all()
        if rs is not None:
            rs.launch()

    def check() -> None:
        sync_all(world, fused.launch, serial_all)
        if gather.check([0, p - 1]):
            raise WrongResult("ring: the serial form's all_gather of K/V is wrong")
        rows = np.unique(np.concatenate([[0, sl - 1], rng.integers(0, sl, 30)]))
        k_all, v_all = np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)
        for r in (0, p - 1):
            out = fused.outputs(r)
            if backward:
                for name, y in out.items():
                    if not np.all(np.isfinite(y.astype(np.float32))):
                        raise WrongResult(f"ring backward: non-finite {name} on rank {r}")
                continue
            for hh in (0, h - 1):
                want = _attn_ref_rows(qs[r], k_all, v_all, rows, hh, hh * hkv // h, r * sl,
                                      causal, scale)
                got = out["o"][0, rows, hh].astype(np.float32)
                if not np.allclose(got, want, atol=2e-2, rtol=2e-2):
                    raise WrongResult(f"ring forward rank {r} head {hh}: max error "
                                      f"{np.abs(got - want).max()}")
        if not backward:  # the serial form's last block is a visible block's partial: finite
            for r in (0, p - 1):
                o = o_tmp[r].read(dt, (b, sl, h, d)).astype(np.float32)
                if not np.all(np.isfinite(o)):
                    raise WrongResult(f"ring serial: non-finite partial on rank {r}")

    def free() -> None:
        for c in (fused, gather) + ((rs,) if rs else ()):
            c.free()
        for buf in o_tmp + lse_tmp + m_src + m_dst + [g for gs in grads for g in gs]:
            buf.free()

    frac = 0.5 if causal else 1.0
    flops = (10 if backward else 4) * b * h * d * sl * sl * p * frac  # one rank's share
    what = ("all_gather of K/V, pk.attention backward per visible block, reduce_scatter of "
            "dK/dV" if backward else
            "all_gather of K/V, pk.attention per visible block, merge (copy of the partials' "
            "bytes)")
    return Bench(fused.launch, serial_all, compute_all, comm_all, check, flops, comm_node,
                 f"serial: {what} (scale model)", free)


# ---------------------------------------------------------------------------------------------
# Ulysses: per rank [B, S/P, H, D], H = heads

def _group_major(x: np.ndarray, p: int) -> np.ndarray:
    _, sl, h, d = x.shape
    return np.ascontiguousarray(x[0].reshape(sl, p, h // p, d).transpose(1, 0, 2, 3))


def ulysses_fwd_bench(world: World, shape: dict, rng) -> Bench:
    p = world.world
    b, sl, h, d = 1, shape["s"] // p, shape["h"], shape["d"]
    g = h // p
    causal = shape["causal"]
    dt = np_dtype(BF16)
    qs, ks, vs = ([normal(rng, (b, sl, h, d)) for _ in range(p)] for _ in range(3))
    scale = float(1.0 / np.sqrt(d))
    comm_node = ulysses_attn.FWD_COMM_SMS
    params = {"b": b, "s": sl, "h": h, "hkv": h, "d": d, "scale": scale,
              "causal": int(causal), "num_comm_sms": comm_node}
    fused = ops.Call(world, ops.Case(
        "ulysses_attn", BF16, [{"q": qs[r], "k": ks[r], "v": vs[r]} for r in range(p)],
        [{"o": np.zeros((b, sl, h, d), dt), "lse": np.zeros((b, h, sl), np.float32)}
         for _ in range(p)], params, exact=False))
    a2a = [ops.Call(world, ops.all_to_all([_group_major(x, p) for x in xs], BF16, 0, 0))
           for xs in (qs, ks, vs)]
    back = ops.Call(world, ops.all_to_all([np.zeros((p, sl, g, d), dt) for _ in range(p)],
                                          BF16, 0, 0))
    lse_tmp = [DeviceBuffer(b * g * sl * p * 4) for _ in range(p)]

    def compute_all() -> None:
        for r in range(p):
            world.launch("attention", r, {
                "dtype": DTYPES[BF16], "q": a2a[0].buffers[r]["y"], "k": a2a[1].buffers[r]["y"],
                "v": a2a[2].buffers[r]["y"], "o": back.buffers[r]["x"], "lse": lse_tmp[r],
                "b": b, "s": sl * p, "h": g, "hkv": g, "d": d, "scale": scale,
                "causal": int(causal)})

    def comm_all() -> None:
        for c in (*a2a, back):
            c.launch()

    def serial_all() -> None:
        for c in a2a:
            c.launch()
        compute_all()
        back.launch()

    def check() -> None:
        sync_all(world, fused.launch, serial_all)
        rows = np.unique(np.concatenate([[0, sl - 1], rng.integers(0, sl, 30)]))
        k_all, v_all = np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)
        for r in (0, p - 1):
            got_s = back.buffers[r]["y"].read(dt, (p, sl, g, d)).astype(np.float32)
            for hh in (0, h - 1):
                want = _attn_ref_rows(qs[r], k_all, v_all, rows, hh, hh, r * sl, causal, scale)
                got = fused.outputs(r)["o"][0, rows, hh].astype(np.float32)
                serial = got_s[hh // g, rows, hh % g]
                for name, y in (("fused", got), ("serial", serial)):
                    if not np.allclose(y, want, atol=2e-2, rtol=2e-2):
                        raise WrongResult(f"Ulysses forward {name} rank {r} head {hh}: max "
                                          f"error {np.abs(y - want).max()}")

    def free() -> None:
        for c in (fused, back, *a2a):
            c.free()
        for buf in lse_tmp:
            buf.free()

    frac = 0.5 if causal else 1.0
    flops = 4 * b * h * d * sl * sl * p * frac
    return Bench(fused.launch, serial_all, compute_all, comm_all, check, flops, comm_node,
                 "serial: all_to_all of q, k, v, pk.attention, all_to_all back (scale model)",
                 free)


def ulysses_bwd_bench(world: World, shape: dict, rng) -> Bench:
    p = world.world
    b, sl, h, d = 1, shape["s"] // p, shape["h"], shape["d"]
    causal = shape["causal"]
    scale = float(1.0 / np.sqrt(d))
    qs, ks, vs, dos = ([normal(rng, (b, sl, h, d)) for _ in range(p)] for _ in range(4))
    sp = -(-sl // 128) * 128
    lses = [(np.log(sl * p) + rng.standard_normal((b, h, sp))).astype(np.float32)
            for _ in range(p)]
    deltas = [rng.standard_normal((b, h, sp)).astype(np.float32) for _ in range(p)]
    # exact lse and delta for head 0 (the checked head), from the float32 forward
    full = [np.concatenate([x[0, :, 0] for x in xs]).astype(np.float32)
            for xs in (qs, ks, vs, dos)]
    q, k, v, do = full
    s = sl * p
    lse0, dl0 = np.empty(s, np.float32), np.empty(s, np.float32)
    for a in range(0, s, 2048):
        sc = (q[a:a + 2048] @ k.T) * scale
        if causal:
            sc = np.where(np.arange(s)[None, :] > np.arange(a, a + sc.shape[0])[:, None],
                          -np.inf, sc)
        mx = sc.max(axis=-1, keepdims=True)
        e = np.exp(sc - mx)
        den = e.sum(axis=-1, keepdims=True)
        lse0[a:a + 2048] = (mx + np.log(den))[:, 0]
        dl0[a:a + 2048] = np.sum(do[a:a + 2048] * ((e / den) @ v), axis=-1)
    for r in range(p):
        lses[r][0, 0, :sl] = lse0[r * sl:(r + 1) * sl]
        deltas[r][0, 0, :sl] = dl0[r * sl:(r + 1) * sl]
    comm_node = ulysses_attn.NUM_COMM_SMS
    composed = UlyssesBackward(world, BF16, qs, ks, vs, dos, lses, deltas, causal=causal,
                               scale=scale)
    fused = FusedUlyssesBackward(world, BF16, qs, ks, vs, dos, lses, deltas, causal=causal,
                                 scale=scale, num_comm_sms=comm_node)

    def check() -> None:
        sync_all(world, fused.launch, composed.launch)
        rows = np.unique(np.concatenate([[0, sl - 1], rng.integers(0, sl, 16)]))
        for r in (0, p - 1):
            qr = np.arange(r * sl, (r + 1) * sl)[rows]
            sc = (q[qr] @ k.T) * scale
            if causal:
                sc = np.where(np.arange(s)[None, :] > qr[:, None], -np.inf, sc)
            pr = np.exp(sc - lse0[qr][:, None])
            ds = pr * ((do[qr] @ v.T) - dl0[qr][:, None])
            want = scale * (ds @ k)  # dq of the sampled rows, head 0
            big = max(1.0, float(np.abs(want).max()))
            for name, c in (("fused", fused), ("composed", composed)):
                got = c.grads(r)["dq"][0, rows, 0].astype(np.float32)
                if not np.allclose(got, want, atol=2e-2 * big, rtol=2e-2):
                    raise WrongResult(f"Ulysses backward {name} rank {r}: dq max error "
                                      f"{np.abs(got - want).max()}")

    def free() -> None:
        composed.free()
        fused.free()

    frac = 0.5 if causal else 1.0
    flops = 10 * b * h * d * sl * sl * p * frac
    return Bench(fused.launch, composed.launch, composed.launch_attention, composed.launch_comm,
                 check, flops, comm_node,
                 "serial: all_to_all of q, dO, k, v, lse/delta, pk.attention backward, "
                 "all_to_all of dq, dk, dv back (scale model)", free)


# ---------------------------------------------------------------------------------------------
# MoE: per rank T tokens of H, top-k of E experts (E / P per rank), expert hidden F

def moe_bench(world: World, op: str, shape: dict, rng) -> Bench:
    p = world.world
    bench_moe.P = p  # bench_moe's helpers take the world size from this module constant
    t, k, experts, h, hidden = (shape[x] for x in ("t", "k", "experts", "h", "hidden"))
    el = experts // p
    capacity = int(1.25 * t * k)
    ids = bench_moe.routing(rng, t, k, experts, False)
    xs = [ops.integers(rng, (t, h)) for _ in range(p)]
    disp = ops.Call(world, ops.moe_dispatch(xs, ids, BF16, num_experts=experts,
                                            capacity=capacity))
    sync_all(world, disp.launch)
    if disp.check():
        raise WrongResult(f"moe_dispatch wrong: {disp.check()[:2]}")
    kept = max(int(disp.case.expected[r]["group_sizes"].sum()) for r in range(p))
    bufs: list = []
    if op == "moe_dispatch_gemm":
        w_host = bench_moe.sparse_w(rng, el, h, hidden)
        ws = [DeviceBuffer.from_array(w_host) for _ in range(p)]
        ys = [DeviceBuffer(capacity * hidden * 2) for _ in range(p)]
        bufs += ws + ys
        args = [{"dtype": 0, "x": disp.buffers[r]["tokens"], "w": ws[r],
                 "group_sizes": disp.buffers[r]["group_sizes"], "y": ys[r], "m": capacity,
                 "k": h, "n": hidden, "groups": el, "group_m": 8} for r in range(p)]
        launch_fused, fbufs = bench_moe.fused_call(world, disp, ws, capacity, hidden, experts)
        bufs += [x for dd in fbufs for x in dd.values()]

        def compute_all() -> None:
            for r in range(p):
                world.launch("grouped_matmul", r, args[r])

        comm_all = disp.launch

        def check() -> None:
            for y in ys:
                y.fill(0xFF)
            sync_all(world, disp.launch, compute_all, launch_fused)
            bench_moe.check_gemm(disp.case.expected[0]["tokens"],
                                 disp.case.expected[0]["group_sizes"], ys[0], w_host, capacity,
                                 hidden, rng)
            bad = [r for r in range(p)
                   if not np.array_equal(ys[r].read(np.uint16, (capacity, hidden)),
                                         fbufs[r]["y"].read(np.uint16, (capacity, hidden)))]
            if bad:
                raise WrongResult(f"moe_dispatch_gemm fused y differs from serial on {bad}")

        flops = 2.0 * kept * h * hidden
        what = "moe_dispatch, then grouped_matmul"
    else:
        w_host = bench_moe.sparse_w(rng, el, hidden, h)
        hs_host = [rng.integers(-3, 4, (capacity, hidden), dtype=np.int8).astype(np_dtype(BF16))
                   for _ in range(p)]
        weights = rng.integers(0, 5, (p, t, k)).astype(np.float32) / 4
        hs = [DeviceBuffer.from_array(a) for a in hs_host]
        ws = [DeviceBuffer.from_array(w_host) for _ in range(p)]
        wts = [DeviceBuffer.from_array(weights[r]) for r in range(p)]
        ys = [DeviceBuffer(capacity * h * 2) for _ in range(p)]
        outs = [DeviceBuffer(t * h * 2) for _ in range(p)]
        fouts = [DeviceBuffer(t * h * 2) for _ in range(p)]
        bufs += hs + ws + wts + ys + outs + fouts
        hd = [disp.buffers[r] for r in range(p)]
        gemm_args = [{"dtype": 0, "x": hs[r], "w": ws[r], "group_sizes": hd[r]["group_sizes"],
                      "y": ys[r], "m": capacity, "k": hidden, "n": h, "groups": el,
                      "group_m": 8} for r in range(p)]
        comb_args = [{"dtype": 0, "y": ys[r], "weights": wts[r], "dest": hd[r]["dest"],
                      "pos": hd[r]["pos"], "out": outs[r], "t": t, "k": k, "h": h,
                      "capacity": capacity} for r in range(p)]
        fused_args = [{"dtype": 0, "h": hs[r], "w": ws[r], "weights": wts[r],
                       "dest": hd[r]["dest"], "pos": hd[r]["pos"],
                       "group_sizes": hd[r]["group_sizes"], "out": fouts[r], "t": t, "k": k,
                       "f": hidden, "n": h, "groups": el, "capacity": capacity}
                      for r in range(p)]

        def compute_all() -> None:
            for r in range(p):
                world.launch("grouped_matmul", r, gemm_args[r])

        def comm_all() -> None:
            world.call("moe_combine", comb_args)

        def launch_fused() -> None:
            world.call("moe_gemm_combine", fused_args)

        def check() -> None:
            for bb in ys + outs + fouts:
                bb.fill(0xFF)
            sync_all(world, compute_all, comm_all, launch_fused)
            bench_moe.check_gemm(hs_host[0], disp.case.expected[0]["group_sizes"], ys[0],
                                 w_host, capacity, h, rng)
            bench_moe.check_combined(disp, ys, weights, outs[0], t, k, h, capacity, rng)
            bad = [r for r in range(p) if not np.array_equal(outs[r].read(np.uint16, (t, h)),
                                                             fouts[r].read(np.uint16, (t, h)))]
            if bad:
                raise WrongResult(f"moe_gemm_combine fused out differs from serial on {bad}")

        flops = 2.0 * kept * hidden * h
        what = "grouped_matmul, then moe_combine"

    def serial_all() -> None:
        if op == "moe_dispatch_gemm":
            disp.launch()
            compute_all()
        else:
            compute_all()
            comm_all()

    def free() -> None:
        disp.free()
        for bb in bufs:
            bb.free()

    # the fused dispatch's comm blocks: the launcher's choice (a quarter of the SMs)
    return Bench(launch_fused, serial_all, compute_all, comm_all, check, flops, 0,
                 f"serial: {what} (scale model)", free)


# ---------------------------------------------------------------------------------------------

def build(world: World, op: str, shape: dict, rng) -> Bench:
    if op in ("gemm_rs", "ag_gemm", "gemm_ar"):
        return tp_bench(world, op, shape, rng)
    if op in cost_model.FP8_OPS:
        return tp_fp8_bench(world, op, shape, rng)
    if op in ("ring_attn", "ring_attn_bwd"):
        return ring_bench(world, shape, rng, op == "ring_attn_bwd")
    if op == "ulysses_attn":
        return ulysses_fwd_bench(world, shape, rng)
    if op == "ulysses_attn_bwd":
        return ulysses_bwd_bench(world, shape, rng)
    return moe_bench(world, op, shape, rng)


def timed(world: World, fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median microseconds per call of each launcher, batches taken in turn (rep 1 of each,
    then rep 2, ...); a batch lasts about 20 ms (2-10 calls)."""
    iters = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        sync_all(world, fn)
        one = time.perf_counter() - start
        iters[name] = int(min(10, max(2, 0.02 / max(one, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters[name]):
                fn()
            world.synchronize()
            samples[name].append((time.perf_counter() - start) / iters[name] * 1e6)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure(world: World, op: str, shape: dict, rng, tag: str, rows: list) -> dict | None:
    p = world.world
    bench = build(world, op, shape, rng)
    try:
        bench.check()
        t = timed(world, {"fused": bench.fused, "serial": bench.serial}, reps=5)
        parts = timed(world, {"compute": bench.compute, "comm": bench.comm}, reps=3)
    finally:
        bench.free()
    fused, serial = t["fused"], t["serial"]
    tc, tm = parts["compute"], parts["comm"]
    bound = max(tc, tm)
    eff = (serial - fused) / (serial - bound) if serial - bound > 1e-9 else None
    sms = world.sms[0]
    row = common.record(
        op=op, shape=shape, dtype=FP8 if op in cost_model.FP8_OPS else BF16, world=p,
        processes=1, median_us=fused,
        tflops=bench.flops / fused / 1e6, baseline=bench.baseline, baseline_median_us=serial,
        path=RESULTS, emulated=True, machine=f"{common.machine()}-emulated", **world.scale,
        link=f"throttled {world.scale['flop_per_byte']:g} FLOP/B, asynchronous",
        comm_sms=world.comm_sms(bench.comm_sms_on_node) if bench.comm_sms_on_node else "auto",
        comm_sms_on_node=bench.comm_sms_on_node or "auto",
        fused_us=round(fused, 2), serial_us=round(serial, 2), t_compute_us=round(tc, 2),
        t_comm_us=round(tm, 2), comm_fraction=round(tm / serial, 4),
        overlap_efficiency=None if eff is None else round(eff, 4),
        exposed_comm=round((fused - tc) / tm, 4) if tm > 0 else None,
        projected_tflops=round(bench.flops / fused / 1e6 * NODE_SMS / sms, 1),
        projection="rank rate x 132 / sms_per_rank (one GPU of the node; a projection)",
        tag=tag, **{"pass": PASSES[op]})
    rows.append(row)
    print(f"P={p} {op:17s} {json.dumps(shape)}: fused {fused:9.1f} us serial {serial:9.1f} "
          f"({serial / fused:5.2f}x)  compute {tc:9.1f} comm {tm:9.1f} "
          f"(comm {tm / serial:4.0%} of serial)  eff {'-' if eff is None else f'{eff:5.2f}'}  "
          f"proj {row['projected_tflops']:6.1f} TF/s", flush=True)
    return row


def default_cases(quick: bool) -> list[dict]:
    """The issue's shapes: the paper's and real models', per rank (= per GPU of the node)."""
    cases = []
    ks = (512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192)
    for op in ("gemm_rs", "ag_gemm", "gemm_ar"):
        for kr in ks:
            cases.append({"op": op, "shape": {"m": 8192, "n": 8192, "k_per_rank": kr}})
    # Llama-3-70B TP MLP: 8192 -> 28672 -> 8192 at 8 GPUs: up [4096 tokens, 8192] x
    # [8192, 28672/8] (ag_gemm), down [4096, 28672/8] x [28672/8, 8192] (gemm_rs)
    cases.append({"op": "ag_gemm", "shape": {"m": 4096, "n": 3584, "k_per_rank": 8192}})
    cases.append({"op": "gemm_rs", "shape": {"m": 4096, "n": 8192, "k_per_rank": 3584}})
    for op in ("ring_attn", "ring_attn_bwd"):
        for s, causal in ((12288, False), (12288, True)) + (() if quick else ((49152, False),)):
            cases.append({"op": op, "shape": {"s": s, "h": 8, "hkv": 8, "d": 128,
                                              "causal": causal}})
        cases.append({"op": op, "shape": {"s": 12288, "h": 64, "hkv": 8, "d": 128,
                                          "causal": False}})
    for op in ("ulysses_attn", "ulysses_attn_bwd"):
        for causal in (False, True):
            cases.append({"op": op, "shape": {"s": 8192, "h": 64, "d": 128, "causal": causal}})
    for op in ("moe_dispatch_gemm", "moe_gemm_combine"):
        cases.append({"op": op, "shape": {"model": "deepseek-v3-like", "t": 2048, "k": 8,
                                          "experts": 256, "h": 7168, "hidden": 2048}})
        cases.append({"op": op, "shape": {"model": "mixtral-like", "t": 2048, "k": 2,
                                          "experts": 8, "h": 4096, "hidden": 14336}})
    return cases


# The shape keys each family's benchmark reads (ring: hkv too; MoE: "model" is a label).
SHAPE_KEYS = {"tp": ("m", "n", "k_per_rank"), "ring": ("s", "h", "hkv", "d", "causal"),
              "ulysses": ("s", "h", "d", "causal"), "moe": ("t", "k", "experts", "h", "hidden")}


def family(op: str) -> str:
    return ("tp" if op.removesuffix("_fp8") in cost_model.OPS else "moe" if op.startswith("moe")
            else op.split("_")[0])


def check_shape(op: str, p: int, shape: dict) -> list[str]:
    """What is wrong with one case for this benchmark (empty: nothing): the op, P, the keys its
    builder reads, and the divisibility its builders and kernels assume (rows and sequences
    split evenly over P in 128-row tiles, TP's N and K in 256-column tiles, heads and experts
    split over P, MoE rows 16-byte vectors)."""
    if op not in PASSES:
        return [f"unknown op {op!r}"]
    if p not in (2, 4, 8):
        return [f"P = {p} is not 2, 4 or 8"]
    fam = family(op)
    missing = [k for k in SHAPE_KEYS[fam] if k not in shape]
    if missing:
        return [f"shape lacks {missing}"]
    bad = []
    if fam == "tp":
        if shape["m"] % (128 * p):
            bad.append("m is not a multiple of 128 P")
        if shape["n"] % 256 or shape["k_per_rank"] % 256:
            bad.append("n or k_per_rank is not a multiple of 256")
        if op in cost_model.FP8_OPS and shape.get("scaling") not in cost_model.FP8_SPEEDUP:
            bad.append(f"scaling is not one of {tuple(cost_model.FP8_SPEEDUP)}")
    elif fam in ("ring", "ulysses"):
        if shape["s"] % (128 * p):
            bad.append("s is not a multiple of 128 P")
        if shape["d"] not in (64, 128):
            bad.append("d is not 64 or 128")
        if fam == "ring" and shape["h"] % shape["hkv"]:
            bad.append("h is not a multiple of hkv")
        if fam == "ulysses" and shape["h"] % p:
            bad.append("h is not a multiple of P")
    else:
        if shape["experts"] % p or shape["h"] % 8 or shape["hidden"] % 128:
            bad.append("experts not a multiple of P, h of 8 or hidden of 128")
    return bad


def estimate_s(cases: list[dict], rows_path=RESULTS) -> float:
    """The run's wall time in seconds, from the committed scale-model rows: each case's serial
    and fused times predicted by the decider, taken to the emulator's time by the rows'
    measured / predicted serial time (geomean per op and P), then what `measure` launches
    (a warm-up and 5 batches of each form, 1 + 3 of each part; batches of 2-10 calls) plus
    the host time per case the earlier rounds' timestamps show (references, data, per
    family), plus about 30 s per world."""
    import fit_decider

    rows = fit_decider.load(rows_path)

    def predicted(op, shape, p):
        if family(op) == "tp":
            m, n, k = shape["m"], shape["n"], shape["k_per_rank"]
            fp8 = shape.get("scaling") if op in cost_model.FP8_OPS else None
            op = op.removesuffix("_fp8")
            fused = min(cost_model.predict(op, m, n, k, p, mode="fused", num_comm_sms=c,
                                           fp8=fp8).predicted_us
                        for c in (cost_model.COMM_SMS_CANDIDATES if op == "ag_gemm" else (0,)))
            return fused, cost_model.predict(op, m, n, k, p, mode="serial",
                                             fp8=fp8).predicted_us
        return cost_model.predict_overlap(op, shape, p)

    logs: dict = {}
    for r in rows:
        logs.setdefault((r["op"], r["world"]), []).append(
            math.log(r["serial_us"] / predicted(r["op"], r["shape"], r["world"])[1]))
    host = {"tp": 2.5, "ring_attn": 2.0, "ring_attn_bwd": 6.0, "ulysses_attn": 5.0,
            "ulysses_attn_bwd": 8.0, "moe": 5.0}
    total = 30.0 * len({c["world"] for c in cases})
    for c in cases:
        op, p = c["op"], c["world"]
        # an fp8 form without rows of its own: its bf16 form's emulator / model ratio
        k = math.exp(statistics.mean(logs.get((op, p)) or logs[(op.removesuffix("_fp8"), p)]))
        fused, serial = (x * k * 1e-6 for x in predicted(op, c["shape"], p))
        batch = lambda t: min(10, max(2, int(0.02 / t))) * t
        total += 6 * (batch(fused) + batch(serial)) + 4 * batch(serial)
        total += host["tp" if family(op) == "tp" else "moe" if op.startswith("moe")
                      else op] * (1.3 if p == 8 else 1.0)
    return total


def dry_run(cases: list[dict]) -> None:
    bad = 0
    for c in cases:
        problems = check_shape(c["op"], c["world"], c["shape"])
        bad += bool(problems)
        fused, serial = ((None, None) if problems or family(c["op"]) == "tp"
                         else cost_model.predict_overlap(c["op"], c["shape"], c["world"]))
        pick = "-" if problems else cost_model.choose(c["op"], c["shape"], c["world"])
        ratio = "" if fused is None else f" predicted serial/fused {serial / fused:5.2f}"
        print(f"P={c['world']} {c['op']:17s} {json.dumps(c['shape'])}: picks {pick}{ratio}"
              + (f"  BAD: {'; '.join(problems)}" if problems else ""))
    print(f"=== {len(cases)} cases, {bad} bad; estimated wall time {estimate_s(cases):.0f} s")
    if bad:
        raise SystemExit("bench_overlap --dry-run: bad cases")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--ops", default=",".join(PASSES), help="comma-separated op stems")
    ap.add_argument("--quick", action="store_true", help="fewer K and sequence lengths")
    ap.add_argument("--cases", default=None, help="a JSON list of cases to run instead")
    ap.add_argument("--tag", default=None,
                    help="the rows' tag (default: the cases file's \"tag\", else overlap)")
    ap.add_argument("--workspace-mib", type=int, default=1024)
    ap.add_argument("--dry-run", action="store_true",
                    help="check --cases and estimate the run's time; no GPU work")
    args = ap.parse_args()
    which = set(args.ops.split(","))
    tag = args.tag or "overlap"
    if args.cases:
        with open(args.cases) as f:
            spec = json.load(f)
        listed = spec["cases"]
        tag = args.tag or spec.get("tag", "overlap")
    if args.dry_run:
        if not args.cases:
            raise SystemExit("bench_overlap --dry-run needs --cases")
        worlds = {int(w) for w in args.worlds.split(",")}
        which = set(args.ops.split(","))
        dry_run([c for c in listed if c["world"] in worlds and c["op"] in which])
        return
    rows: list = []
    failed: list[str] = []
    t0 = time.monotonic()
    for p in (int(s) for s in args.worlds.split(",")):
        cases = ([c for c in listed if c["world"] == p] if args.cases
                 else default_cases(args.quick))
        cases = [c for c in cases if c["op"] in which]
        if not cases:
            continue
        rng = np.random.default_rng(p)
        with World(p, workspace_bytes=args.workspace_mib << 20, timeout_s=30.0,
                   scale_model=True) as world:
            print(f"=== P={p}: {world.sms[0]} SMs per rank, matmul "
                  f"{world.scale['partition_tflops']} TFLOP/s per rank (all at once), link "
                  f"{world.scale['link_gbps']} GB/s per rank (1750 FLOP/B)", flush=True)
            for c in cases:
                try:
                    measure(world, c["op"], c["shape"], rng, tag, rows)
                except WrongResult as e:
                    failed.append(f"P={p} {c['op']} {c['shape']}: {e}")
                    print(f"WRONG: {failed[-1]}", flush=True)
                except Exception as e:  # noqa: BLE001 -- report and go on to the next case
                    failed.append(f"P={p} {c['op']} {c['shape']}: {type(e).__name__}: {e}")
                    print(f"ERROR: {failed[-1]}", flush=True)
                    traceback.print_exc()
                    if "EmulatorError" in type(e).__name__:
                        break  # a trapped context: the rest of this world cannot run
            print(f"=== P={p} done at {time.monotonic() - t0:.0f} s", flush=True)
    summary(rows)
    if failed:
        raise SystemExit("bench_overlap: failed cases:\n  " + "\n  ".join(failed))


def summary(rows: list) -> None:
    for op in PASSES:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        big = [r for r in mine if r["comm_fraction"] >= 0.25]
        effs = [r["overlap_efficiency"] for r in big if r["overlap_efficiency"] is not None]
        print(f"=== {op:17s}: fused/serial geomean {common.geomean([r['ratio'] for r in mine]):.3f}"
              f" over {len(mine)}; where comm >= 25% of serial ({len(big)}): "
              f"{common.geomean([r['ratio'] for r in big]) if big else float('nan'):.3f}x, "
              f"overlap efficiency median "
              f"{statistics.median(effs) if effs else float('nan'):.2f}")


if __name__ == "__main__":
    main()

"""Emulated P-rank benchmarks: the seven cross-rank ops at P = 2, 4, 8 in the rank emulator
(pk_jax.testing.World: P green-context partitions of one GPU, the FFI handlers' launchers).

What the numbers mean: each emulated rank has 1/P of the SMs and all ranks share one HBM, so a
rank computes at about 1/P of the GPU and "links" at the shared-HBM rate, not NVLink's. The
rows measure overlap and protocol cost under true concurrency, not NVLink speed; every row says
`"emulated": true`, `"machine": "h200-emulated"`, `"link": "shared HBM (unthrottled)"`.

Per P:
- fused TP ops against the serial path launched the same way (pk.matmul's launcher, then the
  collective's): gemm_rs (matmul + reduce_scatter), ag_gemm (all_gather + matmul), gemm_ar
  (matmul + all_reduce), at a few (M, N, K) with K the whole contraction; the cost model's
  predictions for both modes next to the measurements, with the model's constants scaled to a
  partition (SMs, peak, HBM / P, link = the measured copy rate / P);
- the four collectives at 32 MiB per rank against a device copy of the same bytes on every
  rank's stream at once (what the shared HBM allows).

Correctness first: each configuration's outputs are checked against a float64 reference
(tolerances as the ops' tests) before it is timed. Timing: back-to-back calls on every rank's
stream, no host synchronisation inside a batch, wall clock per call, median of 5 batches.

    python bench/bench_emulated.py [--worlds 2,4,8] [--quick]
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import dataclasses
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax import cost_model
from pk_jax.runtime import vmm
from pk_jax.testing import DeviceBuffer, World, ops

MACHINE = "h200-emulated"
LINK = "shared HBM (unthrottled)"
BF16 = "bfloat16"


def emulated_gpu(world: World, copy_gbps: float) -> cost_model.GPU:
    """The cost model's constants for one partition of the H200."""
    h = cost_model.H200
    sms = world.sms[0]
    return dataclasses.replace(h, name=f"H200/{world.world}", sms=sms,
                               peak_tflops=h.peak_tflops * sms / h.sms,
                               hbm_gbps=h.hbm_gbps / world.world,
                               nvlink_gbps=copy_gbps / world.world)


def copy_rate_gbps(world: World, nbytes: int = 256 << 20) -> float:
    """Device-to-device copy rate of the whole GPU (bytes read + written per second / 2)."""
    a, b = DeviceBuffer(nbytes), DeviceBuffer(nbytes)
    cu = vmm.driver()
    stream = cu.CUstream(world.parts[0].stream)

    def one():
        vmm.call("cuMemcpyDtoDAsync", b.ptr, a.ptr, nbytes, stream)

    us = common.emulated_us(world, one)
    a.free()
    b.free()
    # One partition's copy engine path is not SM-bound: this is the shared HBM's copy rate.
    return nbytes / (us * 1e-6) / 1e9


# ---------------------------------------------------------------------------------------------
# Fused TP ops against the serial path

def tp_buffers(world: World, op: str, m: int, n: int, k: int, rng) -> dict:
    """Per-rank operands (random integers in {-1, 0, 1}), outputs and serial temporaries."""
    p = world.world
    dt = ops.np_dtype(BF16)
    per = []
    for _ in range(p):
        if op == "ag_gemm":
            x = ops.integers(rng, (m // p, k), -1, 2)
            w = ops.integers(rng, (k, n // p), -1, 2)
        else:
            x = ops.integers(rng, (m, k // p), -1, 2)
            w = ops.integers(rng, (k // p, n), -1, 2)
        per.append((x, w))
    if op == "gemm_rs":
        case = ops.gemm_rs([x for x, _ in per], [w for _, w in per], BF16, exact=False)
    elif op == "gemm_ar":
        case = ops.gemm_ar([x for x, _ in per], [w for _, w in per], BF16, exact=False)
    else:
        case = ops.ag_gemm([x for x, _ in per], [w for _, w in per], BF16, exact=False)
    fused = ops.Call(world, case)
    serial = ops.Call(world, case)  # the same operands and expected outputs, other buffers
    tmp = []
    for r in range(p):
        x, w = case.inputs[r]["x"], case.inputs[r]["w"]
        if op != "ag_gemm":  # x @ w before the collective
            tmp.append(DeviceBuffer(x.shape[0] * w.shape[1] * dt.itemsize))
    return {"case": case, "fused": fused, "serial": serial, "tmp": tmp}


def serial_launch(world: World, op: str, b: dict) -> None:
    """matmul + collective (gemm_rs, gemm_ar) or all_gather + matmul (ag_gemm) on every rank."""
    case, call, tmp = b["case"], b["serial"], b["tmp"]
    dt = ops.DTYPES[BF16]
    for r in range(world.world):
        x, w = case.inputs[r]["x"], case.inputs[r]["w"]
        bufs = call.buffers[r]
        cfg = {"config": 0, "group_m": 8}
        if op == "ag_gemm":  # the gather lands in x_full, which the op also returns
            world.launch("all_gather", r, {"dtype": dt, "x": bufs["x"], "y": bufs["x_full"],
                                           "n": x.size, "n_out": x.size * world.world,
                                           "p0": x.size})
            world.launch("matmul", r, {"dtype": dt, "x": bufs["x_full"], "w": bufs["w"],
                                       "y": bufs["y"], "m": x.shape[0] * world.world,
                                       "k": x.shape[1], "n": w.shape[1],
                                       "y_rows": x.shape[0] * world.world,
                                       "y_cols": w.shape[1], **cfg})
            continue
        mm = x.shape[0] * w.shape[1]
        world.launch("matmul", r, {"dtype": dt, "x": bufs["x"], "w": bufs["w"], "y": tmp[r],
                                   "m": x.shape[0], "k": x.shape[1], "n": w.shape[1],
                                   "y_rows": x.shape[0], "y_cols": w.shape[1], **cfg})
        if op == "gemm_rs":
            world.launch("reduce_scatter", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"],
                                               "n": mm, "n_out": mm // world.world,
                                               "p0": mm // world.world})
        else:
            world.launch("all_reduce", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"], "n": mm,
                                           "n_out": mm})


def model_plan(op: str, m: int, n: int, k: int, p: int, gpu: cost_model.GPU):
    """cost_model.plan over both modes, with ag_gemm's comm SMs below half a partition."""
    cands = [c for c in cost_model.COMM_SMS_CANDIDATES if c <= gpu.sms // 2]
    plans = [cost_model.predict(op, m, n, k, p, mode=md, num_comm_sms=c, gpu=gpu)
             for md in ("fused", "serial")
             for c in (cands if md == "fused" and op == "ag_gemm" else [0])]
    return min(plans, key=lambda pl: pl.predicted_us)


def bench_tp(world: World, gpu: cost_model.GPU, shapes, rng, rows: list) -> None:
    p = world.world
    for op in ("gemm_rs", "ag_gemm", "gemm_ar"):
        for m, n, k in shapes:
            b = tp_buffers(world, op, m, n, k, rng)
            k_dev = k if op == "ag_gemm" else k // p
            plan = model_plan(op, m, n, k_dev, p, gpu)
            comm_sms = plan.num_comm_sms if op == "ag_gemm" else 0
            if op == "ag_gemm":
                comm_sms = comm_sms or 8
                comm_sms = min(comm_sms, world.sms[0] // 2)
                for a in b["fused"].args:
                    a["num_comm_sms"] = comm_sms
            b["fused"].launch()
            serial_launch(world, op, b)
            world.synchronize()
            problems = b["fused"].check() + b["serial"].check()
            if problems:
                raise SystemExit(f"{op} P={p} {m}x{n}x{k}: wrong results: {problems[:3]}")
            t_fused = common.emulated_us(world, b["fused"].launch)
            t_serial = common.emulated_us(world, lambda op=op, b=b: serial_launch(world, op, b))
            pred = {md: cost_model.predict(op, m, n, k_dev, p, mode=md, num_comm_sms=comm_sms,
                                           gpu=gpu).predicted_us for md in ("fused", "serial")}
            flops = 2.0 * m * n * k
            shape = {"m": m, "n": n, "k": k}
            common_fields = {"dtype": BF16, "world": p, "processes": 1, "emulated": True,
                             "machine": MACHINE, "link": LINK, "sms_per_rank": world.sms[0],
                             "predicted_fused_us": round(pred["fused"], 1),
                             "predicted_serial_us": round(pred["serial"], 1),
                             "model_choice": plan.mode, "num_comm_sms": comm_sms}
            row = common.record(op=op, shape=shape, median_us=t_fused,
                                tflops=flops / t_fused / 1e6, baseline="serial (emulated)",
                                baseline_median_us=t_serial, mode="fused", **common_fields)
            rows.append(row)
            faster = "fused" if t_fused < t_serial else "serial"
            print(f"P={p} {op:8s} {m}x{n}x{k}: fused {t_fused:9.1f} us "
                  f"({flops / t_fused / 1e6:6.1f} TFLOP/s)  serial {t_serial:9.1f} us  "
                  f"{t_serial / t_fused:5.2f}x vs serial | model fused {pred['fused']:8.1f} "
                  f"serial {pred['serial']:8.1f} -> {plan.mode} (faster: {faster})", flush=True)
            for c in (b["fused"], b["serial"]):
                c.free()
            for t in b["tmp"]:
                t.free()


# ---------------------------------------------------------------------------------------------
# Collectives against a concurrent device copy of the same bytes

def bench_collectives(world: World, nbytes: int, rng, rows: list) -> None:
    p = world.world
    n = nbytes // 2
    n -= n % (p * 8)
    cu = vmm.driver()
    for op in ops.COLLECTIVES:
        xs = [ops.integers(rng, n) for _ in range(p)]
        if op == "all_reduce":
            case = ops.all_reduce(xs, BF16)
        elif op == "all_gather":
            case = ops.all_gather([x[: n // p] for x in xs], BF16)
        elif op == "reduce_scatter":
            case = ops.reduce_scatter(xs, BF16)
        else:
            case = ops.all_to_all([x.reshape(p * 8, -1) for x in xs], BF16, 0, 0)
        call = ops.Call(world, case)
        call.launch()
        world.synchronize()
        problems = call.check()
        if problems:
            raise SystemExit(f"{op} P={p}: wrong results: {problems[:3]}")
        t = common.emulated_us(world, call.launch)
        moved = case.expected[0]["y"].nbytes  # bytes each rank writes
        src = [DeviceBuffer(moved) for _ in range(p)]
        dst = [DeviceBuffer(moved) for _ in range(p)]

        def copies(src=src, dst=dst, moved=moved):
            for r in range(p):
                vmm.call("cuMemcpyDtoDAsync", dst[r].ptr, src[r].ptr, moved,
                         cu.CUstream(world.parts[r].stream))

        t_copy = common.emulated_us(world, copies)
        row = common.record(op=op, shape={"bytes_per_rank": case.inputs[0]["x"].nbytes},
                            dtype=BF16, world=p, processes=1, median_us=t,
                            gbps=moved / t / 1e3, baseline="concurrent device copy (emulated)",
                            baseline_median_us=t_copy, emulated=True, machine=MACHINE,
                            link=LINK, sms_per_rank=world.sms[0])
        rows.append(row)
        print(f"P={p} {op:14s} {case.inputs[0]['x'].nbytes >> 20:4d} MiB/rank: {t:9.1f} us "
              f"({moved / t / 1e3:7.1f} GB/s written per rank)  copy {t_copy:8.1f} us",
              flush=True)
        call.free()
        for bb in src + dst:
            bb.free()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = [(8192, 8192, 8192), (8192, 8192, 2048), (4096, 4096, 8192)]
    if args.quick:
        shapes = shapes[:2]
    rows: list = []
    for p in (int(s) for s in args.worlds.split(",")):
        with World(p, workspace_bytes=512 << 20, timeout_s=30.0) as world:
            rate = copy_rate_gbps(world)
            gpu = emulated_gpu(world, rate)
            print(f"=== P={p}: {world.sms} SMs per rank, device copy {rate:.0f} GB/s", flush=True)
            bench_tp(world, gpu, shapes, rng, rows)
            bench_collectives(world, 32 << 20, rng, rows)
    tp = [r for r in rows if r.get("mode") == "fused"]
    right = sum(1 for r in tp if (r["model_choice"] == "fused") == (r["ratio"] > 1.0))
    wrong_fused = sum(1 for r in tp if r["model_choice"] == "fused" and r["ratio"] <= 1.0)
    print(f"=== cost model (emulated constants): picked the faster mode in {right}/{len(tp)} "
          f"cases; picked fused where serial was faster in {wrong_fused}")
    if tp:
        print(f"=== geomean fused vs serial: {common.geomean([r['ratio'] for r in tp]):.3f}x")


if __name__ == "__main__":
    main()

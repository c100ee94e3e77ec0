"""Emulated P-rank benchmarks: the seven cross-rank ops at P = 2, 4, 8 in the rank emulator
(pk_jax.testing.World: P green-context partitions of one GPU, the FFI handlers' launchers),
unthrottled and with the link throttle at a real NVLink node's FLOP/byte ratio.

What the numbers mean: each emulated rank has 1/P of the SMs and all ranks share one HBM, so
a rank computes at about 1/P of the GPU. Unthrottled, it "links" at the shared-HBM rate (~240
FLOP per byte: communication is nearly free, overlap barely matters). Throttled, every rank's
cross-rank bytes are paced at link = (the partition's matmul TFLOP/s, measured in the same
run) / 1750 FLOP per byte (a real H100/H200 node: 790 TFLOP/s against 450 GB/s per GPU per
direction), so the emulated machine has a real node's balance of compute and communication.
Neither is NVLink speed. Every row says `"emulated": true`, `"machine": "h200-emulated"`,
`"world"`: P, `"link"`: "unthrottled" or "throttled 1750 FLOP/B" and `"link_gbps"` (the cap
per rank, or the shared HBM's device-copy rate / P when unthrottled).

Per P and link setting:
- fused TP ops against the serial path launched the same way (pk.matmul's launcher, then the
  collective's): gemm_rs (matmul + reduce_scatter), ag_gemm (all_gather + matmul), gemm_ar
  (matmul + all_reduce), at a few (M, N, K) with K the whole contraction; the cost model's
  predictions for both modes next to the measurements, with the model's constants scaled to a
  partition (SMs, peak, HBM / P, the partition's measured GEMM rate; link = the cap when
  throttled, `unthrottled_link_gbps` when not); ag_gemm with the comm SMs of the model's best
  fused plan (`--comm-sms-sweep 2,4,8` adds rows at those counts first, marked
  `comm_sms_forced`);
- the four collectives at 32 MiB per rank against a device copy of the same bytes on every
  rank's stream at once (what the shared HBM allows); throttled rows also give the link floor
  (bytes each rank moves across ranks / cap).

Correctness first: each configuration's outputs are checked against a float64 reference
(tolerances as the ops' tests) before it is timed, throttled and unthrottled. Timing:
back-to-back calls on every rank's stream, no host synchronisation inside a batch, wall clock
per call, median of 5 batches.

    CUDA_MODULE_LOADING=EAGER python bench/bench_emulated.py [--worlds 2,4,8] [--quick]
        [--throttle both|real-node|off] [--flop-per-byte 1750] [--link-gbps G]
        [--ops gemm_rs,ag_gemm,...] [--comm-sms-sweep 2,4,8]
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import dataclasses
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax import cost_model
from pk_jax.runtime import vmm
from pk_jax.testing import REAL_NODE_FLOP_PER_BYTE, DeviceBuffer, World, ops, real_node_link_gbps

MACHINE = "h200-emulated"
BF16 = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Link:
    """One link setting of a run: its row label, the cap (0: unthrottled) and the cost model's
    constants for it."""

    label: str
    gbps: float          # the throttle's cap per rank; 0 = off
    model_gbps: float    # the link rate the cost model is given
    gpu: cost_model.GPU
    copy_gbps: float     # rank 0's partition's copy rate, measured in the run
    tflops: float        # one rank's matmul rate with every rank multiplying, measured


def emulated_gpu(world: World, link_gbps: float, tflops: float) -> cost_model.GPU:
    """The cost model's constants for one partition of the H200, with link `link_gbps` and the
    partition's measured GEMM rate."""
    return partition_gpu(world.world, world.sms[0], link_gbps, tflops)


def partition_gpu(p: int, sms: int, link_gbps: float,
                  tflops: float | None = None) -> cost_model.GPU:
    """The H200's constants scaled to one of P partitions of `sms` SMs (peak by SMs, HBM and its
    copy rate / P: the ranks share one HBM), with link `link_gbps` and, when given, the GEMM
    rate `tflops` measured on the partition while every rank multiplies (partition_tflops; the
    emulator's counterpart of the H200's gemm_efficiency, which comes from pk.matmul measured on
    the whole GPU). Also bench/check_cost_model.py, from a row's fields."""
    h = cost_model.H200
    peak = h.peak_tflops * sms / h.sms
    return dataclasses.replace(h, name=f"H200/{p}", sms=sms, peak_tflops=peak,
                               gemm_efficiency=tflops / peak if tflops else h.gemm_efficiency,
                               hbm_gbps=h.hbm_gbps / p, copy_gbps=h.copy_gbps / p,
                               nvlink_gbps=link_gbps)


def copy_rate_gbps(world: World, nbytes: int = 256 << 20) -> float:
    """Device-to-device copy rate of rank 0's partition alone (bytes copied per second)."""
    a, b = DeviceBuffer(nbytes), DeviceBuffer(nbytes)
    cu = vmm.driver()
    stream = cu.CUstream(world.parts[0].stream)

    def one():
        vmm.call("cuMemcpyDtoDAsync", b.ptr, a.ptr, nbytes, stream)

    us = common.emulated_us(world, one)
    a.free()
    b.free()
    # NOTES: the copy runs on partition 0's SMs: below 64 SMs it is bound by them, not by the
    # HBM, so it is one partition's rate (measured: bench/results/emulated_notes.md,
    # "Measurements moved from code comments (issue 37)").
    return nbytes / (us * 1e-6) / 1e9


def partition_tflops(world: World, m: int = 8192, n: int = 8192, k: int = 2048) -> float:
    """TFLOP/s of one rank's matmul (pk.matmul's launcher, the serial path's GEMM) while every
    rank runs one at once: the emulated rank's compute rate, measured."""
    p = world.world
    bufs = [(DeviceBuffer(m * k * 2), DeviceBuffer(k * n * 2), DeviceBuffer(m * n * 2))
            for _ in range(p)]
    for x, w, _ in bufs:
        x.fill(0x3C)  # bf16 0x3C3C: a small finite value
        w.fill(0x3C)
    dt = ops.DTYPES[BF16]

    def all_ranks():
        for r, (x, w, y) in enumerate(bufs):
            world.launch("matmul", r, {"dtype": dt, "x": x, "w": w, "y": y, "m": m, "k": k,
                                       "n": n, "y_rows": m, "y_cols": n, "config": 0,
                                       "group_m": 8})

    us = common.emulated_us(world, all_ranks)
    for trio in bufs:
        for b in trio:
            b.free()
    return 2.0 * m * n * k / (us * 1e-6) / 1e12


def unthrottled_link_gbps(p: int, partition_copy_gbps: float) -> float:
    """What one of P ranks moves per second when every rank copies at once, unthrottled: its
    partition's own copy rate (measured, SM-bound below 64 SMs: copy_rate_gbps), or its 1/P
    of the shared HBM's copy rate (cost_model.H200.copy_gbps counts bytes read + written),
    whichever is lower. Rows without `partition_copy_gbps` (before f8bff60) took the
    partition's rate / P, as if it were the whole HBM's: at P = 8 far below what the serial
    all_gather of ag_gemm measured per rank (bench/results/emulated_notes.md, "Measurements
    moved from code comments (issue 37)")."""
    return min(partition_copy_gbps, cost_model.H200.copy_gbps / 2 / p)


def links_for(world: World, throttle: str, flop_per_byte: float, link_gbps: float | None,
              copy_gbps: float, tflops: float) -> list[Link]:
    """The link settings of this run: unthrottled and/or throttled."""
    p = world.world
    out = []
    if throttle in ("both", "off"):
        free = unthrottled_link_gbps(p, copy_gbps)
        out.append(Link("unthrottled", 0.0, free, emulated_gpu(world, free, tflops), copy_gbps,
                        tflops))
    if throttle in ("both", "real-node"):
        cap = link_gbps or real_node_link_gbps(tflops, flop_per_byte)
        label = (f"throttled {cap:.1f} GB/s" if link_gbps
                 else f"throttled {flop_per_byte:g} FLOP/B")
        out.append(Link(label, cap, cap, emulated_gpu(world, cap, tflops), copy_gbps, tflops))
    return out


def link_fields(world: World, link: Link) -> dict:
    return {"emulated": True, "machine": MACHINE, "link": link.label,
            "link_gbps": round(link.model_gbps, 2), "throttled": link.gbps > 0,
            "sms_per_rank": world.sms[0], "partition_copy_gbps": round(link.copy_gbps, 1),
            "partition_tflops": round(link.tflops, 1)}


def poison(call: ops.Call) -> None:
    for r, bufs in enumerate(call.buffers):
        for name in call.case.expected[r]:
            bufs[name].fill(0xFF)


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


def serial_launch(world: World, op: str, b: dict,
                  parts: tuple[str, ...] = ("compute", "comm")) -> None:
    """matmul + collective (gemm_rs, gemm_ar) or all_gather + matmul (ag_gemm) on every rank;
    `parts` picks the matmul ("compute") and/or the collective ("comm") alone."""
    case, call, tmp = b["case"], b["serial"], b["tmp"]
    dt = ops.DTYPES[BF16]
    for r in range(world.world):
        x, w = case.inputs[r]["x"], case.inputs[r]["w"]
        bufs = call.buffers[r]
        cfg = {"config": 0, "group_m": 8}
        if op == "ag_gemm":  # the gather lands in x_full, which the op also returns
            if "comm" in parts:
                world.launch("all_gather", r, {"dtype": dt, "x": bufs["x"],
                                               "y": bufs["x_full"], "n": x.size,
                                               "n_out": x.size * world.world, "p0": x.size})
            if "compute" in parts:
                world.launch("matmul", r, {"dtype": dt, "x": bufs["x_full"], "w": bufs["w"],
                                           "y": bufs["y"], "m": x.shape[0] * world.world,
                                           "k": x.shape[1], "n": w.shape[1],
                                           "y_rows": x.shape[0] * world.world,
                                           "y_cols": w.shape[1], **cfg})
            continue
        mm = x.shape[0] * w.shape[1]
        if "compute" in parts:
            world.launch("matmul", r, {"dtype": dt, "x": bufs["x"], "w": bufs["w"], "y": tmp[r],
                                       "m": x.shape[0], "k": x.shape[1], "n": w.shape[1],
                                       "y_rows": x.shape[0], "y_cols": w.shape[1], **cfg})
        if "comm" not in parts:
            continue
        if op == "gemm_rs":
            world.launch("reduce_scatter", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"],
                                               "n": mm, "n_out": mm // world.world,
                                               "p0": mm // world.world})
        else:
            world.launch("all_reduce", r, {"dtype": dt, "x": tmp[r], "y": bufs["y"], "n": mm,
                                           "n_out": mm})


def model_plan(op: str, m: int, n: int, k: int, p: int, gpu: cost_model.GPU,
               modes: tuple[str, ...] = ("fused", "serial")):
    """cost_model.plan over `modes`, with ag_gemm's comm SMs below half a partition: the fastest
    prediction of each mode, and of fused and serial what "auto" picks (cost_model.auto_pick)."""
    cands = [c for c in cost_model.COMM_SMS_CANDIDATES if c <= gpu.sms // 2]
    best = {md: min((cost_model.predict(op, m, n, k, p, mode=md, num_comm_sms=c, gpu=gpu)
                     for c in (cands if md == "fused" and op == "ag_gemm" else [0])),
                    key=lambda pl: pl.predicted_us) for md in modes}
    if "fused" in best and "serial" in best:
        return cost_model.auto_pick(op, best["fused"], best["serial"])
    return min(best.values(), key=lambda pl: pl.predicted_us)


TP_OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


def bench_tp(world: World, links: list[Link], shapes, rng, rows: list,
             which: tuple[str, ...] = TP_OPS, sweep: tuple[int, ...] = ()) -> None:
    """Fused against serial per op, shape and link, both checked first. ag_gemm runs with the
    comm SMs of the model's best fused plan; `sweep` adds rows at those comm SM counts first
    (marked comm_sms_forced; bench/check_cost_model.py judges the model's rows only)."""
    p = world.world
    for op in (o for o in TP_OPS if o in which):
        for m, n, k in shapes:
            b = tp_buffers(world, op, m, n, k, rng)
            k_dev = k if op == "ag_gemm" else k // p
            n_dev = n // p if op == "ag_gemm" else n  # ag_gemm: each rank has w[:, N/P]
            for link in links:
                world.set_link(link.gbps)
                plan = model_plan(op, m, n_dev, k_dev, p, link.gpu)
                runs = [(0, False)]
                if op == "ag_gemm":  # the comm SMs of the model's best fused plan, last
                    best = model_plan(op, m, n_dev, k_dev, p, link.gpu, modes=("fused",))
                    runs = [(c, True) for c in sweep
                            if c < world.sms[0] and c != best.num_comm_sms]
                    runs.append((best.num_comm_sms, False))
                t_serial = None
                for comm_sms, forced in runs:
                    if op == "ag_gemm":
                        for a in b["fused"].args:
                            a["num_comm_sms"] = comm_sms
                    for c in (b["fused"], b["serial"]):
                        poison(c)
                    b["fused"].launch()
                    serial_launch(world, op, b)
                    world.synchronize()
                    problems = b["fused"].check() + b["serial"].check()
                    if problems:
                        raise SystemExit(f"{op} P={p} {m}x{n}x{k} ({link.label}): wrong results: "
                                         f"{problems[:3]}")
                    t_fused = common.emulated_us(world, b["fused"].launch)
                    if t_serial is None:
                        t_serial = common.emulated_us(
                            world, lambda op=op, b=b: serial_launch(world, op, b))
                    pred = {md: cost_model.predict(op, m, n_dev, k_dev, p, mode=md,
                                                   num_comm_sms=comm_sms,
                                                   gpu=link.gpu).predicted_us
                            for md in ("fused", "serial")}
                    flops = 2.0 * m * n * k
                    extra = {"comm_sms_forced": True} if forced else {}
                    row = common.record(
                        op=op, shape={"m": m, "n": n, "k": k}, median_us=t_fused,
                        tflops=flops / t_fused / 1e6, baseline="serial (emulated)",
                        baseline_median_us=t_serial, mode="fused", dtype=BF16, world=p,
                        processes=1, predicted_fused_us=round(pred["fused"], 1),
                        predicted_serial_us=round(pred["serial"], 1), model_choice=plan.mode,
                        num_comm_sms=comm_sms, **extra, **link_fields(world, link))
                    if not forced:
                        rows.append(row)
                    faster = "fused" if t_fused < t_serial else "serial"
                    print(f"P={p} {link.label:22s} {op:8s} {m}x{n}x{k}: fused {t_fused:9.1f} us "
                          f"({flops / t_fused / 1e6:6.1f} TFLOP/s)  serial {t_serial:9.1f} us  "
                          f"{t_serial / t_fused:5.2f}x | model fused {pred['fused']:8.1f} "
                          f"serial {pred['serial']:8.1f} -> {plan.mode} (faster: {faster})"
                          + (f" [comm SMs {comm_sms}{', forced' if forced else ''}]"
                             if op == "ag_gemm" else ""), flush=True)
            world.set_link(None)
            for c in (b["fused"], b["serial"]):
                c.free()
            for t in b["tmp"]:
                t.free()


# ---------------------------------------------------------------------------------------------
# Collectives against a concurrent device copy of the same bytes

def link_bytes(op: str, case: ops.Case, p: int) -> int:
    """Bytes each rank moves to or from other ranks' workspaces in one call (what the throttle
    paces; pk/collective.cuh): pulls of the peers' staged data."""
    nbytes = case.inputs[0]["x"].nbytes
    if op == "all_reduce":  # one-shot at P <= 2 or <= 512 KiB, else two-shot (sum + gather)
        return (p - 1) * nbytes if p <= 2 or nbytes <= 512 * 1024 else 2 * (p - 1) * nbytes // p
    if op == "all_gather":
        return (p - 1) * nbytes
    return (p - 1) * nbytes // p  # reduce_scatter (my slice from every peer), all_to_all


def bench_collectives(world: World, links: list[Link], nbytes: int, rng, rows: list,
                      which: tuple[str, ...] = ops.COLLECTIVES) -> None:
    p = world.world
    n = nbytes // 2
    n -= n % (p * 8)
    cu = vmm.driver()
    for op in (o for o in ops.COLLECTIVES if o in which):
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
        moved = case.expected[0]["y"].nbytes  # bytes each rank writes
        src = [DeviceBuffer(moved) for _ in range(p)]
        dst = [DeviceBuffer(moved) for _ in range(p)]

        def copies(src=src, dst=dst, moved=moved):
            for r in range(p):
                vmm.call("cuMemcpyDtoDAsync", dst[r].ptr, src[r].ptr, moved,
                         cu.CUstream(world.parts[r].stream))

        world.set_link(None)
        t_copy = common.emulated_us(world, copies)
        linked = link_bytes(op, case, p)
        for link in links:
            world.set_link(link.gbps)
            poison(call)
            call.launch()
            world.synchronize()
            problems = call.check()
            if problems:
                raise SystemExit(f"{op} P={p} ({link.label}): wrong results: {problems[:3]}")
            t = common.emulated_us(world, call.launch)
            floor = linked / (link.gbps * 1e3) if link.gbps else None  # us
            row = common.record(op=op, shape={"bytes_per_rank": case.inputs[0]["x"].nbytes},
                                dtype=BF16, world=p, processes=1, median_us=t,
                                gbps=moved / t / 1e3, baseline="concurrent device copy (emulated)",
                                baseline_median_us=t_copy, link_bytes_per_rank=linked,
                                link_floor_us=None if floor is None else round(floor, 1),
                                **link_fields(world, link))
            rows.append(row)
            extra = f"  link floor {floor:8.1f} us" if floor else ""
            print(f"P={p} {link.label:22s} {op:14s} {case.inputs[0]['x'].nbytes >> 20:4d} "
                  f"MiB/rank: {t:9.1f} us ({moved / t / 1e3:7.1f} GB/s written per rank)  "
                  f"copy {t_copy:8.1f} us{extra}", flush=True)
        world.set_link(None)
        call.free()
        for bb in src + dst:
            bb.free()


def summary(rows: list) -> None:
    for label in dict.fromkeys(r["link"] for r in rows):
        tp = [r for r in rows if r.get("mode") == "fused" and r["link"] == label]
        if not tp:
            continue
        right = sum(1 for r in tp if (r["model_choice"] == "fused") == (r["ratio"] > 1.0))
        wrong_fused = sum(1 for r in tp if r["model_choice"] == "fused" and r["ratio"] <= 1.0)
        print(f"=== {label}: cost model (emulated constants) picked the faster mode in "
              f"{right}/{len(tp)} cases; picked fused where serial was faster in {wrong_fused}; "
              f"geomean fused vs serial {common.geomean([r['ratio'] for r in tp]):.3f}x")
        for p in sorted({r["world"] for r in tp}):
            at = [r["ratio"] for r in tp if r["world"] == p]
            print(f"    P={p}: fused vs serial geomean {common.geomean(at):.3f}x "
                  f"({', '.join(f'{x:.2f}' for x in at)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--quick", action="store_true", help="two GEMM shapes, 16 MiB collectives")
    ap.add_argument("--throttle", choices=("both", "real-node", "off"), default="both",
                    help="unthrottled and real-node rows (default), or only one of them")
    ap.add_argument("--flop-per-byte", type=float, default=REAL_NODE_FLOP_PER_BYTE,
                    help="the real node's FLOP/byte the throttle reproduces (default 1750)")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="a fixed cap per rank (GB/s) instead of the FLOP/byte rule")
    ap.add_argument("--ops", default=",".join(TP_OPS + tuple(ops.COLLECTIVES)),
                    help="comma-separated ops to run (default: all seven)")
    ap.add_argument("--comm-sms-sweep", default="",
                    help="ag_gemm: also time fused at these comm SM counts (e.g. 2,4,8)")
    args = ap.parse_args()
    sweep = tuple(int(c) for c in args.comm_sms_sweep.split(",") if c)
    which = tuple(args.ops.split(","))
    unknown = set(which) - set(TP_OPS) - set(ops.COLLECTIVES)
    if unknown:
        ap.error(f"--ops: unknown {sorted(unknown)}; known: {TP_OPS + tuple(ops.COLLECTIVES)}")
    rng = np.random.default_rng(0)
    shapes = [(8192, 8192, 8192), (8192, 8192, 2048), (4096, 4096, 8192)]
    coll_bytes = 32 << 20
    if args.quick:
        shapes, coll_bytes = shapes[:2], 16 << 20
    rows: list = []
    t0 = time.monotonic()
    for p in (int(s) for s in args.worlds.split(",")):
        with World(p, workspace_bytes=512 << 20, timeout_s=30.0) as world:
            rate = copy_rate_gbps(world)
            tflops = partition_tflops(world)
            links = links_for(world, args.throttle, args.flop_per_byte, args.link_gbps, rate,
                              tflops)
            free = unthrottled_link_gbps(p, rate)
            print(f"=== P={p}: {world.sms} SMs per rank, partition copy {rate:.0f} GB/s "
                  f"({free:.0f} GB/s per rank unthrottled, all ranks at once); matmul "
                  f"{tflops:.1f} TFLOP/s per rank (all ranks at once) -> "
                  f"{tflops * 1e3 / free:.0f} FLOP/B unthrottled; real-node cap "
                  f"{tflops:.1f}e12 / {args.flop_per_byte:g} = "
                  f"{real_node_link_gbps(tflops, args.flop_per_byte):.1f} GB/s per rank; "
                  f"links: {', '.join(f'{lk.label} ({lk.model_gbps:.1f} GB/s)' for lk in links)}",
                  flush=True)
            bench_tp(world, links, shapes, rng, rows, which, sweep)
            bench_collectives(world, links, coll_bytes, rng, rows, which)
            print(f"=== P={p} done at {time.monotonic() - t0:.0f} s", flush=True)
    summary(rows)
    print(f"=== total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()

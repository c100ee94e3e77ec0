"""Expert-parallel MoE (dispatch, combine, and the expert GEMMs serial and fused), emulated at P = 8.

pk_jax.testing.World: 8 green-context partitions of one GPU, the FFI handlers' launchers.

Shapes (per rank, scaled to a partition of 1/8 of the GPU):
- DeepSeek-V3-like: top-8 of 256 experts, H 7168 (expert hidden 2048), T 1024 tokens;
- Mixtral-like: top-2 of 8 experts, H 4096 (expert hidden 14336), T 2048 tokens;
capacity = 1.25 x the average rows per rank; uniform routing (k distinct experts per token) and
Zipf-skewed routing (exponent 1.3 over a random permutation of the experts: hot experts overflow
their rank's capacity and drop rows, many experts get none).

Per shape: the dispatch kernel (pk_moe_dispatch: count exchange, routing, rows pushed into the
experts' ranks) against the pk all_gather kernel of x (the traffic of the lax reference, which
all-gathers every token to every rank before selecting), and the combine kernel
(pk_moe_combine: pull of each slot's expert row, fp32 weighted sum) against the all_gather of y
(the reference's combine). Both baselines run the same emulated way, so the ratio is the
kernel's against the reference's communication alone (the reference's index arithmetic comes on
top).

Then the first expert GEMM (pk.moe_dispatch_gemm's work), per shape:
- serial: the dispatch, then pk's grouped GEMM (grouped_matmul's launcher, mode FWD) on every
  rank's received tokens [capacity, H] x w1 [E / P, H, expert hidden], on the same stream;
- reference: the all_gather of x (the lax reference's traffic) plus the same grouped GEMM,
  timed apart and added (the reference's own GEMM, jax.lax.ragged_dot, is far slower:
  bench/results/grouped_matmul.jsonl; it cannot run inside an emulated partition);
- fused: cuda/kernels/moe_dispatch_gemm.cuh, the GEMM of each expert starting as soon as
  every rank's rows of it have arrived (pk.moe_dispatch_gemm's path where the one decider,
  cost_model.choose, picks it, or with PK_JAX_MOE_FUSED=1); its y is checked equal to the
  serial path's on every rank before it is timed.
The GEMM's result is checked exactly on sampled rows of every group of rank 0 (w1 has 16
nonzero +-1 entries per column, so every product is a small integer, exact in bf16).

And the second expert GEMM with the combine (pk.moe_gemm_combine's work), per shape, on
integer hidden rows h [capacity, expert hidden] and w2 [E / P, expert hidden, H] (16 nonzero
+-1 per column), with the dispatch's handle:
- serial: grouped GEMM, then the combine kernel (pk.moe_gemm_combine with PK_JAX_MOE_FUSED=0);
- reference: the same grouped GEMM plus the all_gather of y (the lax reference's traffic),
  timed apart and added;
- fused: cuda/kernels/moe_gemm_combine.cuh (the GEMM's epilogue stores each output row into
  its token's rank's workspace; the owner sums its k slots; pk.moe_gemm_combine's path where
  the decider picks it, or with PK_JAX_MOE_FUSED=1), checked equal to the serial output
  on every rank before it is timed; the serial output is checked on sampled tokens of rank 0
  against numpy on the GEMM's y.
A fused kernel that fails its check is reported (and the script exits non-zero at the end)
without a row; the other rows are kept.

What the numbers mean: each emulated rank has 1/8 of the SMs, and all ranks share one HBM, so
"links" run at the shared-HBM rate, not NVLink's; every row says `"emulated": true`.

Correctness first: every configuration's outputs are checked exactly (integer inputs) against
the numpy references of pk_jax.testing.ops before it is timed. Timing: back-to-back calls on
every rank's stream, no host synchronisation inside a batch, wall clock per call, median of 5
batches of 10. Rows go to bench/results/moe.jsonl; the plot (bench/results/moe.png, the latest
row per op, shape and path) is drawn by bench/plot_moe.py when matplotlib is there.

    CUDA_MODULE_LOADING=EAGER python bench/bench_moe.py [--quick | --skewed] [--no-fused]
        [--comm-sms C]

--quick: the uniform DeepSeek-V3-like and Mixtral-like shapes (about a minute on the H200);
--skewed: their Zipf-skewed routing only (about a minute); neither: all four.
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

from pk_jax.testing import DeviceBuffer, World, ops
from pk_jax.testing.emulator import np_dtype

MACHINE = "h200-emulated"
FUSED = True  # --no-fused turns the fused kernels' rows off
COMM_SMS = 0  # --comm-sms: the fused dispatch's comm blocks (0: the launcher's choice)
FAILED: list[str] = []  # fused kernels that failed their check (no row; exit status 1)
LINK = "shared HBM (unthrottled)"
BF16 = "bfloat16"
P = 8

# name, tokens per rank, k, experts, H, expert hidden, skewed routing
SHAPES = [
    ("deepseek-v3-like", 1024, 8, 256, 7168, 2048, False),
    ("mixtral-like", 2048, 2, 8, 4096, 14336, False),
    ("deepseek-v3-like", 1024, 8, 256, 7168, 2048, True),
    ("mixtral-like", 2048, 2, 8, 4096, 14336, True),
]
QUICK = 2  # --quick: the first QUICK shapes (uniform routing)


def checked(world: World, case: ops.Case, ranks=None) -> ops.Call:
    call = ops.Call(world, case)
    call.launch()
    world.synchronize()
    problems = call.check(ranks)
    if problems:
        raise SystemExit(f"bench_moe: wrong result before timing: {problems[:3]}")
    return call


def routing(rng, t: int, k: int, experts: int, skew: bool) -> np.ndarray:
    if skew:  # Zipf over a random permutation: a few hot experts, a long tail
        perm = rng.permutation(experts)
        raw = np.minimum(rng.zipf(1.3, (P, t, k)) - 1, experts - 1)
        return perm[raw].astype(np.int32)
    # k distinct experts per token, as a top-k router picks them
    return np.argsort(rng.random((P, t, experts)), axis=-1)[..., :k].astype(np.int32)


def run_shape(world: World, name, t, k, experts, h, hidden, skew, rng, rows: list) -> None:
    ids = routing(rng, t, k, experts, skew)
    capacity = int(1.25 * t * k)  # P t k slots over P ranks, 25% headroom
    shape = {"model": name, "tokens_per_rank": t, "k": k, "experts": experts, "h": h,
             "expert_hidden": hidden, "capacity": capacity, "skewed": skew}
    fields = {"dtype": BF16, "world": P, "processes": 1, "emulated": True, "machine": MACHINE,
              "link": LINK, "sms_per_rank": world.sms[0]}

    xs = [ops.integers(rng, (t, h)) for _ in range(P)]
    disp = checked(world, ops.moe_dispatch(xs, ids, BF16, num_experts=experts,
                                           capacity=capacity))
    kept = [int(disp.case.expected[r]["group_sizes"].sum()) for r in range(P)]
    dropped = sum(int(disp.case.expected[r]["dropped"][0]) for r in range(P))
    # The baselines' outputs (P times the input) are checked on rank 0 only (host memory).
    gather_x = checked(world, ops.all_gather([x.reshape(-1) for x in xs], BF16), [0])
    t_disp = common.emulated_us(world, disp.launch)
    t_ag = common.emulated_us(world, gather_x.launch)
    moved = max(kept) * h * 2  # bytes the busiest rank receives
    rows.append(common.record(op="moe_dispatch", shape=shape, median_us=t_disp,
                              gbps=moved / t_disp / 1e3,
                              baseline="all_gather of x (the lax reference's traffic, emulated)",
                              baseline_median_us=t_ag, dropped=dropped,
                              path=common.RESULTS / "moe.jsonl", **fields))
    print(f"{name:17s} T={t} k={k} E={experts} H={h} skew={skew!s:5s}: dispatch "
          f"{t_disp:9.1f} us ({moved / t_disp / 1e3:6.1f} GB/s into the busiest rank, "
          f"{dropped} dropped)  all_gather(x) {t_ag:9.1f} us  {t_ag / t_disp:5.2f}x",
          flush=True)
    gemm_rows(world, disp, t_disp, t_ag, experts, h, hidden, kept, shape, fields, rng, rows)
    gather_x.free()

    ys = [ops.integers(rng, (capacity, h)) for _ in range(P)]
    weights = rng.integers(0, 5, (P, t, k)).astype(np.float32) / 4
    comb = checked(world, ops.moe_combine(ys, weights, ids, BF16, num_experts=experts))
    gather_y = checked(world, ops.all_gather([y.reshape(-1) for y in ys], BF16), [0])
    t_comb = common.emulated_us(world, comb.launch)
    t_agy = common.emulated_us(world, gather_y.launch)
    pulled = t * k * h * 2
    rows.append(common.record(op="moe_combine", shape=shape, median_us=t_comb,
                              gbps=pulled / t_comb / 1e3,
                              baseline="all_gather of y (the lax reference's traffic, emulated)",
                              baseline_median_us=t_agy, path=common.RESULTS / "moe.jsonl",
                              **fields))
    print(f"{name:17s} T={t} k={k} E={experts} H={h} skew={skew!s:5s}: combine  "
          f"{t_comb:9.1f} us ({pulled / t_comb / 1e3:6.1f} GB/s pulled per rank)  "
          f"all_gather(y) {t_agy:9.1f} us  {t_agy / t_comb:5.2f}x", flush=True)
    comb.free()
    gather_y.free()
    # The dispatch's handle (its checked outputs) routes the second GEMM's rows.
    gemm_combine_rows(world, disp, t_comb, t_agy, experts, h, hidden, kept, shape, fields, rng,
                      rows)
    disp.free()


def sparse_w(rng, el: int, h: int, f: int) -> np.ndarray:
    """[el, h, f] bf16 with 16 nonzero +-1 entries per column (exact integer products)."""
    w = np.zeros((el, h, f), np_dtype(BF16))
    nz = 16
    rows = rng.integers(0, h, (el, nz, f))
    signs = rng.choice(np.array([-1.0, 1.0], np_dtype(BF16)), (el, nz, f))
    e_idx = np.arange(el)[:, None, None]
    c_idx = np.arange(f)[None, None, :]
    w[e_idx, rows, c_idx] = signs  # a repeated row keeps one entry: still exact
    return w


def gemm_rows(world: World, disp: ops.Call, t_disp: float, t_ag: float, experts: int, h: int,
              hidden: int, kept: list[int], shape: dict, fields: dict, rng, rows: list) -> None:
    """Serial (dispatch, then the grouped GEMM) and the reference's time, after a check."""
    el = experts // P
    capacity = shape["capacity"]
    w_host = sparse_w(rng, el, h, hidden)
    ws = [DeviceBuffer.from_array(w_host) for _ in range(P)]
    ys = [DeviceBuffer(capacity * hidden * 2) for _ in range(P)]
    args = [{"dtype": 0, "x": disp.buffers[r]["tokens"], "w": ws[r],
             "group_sizes": disp.buffers[r]["group_sizes"], "y": ys[r], "m": capacity, "k": h,
             "n": hidden, "groups": el, "group_m": 8} for r in range(P)]

    fused = fused_call(world, disp, ws, capacity, hidden, experts) if FUSED else None

    def gemm_all() -> None:
        for r in range(P):
            world.launch("grouped_matmul", r, args[r])

    def serial_all() -> None:
        disp.launch()
        gemm_all()

    try:
        for y in ys:
            y.fill(0xFF)
        serial_all()
        world.synchronize()
        check_gemm(disp.case.expected[0]["tokens"], disp.case.expected[0]["group_sizes"],
                   ys[0], w_host, capacity, hidden, rng)
        t_gemm = common.emulated_us(world, gemm_all)
        t_serial = common.emulated_us(world, serial_all)
        t_fused = None
        if fused is not None:
            launch_fused, fbufs = fused
            launch_fused()
            world.synchronize()
            bad = [r for r in range(P)
                   if not np.array_equal(ys[r].read(np.uint16, (capacity, hidden)),
                                         fbufs[r]["y"].read(np.uint16, (capacity, hidden)))]
            if bad:
                FAILED.append(f"moe_dispatch_gemm {shape}: fused y differs from serial on "
                              f"ranks {bad}")
                print(f"bench_moe: FAILED {FAILED[-1]}", flush=True)
            else:
                t_fused = common.emulated_us(world, launch_fused)
    finally:
        for b in ws + ys + ([b for d in fused[1] for b in d.values()] if fused else []):
            b.free()
    flops = 2.0 * max(kept) * h * hidden  # the busiest rank's GEMM
    t_ref = t_ag + t_gemm
    rows.append(common.record(op="moe_dispatch_gemm", shape=shape, median_us=t_serial,
                              tflops=flops / t_serial / 1e6, path=common.RESULTS / "moe.jsonl",
                              baseline="reference: all_gather of x + the same grouped GEMM "
                                       "(emulated, timed apart)",
                              baseline_median_us=t_ref, variant="serial (dispatch, then "
                              "grouped_matmul)", dispatch_us=round(t_disp, 3),
                              gemm_us=round(t_gemm, 3), **fields))
    if t_fused is not None:
        rows.append(common.record(op="moe_dispatch_gemm", shape=shape, median_us=t_fused,
                                  tflops=flops / t_fused / 1e6, path=common.RESULTS / "moe.jsonl",
                                  baseline="serial: moe_dispatch, then grouped_matmul (emulated)",
                                  baseline_median_us=t_serial, variant="fused",
                                  reference_us=round(t_ref, 3), num_comm_sms=COMM_SMS or "auto",
                                  ratio_vs_reference=round(t_ref / t_fused, 4), **fields))
    print(f"{'':17s} first expert GEMM ({el} experts/rank, {h} -> {hidden}): grouped GEMM "
          f"{t_gemm:9.1f} us ({flops / t_gemm / 1e6:6.1f} TFLOP/s on 1/{P} of the GPU); "
          f"serial {t_serial:9.1f} us (dispatch {t_disp:.1f} + GEMM, overlap none); "
          f"reference {t_ref:9.1f} us; {t_ref / t_serial:5.2f}x", flush=True)
    if t_fused is not None:
        print(f"{'':17s} fused {t_fused:9.1f} us ({flops / t_fused / 1e6:6.1f} TFLOP/s): "
              f"{t_serial / t_fused:5.2f}x serial, {t_ref / t_fused:5.2f}x reference", flush=True)


def fused_call(world: World, disp: ops.Call, ws: list, capacity: int, hidden: int,
               experts: int):
    """The fused kernel's launcher fields on every rank (the dispatch's inputs, w1, fresh
    outputs and scratch): (launch_all, buffers per rank)."""
    c = disp.case.params
    t, k, h = c["t"], c["k"], c["h"]
    bufs, args = [], []
    for r in range(P):
        b = {"y": DeviceBuffer(capacity * hidden * 2), "order": DeviceBuffer(t * k * 4),
             "order_off": DeviceBuffer((experts + 1) * 4), "dest": DeviceBuffer(t * k * 4),
             "pos": DeviceBuffer(t * k * 4), "dropped": DeviceBuffer(4),
             "recv_dropped": DeviceBuffer(4), "group_sizes": DeviceBuffer(experts // P * 4)}
        b["y"].fill(0xFF)
        bufs.append(b)
        args.append({"dtype": 0, "x": disp.buffers[r]["x"], "ids": disp.buffers[r]["ids"],
                     "w": ws[r], **b, "t": t, "k": k, "h": h, "n": hidden,
                     "num_experts": experts, "capacity": capacity, "num_comm_sms": COMM_SMS})

    def launch_all() -> None:
        world.call("moe_dispatch_gemm", args)

    return launch_all, bufs


def check_gemm(tokens: np.ndarray, sizes: np.ndarray, y: DeviceBuffer, w_host: np.ndarray,
               capacity: int, hidden: int, rng) -> np.ndarray:
    """Rank 0's GEMM output against numpy on the first, last and 8 random rows of every group
    and on the zero tail; exact. Returns the output read back (float32)."""
    want_tokens = tokens.astype(np.float32)
    sizes = sizes.astype(np.int64)
    got = y.read(np_dtype(BF16), (capacity, hidden)).astype(np.float32)
    offs = np.concatenate([[0], np.cumsum(sizes)])
    problems = []
    for e, n in enumerate(sizes):
        if n == 0:
            continue
        pick = np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, 8)])) + offs[e]
        want = want_tokens[pick] @ w_host[e].astype(np.float32)
        if not np.array_equal(got[pick], want):
            problems.append(f"group {e} rows {pick[:4]}...")
    if offs[-1] < capacity and np.any(got[offs[-1]:] != 0):
        problems.append(f"rows past {offs[-1]} are not zero")
    if problems:
        raise SystemExit(f"bench_moe: grouped GEMM wrong before timing: {problems[:3]}")
    return got


def gemm_combine_rows(world: World, disp: ops.Call, t_comb: float, t_agy: float,
                      experts: int, h: int, hidden: int, kept: list[int], shape: dict,
                      fields: dict, rng, rows: list) -> None:
    """The second expert GEMM with the combine: serial (grouped GEMM, then the combine kernel),
    the reference's time (the same GEMM + all_gather of y) and the fused kernel, after checks."""
    el = experts // P
    c = disp.case.params
    t, k, capacity = c["t"], c["k"], c["capacity"]
    w_host = sparse_w(rng, el, hidden, h)  # w2 [E / P, expert hidden, H]
    hs_host = [rng.integers(-3, 4, (capacity, hidden), dtype=np.int8).astype(np_dtype(BF16))
               for _ in range(P)]
    weights = (rng.integers(0, 5, (P, t, k)).astype(np.float32) / 4)
    hs = [DeviceBuffer.from_array(a) for a in hs_host]
    ws = [DeviceBuffer.from_array(w_host) for _ in range(P)]
    wts = [DeviceBuffer.from_array(weights[r]) for r in range(P)]
    ys = [DeviceBuffer(capacity * h * 2) for _ in range(P)]
    outs = [DeviceBuffer(t * h * 2) for _ in range(P)]
    fouts = [DeviceBuffer(t * h * 2) for _ in range(P)]
    hd = [disp.buffers[r] for r in range(P)]  # the dispatch's handle (checked outputs)
    gemm_args = [{"dtype": 0, "x": hs[r], "w": ws[r], "group_sizes": hd[r]["group_sizes"],
                  "y": ys[r], "m": capacity, "k": hidden, "n": h, "groups": el, "group_m": 8}
                 for r in range(P)]
    comb_args = [{"dtype": 0, "y": ys[r], "weights": wts[r], "dest": hd[r]["dest"],
                  "pos": hd[r]["pos"], "out": outs[r], "t": t, "k": k, "h": h,
                  "capacity": capacity} for r in range(P)]
    fused_args = [{"dtype": 0, "h": hs[r], "w": ws[r], "weights": wts[r],
                   "dest": hd[r]["dest"], "pos": hd[r]["pos"],
                   "group_sizes": hd[r]["group_sizes"], "out": fouts[r], "t": t, "k": k,
                   "f": hidden, "n": h, "groups": el, "capacity": capacity} for r in range(P)]

    def gemm_all() -> None:
        for r in range(P):
            world.launch("grouped_matmul", r, gemm_args[r])

    def serial_all() -> None:
        gemm_all()
        world.call("moe_combine", comb_args)

    def fused_all() -> None:
        world.call("moe_gemm_combine", fused_args)

    try:
        for b in ys + outs + fouts:
            b.fill(0xFF)
        serial_all()
        world.synchronize()
        sizes0 = disp.case.expected[0]["group_sizes"]
        check_gemm(hs_host[0], sizes0, ys[0], w_host, capacity, h, rng)
        check_combined(disp, ys, weights, outs[0], t, k, h, capacity, rng)
        t_gemm = common.emulated_us(world, gemm_all)
        t_serial = common.emulated_us(world, serial_all)
        t_fused = None
        if FUSED:
            fused_all()
            world.synchronize()
            bad = [r for r in range(P)
                   if not np.array_equal(outs[r].read(np.uint16, (t, h)),
                                         fouts[r].read(np.uint16, (t, h)))]
            if bad:
                FAILED.append(f"moe_gemm_combine {shape}: fused out differs from serial on "
                              f"ranks {bad}")
                print(f"bench_moe: FAILED {FAILED[-1]}", flush=True)
            else:
                t_fused = common.emulated_us(world, fused_all)
    finally:
        for b in hs + ws + wts + ys + outs + fouts:
            b.free()
    flops = 2.0 * max(kept) * hidden * h  # the busiest rank's GEMM
    t_ref = t_gemm + t_agy
    rows.append(common.record(op="moe_gemm_combine", shape=shape, median_us=t_serial,
                              tflops=flops / t_serial / 1e6, path=common.RESULTS / "moe.jsonl",
                              baseline="reference: the same grouped GEMM + all_gather of y "
                                       "(emulated, timed apart)",
                              baseline_median_us=t_ref, variant="serial (grouped_matmul, then "
                              "moe_combine)", combine_us=round(t_comb, 3),
                              gemm_us=round(t_gemm, 3), **fields))
    if t_fused is not None:
        rows.append(common.record(op="moe_gemm_combine", shape=shape, median_us=t_fused,
                                  tflops=flops / t_fused / 1e6, path=common.RESULTS / "moe.jsonl",
                                  baseline="serial: grouped_matmul, then moe_combine (emulated)",
                                  baseline_median_us=t_serial, variant="fused",
                                  reference_us=round(t_ref, 3),
                                  ratio_vs_reference=round(t_ref / t_fused, 4), **fields))
    print(f"{'':17s} second expert GEMM + combine ({el} experts/rank, {hidden} -> {h}): "
          f"grouped GEMM {t_gemm:9.1f} us; serial {t_serial:9.1f} us; reference "
          f"{t_ref:9.1f} us; {t_ref / t_serial:5.2f}x", flush=True)
    if t_fused is not None:
        print(f"{'':17s} fused {t_fused:9.1f} us ({flops / t_fused / 1e6:6.1f} TFLOP/s): "
              f"{t_serial / t_fused:5.2f}x serial, {t_ref / t_fused:5.2f}x reference", flush=True)


def check_combined(disp: ops.Call, ys: list, weights: np.ndarray, out: DeviceBuffer, t: int,
                   k: int, h: int, capacity: int, rng) -> None:
    """Rank 0's combined output on 32 random tokens against numpy on every rank's y; exact."""
    dest = disp.case.expected[0]["dest"]
    pos = disp.case.expected[0]["pos"]
    y_all = [y.read(np_dtype(BF16), (capacity, h)) for y in ys]
    got = out.read(np_dtype(BF16), (t, h)).astype(np.float64)
    for tok in rng.integers(0, t, 32):
        want = np.zeros(h)
        for j in range(k):
            if pos[tok, j] >= 0:
                want += float(weights[0, tok, j]) * y_all[dest[tok, j]][pos[tok, j]].astype(
                    np.float64)
        want = want.astype(np.float32).astype(np_dtype(BF16)).astype(np.float64)
        if not np.array_equal(got[tok], want):
            raise SystemExit(f"bench_moe: serial moe_gemm_combine wrong before timing: token "
                             f"{tok} of rank 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"the first {QUICK} shapes (uniform routing)")
    parser.add_argument("--skewed", action="store_true",
                        help="the Zipf-skewed shapes only (the other half of a full run)")
    parser.add_argument("--no-fused", action="store_true",
                        help="without the fused kernels")
    parser.add_argument("--comm-sms", type=int, default=0,
                        help="the fused dispatch's comm blocks per rank (0: the launcher's "
                             "choice)")
    args = parser.parse_args()
    global FUSED, COMM_SMS
    FUSED = not args.no_fused
    COMM_SMS = args.comm_sms
    rng = np.random.default_rng(0)
    rows: list = []
    # The workspace holds the busiest shape's received rows (capacity x H x 2 bytes).
    with World(P, timeout_s=30.0, workspace_bytes=256 << 20) as world:
        shapes = (SHAPES[:QUICK] if args.quick else SHAPES[QUICK:] if args.skewed
                  else SHAPES)
        for shape in shapes:
            run_shape(world, *shape, rng, rows)
    ratios = [r["ratio"] for r in rows if r["ratio"] and "fused" not in r.get("variant", "")]
    print(f"geomean of the kernels and serial paths vs the reference: "
          f"{common.geomean(ratios):.2f}x ({len(ratios)} rows, emulated P={P})")
    fused = [r["ratio"] for r in rows if "fused" in r.get("variant", "")]
    if fused:
        print(f"geomean of the fused kernels vs serial: {common.geomean(fused):.2f}x "
              f"({len(fused)} rows)")
    try:
        import plot_moe
        plot_moe.main()
    except ImportError as e:
        print(f"no plot: {e}")
    if FAILED:
        raise SystemExit("bench_moe: fused kernels failed their checks: " + "; ".join(FAILED))


if __name__ == "__main__":
    main()

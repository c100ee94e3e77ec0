"""Expert-parallel MoE dispatch and combine, emulated at P = 8 (pk_jax.testing.World: 8 green-
context partitions of one GPU, the FFI handlers' launchers).

Shapes (per rank, scaled to a partition of 1/8 of the GPU):
- DeepSeek-V3-like: top-8 of 256 experts, H 7168 (expert hidden 2048), T 1024 tokens;
- Mixtral-like: top-2 of 8 experts, H 4096 (expert hidden 14336), T 2048 tokens;
capacity = 1.25 x the average rows per rank, uniform routing (and a skewed row for DeepSeek).

Per shape: the dispatch kernel (pk_moe_dispatch: count exchange, routing, rows pushed into the
experts' ranks) against the pk all_gather kernel of x (the traffic of the lax reference, which
all-gathers every token to every rank before selecting), and the combine kernel
(pk_moe_combine: pull of each slot's expert row, fp32 weighted sum) against the all_gather of y
(the reference's combine). Both baselines run the same emulated way, so the ratio is the
kernel's against the reference's communication alone (the reference's index arithmetic comes on
top). The expert GEMMs (grouped_matmul) are not in the emulator: moe_dispatch_gemm is the
dispatch followed by grouped_matmul (bench/bench_grouped_matmul.py times that part).

What the numbers mean: each emulated rank has 1/8 of the SMs, and all ranks share one HBM, so
"links" run at the shared-HBM rate, not NVLink's; every row says `"emulated": true`.

Correctness first: every configuration's outputs are checked exactly (integer inputs) against
the numpy references of pk_jax.testing.ops before it is timed. Timing: back-to-back calls on
every rank's stream, no host synchronisation inside a batch, wall clock per call, median of 5
batches of 10.

    CUDA_MODULE_LOADING=EAGER python bench/bench_moe.py [--quick]
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

from pk_jax.testing import World, ops

MACHINE = "h200-emulated"
LINK = "shared HBM (unthrottled)"
BF16 = "bfloat16"
P = 8

# name, tokens per rank, k, experts, H, expert hidden, skewed routing
SHAPES = [
    ("deepseek-v3-like", 1024, 8, 256, 7168, 2048, False),
    ("deepseek-v3-like", 1024, 8, 256, 7168, 2048, True),
    ("mixtral-like", 2048, 2, 8, 4096, 14336, False),
]


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
    disp.free()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows: list = []
    # The workspace holds the busiest shape's received rows (capacity x H x 2 bytes).
    with World(P, timeout_s=30.0, workspace_bytes=256 << 20) as world:
        for shape in SHAPES[:1] if args.quick else SHAPES:
            run_shape(world, *shape, rng, rows)
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    print(f"geomean vs the reference's all_gather: {common.geomean(ratios):.2f}x "
          f"({len(ratios)} rows, emulated P={P})")


if __name__ == "__main__":
    main()

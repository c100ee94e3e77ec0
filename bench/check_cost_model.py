"""Checks the cost model (pk_jax/cost_model.py) as it is now against the rank emulator's
measurements in bench/results/{gemm_rs,ag_gemm,gemm_ar}.jsonl (issue 10 item 6): for every
emulated (op, P, shape, link) case, the latest row's measured fused and serial times against
what the model picks with that row's constants (a partition's SMs and peak, HBM / P, the row's
link rate: bench_emulated.partition_gpu). The rows' own `model_choice` is what the model of
their commit picked; this recomputes it, so a model change can be judged on recorded data.

    python bench/check_cost_model.py

Prints one line per case and the summary: how often the model picks the faster mode, and
whether every fused pick was faster. First it derives the margin "auto" needs before it picks
fused (cost_model.FUSED_MARGIN, ag_gemm's; gemm_rs and gemm_ar take the overlap form's margin)
from data that are not these cases: the model's error on each fused kernel's time in the P = 1
rows of bench_tp on the H200 (`fused_margin`). Runs anywhere (no GPU).
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_emulated import model_plan, partition_gpu, unthrottled_link_gbps

from pk_jax import cost_model

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


# The P = 1 rows whose fused kernels are the ones the model costs at P = 1: gemm_rs / gemm_ar
# store their tiles straight into y (2835c57) since 2026-12-01 13:19 UTC (earlier rows ran the
# full protocol at P = 1); ag_gemm's own rows became a work list shared with the compute warps
# at 861c0cf (its rows since 2026-12-02 05:38 UTC).
P1_ROWS_SINCE = {"gemm_rs": "2026-12-01T13:19", "ag_gemm": "2026-12-02T05:38",
                 "gemm_ar": "2026-12-01T13:19"}
# Below this predicted time a call is its per-call costs, which the model does not claim: the
# one such shape of bench_tp (4096 x 4096 x 512) misses its prediction in every mode alike,
# pk.matmul alone too (measured: bench/results/tp_notes.md, "Measurements moved from code
# comments (issue 37)").
P1_MIN_PREDICTED_US = 100.0


def fused_p1_errors() -> list[tuple[str, dict, str, float, float]]:
    """(op, shape, commit, measured us, predicted us) of every P = 1 forced-fused row of
    bench_tp on the H200 since P1_ROWS_SINCE[op] with the model's fused prediction (the row's comm
    SMs) at P1_MIN_PREDICTED_US or more: nothing crosses ranks, so it is the model's error on
    the fused kernels alone."""
    out = []
    for op in OPS:
        path = RESULTS / f"{op}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            r = json.loads(line)
            if (r.get("world") != 1 or r.get("emulated") or "fused_median_us" not in r
                    or "H200" not in r.get("gpu", "") or r["date"] < P1_ROWS_SINCE[op]):
                continue
            s = r["shape"]
            pred = cost_model.predict(op, s["m"], s["n"], s["k"], 1, mode="fused",
                                      num_comm_sms=r.get("fused_num_comm_sms") or 0,
                                      gpu=cost_model.H200).predicted_us
            if pred >= P1_MIN_PREDICTED_US:
                out.append((op, s, r["commit"], r["fused_median_us"], pred))
    return out


def fused_margin(op: str, errs: list | None = None) -> float:
    """The margin by which "auto" wants op's fused predicted faster than serial
    (cost_model.FUSED_MARGIN[op]): the largest |measured / predicted - 1| over op's shapes in
    fused_p1_errors, each shape's measured time the median of its runs: a single run moves a
    shape by several % (measured: bench/results/tp_notes.md, "Measurements moved from code
    comments (issue 37)"), and the margin bounds the model's error, not one run's noise.
    errs: fused_p1_errors(), when the caller has it already."""
    runs: dict[tuple, list[float]] = {}
    for o, s, _, meas, pred in errs if errs is not None else fused_p1_errors():
        if o == op:
            runs.setdefault((s["m"], s["n"], s["k"], pred), []).append(meas)
    return max(abs(statistics.median(meas) / key[-1] - 1) for key, meas in runs.items())


def link_kind(r: dict) -> str:
    """Rows before the throttle existed say "shared HBM (unthrottled)"."""
    return "throttled" if r.get("throttled") or str(r.get("link", "")).startswith(
        "throttled") else "unthrottled"


def latest_rows(op: str) -> dict:
    """The latest emulated fused-vs-serial row per (link, P, M, N, K)."""
    latest = {}
    path = RESULTS / f"{op}.jsonl"
    if not path.exists():
        return latest
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("emulated") and r.get("mode") == "fused" and not r.get("comm_sms_forced"):
            s = r["shape"]
            latest[(link_kind(r), r["world"], s["m"], s["n"], s["k"])] = r
    return latest


def link_gbps(r: dict) -> float:
    """The link rate of row r's case: the cap when throttled; unthrottled, what
    bench_emulated.unthrottled_link_gbps makes of the partition's copy rate (rows before
    `partition_copy_gbps` was recorded stored that rate / P)."""
    if link_kind(r) == "throttled":
        return r["link_gbps"]
    copy = r.get("partition_copy_gbps") or r["link_gbps"] * r["world"]
    return unthrottled_link_gbps(r["world"], copy)


def model_choice(r: dict) -> str:
    """What the current cost model picks for row r's case, with the row's constants (rows from
    before the throttle lack them: their recorded choice)."""
    if "sms_per_rank" not in r or "link_gbps" not in r:
        return r.get("model_choice", "serial")
    return model_predictions(r)[0]


def model_predictions(r: dict) -> tuple[str, float, float]:
    """The current cost model's pick and its predicted fused and serial microseconds for row
    r's case, with the row's constants."""
    p, s = r["world"], r["shape"]
    op = r["op"]
    n = s["n"] // p if op == "ag_gemm" else s["n"]  # ag_gemm: each rank has w[:, N/P]
    k = s["k"] if op == "ag_gemm" else s["k"] // p
    gpu = partition_gpu(p, r["sms_per_rank"], link_gbps(r), r.get("partition_tflops"))
    pick = model_plan(op, s["m"], n, k, p, gpu)
    serial = model_plan(op, s["m"], n, k, p, gpu, modes=("serial",))
    fused = model_plan(op, s["m"], n, k, p, gpu, modes=("fused",))
    return pick.mode, fused.predicted_us, serial.predicted_us


def main() -> None:
    errs = fused_p1_errors()
    for op, s, commit, meas, pred in errs:
        print(f"P=1 fused {op:8s} {s['m']}x{s['n']}x{s['k']:<5d} ({commit}): measured "
              f"{meas:8.1f} us predicted {pred:8.1f} us: {meas / pred - 1:+.3f}")
    for op in OPS:
        margin = (f"cost_model.FUSED_MARGIN[{op!r}] = {cost_model.FUSED_MARGIN[op]}"
                  if op in cost_model.FUSED_MARGIN else
                  f"auto's margin at P > 1 is the overlap form's, {cost_model.margin(op)}")
        print(f"the model's largest error on {op}'s fused time at P = 1: "
              f"{fused_margin(op, errs):.3f} over {sum(e[0] == op for e in errs)} rows "
              f"({margin})")
    print()
    right = picks = bad_picks = total = 0
    for op in OPS:
        for (kind, p, m, n, k), r in sorted(latest_rows(op).items()):
            if "sms_per_rank" not in r or "link_gbps" not in r:
                continue  # rows from before the throttle lack the constants
            faster = "fused" if r["median_us"] < r["baseline_median_us"] else "serial"
            pick, pred_fused, pred_serial = model_predictions(r)
            total += 1
            right += pick == faster
            picks += pick == "fused"
            bad_picks += pick == "fused" and faster != "fused"
            print(f"{op:8s} P={p} {m}x{n}x{k:<5d} {kind:11s} fused {r['median_us']:8.1f} us "
                  f"serial {r['baseline_median_us']:8.1f} us ({r['commit']}); predicted fused "
                  f"{pred_fused:8.1f} serial {pred_serial:8.1f}: picks {pick:6s} "
                  f"{'right' if pick == faster else 'WRONG'}")
    print(f"the model picks the faster mode in {right} of {total} cases "
          f"({100 * right / max(total, 1):.0f}%, target 90%); it picks fused in {picks}, "
          f"of which {bad_picks} were slower than serial (target 0)")


if __name__ == "__main__":
    main()

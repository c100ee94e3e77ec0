"""Fits the decider's constants (pk_jax/cost_model.py) on the scale-model rows, and judges the
fit shape by shape.

Rows: bench/results/overlap.jsonl, those with scale_model and a tag in TRAIN_TAGS (the first
run, the rest of its grid and the first validation cases: 153 rows). The second validation
cases (bench/results/decider_cases_2.json, tag "decider-validation-2") are never read here.

- COLLECTIVE_FLOOR_US: from the TP rows' serial collective timed alone (t_comm_us; one call of
  pk's all_gather, reduce_scatter or all_reduce), taken to a node's time by the row's link rate
  (x link_gbps / nvlink_gbps: the scale model throttles the link by the partition's share),
  against max(floor, `cost_model.collective_us` without the floor): least squares on the log,
  the floor on a FLOOR_STEP_US grid.
- FUSED_OVERHEAD of gemm_rs and gemm_ar: their fused prediction at P > 1 is
  launch + max(tc, tm) + a tc + b tm + sync (`cost_model.predict`); (a, b) >= 0 by least squares
  on the measured fused / serial against the predicted, over all their rows.
- FUSED_OVERHEAD of cost_model.OVERLAP_OPS: as before on the rows of tag "overlap" only
  (OVERLAP_FIT_TAGS), (a, b) >= 0 by least squares on fused / serial with the serial parts
  `cost_model.overlap_parts` (now with the floor on each collective call).

Then scores `cost_model.choose` (the one decider) with the fitted constants: in sample, and
leave-one-shape-out (every row of one (op, shape), at every P, left out of every fit above and
then judged), and trained on tags "overlap" and "overlap-full" only, judged on the first
validation cases. accuracy = right picks / cases that are not ties (|serial / fused - 1| <=
3%); time_lost = sum of the picked mode's times / sum of the faster mode's - 1.

    python bench/fit_decider.py [--rows bench/results/overlap.jsonl] [--no-loso]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax import cost_model

TRAIN_TAGS = ("overlap", "overlap-full", "decider-validation")
OVERLAP_FIT_TAGS = ("overlap",)
FLOOR_STEP_US = 0.5
FLOOR_MAX_US = 200.0
TIE = 0.03


def load(path=common.RESULTS / "overlap.jsonl", tags=TRAIN_TAGS) -> list[dict]:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r.get("scale_model") and r.get("tag") in tags]


def shape_key(r: dict) -> tuple[str, str]:
    return r["op"], json.dumps(r["shape"], sort_keys=True)


@contextlib.contextmanager
def constants(floor: float | None = None, overhead: dict | None = None):
    """cost_model with COLLECTIVE_FLOOR_US and FUSED_OVERHEAD entries set inside the block."""
    saved = cost_model.COLLECTIVE_FLOOR_US, dict(cost_model.FUSED_OVERHEAD)
    if floor is not None:
        cost_model.COLLECTIVE_FLOOR_US = floor
    cost_model.FUSED_OVERHEAD.update(overhead or {})
    try:
        yield
    finally:
        cost_model.COLLECTIVE_FLOOR_US = saved[0]
        cost_model.FUSED_OVERHEAD.clear()
        cost_model.FUSED_OVERHEAD.update(saved[1])


def tp_terms(r: dict, mode: str) -> dict:
    s = r["shape"]
    pl = cost_model.predict(r["op"], s["m"], s["n"], s["k_per_rank"], r["world"], mode=mode)
    return dict(pl.terms, total=pl.predicted_us)


def fit_floor(rows: list[dict]) -> float:
    """COLLECTIVE_FLOOR_US from the TP rows' collectives timed alone (see the module doc)."""
    with constants(floor=0.0):
        data = [(math.log(r["t_comm_us"] * r["link_gbps"] / cost_model.H200.nvlink_gbps),
                 tp_terms(r, "serial")["non_overlap"]) for r in rows if r["op"] in cost_model.OPS]
    y, bw = np.array([d[0] for d in data]), np.array([d[1] for d in data])
    grid = np.arange(0.0, FLOOR_MAX_US + FLOOR_STEP_US / 2, FLOOR_STEP_US)
    err = [float(np.sum((y - np.log(np.maximum(f, bw))) ** 2)) for f in grid]
    return float(grid[int(np.argmin(err))])


def nonneg_lstsq(a_mat: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """min |a_mat c - y|^2 over c >= 0 (two columns): drop a column whose fit is negative."""
    best = None
    for cols in ((0, 1), (0,), (1,), ()):
        coef = np.zeros(2)
        if cols:
            sol, *_ = np.linalg.lstsq(a_mat[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef[list(cols)] = sol
        err = float(np.sum((a_mat @ coef - y) ** 2))
        if best is None or err < best[1]:
            best = (coef, err)
    return float(best[0][0]), float(best[0][1])


def fit_tp(rows: list[dict]) -> tuple[float, float]:
    """(a, b) of one of cost_model.TP_OVERLAP_FORM: measured fused / serial = predicted, i.e.
    (L_f + max(tc, tm) + a tc + b tm) / serial_pred, with L_f the fused launch and sync."""
    cols, y = [], []
    with constants(overhead={r["op"]: (0.0, 0.0) for r in rows}):
        for r in rows:
            f, s = tp_terms(r, "fused"), tp_terms(r, "serial")["total"]
            cols.append([f["comp"] / s, f["comm"] / s])
            y.append(r["fused_us"] / r["serial_us"] - f["total"] / s)
    return nonneg_lstsq(np.array(cols), np.array(y))


def fit_overlap(rows: list[dict]) -> tuple[float, float]:
    """(a, b) of one of OVERLAP_OPS: fused / serial = (max(tc, tm) + a tc + b tm) / (tc + tm)."""
    cols, y = [], []
    for r in rows:
        c, m = cost_model.overlap_parts(r["op"], r["shape"], r["world"])
        cols.append([c / (c + m), m / (c + m)])
        y.append(r["fused_us"] / r["serial_us"] - max(c, m) / (c + m))
    return nonneg_lstsq(np.array(cols), np.array(y))


def fit(rows: list[dict]) -> tuple[float, dict]:
    """The floor and every op's FUSED_OVERHEAD from `rows` (see the module doc)."""
    floor = fit_floor(rows)
    overhead = {}
    with constants(floor=floor):
        for op in cost_model.TP_OVERLAP_FORM:
            mine = [r for r in rows if r["op"] == op]
            if mine:
                overhead[op] = fit_tp(mine)
        for op in cost_model.OVERLAP_OPS:
            mine = [r for r in rows if r["op"] == op and r["tag"] in OVERLAP_FIT_TAGS]
            if mine:
                overhead[op] = fit_overlap(mine)
    return floor, overhead


def score(rows: list[dict], picks: list[str]) -> dict:
    n = ties = correct = 0
    picked = best = 0.0
    for r, choice in zip(rows, picks):
        n += 1
        fused, serial = r["fused_us"], r["serial_us"]
        picked += fused if choice == "fused" else serial
        best += min(fused, serial)
        if abs(serial / fused - 1) <= TIE:
            ties += 1
        elif (choice == "fused") == (fused < serial):
            correct += 1
    judged = n - ties
    return {"cases": n, "ties": ties, "correct": correct,
            "accuracy": round(correct / judged, 4) if judged else None,
            "time_lost": round(picked / best - 1, 4) if best else None}


def picks(rows: list[dict]) -> list[str]:
    return [cost_model.choose(r["op"], r["shape"], r["world"]) for r in rows]


def leave_one_shape_out(rows: list[dict]) -> tuple[list[dict], list[str]]:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[shape_key(r)].append(r)
    out, chosen = [], []
    for key, held in groups.items():
        floor, overhead = fit([r for r in rows if shape_key(r) != key])
        with constants(floor, overhead):
            out += held
            chosen += picks(held)
    return out, chosen


def line(name: str, s: dict) -> str:
    return (f"{name:34s} cases {s['cases']:3d} ties {s['ties']:3d} correct {s['correct']:3d} "
            f"accuracy {s['accuracy']} time_lost {s['time_lost']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(common.RESULTS / "overlap.jsonl"))
    ap.add_argument("--no-loso", action="store_true", help="skip leave-one-shape-out")
    args = ap.parse_args()
    rows = load(args.rows)
    print(line("cost_model as committed, in sample", score(rows, picks(rows))))
    floor, overhead = fit(rows)
    print(f"COLLECTIVE_FLOOR_US = {floor}")
    print("FUSED_OVERHEAD = {" + ", ".join(f'"{op}": ({a:.3f}, {b:.3f})'
                                           for op, (a, b) in overhead.items()) + "}")
    with constants(floor, overhead):
        print(line("fitted, in sample", score(rows, picks(rows))))
        for op in cost_model.OPS + cost_model.OVERLAP_OPS:
            mine = [r for r in rows if r["op"] == op]
            print(line(f"  {op}", score(mine, picks(mine))))
    first = [r for r in rows if r["tag"] != "decider-validation"]
    held = [r for r in rows if r["tag"] == "decider-validation"]
    with constants(*fit(first)):
        print(line("fitted without decider-validation,", score(held, picks(held))))
        print("  judged on decider-validation")
    if not args.no_loso:
        out, chosen = leave_one_shape_out(rows)
        print(line("fitted, leave-one-shape-out", score(out, chosen)))
        for op in cost_model.OPS + cost_model.OVERLAP_OPS:
            mine = [(r, c) for r, c in zip(out, chosen) if r["op"] == op]
            print(line(f"  {op}", score([r for r, _ in mine], [c for _, c in mine])))


if __name__ == "__main__":
    main()

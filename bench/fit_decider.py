"""Fits the decider's FUSED_OVERHEAD (pk_jax/cost_model.py) on the first scale-model run.

For each of cost_model.OVERLAP_OPS, on its rows of bench/results/overlap.jsonl with tag
"overlap" (the training run; the validation cases of bench/results/decider_cases.json are
never read here), the serial form's parts t_compute and t_comm are predicted from the shape
(`cost_model.overlap_parts`, the H200's constants) and (a, b) fitted by least squares on the
measured fused / serial:

    fused / serial = (max(tc, tm) + a tc + b tm) / (tc + tm),     a, b >= 0

Prints the constants to commit and, in sample, how often `cost_model.choose` with them picks
the faster mode (ties: within 3%), for the TP GEMMs too (their constants are older).

    python bench/fit_decider.py [--rows bench/results/overlap.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax import cost_model


def fit(rows: list[dict]) -> tuple[float, float]:
    tc, tm, y = [], [], []
    for r in rows:
        c, m = cost_model.overlap_parts(r["op"], r["shape"], r["world"])
        tc.append(c / (c + m))
        tm.append(m / (c + m))
        y.append(r["fused_us"] / r["serial_us"] - max(c, m) / (c + m))
    a_mat, y = np.array([tc, tm]).T, np.array(y)
    best = None
    for cols in ((0, 1), (0,), (1,), ()):  # a, b >= 0: drop a column whose fit is negative
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(common.RESULTS / "overlap.jsonl"))
    args = ap.parse_args()
    with open(args.rows) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if r.get("tag") == "overlap" and r.get("scale_model")]
    fitted = {}
    for op in cost_model.OVERLAP_OPS:
        mine = [r for r in train if r["op"] == op]
        if mine:
            fitted[op] = tuple(round(v, 3) for v in fit(mine))
    print("FUSED_OVERHEAD = " + json.dumps(fitted).replace("[", "(").replace("]", ")"))
    saved = dict(cost_model.FUSED_OVERHEAD)
    cost_model.FUSED_OVERHEAD.update(fitted)
    try:
        for op in cost_model.OPS + cost_model.OVERLAP_OPS:
            mine = [r for r in train if r["op"] == op]
            judged = [r for r in mine if abs(r["serial_us"] / r["fused_us"] - 1) > 0.03]
            right = sum(1 for r in judged
                        if (cost_model.choose(op, r["shape"], r["world"]) == "fused")
                        == (r["fused_us"] < r["serial_us"]))
            print(f"{op:17s} in sample: {right}/{len(judged)} right ({len(mine) - len(judged)} "
                  "ties)")
    finally:
        cost_model.FUSED_OVERHEAD.update(saved)


if __name__ == "__main__":
    main()

"""Fits the decider's constants (pk_jax/cost_model.py) on the scale-model rows, and judges the
fit shape by shape.

Rows: bench/results/overlap.jsonl, those with scale_model and a tag in TRAIN_TAGS: every
scale-model row measured so far (the first run, the rest of its grid, and the first two
validation rounds, whose rows became training data once scored: 211 rows). A later round's
cases (bench/results/decider_cases_3.json, tag "decider-validation-3") are never read here.

- COLLECTIVE_FLOOR_US: from the TP rows' serial collective timed alone (t_comm_us; one call of
  pk's all_gather, reduce_scatter or all_reduce), taken to a node's time by the row's link rate
  (x link_gbps / nvlink_gbps: the scale model throttles the link by the partition's share),
  against max(floor, `cost_model.collective_us` without the floor): least squares on the log,
  the floor on a FLOOR_STEP_US grid.
- FUSED_OVERHEAD of gemm_rs and gemm_ar: their fused prediction at P > 1 is
  launch + max(tc, tm) + a tc + b tm + sync (`cost_model.predict`); (a, b) >= 0 by least squares
  on the measured fused / serial against the predicted, over all their rows.
- FUSED_OVERHEAD and PIPELINE_OVERHEAD of cost_model.OVERLAP_OPS: fused / serial =
  (max(tc, tm) + (a + c 2/P) tc + (b + d 2/P) tm) / (tc + tm) with the serial parts
  `cost_model.overlap_parts`, (a, b, c, d) >= 0 by least squares over all the op's rows.

Then scores `cost_model.choose` (the one decider) with the fitted constants, in sample and
leave-one-shape-out (every row of one (op, shape), at every P, left out of every fit above and
then judged), beside, on the same folds, the second round's procedure (c = d = 0, the overlap
ops fitted on tag "overlap" only), a constant per-op rule (the training folds' majority),
always fused and always serial. accuracy = right picks / cases that are not ties
(|serial / fused - 1| <= 3%); time_lost = sum of the picked mode's times / sum of the faster
mode's - 1.

    python bench/fit_decider.py [--rows bench/results/overlap.jsonl] [--no-loso]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import numpy as np

from pk_jax import cost_model

TRAIN_TAGS = ("overlap", "overlap-full", "decider-validation", "decider-validation-2")
# The second round fitted the overlap ops on the first run's rows only; kept for the comparison.
ROUND2_OVERLAP_TAGS = ("overlap",)
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
def constants(floor: float | None = None, overhead: dict | None = None,
              pipeline: dict | None = None):
    """cost_model with COLLECTIVE_FLOOR_US and the FUSED_OVERHEAD / PIPELINE_OVERHEAD entries
    given set inside the block (pipeline given: it replaces the whole dict)."""
    saved = (cost_model.COLLECTIVE_FLOOR_US, dict(cost_model.FUSED_OVERHEAD),
             dict(cost_model.PIPELINE_OVERHEAD))
    if floor is not None:
        cost_model.COLLECTIVE_FLOOR_US = floor
    cost_model.FUSED_OVERHEAD.update(overhead or {})
    if pipeline is not None:
        cost_model.PIPELINE_OVERHEAD.clear()
        cost_model.PIPELINE_OVERHEAD.update(pipeline)
    try:
        yield
    finally:
        cost_model.COLLECTIVE_FLOOR_US = saved[0]
        for d, old in ((cost_model.FUSED_OVERHEAD, saved[1]),
                       (cost_model.PIPELINE_OVERHEAD, saved[2])):
            d.clear()
            d.update(old)


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


def nonneg_lstsq(a_mat: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """min |a_mat c - y|^2 over c >= 0 (a few columns): every subset of the columns solved
    unconstrained, those with a negative coefficient dropped, the least error kept."""
    n = a_mat.shape[1]
    best = None
    for cols in (c for k in range(n, -1, -1) for c in itertools.combinations(range(n), k)):
        coef = np.zeros(n)
        if cols:
            sol, *_ = np.linalg.lstsq(a_mat[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            coef[list(cols)] = sol
        err = float(np.sum((a_mat @ coef - y) ** 2))
        if best is None or err < best[1]:
            best = (coef, err)
    return tuple(float(c) for c in best[0])


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


def fit_overlap(rows: list[dict], pipeline: bool = True) -> tuple[float, ...]:
    """(a, b, c, d) of one of OVERLAP_OPS: fused / serial =
    (max(tc, tm) + (a + c 2/P) tc + (b + d 2/P) tm) / (tc + tm); c = d = 0 without pipeline."""
    cols, y = [], []
    for r in rows:
        c, m = cost_model.overlap_parts(r["op"], r["shape"], r["world"])
        piece = 2.0 / r["world"]
        row = [c / (c + m), m / (c + m)]
        cols.append(row + [piece * x for x in row] if pipeline else row)
        y.append(r["fused_us"] / r["serial_us"] - max(c, m) / (c + m))
    coef = nonneg_lstsq(np.array(cols), np.array(y))
    return coef if pipeline else coef + (0.0, 0.0)


def fit(rows: list[dict], *, round2: bool = False) -> tuple[float, dict, dict]:
    """The floor, every op's FUSED_OVERHEAD and the overlap ops' PIPELINE_OVERHEAD from `rows`
    (see the module doc); round2: the second round's procedure (no pipeline share, the overlap
    ops fitted on ROUND2_OVERLAP_TAGS only)."""
    floor = fit_floor(rows)
    overhead, pipeline = {}, {}
    with constants(floor=floor):
        for op in cost_model.TP_OVERLAP_FORM:
            mine = [r for r in rows if r["op"] == op]
            if mine:
                overhead[op] = fit_tp(mine)
        for op in cost_model.OVERLAP_OPS:
            mine = [r for r in rows if r["op"] == op
                    and (not round2 or r["tag"] in ROUND2_OVERLAP_TAGS)]
            if mine:
                a, b, c, d = fit_overlap(mine, pipeline=not round2)
                overhead[op], pipeline[op] = (a, b), (c, d)
    return floor, overhead, pipeline


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


def majority(rows: list[dict]) -> dict:
    """Each op's faster mode in most of `rows` (the constant per-op rule)."""
    votes = collections.defaultdict(collections.Counter)
    for r in rows:
        votes[r["op"]]["fused" if r["fused_us"] < r["serial_us"] else "serial"] += 1
    return {op: v.most_common(1)[0][0] for op, v in votes.items()}


RULES = ("round 3 (this fit)", "round 2 procedure", "constant per op", "always fused",
         "always serial")


def rule_picks(rule: str, train: list[dict], held: list[dict]) -> list[str]:
    """What `rule`, fitted on `train`, picks for the rows `held`."""
    if rule == "always fused":
        return ["fused"] * len(held)
    if rule == "always serial":
        return ["serial"] * len(held)
    if rule == "constant per op":
        constant = majority(train)
        return [constant.get(r["op"], "serial") for r in held]
    with constants(*fit(train, round2=rule == "round 2 procedure")):
        return picks(held)


def leave_one_shape_out(rows: list[dict], rule: str = RULES[0]
                        ) -> tuple[list[dict], list[str]]:
    groups = collections.defaultdict(list)
    for r in rows:
        groups[shape_key(r)].append(r)
    out, chosen = [], []
    for key, held in groups.items():
        out += held
        chosen += rule_picks(rule, [r for r in rows if shape_key(r) != key], held)
    return out, chosen


def line(name: str, s: dict) -> str:
    return (f"{name:34s} cases {s['cases']:3d} ties {s['ties']:3d} correct {s['correct']:3d} "
            f"accuracy {s['accuracy']} time_lost {s['time_lost']}")


def per_op(out: list[dict], chosen: list[str]) -> str:
    parts = []
    for op in cost_model.OPS + cost_model.OVERLAP_OPS:
        mine = [(r, c) for r, c in zip(out, chosen) if r["op"] == op]
        s = score([r for r, _ in mine], [c for _, c in mine])
        parts.append(f"{op} {s['correct']}/{s['cases'] - s['ties']}")
    return "    " + ", ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(common.RESULTS / "overlap.jsonl"))
    ap.add_argument("--no-loso", action="store_true", help="skip leave-one-shape-out")
    args = ap.parse_args()
    rows = load(args.rows)
    print(f"{len(rows)} rows")
    print(line("cost_model as committed, in sample", score(rows, picks(rows))))
    floor, overhead, pipeline = fit(rows)
    print(f"COLLECTIVE_FLOOR_US = {floor}")
    print("FUSED_OVERHEAD = {" + ", ".join(f'"{op}": ({a:.3f}, {b:.3f})'
                                           for op, (a, b) in overhead.items()) + "}")
    print("PIPELINE_OVERHEAD = {" + ", ".join(f'"{op}": ({c:.3f}, {d:.3f})'
                                              for op, (c, d) in pipeline.items()) + "}")
    with constants(floor, overhead, pipeline):
        print(line("fitted, in sample", score(rows, picks(rows))))
        print(per_op(rows, picks(rows)))
    if not args.no_loso:
        for rule in RULES:
            out, chosen = leave_one_shape_out(rows, rule)
            print(line(f"LOSO {rule}", score(out, chosen)))
            print(per_op(out, chosen))


if __name__ == "__main__":
    main()

"""Scores the fused/serial decider out of sample (issue 36, section 4).

The validation cases (bench/results/decider_cases.json) were committed before any scale-model
run of them and fit nothing. Their rows (bench/results/overlap.jsonl, tag
"decider-validation") are scored against what each rule picks:
- "pk_jax": the one decider, `cost_model.choose(op, shape, P)` (the cost model's prediction
  at a real node's constants; what `_backend.route` runs);
- "always_fused", "always_serial";
- "constant_per_op": each op's faster mode in most of the training rows (tag "overlap", the
  first scale-model run), a trivial rule fitted in sample.
A case is a tie where |serial / fused - 1| <= 3%: any pick is right there. accuracy = correct /
(cases - ties); time_lost = sum over cases of the picked mode's time / the faster mode's time,
minus 1. Writes bench/results/decider_validation.json.

    python bench/check_decider.py [--rows bench/results/overlap.jsonl]
        [--cases bench/results/decider_cases.json] [--out bench/results/decider_validation.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

from pk_jax import cost_model

TIE = 0.03


def load(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest(rows: list[dict], tag: str) -> dict:
    """The newest row per (op, world, shape) of a tag."""
    out = {}
    for r in rows:
        if r.get("tag") == tag and r.get("scale_model"):
            out[(r["op"], r["world"], json.dumps(r["shape"], sort_keys=True))] = r
    return out


def score(cases: list[dict], rows: dict, pick) -> dict:
    n = ties = correct = 0
    picked = best = 0.0
    missing = []
    for c in cases:
        r = rows.get((c["op"], c["world"], json.dumps(c["shape"], sort_keys=True)))
        if r is None:
            missing.append(c)
            continue
        n += 1
        fused, serial = r["fused_us"], r["serial_us"]
        choice = pick(c)
        t = fused if choice == "fused" else serial
        picked += t
        best += min(fused, serial)
        if abs(serial / fused - 1) <= TIE:
            ties += 1
        elif (choice == "fused") == (fused < serial):
            correct += 1
    judged = n - ties
    return {"cases": n, "ties": ties, "correct": correct,
            "accuracy": round(correct / judged, 4) if judged else None,
            "time_lost": round(picked / best - 1, 4) if best else None,
            "missing": len(missing)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(common.RESULTS / "overlap.jsonl"))
    ap.add_argument("--cases", default=str(common.RESULTS / "decider_cases.json"))
    ap.add_argument("--out", default=str(common.RESULTS / "decider_validation.json"))
    args = ap.parse_args()
    with open(args.cases) as f:
        cases = json.load(f)["cases"]
    rows = load(args.rows)
    valid = latest(rows, "decider-validation")
    train = latest(rows, "overlap")
    votes = collections.defaultdict(collections.Counter)
    for (op, _, _), r in train.items():
        votes[op]["fused" if r["fused_us"] < r["serial_us"] else "serial"] += 1
    constant = {op: v.most_common(1)[0][0] for op, v in votes.items()}
    rules = {
        "pk_jax": lambda c: cost_model.choose(c["op"], c["shape"], c["world"]),
        "always_fused": lambda c: "fused",
        "always_serial": lambda c: "serial",
        "constant_per_op": lambda c: constant.get(c["op"], "serial"),
    }
    result = {"tie_band": TIE, "constant_per_op": constant,
              "scores": {name: score(cases, valid, rule) for name, rule in rules.items()}}
    per_op = {}
    for op in sorted({c["op"] for c in cases}):
        mine = [c for c in cases if c["op"] == op]
        per_op[op] = {name: score(mine, valid, rule) for name, rule in rules.items()}
    result["per_op"] = per_op
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in result["scores"].items():
        print(f"{name:16s} cases {s['cases']:3d} ties {s['ties']:3d} correct {s['correct']:3d} "
              f"accuracy {s['accuracy']} time_lost {s['time_lost']} (missing {s['missing']})")


if __name__ == "__main__":
    main()

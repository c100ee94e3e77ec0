"""Scores the fused/serial decider out of sample (issue 36, section 4).

A validation round is a cases file committed before any scale-model run of its cases, whose
cases fit nothing: bench/results/decider_cases.json (the first round), decider_cases_2.json
(the second). Their rows (bench/results/overlap.jsonl, the round's tag) are scored against what
each rule picks:
- "pk_jax": the one decider, `cost_model.choose(op, shape, P)` (the cost model's prediction
  at a real node's constants; what the ops run);
- "always_fused", "always_serial";
- "constant_per_op": each op's faster mode in most of the training rows (the round's training
  tags), a trivial rule fitted in sample.
A case is a tie where |serial / fused - 1| <= 3%: any pick is right there. accuracy = correct /
(cases - ties); time_lost = sum over cases of the picked mode's time / the faster mode's time,
minus 1.

The cases file names its round: "tag" (the rows' tag, bench_overlap.py --tag), "train_tags"
(the rows the decider was fitted on) and "scores" (the file written, under bench/results);
without them, the first round's: "decider-validation", ["overlap"], decider_validation.json.
Flags override them.

    python bench/check_decider.py [--cases bench/results/decider_cases.json]
        [--rows bench/results/overlap.jsonl] [--tag TAG] [--train-tags T1,T2] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import fit_decider

from pk_jax import cost_model

TIE = fit_decider.TIE


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
    """fit_decider.score over the cases that have a row, `pick(case, row)` each one's choice."""
    found = [(c, rows.get((c["op"], c["world"], json.dumps(c["shape"], sort_keys=True))))
             for c in cases]
    have = [(c, r) for c, r in found if r is not None]
    result = fit_decider.score([r for _, r in have], [pick(c, r) for c, r in have])
    return {**result, "missing": len(found) - len(have)}


# What a cases file without "tag", "train_tags" or "scores" means: the first round.
FIRST_ROUND = {"tag": "decider-validation", "train_tags": ["overlap"],
               "scores": "decider_validation.json"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default=str(common.RESULTS / "overlap.jsonl"))
    ap.add_argument("--cases", default=str(common.RESULTS / "decider_cases.json"))
    ap.add_argument("--tag", default=None, help="the validation rows' tag")
    ap.add_argument("--train-tags", default=None, help="comma-separated training tags")
    ap.add_argument("--out", default=None, help="the scores' JSON file")
    args = ap.parse_args()
    with open(args.cases) as f:
        listed = json.load(f)
    cases = listed["cases"]
    tag = args.tag or listed.get("tag", FIRST_ROUND["tag"])
    train_tags = (args.train_tags.split(",") if args.train_tags
                  else listed.get("train_tags", FIRST_ROUND["train_tags"]))
    out = args.out or str(common.RESULTS / listed.get("scores", FIRST_ROUND["scores"]))
    rows = load(args.rows)
    valid = latest(rows, tag)
    votes = collections.defaultdict(collections.Counter)
    for t in train_tags:
        for (op, _, _), r in latest(rows, t).items():
            votes[op]["fused" if r["fused_us"] < r["serial_us"] else "serial"] += 1
    constant = {op: v.most_common(1)[0][0] for op, v in votes.items()}
    # the decider at the GPU the row ran on (as _backend.route asks it: cost_model.gpu_for),
    # and an fp8 form's constant rule its bf16 form's majority
    rules = {
        "pk_jax": lambda c, r: cost_model.choose(c["op"], c["shape"], c["world"],
                                                 gpu=cost_model.gpu_for(r.get("gpu", "H200"))),
        "always_fused": lambda c, r: "fused",
        "always_serial": lambda c, r: "serial",
        "constant_per_op": lambda c, r: constant.get(
            c["op"], constant.get(c["op"].removesuffix("_fp8"), "serial")),
    }
    result = {"tag": tag, "train_tags": train_tags, "tie_band": TIE, "constant_per_op": constant,
              "scores": {name: score(cases, valid, rule) for name, rule in rules.items()}}
    per_op = {}
    for op in sorted({c["op"] for c in cases}):
        mine = [c for c in cases if c["op"] == op]
        per_op[op] = {name: score(mine, valid, rule) for name, rule in rules.items()}
    result["per_op"] = per_op
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for name, s in result["scores"].items():
        print(f"{name:16s} cases {s['cases']:3d} ties {s['ties']:3d} correct {s['correct']:3d} "
              f"accuracy {s['accuracy']} time_lost {s['time_lost']} (missing {s['missing']})")


if __name__ == "__main__":
    main()

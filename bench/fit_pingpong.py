"""Chooses grouped_matmul.PINGPONG_MAX_K on one set of rows and judges it on another.

Rows: bench/results/grouped_matmul.jsonl from `bench_grouped_matmul.py --schedules` (per
shape and direction, the cooperative and the ping-pong schedule timed interleaved): tag
`schedule-fit` (the tokamax spec shapes) and `schedule-judge` (bench/results/
grouped_schedule_cases.json, committed before any run). The rule, fixed before either ran: one
threshold T for the forward (contraction K) and dx (contraction N), ping-pong where the
contraction is at most T; T is the candidate (0 or a fit row's contraction) with the least
total time over the fit rows. On the judge rows: correct where the rule picks the faster
schedule (ties, |ratio - 1| <= 3%, left out), time lost against always picking the faster.
Prints both and writes bench/results/pingpong_validation.json.

Run here (no GPU): python bench/fit_pingpong.py [--commit C] (rows of that build only)
"""

from __future__ import annotations

import argparse
import json
import sys

import common

TIE = 0.03


def load(commit: str | None) -> dict[str, list[dict]]:
    """tag -> [{name, direction, contraction, coop, pp}], the newest row pair per case."""
    pairs: dict[tuple, dict] = {}
    with open(common.RESULTS / "grouped_matmul.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r.get("tag") not in ("schedule-fit", "schedule-judge"):
                continue
            if commit and r["commit"] != commit:
                continue
            s = r["shape"]
            key = (r["tag"], s["name"], s["tokens"], s["experts"], s["k"], s["n"],
                   r["direction"])
            p = pairs.setdefault(key, {"name": s["name"], "shape": s, "direction": r["direction"],
                                       "contraction": r["contraction"]})
            p["pp" if r["kernel"] == "tiled_pingpong" else "coop"] = r["median_us"]
    out: dict[str, list[dict]] = {"schedule-fit": [], "schedule-judge": []}
    for key, p in pairs.items():
        if "pp" in p and "coop" in p:
            out[key[0]].append(p)
    return out


def picked(p: dict, t: int) -> float:
    return p["pp"] if p["contraction"] <= t else p["coop"]


def score(rows: list[dict], t: int) -> dict:
    judged = [p for p in rows if abs(p["coop"] / p["pp"] - 1) > TIE]
    correct = sum((p["pp"] < p["coop"]) == (p["contraction"] <= t) for p in judged)
    best = sum(min(p["pp"], p["coop"]) for p in rows)
    return {"cases": len(rows), "ties": len(rows) - len(judged), "correct": correct,
            "accuracy": round(correct / len(judged), 3) if judged else None,
            "time_lost": round(sum(picked(p, t) for p in rows) / best - 1, 4) if rows else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    rows = load(args.commit)
    fit, judge = rows["schedule-fit"], rows["schedule-judge"]
    if not fit:
        raise SystemExit("no schedule-fit rows: run bench_grouped_matmul.py --schedules first")
    candidates = sorted({0} | {p["contraction"] for p in fit})
    t = min(candidates, key=lambda c: (sum(picked(p, c) for p in fit), c))
    for p in sorted(fit + judge, key=lambda p: (p["contraction"], p["direction"])):
        print(f"{p['name']:>16} {p['direction']:>3} contraction {p['contraction']:>6}: "
              f"cooperative {p['coop']:9.1f} us, ping-pong {p['pp']:9.1f} us, "
              f"{p['coop'] / p['pp']:.3f}x")
    result = {"threshold": t, "fit": score(fit, t), "judge": score(judge, t) if judge else None,
              "always_pingpong": score(judge, 1 << 30) if judge else None,
              "never_pingpong": score(judge, 0) if judge else None}
    print(json.dumps(result, indent=1))
    with open(common.RESULTS / "pingpong_validation.json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scores grouped_matmul's choice of schedule (`pingpong_width`) on measured rows.

Rows: bench/results/grouped_matmul.jsonl from `bench_grouped_matmul.py --schedules` (per
shape and direction, the cooperative and the ping-pong schedule timed interleaved), grouped by
tag: `schedule-fit` (the tokamax spec shapes) and `schedule-judge`
(grouped_schedule_cases.json), on which the rule was chosen (in sample), and
`schedule-judge-2` (grouped_schedule_cases_2.json, committed with the rule before it ran), which
judges it. Per tag: correct where the rule picks the faster schedule (ties, |ratio - 1| <= 3%,
left out), and time lost against always picking the faster, beside always and never ping-pong.
Prints them and writes bench/results/pingpong_validation.json.

Run here (no GPU): python bench/check_pingpong.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
import fit_decider

from pk_jax.ops import grouped_matmul as gm

TIE = fit_decider.TIE
TAGS = ("schedule-fit", "schedule-judge", "schedule-judge-2")


def load() -> dict[str, list[dict]]:
    """tag -> [{name, direction, width, coop, pp}], the newest row pair per case."""
    pairs: dict[tuple, dict] = {}
    with open(common.RESULTS / "grouped_matmul.jsonl") as f:
        for line in f:
            r = json.loads(line)
            if r.get("tag") not in TAGS:
                continue
            s = r["shape"]
            key = (r["tag"], s["name"], s["tokens"], s["experts"], s["k"], s["n"],
                   r["direction"])
            # The product's output width: the forward's N, dx's K.
            width = s["n"] if r["direction"] == "fwd" else s["k"]
            p = pairs.setdefault(key, {"name": s["name"], "direction": r["direction"],
                                       "width": width})
            p["pp" if r["kernel"] == "tiled_pingpong" else "coop"] = r["median_us"]
    out: dict[str, list[dict]] = {t: [] for t in TAGS}
    for key, p in pairs.items():
        if "pp" in p and "coop" in p:
            out[key[0]].append(p)
    return out


def score(rows: list[dict], rule) -> dict:
    """The decider's score (fit_decider.score: ties, accuracy, time lost), the ping-pong
    schedule in the place of "fused" and the cooperative one of "serial"."""
    pairs = [{"fused_us": p["pp"], "serial_us": p["coop"]} for p in rows]
    return fit_decider.score(pairs, ["fused" if rule(p["width"]) else "serial" for p in rows])


def main() -> int:
    rows = load()
    rules = {"pingpong_width": gm.pingpong_width, "always_pingpong": lambda w: True,
             "never_pingpong": lambda w: False}
    result = {"waste": gm.PINGPONG_WASTE, "tie_band": TIE, "scores": {}}
    for tag in TAGS:
        for p in sorted(rows[tag], key=lambda p: (p["width"], p["direction"])):
            print(f"{tag:>16} {p['name']:>16} {p['direction']:>3} width {p['width']:>6}: "
                  f"cooperative {p['coop']:9.1f} us, ping-pong {p['pp']:9.1f} us, "
                  f"{p['coop'] / p['pp']:.3f}x, picks "
                  f"{'ping-pong' if gm.pingpong_width(p['width']) else 'cooperative'}")
        if rows[tag]:
            result["scores"][tag] = {name: score(rows[tag], rule) for name, rule in rules.items()}
    print(json.dumps(result["scores"], indent=1))
    with open(common.RESULTS / "pingpong_validation.json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

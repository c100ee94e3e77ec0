"""Plots bench/results/moe.jsonl (the latest row per op, shape and path; emulated P = 8) into
bench/results/moe.png, three panels of microseconds per call (lower is better):
- the dispatch and combine kernels against the all_gathers of x and y that the lax reference
  moves;
- the first expert GEMM (pk.moe_dispatch_gemm's work): the reference's traffic plus the same
  grouped GEMM, the serial path (dispatch, then grouped_matmul) and the fused kernel;
- the second expert GEMM with the combine (pk.moe_gemm_combine's work), the same three.
Labels are the ratio against the serial path (fused) or the reference (the rest). Runs anywhere
matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _gemm_series(op: str, reference: str, serial: str, fused: str) -> list:
    """A GEMM op's bars: the reference (timed apart), the serial path and the fused kernel."""
    return [(reference, op, "serial", "baseline_median_us", "#999999"),
            (serial, op, "serial", "median_us", "#1f77b4"),
            (fused, op, "fused", "median_us", "#d62728")]


# (title, [(label, op, path, field, color)]): one panel each.
PANELS = [
    ("moe_dispatch / moe_combine kernels vs the reference's all_gathers",
     [("all_gather of x", "moe_dispatch", None, "baseline_median_us", "#bbbbbb"),
      ("moe_dispatch", "moe_dispatch", None, "median_us", "#d62728"),
      ("all_gather of y", "moe_combine", None, "baseline_median_us", "#777777"),
      ("moe_combine", "moe_combine", None, "median_us", "#ff7f0e")]),
    ("first expert GEMM: dispatch + grouped GEMM",
     _gemm_series("moe_dispatch_gemm", "reference traffic + grouped GEMM",
                  "serial (dispatch, grouped_matmul)", "fused (opt-in)")),
    ("second expert GEMM + combine",
     _gemm_series("moe_gemm_combine", "grouped GEMM + reference traffic",
                  "serial (grouped_matmul, moe_combine)", "fused (the default)")),
]


def _path(row: dict) -> str | None:
    variant = row.get("variant")
    if variant is None:
        return None
    return "fused" if variant.startswith("fused") else "serial"


def main() -> None:
    rows, shapes = {}, []
    for line in (RESULTS / "moe.jsonl").read_text().splitlines():
        r = json.loads(line)
        s = r["shape"]
        shape = (s["model"], s["skewed"], s["tokens_per_rank"], s["k"], s["experts"], s["h"])
        if shape not in shapes:
            shapes.append(shape)
        rows[(r["op"], shape, _path(r))] = r  # later runs replace earlier ones
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(11, 4 * len(PANELS)), squeeze=False)
    labels = [f"{m}\n{'Zipf' if skew else 'uniform'} routing" for m, skew, *_ in shapes]
    for ax, (title, series) in zip(axes[:, 0], PANELS):
        width = 0.8 / len(series)
        top = 0.0
        for j, (label, op, path, field, color) in enumerate(series):
            xs, ys, notes = [], [], []
            for i, shape in enumerate(shapes):
                r = rows.get((op, shape, path))
                if r is None or r.get(field) is None:
                    continue
                xs.append(i + (j - (len(series) - 1) / 2) * width)
                ys.append(r[field])
                notes.append(r["ratio"] if field == "median_us" else None)
            ax.bar(xs, ys, width, label=label, color=color)
            for x, y, ratio in zip(xs, ys, notes):
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}x", (x, y), ha="center", va="bottom", fontsize=7)
            top = max([top, *ys])
        ax.set_xticks(range(len(shapes)), labels, fontsize=8)
        ax.set_ylabel("us per call (per rank)")
        ax.set_title(f"MoE, 8 emulated ranks on one H200: {title}", fontsize=10)
        ax.set_ylim(0, 1.25 * top)
        ax.legend(fontsize=7, ncol=len(series), loc="upper center")
    fig.tight_layout()
    fig.savefig(RESULTS / "moe.png", dpi=120)
    print(f"wrote {RESULTS / 'moe.png'}")


if __name__ == "__main__":
    main()

"""Plots bench/results/grouped_matmul.jsonl (the latest forward row per shape and group-size
distribution) as TFLOP/s for pk.grouped_matmul, a dense GEMM of the same FLOPs and
jax.lax.ragged_dot, into bench/results/grouped_matmul.png. Runs anywhere matplotlib is
installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main() -> None:
    rows = {}
    for line in (RESULTS / "grouped_matmul.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("direction", "fwd") != "fwd":
            continue
        s = r["shape"]
        rows[(s["name"], s["dist"], r["dtype"])] = r  # later runs replace earlier ones
    keys = list(rows)
    labels = [f"{name}\n{dist}" for name, dist, _ in keys]
    series = [("jax.lax.ragged_dot", [rows[k]["baseline_tflops"] for k in keys], "#999999"),
              ("dense GEMM, same FLOPs (cuBLAS)", [rows[k]["dense_tflops"] for k in keys],
               "#1f77b4"),
              ("pk.grouped_matmul", [rows[k]["tflops"] for k in keys], "#d62728")]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for j, (label, values, color) in enumerate(series):
        ax.bar([i + (j - 1) * 0.27 for i in range(len(keys))], values, 0.27, label=label,
               color=color)
    for i, k in enumerate(keys):
        ax.annotate(f"{rows[k]['ratio']:.0f}x", (i + 0.27, rows[k]["tflops"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(keys)), labels, fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16)")
    ax.set_title("Grouped GEMM on one H200: pk.grouped_matmul vs ragged_dot (label: speed-up)")
    ax.set_ylim(0, 1.2 * max(max(v) for _, v, _ in series))
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(RESULTS / "grouped_matmul.png", dpi=120)
    print(f"wrote {RESULTS / 'grouped_matmul.png'}")


if __name__ == "__main__":
    main()

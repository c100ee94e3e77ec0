"""Plots bench/results/{gemm_rs,ag_gemm,gemm_ar}.jsonl (the latest P = 1 row per op and shape) as
TFLOP/s of the op as called (auto), the fused protocol forced, pk.matmul and XLA's baseline,
into bench/results/tp.png. Runs anywhere matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OPS = ("gemm_rs", "ag_gemm", "gemm_ar")
SERIES = (("baseline_tflops", "XLA (x @ w + lax collective)", "#999999"),
          ("matmul_tflops", "pk.matmul", "#1f77b4"),
          ("tflops", "op (auto)", "#d62728"),
          ("fused_tflops", "op (fused forced)", "#ff9896"))


def main() -> None:
    fig, axes = plt.subplots(len(OPS), 1, figsize=(10, 3.2 * len(OPS)), squeeze=False)
    for ax, op in zip(axes[:, 0], OPS):
        path = RESULTS / f"{op}.jsonl"
        rows = {}
        if path.exists():
            for line in path.read_text().splitlines():
                r = json.loads(line)
                if r.get("world") == 1 and not r.get("functional_only"):
                    s = r["shape"]
                    rows[(s["m"], s["n"], s["k"])] = r  # later runs replace earlier ones
        keys = sorted(rows)
        for j, (field, label, color) in enumerate(SERIES):
            ax.bar([i + 0.2 * (j - 1.5) for i in range(len(keys))],
                   [rows[k].get(field) or 0 for k in keys], 0.2, label=label, color=color)
        ax.set_xticks(range(len(keys)), [f"{m}x{n}x{k}" for m, n, k in keys], fontsize=8)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"pk {op}, P = 1 (M x N x K)")
    axes[0, 0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "tp.png", dpi=120)
    print("wrote", RESULTS / "tp.png")


if __name__ == "__main__":
    main()

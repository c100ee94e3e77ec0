"""Plots the rank emulator's rows of bench/results/{gemm_rs,ag_gemm,gemm_ar}.jsonl (latest row
per op, link setting, P and shape, `"emulated": true`): fused against serial time per P, one
row of panels unthrottled (shared HBM) and one throttled (the link cap at a real node's FLOP
per byte), bars colored by the current cost model's choice (bench/check_cost_model.py), into
bench/results/emulated.png. Runs anywhere matplotlib is installed."""

from __future__ import annotations

import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from check_cost_model import latest_rows, model_choice

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OPS = ("gemm_rs", "ag_gemm", "gemm_ar")
LINKS = ("unthrottled", "throttled")


def main() -> None:
    fig, axes = plt.subplots(len(LINKS), len(OPS), figsize=(5 * len(OPS), 4 * len(LINKS)),
                             squeeze=False)
    for i, kind in enumerate(LINKS):
        for ax, op in zip(axes[i], OPS):
            data = {key[1:]: r for key, r in latest_rows(op).items() if key[0] == kind}
            keys = sorted(data)
            labels = [f"P={p}\nK={k}" if m == n == 8192 else f"P={p}\n{m}x{n}x{k}"
                      for p, m, n, k in keys]
            ratios = [data[k]["ratio"] for k in keys]
            colors = ["#d62728" if model_choice(data[k]) == "fused" else "#1f77b4"
                      for k in keys]
            ax.bar(range(len(keys)), ratios, color=colors)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks(range(len(keys)), labels, fontsize=7)
            gb = sorted({round(data[k]["link_gbps"]) for k in keys if data[k].get("link_gbps")})
            what = ("shared HBM" if kind == "unthrottled" else "link capped at 1750 FLOP/B")
            if gb:
                what += f", {'/'.join(map(str, gb))} GB/s per rank"
            ax.set_title(f"{op}: serial / fused time\n({kind}: {what})", fontsize=9)
            ax.set_ylabel("> 1: fused faster")
            if not keys:
                ax.text(0.5, 0.5, "no rows yet", ha="center", va="center",
                        transform=ax.transAxes)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#d62728", "#1f77b4")]
    fig.legend(handles, ["cost model picks fused", "cost model picks serial"], loc="lower center",
               ncol=2)
    fig.suptitle("Rank emulator on one H200 (P partitions of 132/P SMs, shared HBM, no NVLink)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    out = RESULTS / "emulated.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()

"""Plots the rank emulator's rows of bench/results/{gemm_rs,ag_gemm,gemm_ar}.jsonl (latest row
per op, P and shape, `"emulated": true`): fused against serial time per P, and the cost model's
choice, into bench/results/emulated.png. Runs anywhere matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
OPS = ("gemm_rs", "ag_gemm", "gemm_ar")


def rows(op: str) -> dict:
    latest = {}
    for line in (RESULTS / f"{op}.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("emulated") and r.get("mode") == "fused":
            s = r["shape"]
            latest[(r["world"], s["m"], s["n"], s["k"])] = r
    return latest


def main() -> None:
    fig, axes = plt.subplots(1, len(OPS), figsize=(5 * len(OPS), 4), squeeze=False)
    for ax, op in zip(axes[0], OPS):
        data = rows(op)
        keys = sorted(data)
        labels = [f"P={p}\nK={k}" if m == n == 8192 else f"P={p}\n{m}x{n}x{k}"
                  for p, m, n, k in keys]
        ratios = [data[k]["ratio"] for k in keys]
        colors = ["#d62728" if data[k]["model_choice"] == "fused" else "#1f77b4" for k in keys]
        ax.bar(range(len(keys)), ratios, color=colors)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), labels, fontsize=7)
        ax.set_title(f"{op} (M = N = 8192): serial / fused time")
        ax.set_ylabel("> 1: fused faster")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#d62728", "#1f77b4")]
    fig.legend(handles, ["cost model picks fused", "cost model picks serial"], loc="lower center",
               ncol=2)
    fig.suptitle("Rank emulator on one H200 (P partitions of 132/P SMs, shared HBM, no NVLink)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    out = RESULTS / "emulated.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()

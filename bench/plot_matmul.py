"""Plots bench/results/matmul.jsonl (the latest row per shape) as TFLOP/s by shape for pk.matmul
and cuBLAS (jnp.dot), into bench/results/matmul.png. Runs anywhere matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main() -> None:
    rows = {}
    for line in (RESULTS / "matmul.jsonl").read_text().splitlines():
        r = json.loads(line)
        s = r["shape"]
        rows[(s["m"], s["n"], s["k"], r["dtype"])] = r  # later runs replace earlier ones
    keys = list(rows)
    labels = [f"{m}x{n}x{k}" for m, n, k, _ in keys]
    ours = [rows[k]["tflops"] for k in keys]
    base = [rows[k]["baseline_tflops"] for k in keys]
    x = range(len(keys))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar([i - 0.2 for i in x], base, 0.4, label="jnp.dot (cuBLAS)", color="#999999")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label="pk.matmul", color="#d62728")
    for i, k in enumerate(keys):
        ax.text(i + 0.2, ours[i] + 5, f"{rows[k]['ratio']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels, rotation=20, fontsize=8)
    ax.set_ylabel("TFLOP/s (bf16 in/out, fp32 accumulate)")
    r0 = rows[keys[0]]
    ax.set_title(f"pk.matmul vs cuBLAS on {r0['gpu']} ({r0['date'][:10]}), M x N x K")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(RESULTS / "matmul.png", dpi=120)
    print("wrote", RESULTS / "matmul.png")


if __name__ == "__main__":
    main()

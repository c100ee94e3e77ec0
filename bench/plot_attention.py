"""Plots bench/results/attention.jsonl (the latest row per shape, causal flag and direction) as
TFLOP/s for pk.attention, cuDNN and XLA, forward and forward+backward, into
bench/results/attention.png. Runs anywhere matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main() -> None:
    rows = {}
    for line in (RESULTS / "attention.jsonl").read_text().splitlines():
        r = json.loads(line)
        s = r["shape"]
        key = (s["b"], s["s"], s["h"], s["hkv"], s["d"], s["causal"], r["dtype"])
        rows[(r["direction"], key)] = r  # later runs replace earlier ones
    directions = [d for d in ("fwd", "fwd+bwd") if any(k[0] == d for k in rows)]
    fig, axes = plt.subplots(len(directions), 1, figsize=(12, 4.5 * len(directions)),
                             squeeze=False)
    for ax, direction in zip(axes[:, 0], directions):
        keys = [k for (d, k) in rows if d == direction]
        labels = [f"{s}x{h}/{hkv}\nD{d}{' causal' if c else ''}"
                  for _, s, h, hkv, d, c, _ in keys]
        series = [("XLA", [rows[(direction, k)]["xla_tflops"] or 0 for k in keys], "#999999"),
                  ("cuDNN", [rows[(direction, k)]["baseline_tflops"] for k in keys], "#1f77b4"),
                  ("pk.attention", [rows[(direction, k)]["tflops"] for k in keys], "#d62728")]
        for j, (label, values, color) in enumerate(series):
            ax.bar([i + (j - 1) * 0.27 for i in range(len(keys))], values, 0.27, label=label,
                   color=color)
        for i, k in enumerate(keys):
            r = rows[(direction, k)]
            ax.annotate(f"{r['ratio']:.2f}x", (i + 0.27, r["tflops"]), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(keys)), labels, fontsize=7)
        ax.set_ylabel("TFLOP/s (bf16)")
        ax.set_title(f"Attention {direction} on one H200: pk.attention vs cuDNN "
                     "(label: cuDNN time / ours)")
        ax.set_ylim(0, 1.2 * max(max(v) for _, v, _ in series))
        ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    fig.savefig(RESULTS / "attention.png", dpi=120)
    print(f"wrote {RESULTS / 'attention.png'}")


if __name__ == "__main__":
    main()

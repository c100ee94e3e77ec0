"""Plots the rank emulator's rows of bench/results/ring_attention.jsonl and
ulysses_attention.jsonl (latest row per pass, P, S/P and causal, `"emulated": true`): baseline
time / ours per shape, one panel per (op, pass): ring forward and backward against the unfused
ring (pk.attention per block after an all_gather), Ulysses forward against the unfused
all_to_all / pk.attention / all_to_all, Ulysses backward (composed of kernels) against the
fused ring backward, and the fused Ulysses backward (ulysses_attention_bwd_fused.jsonl) against
the composed one; into bench/results/sp_attention.png. Runs anywhere matplotlib is
installed.

    python bench/plot_sp_attention.py
"""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PANELS = (("ring_attention", "forward", "unfused ring / fused"),
          ("ring_attention", "backward", "unfused ring / fused"),
          ("ulysses_attention", "forward", "unfused / fused"),
          ("ulysses_attention", "backward", "fused ring / composed Ulysses"),
          ("ulysses_attention_bwd_fused", "backward", "composed / fused Ulysses"))


def latest(op: str) -> dict:
    """The last emulated row per (pass, P, S/P, causal) of bench/results/<op>.jsonl."""
    rows: dict = {}
    path = RESULTS / f"{op}.jsonl"
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if not r.get("emulated") or not r.get("ratio"):
            continue
        sh = r["shape"]
        rows[(sh.get("pass", "forward"), r["world"], sh["s_local"], sh["causal"])] = r
    return rows


def main() -> None:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 4), squeeze=False)
    for ax, (op, which, what) in zip(axes[0], PANELS):
        data = {k[1:]: r for k, r in latest(op).items() if k[0] == which}
        keys = sorted(data)
        ax.bar(range(len(keys)), [data[k]["ratio"] for k in keys],
               color=["#d62728" if k[2] else "#1f77b4" for k in keys])
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(keys)), [f"P={p}\nS/P={sl}" for p, sl, _ in keys], fontsize=7)
        ax.set_title(f"{op} {which}\n{what}", fontsize=9)
        ax.set_ylabel("> 1: ours faster")
        if not keys:
            ax.text(0.5, 0.5, "no rows yet", ha="center", va="center", transform=ax.transAxes)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#d62728", "#1f77b4")]
    fig.legend(handles, ["causal", "not causal"], loc="lower center", ncol=2)
    fig.suptitle("Sequence-parallel attention in the rank emulator on one H200 (P partitions, "
                 "shared HBM, no NVLink)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.93))
    out = RESULTS / "sp_attention.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()

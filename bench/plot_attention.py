"""Plots the newest `"grid": "fa3-paper"` rows of bench/results/attention.jsonl (written by
bench/bench_attention.py) into bench/results/attention.png: TFLOP/s per shape of pk.attention,
FlashAttention-3, cuDNN and tokamax, forward above and forward+backward below, with the
geometric mean of peer time / ours per peer in each panel's title. For each (shape, pass, peer)
the newest row counts; pk.attention's bar is taken from the newest of its shape's rows. Runs
anywhere matplotlib is installed: python bench/plot_attention.py [--rows FILE] [--out PNG]."""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
GRID = "fa3-paper"
PASSES = ("forward", "forward+backward")
SERIES = (("pk", "pk.attention", "#d62728"), ("fa3", "FlashAttention-3", "#2ca02c"),
          ("cudnn", "cuDNN", "#1f77b4"), ("tokamax", "tokamax (Mosaic GPU)", "#9467bd"))
SUBSETS = {"paper": 0, "gqa": 1, "long": 2}


def _shape_key(r: dict) -> tuple:
    s = r["shape"]
    return (SUBSETS.get(r.get("subset"), 3), s["d"], s["s"], s["h"], s["hkv"], s["b"],
            s["causal"])


def _label(key: tuple) -> str:
    _, d, s, h, hkv, _, causal = key
    seq = f"{s // 1024}K" if s >= 1024 else str(s)
    heads = f"D{d}" if h == hkv else f"{h}/{hkv}"
    return f"{seq}\n{heads}\n{'causal' if causal else 'full'}"


def load(rows_path: pathlib.Path) -> dict:
    """(pass, shape key, baseline) -> newest row of the fa3-paper grid."""
    rows = {}
    for line in rows_path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("grid") != GRID or r.get("pass") not in PASSES:
            continue
        key = (r["pass"], _shape_key(r), r["baseline"])
        if key not in rows or r["date"] >= rows[key]["date"]:
            rows[key] = r
    return rows


def main(rows_path: pathlib.Path | None = None, out: pathlib.Path | None = None) -> None:
    rows_path = rows_path or RESULTS / "attention.jsonl"
    out = out or RESULTS / "attention.png"
    rows = load(rows_path)
    if not rows:
        print(f"no {GRID} rows in {rows_path}; {out} left as it is")
        return
    passes = [p for p in PASSES if any(k[0] == p for k in rows)]
    n_shapes = max(len({k[1] for k in rows if k[0] == p}) for p in passes)
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(10, 0.62 * n_shapes + 2),
                                                      4.8 * len(passes)), squeeze=False)
    width = 0.8 / len(SERIES)
    for ax, pass_name in zip(axes[:, 0], passes):
        shapes = sorted({k[1] for k in rows if k[0] == pass_name})
        values = {name: [] for name, _, _ in SERIES}
        gm = {}
        for shape in shapes:
            mine = [r for (p, s, _), r in rows.items() if p == pass_name and s == shape]
            values["pk"].append(max(mine, key=lambda r: r["date"])["tflops"])
            for name, _, _ in SERIES[1:]:
                r = rows.get((pass_name, shape, name))
                values[name].append(r["baseline_tflops"] if r else 0.0)
                if r:
                    gm.setdefault(name, []).append(r["ratio"])
        for j, (name, label, color) in enumerate(SERIES):
            if not any(values[name]):
                continue
            ax.bar([i + (j - (len(SERIES) - 1) / 2) * width for i in range(len(shapes))],
                   values[name], width, label=label, color=color)
        ax.set_xticks(range(len(shapes)), [_label(s) for s in shapes], fontsize=7)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylabel("TFLOP/s (bf16)")
        labels = {n: lab for n, lab, _ in SERIES}
        means = ", ".join(f"{labels[n]} {math.exp(sum(map(math.log, v)) / len(v)):.2f}x"
                          for n, v in gm.items())
        ax.set_title(f"Attention {pass_name} on one {next(iter(rows.values()))['gpu']}, FA3 "
                     f"paper grid (16K tokens, hidden 2048) + GQA 32/4 + S=32K\n"
                     f"geomean of peer time / pk.attention time: {means}", fontsize=9)
        top = max(max(v) for v in values.values())
        ax.set_ylim(0, 1.25 * top if top > 0 else 1)
        ax.legend(fontsize=8, ncol=len(SERIES), loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=pathlib.Path, default=None,
                    help="rows file (default bench/results/attention.jsonl)")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="picture (default bench/results/attention.png)")
    args = ap.parse_args()
    main(args.rows, args.out)

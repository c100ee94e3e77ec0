"""Plots the fp8 GEMM rows (bench/results/matmul_fp8.jsonl, grouped_matmul_fp8.jsonl; the latest
row per shape, scaling and baseline) as TFLOP/s, into bench/results/fp8.png: the dense GEMM
(pk fp8 per tensor and blockwise against XLA's fp8 dot and pk.matmul in bf16) and the MoE
grouped GEMM in its [E, N, K] form (against pk.grouped_matmul in bf16 and the dense fp8 GEMM of
the same layout and FLOPs). Runs anywhere matplotlib is installed."""

from __future__ import annotations

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def latest(name: str) -> list[dict]:
    """The newest row per (shape, scaling, baseline, w_layout) of results/<name>.jsonl."""
    rows = {}
    for line in (RESULTS / f"{name}.jsonl").read_text().splitlines():
        r = json.loads(line)
        key = (json.dumps(r["shape"], sort_keys=True), r["scaling"], r["baseline"],
               r.get("w_layout"))
        rows[key] = r  # later runs replace earlier ones
    return list(rows.values())


def dense_bars(rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """Per shape: what each series reached, from the rows that time it (w as [K, N])."""
    series = {"pk.matmul bf16": {}, "XLA fp8 dot (cuBLASLt)": {}, "pk fp8 per tensor": {},
              "pk fp8 blockwise": {}}
    shapes = []
    for r in rows:
        s = r["shape"]
        label = f"{s['m']}x{s['n']}x{s['k']}"
        if label not in shapes:
            shapes.append(label)
        if r.get("w_layout") != "kn":
            continue
        if r["scaling"] == "tensor" and r["baseline"] == "XLA fp8 dot (cuBLASLt)":
            series["XLA fp8 dot (cuBLASLt)"][label] = r["baseline_tflops"]
            series["pk fp8 per tensor"][label] = r["tflops"]
        elif r["scaling"] == "tensor" and r["baseline"] == "pk.matmul bf16":
            series["pk.matmul bf16"][label] = r["baseline_tflops"]
        elif r["scaling"] == "block" and r["baseline"] == "pk matmul_fp8 per tensor":
            series["pk fp8 blockwise"][label] = r["tflops"]
    return shapes, {k: [v.get(s, 0.0) for s in shapes] for k, v in series.items()}


def grouped_bars(rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """Per shape and size distribution, the [E, N, K] form and its baselines."""
    series = {"pk.grouped_matmul bf16": {}, "dense fp8 GEMM, same layout (per tensor)": {},
              "pk grouped fp8 per tensor": {}, "pk grouped fp8 blockwise": {}}
    shapes = []
    for r in rows:
        if r.get("w_layout") != "enk":
            continue
        s = r["shape"]
        label = f"{s['name']}\n{s['dist']}"
        scale = "per tensor" if r["scaling"] == "tensor" else "blockwise"
        if r["baseline"].startswith("pk matmul_fp8 dense") and "given as" in r["baseline"]:
            if label not in shapes:
                shapes.append(label)
            series[f"pk grouped fp8 {scale}"][label] = r["tflops"]
            if r["scaling"] == "tensor":
                series["dense fp8 GEMM, same layout (per tensor)"][label] = r["baseline_tflops"]
        elif r["baseline"] == "pk.grouped_matmul bf16" and r["scaling"] == "tensor":
            series["pk.grouped_matmul bf16"][label] = r["baseline_tflops"]
    return shapes, {k: [v.get(s, 0.0) for s in shapes] for k, v in series.items()}


def bars(ax, shapes: list[str], series: dict[str, list[float]], colors: list[str]) -> None:
    width = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(shapes))]
        ax.bar(xs, vals, width, label=name, color=colors[j])
    ax.set_xticks(range(len(shapes)), shapes, fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0, 1.18 * max(max(v) for v in series.values()))  # room for the legend
    ax.legend(fontsize=7, loc="upper left", ncol=len(series))


def provenance(rows: list[dict]) -> str:
    """The GPUs and the newest date of the rows a panel draws (they may mix runs)."""
    return f"{', '.join(sorted({r['gpu'] for r in rows}))} ({max(r['date'] for r in rows)[:10]})"


def main() -> None:
    dense = latest("matmul_fp8")
    grouped = latest("grouped_matmul_fp8")
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 8))
    shapes, series = dense_bars(dense)
    bars(a1, shapes, series, ["#999999", "#555555", "#d62728", "#ff9896"])
    a1.set_title(f"fp8 GEMM (e4m3, bf16 out) on {provenance(dense)}, M x N x K", fontsize=9)
    shapes, series = grouped_bars(grouped)
    bars(a2, shapes, series, ["#999999", "#555555", "#1f77b4", "#aec7e8"])
    a2.set_title(f"MoE grouped GEMM, w [E, N, K], on {provenance(grouped)}: experts x K -> N",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(RESULTS / "fp8.png", dpi=120)
    print("wrote", RESULTS / "fp8.png")


if __name__ == "__main__":
    main()

"""mkdocs hook: the benchmark plots of bench/results/ as site files under results/, so the
performance page shows them without a copy kept in docs/ (the plots are rewritten by the
benchmarks, and a copy would go stale)."""

from __future__ import annotations

import pathlib

from mkdocs.structure.files import File

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def on_files(files, config):
    for png in sorted((BENCH / "results").glob("*.png")):
        files.append(File(f"results/{png.name}", str(BENCH), config["site_dir"],
                          config["use_directory_urls"]))
    return files

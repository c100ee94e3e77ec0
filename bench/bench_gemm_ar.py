"""Benchmark of pk.gemm_all_reduce: see bench_tp.py (same options; P = 1 against pk.matmul and XLA, or
under `python -m pk_jax.launch -n N --share-gpu bench/bench_gemm_ar.py` for P = N, functional
only)."""

import sys

from bench_tp import main

if __name__ == "__main__":
    sys.exit(main(["--ops", "gemm_ar", *sys.argv[1:]]))

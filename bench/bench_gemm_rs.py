"""Benchmark of pk.gemm_reduce_scatter: see bench_tp.py (same options; P = 1 against pk.matmul and XLA, or
under `python -m pk_jax.launch -n N --share-gpu bench/bench_gemm_rs.py` for P = N, functional
only)."""

import sys

from bench_tp import main

if __name__ == "__main__":
    sys.exit(main(["--ops", "gemm_rs", *sys.argv[1:]]))

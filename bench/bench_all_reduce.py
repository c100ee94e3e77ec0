"""Benchmark of pk.all_reduce: see bench_collectives.py (same options; P = 1 against XLA, or under
`python -m pk_jax.launch -n N --share-gpu bench/bench_all_reduce.py` for P = N)."""

import sys

from bench_collectives import main

if __name__ == "__main__":
    sys.exit(main(["--op", "all_reduce", *sys.argv[1:]]))

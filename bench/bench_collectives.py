"""Benchmark of the four collective kernels: latency for small messages, bandwidth for large.

    python bench/bench_collectives.py [--op all_reduce ...] [--quick]          # P = 1
    python -m pk_jax.launch -n 4 --share-gpu bench/bench_collectives.py        # P = 4

P = 1 (one process): each pk kernel against XLA's own collective in the same run. Users get
XLA's no-op there (pk's collectives take the reference over a 1-device axis); this benchmark
sets PK_JAX_SINGLE_DEVICE_KERNELS=1 to time the kernel anyway: its staging copy, the copy out
of the workspace, the FFI call and the signal round trip. P > 1 (processes sharing one GPU through the
launcher): absolute numbers only. Kernels of different processes time-slice on the one GPU, so
these numbers measure the protocol under time slicing, not NVLink; they are functional only.

Every size is checked for correctness first (x = rank + 1, so sums and gathered blocks are
known), then timed with common.time_us (back-to-back calls, median of batches). Sizes are the
bytes of each device's input; `gbps` is the algorithm bandwidth, input bytes / time. One JSON
line per (op, size) goes to bench/results/<op>.jsonl (rank 0 only).
"""

from __future__ import annotations

import argparse
import os
import sys

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SIZES_P1 = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20)
SIZES_MP = (4 << 10, 256 << 10, 4 << 20)
COLS = 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", action="append", choices=OPS, help="ops to run (default: all)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PK_JAX_SINGLE_DEVICE_KERNELS", "1")  # P = 1: the kernel, not a no-op

    import pk_jax.launch

    pk_jax.launch.initialize()
    import common
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pk_jax as pk

    n = jax.process_count()
    me = jax.process_index()
    world = len(jax.devices())
    dtype = jnp.dtype(args.dtype)
    mesh = jax.make_mesh((world,), ("x",), devices=jax.devices())
    pk.init(mesh)
    spec = P("x")

    ours_fns = {
        "all_reduce": lambda a: pk.all_reduce(a, "x"),
        "all_gather": lambda a: pk.all_gather(a, "x", axis=0),
        "reduce_scatter": lambda a: pk.reduce_scatter(a, "x"),
        "all_to_all": lambda a: pk.all_to_all(a, "x", 0, 0),
    }
    xla_fns = {
        "all_reduce": lambda a: jax.lax.psum(a, "x"),
        "all_gather": lambda a: jax.lax.all_gather(a, "x", axis=0, tiled=True),
        "reduce_scatter": lambda a: jax.lax.psum_scatter(a, "x", tiled=True),
        "all_to_all": lambda a: jax.lax.all_to_all(a, "x", 0, 0, tiled=True),
    }
    for op in args.op or OPS:
        if pk.backend_name(op, "x") != "cuda":
            raise SystemExit(f"pk.{op} would run its reference here: no sm_90 GPU or no extension")
        sizes = SIZES_P1 if world == 1 else SIZES_MP
        if me == 0:
            print(f"{op} P={world} ({n} processes) {dtype.name}")
            print(f"{'bytes/device':>13} {'pk us':>10} {'pk GB/s':>9} {'XLA us':>10}  ratio")
        for size in sizes:
            rows = max(world, size // (COLS * dtype.itemsize) // world * world)
            shape = (rows * world, COLS)  # global: device r holds rows [r rows, (r+1) rows)

            def block(idx, rows=rows, shape=shape):
                start = idx[0].start or 0
                r = start // rows
                return np.full((rows, COLS), r + 1, dtype)

            sets = [(jax.make_array_from_callback(shape, NamedSharding(mesh, spec), block),)]
            ours = jax.jit(jax.shard_map(ours_fns[op], mesh=mesh, in_specs=(spec,),
                                         out_specs=spec))
            y = np.asarray(ours(*sets[0]).addressable_shards[0].data, np.float32)
            _check(op, y, world, me if n > 1 else 0, rows)
            iters = 5 if n > 1 else 50
            reps = 3 if (n > 1 or args.quick) else 11
            t_ours = common.time_us(ours, sets, iters=iters, reps=reps)
            t_base = None
            if n == 1:
                base = jax.jit(jax.shard_map(xla_fns[op], mesh=mesh, in_specs=(spec,),
                                             out_specs=spec))
                t_base = common.time_us(base, sets, iters=iters, reps=reps)
            nbytes = rows * COLS * dtype.itemsize
            gbps = nbytes / t_ours / 1e3
            if me == 0:
                ratio = f"{t_base / t_ours:6.3f}x vs XLA" if t_base else "(no baseline: shared GPU)"
                base_s = f"{t_base:10.1f}" if t_base else f"{'-':>10}"
                print(f"{nbytes:>13} {t_ours:10.1f} {gbps:9.2f} {base_s}  {ratio}")
                common.record(op=op, shape={"rows": rows, "cols": COLS, "bytes": nbytes},
                              dtype=dtype.name, world=world, processes=n, median_us=t_ours,
                              gbps=gbps, baseline=("XLA lax collective" if t_base else
                                                   "none (processes share one GPU)"),
                              baseline_median_us=t_base, iters=iters, reps=reps,
                              note=None if n == 1 else "functional only: P processes time-slice "
                              "one GPU")
    pk.shutdown()
    return 0


def _check(op: str, y, world: int, rank: int, rows: int) -> None:
    """x_r = r + 1 everywhere: the expected result of each op on `rank`."""
    import numpy as np

    if op == "all_reduce" or op == "reduce_scatter":
        want = np.full_like(y, world * (world + 1) / 2)
    elif op == "all_gather":
        want = np.repeat(np.arange(1, world + 1, dtype=np.float32), rows)[:, None] * np.ones_like(
            y[:1])
    else:  # all_to_all: block p of the result comes from rank p
        want = np.repeat(np.arange(1, world + 1, dtype=np.float32), rows // world)[:, None] * \
            np.ones_like(y[:1])
    if y.shape != want.shape or not np.array_equal(y, want):
        raise SystemExit(f"pk.{op} is wrong on rank {rank}: got {y.ravel()[:4]}..., "
                         f"want {want.ravel()[:4]}...")


if __name__ == "__main__":
    sys.exit(main())

"""Shared benchmark helpers: timing jitted functions on the device, and JSON-lines results.

Timing: `time_us` runs `iters` back-to-back calls (rotating over several input sets so caches
and low-entropy data do not flatter anyone), blocks once at the end, and takes the median over
`reps` such batches. One call + block_until_ready would add 0.1-0.2 ms of host overhead.

Results: one JSON object per measured shape appended to bench/results/<op>.jsonl, with the
fields every row carries (op, shape, dtype, world, processes, gpu, machine, commit, date,
median_us, tflops or gbps, baseline, baseline_median_us, ratio = baseline / ours).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def time_us(fn: Callable, arg_sets: Sequence[tuple], *, iters: int = 20, reps: int = 7,
            warmup: int = 3) -> float:
    """Median microseconds per call of `fn` over `reps` batches of `iters` back-to-back calls."""
    return time_us_interleaved({"fn": fn}, arg_sets, iters=iters, reps=reps, warmup=warmup)["fn"][0]


def time_us_interleaved(fns: dict[str, Callable], arg_sets: Sequence[tuple], *, iters: int = 20,
                        reps: int = 7, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """Like time_us for several functions, their batches taken in turn (rep 1 of each, then rep
    2, ...), so clock and power drift fall on all of them alike. Returns name -> (median
    microseconds per call, median microseconds the host took to issue a call). Where the
    second is close to the first, the host, not the GPU, sets the pace."""
    arg_sets = list(arg_sets)
    for fn in fns.values():
        for i in range(warmup):
            jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    wall: dict[str, list[float]] = {name: [] for name in fns}
    issue: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out = None
            start = time.perf_counter()
            for i in range(iters):
                out = fn(*arg_sets[i % len(arg_sets)])
            issued = time.perf_counter()
            jax.block_until_ready(out)
            end = time.perf_counter()
            wall[name].append((end - start) / iters * 1e6)
            issue[name].append((issued - start) / iters * 1e6)
    return {name: (statistics.median(wall[name]), statistics.median(issue[name]))
            for name in fns}


class Rotating:
    """fn over its own input sets in turn, called with no arguments: for time_us_interleaved
    (which rotates one shared list of sets) where every variant has its own sets."""

    def __init__(self, fn, arg_sets):
        self.fn, self.arg_sets, self.i = fn, arg_sets, 0

    def __call__(self):
        args = self.arg_sets[self.i % len(self.arg_sets)]
        self.i += 1
        return self.fn(*args)


def gpu_name() -> str:
    d = jax.devices()[0]
    return d.device_kind if d.platform == "gpu" else d.platform


def machine() -> str:
    """PK_JAX_MACHINE, else the GPU model and count on this host: 'h200', 'h200-x8'."""
    if os.environ.get("PK_JAX_MACHINE"):
        return os.environ["PK_JAX_MACHINE"]
    d = jax.devices()[0]
    if d.platform != "gpu":
        return d.platform
    name = "h200" if "H200" in d.device_kind else d.device_kind.lower().replace(" ", "-")
    try:  # physical GPUs, not JAX devices: several processes may share one GPU
        n = len(subprocess.check_output(["nvidia-smi", "-L"], text=True).strip().splitlines())
    except (OSError, subprocess.CalledProcessError):
        n = len(jax.local_devices())
    return name if n <= 1 else f"{name}-x{n}"


def commit() -> str:
    """PK_JAX_COMMIT if set (a copied tree's .git may be stale), else git's HEAD."""
    if os.environ.get("PK_JAX_COMMIT"):
        return os.environ["PK_JAX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                       cwd=RESULTS.parent, stderr=subprocess.DEVNULL,
                                       text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("PK_JAX_COMMIT", "unknown")


def record(*, op: str, shape: dict, dtype: str, world: int, processes: int, median_us: float,
           baseline: str, baseline_median_us: float | None, tflops: float | None = None,
           gbps: float | None = None, path: pathlib.Path | None = None, **extra) -> dict:
    """Appends one result line to bench/results/<op>.jsonl (or `path`) and returns it."""
    row = {
        "op": op, "shape": shape, "dtype": dtype, "world": world, "processes": processes,
        "gpu": gpu_name(), "machine": machine(), "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "median_us": round(median_us, 3),
        "tflops": None if tflops is None else round(tflops, 2),
        "gbps": None if gbps is None else round(gbps, 2),
        "baseline": baseline,
        "baseline_median_us": None if baseline_median_us is None else round(baseline_median_us, 3),
        "ratio": None if not baseline_median_us else round(baseline_median_us / median_us, 4),
        **extra,
    }
    path = path or RESULTS / f"{op}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def emulated_us(world, launch_all, *, iters: int = 10, reps: int = 5) -> float:
    """Median microseconds per call of `launch_all()`, which queues one call on every rank of
    the rank emulator's `world` (pk_jax.testing.World); the world is synchronized (bounded by
    its timeout) after each batch of `iters` calls."""
    launch_all()
    world.synchronize()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(iters):
            launch_all()
        world.synchronize()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)

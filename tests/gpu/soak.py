"""A soak of the rank emulator (issue 39, section 6): N calls at P = 8 mixing every cross-rank op
emu_cases builds (the collectives, the TP GEMMs, the MoE dispatch/scatter/combine/gather, the
fused MoE ops, ring attention forward and backward, Ulysses forward and fused backward), each
rank starting each call after a random delay, every result checked against its numpy
reference, with the World closed and made again every few thousand calls.

    python tests/gpu/soak.py [--calls 100000] [--minutes M] [--ops a,b] [--pool 8] [--batch 32]

Prints progress lines and a last line `soak: N calls, M ops, K world cycles, W wrong, E errors,
T s`; exits non-zero on any wrong result or error (tests/gpu/run_all.sh section `soak`).

How it stays fast (the host, not the GPU, sets the pace: a small call is ~50-100 us of GPU
time, its numpy reference up to seconds to build):
- a pool of small cases per op is built once, in worker processes forked before CUDA starts,
  and each case's Call is reused for every call of it (`PooledCall`);
- a call's outputs on every rank live in one device arena, so poisoning them is one memset and
  reading them back one copy; bytes equal to the last bytes that passed Call.check (at first
  the expected values of an exact case) pass again, anything else goes through Call.check
  (the numpy reference, with its tolerance);
- calls are queued in batches of distinct pooled calls (a random mix of ops, or one op's whole
  pool back to back) with one host synchronization per batch, as emu_cases.run_calls does.

A call's poison alternates between 0xFF and 0x7F (0xFF reads -1 in int32 outputs, a legal MoE
position). The padding between a call's outputs in the arena is poisoned too and must stay so:
a kernel writing past the end of an output is reported as wrong.

The World cycles stand in for pk.init / pk.shutdown cycles: each closes the communicators,
symmetric memory and green contexts and makes new ones (new communicator ids, a workspace size
alternating between WORKSPACES), while the calls' buffers live on, as an application's arrays
outlive pk.shutdown (this process holds the primary context across the cycles). A real
pk.init / pk.shutdown cycle through JAX is not run in this process, beside the emulator's
contexts; those cycles are tested by tests/gpu/test_reinit.py and tests/test_state.py
(run_all.sh section state).
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA; at P = 8 the ranks
# have 16 streams, more than CUDA's default 8 hardware work queues (under compute-sanitizer,
# ranks 4-7 never started with 8: pk_jax/testing/emulator.py's docstring).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# The pool's numpy references are many small matmuls, built by one process per core: one BLAS
# thread each (set before numpy loads; more threads only contend for the cores).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import multiprocessing
import sys
import time
import zlib
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import emu_cases

from pk_jax.runtime import vmm
from pk_jax.testing import ops
from pk_jax.testing.emulator import DeviceBuffer

P = 8
SOAK_OPS = ops.OPS + ops.MOE + ops.FUSED_MOE + ops.ATTENTION + ("ulysses_attn_bwd",)
# The ops whose references are slowest to build, first in the workers' queue.
SLOW_OPS = ("ulysses_attn_bwd", "ring_attn_bwd", "moe_gemm_combine", "ulysses_attn",
            "ring_attn", "moe_dispatch_gemm")
POISONS = (0xFF, 0x7F)
WORKSPACES = (256 << 20, 128 << 20)  # per World cycle, alternating
ALIGN = 256                          # each output's offset in its call's arena (cuMemAlloc's)


def small_case(op: str, p: int, seed: int, index: int) -> ops.Case:
    """Case `index` of `op` at world p: emu_cases' random cases (exact integers but for
    attention), the attention ones kept small (S/P in 1..200, one K/V head per rank for
    Ulysses) so their float32 references take about a second at most. Deterministic in
    (seed, op, index)."""
    rng = np.random.default_rng([seed, zlib.crc32(op.encode()), index])

    def pick(*choices):
        return choices[int(rng.integers(0, len(choices)))]

    if op in ("ring_attn", "ring_attn_bwd"):
        backward = op == "ring_attn_bwd"
        hkv = pick(1, 2)
        sl = pick(2, 64, 130) if backward else pick(2, 64, 130, 200)
        return emu_cases.ring_case(p, rng, s_local=sl, hkv=hkv, h=hkv * pick(1, 2),
                                   backward=backward)
    if op == "ulysses_attn":
        return emu_cases.ulysses_case(p, rng, s_local=pick(1, 2, 64, 130), hkv=p,
                                      h=p * pick(1, 2))
    if op == "ulysses_attn_bwd":  # GQA (two query heads per K/V head) at S/P <= 64 only
        sl = pick(1, 2, 64, 130)
        return emu_cases.ulysses_bwd_case(p, rng, s_local=sl, hkv=p,
                                          h=p * (pick(1, 2) if sl <= 64 else 1), b=1)
    if op == "moe_gemm_combine":
        return emu_cases.gemm_combine_case(p, rng, t=int(rng.integers(1, 100)))
    if op == "moe_dispatch_gemm":
        return emu_cases.fused_case(p, rng, t=int(rng.integers(1, 100)))
    return emu_cases.case(op, p, rng)


def build_pool(names, p: int, per_op: int, seed: int, workers: int) -> list[ops.Case]:
    """`per_op` cases of each op in `names`, op by op in `names`' order; built by `workers`
    processes forked here (call it before CUDA starts in this process), slowest ops first."""
    tasks = [(op, p, seed, i) for op in names for i in range(per_op)]
    order = sorted(range(len(tasks)), key=lambda j: (
        SLOW_OPS.index(tasks[j][0]) if tasks[j][0] in SLOW_OPS else len(SLOW_OPS)))
    if workers > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            built = pool.starmap(small_case, [tasks[j] for j in order], chunksize=1)
    else:
        built = [small_case(*tasks[j]) for j in order]
    cases: list = [None] * len(tasks)
    for j, c in zip(order, built):
        cases[j] = c
    return cases


def arena_layout(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Offsets of buffers of `sizes` bytes laid out back to back, each at a multiple of
    `align` with at least one byte of padding after it, and the total size (a multiple of
    `align`)."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-(int(n) + 1) // align) * align
    return offsets, max(end, align)


def skew_delays(rng: np.random.Generator, p: int, skew_ns: int,
                straggler_ns: int) -> list[int] | None:
    """Per-rank start delays of one call: none (a quarter of the calls), each rank uniform in
    [0, skew_ns], or (15%) that plus one straggler rank up to straggler_ns later still."""
    u = rng.random()
    if u < 0.25 or (skew_ns <= 0 and straggler_ns <= 0):
        return None
    delays = rng.integers(0, max(skew_ns, 0) + 1, p)
    if u >= 0.85 and straggler_ns > 0:
        delays[int(rng.integers(0, p))] += int(rng.integers(1, straggler_ns + 1))
    return [int(d) for d in delays]


def plan_batch(rng: np.random.Generator, by_op: dict[str, list[int]], size: int) -> list[int]:
    """Distinct pool indices for one batch: a quarter of the batches one op's whole pool (up to
    `size`) in random order, so an op follows itself; the others a random mix of every op."""
    if rng.random() < 0.25:
        names = list(by_op)
        idx = list(by_op[names[int(rng.integers(0, len(names)))]])
        rng.shuffle(idx)
        return idx[:size]
    every = [i for v in by_op.values() for i in v]
    return [every[int(i)] for i in rng.choice(len(every), min(size, len(every)), replace=False)]


class _ArenaView(DeviceBuffer):
    """One output's bytes inside its call's arena (freed with the arena)."""

    def __init__(self, ptr: int, nbytes: int):  # allocates nothing
        self.ptr, self.nbytes = int(ptr), int(nbytes)

    def free(self) -> None:
        self.ptr = 0


class PooledCall(ops.Call):
    """An ops.Call reused call after call: every rank's outputs in one device arena, poisoned
    with one memset (`poison`), read back with one copy and checked (`verify`).

    `verify` compares the bytes read with the last bytes that passed Call.check (at first the
    expected values, for an exact case with a finite reference): equal bytes pass the same
    check again, so only new bytes (every tolerance case's first call, a kernel whose rounding
    varies between calls, a wrong result) go through Call.check, counted in `checks`.
    """

    def __init__(self, world, case: ops.Case):
        super().__init__(world, case)
        slots = [(r, k, v) for r in range(world.world) for k, v in case.expected[r].items()]
        offsets, size = arena_layout([v.nbytes for _, _, v in slots])
        self.arena = DeviceBuffer(size)
        self.host = np.empty(size, np.uint8)
        self.slots: list[dict[str, tuple[int, np.ndarray]]] = [{} for _ in range(world.world)]
        self.pads: list[tuple[int, str, int, int]] = []  # the padding after each output
        image = np.zeros(size, np.uint8)
        for (r, k, v), off, end in zip(slots, offsets, offsets[1:] + [size]):
            self.buffers[r][k].free()
            self.buffers[r][k] = _ArenaView(self.arena.ptr + off, v.nbytes)
            self.slots[r][k] = (off, v)
            self.pads.append((r, k, off + v.nbytes, end))
            image[off:off + v.nbytes] = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
        self.args = [self._fields(r, self.buffers[r]) for r in range(world.world)]
        self.image: np.ndarray | None = None
        self.image_poison = -1
        self.checks = 0
        if case.exact and all(np.all(np.isfinite(v.astype(np.float64)))
                              for e in case.expected for v in e.values()):
            self._accept(image)  # equal bytes are equal values (Call.check's exact test)

    def _accept(self, image: np.ndarray) -> None:
        self.image = image.copy()
        self.image_poison = -1

    def _same_as_accepted(self, byte: int) -> bool:
        if self.image is None:
            return False
        if self.image_poison != byte:
            for _, _, a, b in self.pads:
                self.image[a:b] = byte
            self.image_poison = byte
        # as 8-byte words (the arena's size is a multiple of ALIGN): half the time of bytes
        return bool(np.array_equal(self.host.view(np.uint64), self.image.view(np.uint64)))

    def poison(self, byte: int) -> None:
        """Queues the poison of every output (and the padding); callers synchronize the
        context once before launching (DeviceBuffer.fill's NOTES)."""
        self.arena.fill_async(byte)

    def outputs(self, rank: int) -> dict[str, np.ndarray]:
        """Rank `rank`'s outputs from the last `verify`'s copy of the arena."""
        return {k: self.host[off:off + v.nbytes].view(v.dtype).reshape(v.shape).copy()
                for k, (off, v) in self.slots[rank].items()}

    def verify(self, byte: int) -> list[str]:
        """Reads every rank's outputs and returns the problems (empty when all match and
        the padding still holds the poison `byte`)."""
        if self.host.nbytes:
            vmm.call("cuMemcpyDtoH", self.host.ctypes.data, self.arena.ptr, self.host.nbytes)
        if self._same_as_accepted(byte):
            return []
        self.checks += 1
        problems = self.check()
        for r, k, a, b in self.pads:
            bad = np.flatnonzero(self.host[a:b] != byte)
            if bad.size:
                problems.append(f"{self.case.op} rank {r} {k}: {bad.size} bytes of padding "
                                f"written past the output's end (the first {int(bad[0])} "
                                "bytes past it)")
        if not problems:
            self._accept(self.host)
        return problems

    def free(self) -> None:
        super().free()
        self.arena.free()


def make_world(cycle: int, timeout_s: float):
    from pk_jax.testing import World

    return World(P, workspace_bytes=WORKSPACES[cycle % len(WORKSPACES)], timeout_s=timeout_s)


def soak(args, *, new_world=make_world) -> int:
    """The soak of `args` (parse_args); returns the exit status. `new_world(cycle, timeout_s)`
    makes the World of each cycle."""
    start = time.monotonic()
    deadline = start + 60.0 * args.minutes if args.minutes else float("inf")
    names = args.ops
    cases = build_pool(names, P, args.pool, args.seed, args.workers)
    by_op: dict[str, list[int]] = {op: [] for op in names}
    for i, c in enumerate(cases):
        by_op[c.op].append(i)
    print(f"soak: a pool of {len(cases)} cases ({args.pool} of each of {len(names)} ops) built "
          f"in {time.monotonic() - start:.1f} s with {args.workers} workers", flush=True)

    rng = np.random.default_rng(args.seed)
    done, cycles, wrong, errors = 0, 0, 0, 0
    per_op: Counter = Counter()
    problems: list[str] = []
    stopped = ""
    ctx = vmm.Context(0)  # the primary context outlives every World: the calls' buffers too
    ctx.__enter__()
    world, calls = None, []
    try:
        world = new_world(0, args.timeout)
        calls = [PooledCall(world, c) for c in cases]
        uses = [0] * len(calls)
        since_cycle = 0
        last_print = time.monotonic()
        print(f"soak: {len(calls)} calls on the device, P = {P}, {world.sms} SMs per rank, "
              f"{time.monotonic() - start:.1f} s", flush=True)
        while done < args.calls:
            if time.monotonic() > deadline:
                stopped = f" (stopped at the {args.minutes:g}-minute budget)"
                break
            if since_cycle >= args.cycle_every:
                world.close()
                cycles += 1
                world = new_world(cycles, args.timeout)
                for c in calls:
                    c.world = world
                since_cycle = 0
            batch = plan_batch(rng, by_op, min(args.batch, args.calls - done))
            poison_of = {}
            for i in batch:
                poison_of[i] = POISONS[uses[i] % len(POISONS)]
                calls[i].poison(poison_of[i])
            vmm.call("cuCtxSynchronize")
            try:
                for i in batch:
                    calls[i].launch(delays_ns=skew_delays(rng, P, args.skew_ns,
                                                          args.straggler_ns))
                world.synchronize()
            except (ValueError, RuntimeError) as e:  # a refused launch (ValueError), a timeout
                # or a trap (EmulatorError): after a trap the context is unusable
                errors += 1
                mix = dict(Counter(calls[i].case.op for i in batch))
                problems.append(f"error in a batch of {mix}: {type(e).__name__}: {e}")
                print(problems[-1], flush=True)
                stopped = " (stopped at the error)"
                break
            for i in batch:
                uses[i] += 1
                found = calls[i].verify(poison_of[i])
                per_op[calls[i].case.op] += 1
                if found:
                    wrong += 1
                    if len(problems) < args.show:
                        problems.append(f"call {done + 1} ({calls[i].case.op}): {found[0]}")
                        print(f"WRONG: {problems[-1]}", flush=True)
                done += 1
                since_cycle += 1
            now = time.monotonic()
            if now - last_print >= args.progress_s:
                last_print = now
                print(f"soak: {done}/{args.calls} calls, {cycles} world cycles, {wrong} wrong, "
                      f"{now - start:.0f} s", flush=True)
    except (ValueError, RuntimeError) as e:  # making a World or a call failed (CudaError)
        errors += 1
        problems.append(f"{type(e).__name__}: {e}")
        print(f"error: {problems[-1]}", flush=True)
        stopped = stopped or " (stopped at the error)"
    finally:
        if not errors:  # after a trap the context is unusable: the process ends instead
            for c in calls:
                c.free()
            if world is not None:
                world.close()
            ctx.__exit__(None, None, None)
            ctx.release()
    elapsed = time.monotonic() - start
    checks: Counter = Counter()
    for c in calls:
        checks[c.case.op] += c.checks
    print("soak: calls per op (of them checked by Call.check: bytes not seen before): "
          + ", ".join(f"{op} {per_op[op]} ({checks[op]})" for op in names), flush=True)
    if not done:
        errors = max(errors, 1)
        print("soak: no call ran", flush=True)
    print(f"soak: {done} calls, {len(names)} ops, {cycles} world cycles, {wrong} wrong, "
          f"{errors} errors, {elapsed:.1f} s{stopped}", flush=True)
    return 1 if wrong or errors else 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000, help="calls in all (default 100000)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="stop after this many minutes (pool building included) and still "
                         "print the summary (default: no limit)")
    ap.add_argument("--ops", type=lambda s: [o for o in s.split(",") if o],
                    default=list(SOAK_OPS), help="comma-separated ops (default: all: "
                    + ",".join(SOAK_OPS) + ")")
    ap.add_argument("--pool", type=int, default=8, help="cases per op (default 8)")
    ap.add_argument("--batch", type=int, default=32,
                    help="calls queued between host synchronizations (default 32)")
    ap.add_argument("--cycle-every", type=int, default=5000,
                    help="calls between World close / re-create cycles (default 5000)")
    ap.add_argument("--skew-ns", type=int, default=20_000,
                    help="each rank's random start delay, up to (default 20000)")
    ap.add_argument("--straggler-ns", type=int, default=1_000_000,
                    help="a straggler's extra delay, up to (default 1000000)")
    ap.add_argument("--timeout", type=float,
                    default=float(os.environ.get("PK_JAX_TIMEOUT_S", "10")),
                    help="the kernels' wait bound, s (default PK_JAX_TIMEOUT_S or 10)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes building the pool (default min(16, CPUs))")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--progress-s", type=float, default=15.0,
                    help="seconds between progress lines (default 15)")
    ap.add_argument("--show", type=int, default=20, help="wrong results printed (default 20)")
    args = ap.parse_args(argv)
    unknown = [o for o in args.ops if o not in SOAK_OPS]
    if unknown:
        ap.error(f"--ops: unknown {unknown}; choose from {','.join(SOAK_OPS)}")
    for name in ("calls", "pool", "batch", "cycle_every", "workers"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


if __name__ == "__main__":
    sys.exit(soak(parse_args()))

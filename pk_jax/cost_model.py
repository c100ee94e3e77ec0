"""Cost model of the fused tensor-parallel GEMM ops (gemm_rs, ag_gemm, gemm_ar).

For one call it predicts, in microseconds,

    T = T_launch + max(T_comp, T_mem, T_comm) + T_non_overlap + T_sync

and picks how the op runs:

- `mode`: "fused" (the overlapped kernel), "serial" (pk.matmul, then the pk collective: the
  fallback when overlap cannot pay for its fixed costs) or "local" (P = 1: gemm_rs and gemm_ar
  are one matmul kernel writing the output, ag_gemm is pk.matmul and returns x as the gather).
- `num_comm_sms`: communication SMs of ag_gemm (0 for gemm_rs / gemm_ar, whose storers push
  their own tiles), chosen to minimise T: more SMs pull faster but leave fewer for the GEMM.

Terms (every byte count uses the dtype's itemsize; M = rows of the whole product, K = the
contraction length each device multiplies, N = output columns):

- T_comp: 2 M N K / (peak x GEMM efficiency x compute SMs / SMs), and for the fused kernels
  x FUSED_EFFICIENCY (their GEMM rate against pk.matmul's, measured at P = 1).
- T_mem: the GEMM's HBM traffic (A, B once, C once) / HBM bandwidth.
- T_comm: what crosses NVLink while the GEMM runs: ag_gemm's communication SMs copy M/P x K
  rows into the workspace (P > 1) and the other ranks' (P-1) M/P x K rows into the gathered x
  over NVLink (none at P = 1): the slower of the NVLink part and everything at num_comm_sms x
  the per-SM copy bandwidth. At P > 1 GATHER_EXPOSED (half) of ag_gemm's T_comm is also counted
  in T_non_overlap: measured in the rank emulator, its fused kernel hides only part of it.
- ag_gemm's own M/P x K rows of the gathered x (at P = 1 all of it): an HBM read and write in
  T_mem; the communication SMs copy them during the GEMM (T_comp), and what they have not
  copied by then is copied by every SM after the last tile, at the copy rate, in T_non_overlap.
  Too few communication SMs leave much of it to that tail; too many cost the GEMM SMs.
- T_non_overlap: work before the first or after the last tile: ag_gemm waits for the first
  remote row block (none at P = 1) and copies the rest of its own rows (above). At P = 1 (fused
  forced) gemm_rs and gemm_ar store their tiles straight into y (no owner buffer, no enter or
  leave kernel): none of it.
- T_sync: barriers x one NVLink round trip; T_launch: kernels x launch cost.
- gemm_rs and gemm_ar at P > 1 take the form of the sequence- and expert-parallel ops below:
  T_comp = max(T_comp, T_mem) of pk.matmul, T_comm = the serial path's collective, and
  T_non_overlap = a T_comp + b T_comm (FUSED_OVERHEAD[op] = (a, b), fitted on the rank
  emulator's scale-model rows): what the fused kernel adds to its GEMM (its pushes from the
  epilogue, the owner buffer's zero-fill and copy-out, the flags) and what it leaves exposed of
  the collective.

"serial" is T_launch + max(T_comp, T_mem) at all SMs + the collective as pk's collective engine
runs it (`collective_phases`): a staging copy into the symmetric workspace, then the pulls from
the peers, each phase at the slower of its HBM traffic at the copy rate and its peer bytes over
NVLink, and never less than COLLECTIVE_FLOOR_US a call.

"auto" (P > 1) runs fused only where the model predicts it faster than serial by more than its
own error (`margin`: for ag_gemm its measured error on the fused kernel's time,
FUSED_MARGIN[op]; for the overlap form, OVERLAP_MARGIN): a near-tie goes to the simpler serial
path.

The fp8 forms (gemm_rs and gemm_ar with fp8 operands, `fp8` = their scaling, "tensor" or
"block"): operands of 1 byte, a bf16 output (the collective moves bf16), and the GEMM rate
times FP8_SPEEDUP[scaling], the fp8 kernel's measured rate against pk.matmul's. Their other
constants are the bf16 forms': not fitted on fp8 rows.

Overrides: the context manager `override(mode=..., num_comm_sms=...)`, which is part of what
jit caches on (a jitted function called inside and outside the block is traced for each), or
PK_JAX_TP_MODE / PK_JAX_TP_COMM_SMS in the environment, fixed at the first `pk.init`. The
constants below are from the data sheets, the H200 GEMM efficiency from pk.matmul's measured
rate (bench/results/matmul_notes.md) and the copy rate measured on the H200 (see
GPU.copy_gbps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax

OPS = ("gemm_rs", "ag_gemm", "gemm_ar")
MODES = ("auto", "fused", "serial", "local")


@dataclasses.dataclass(frozen=True)
class GPU:
    """Throughputs and latencies of one GPU model (dense bf16/fp16)."""

    name: str
    sms: int
    peak_tflops: float        # dense bf16 tensor-core peak
    gemm_efficiency: float    # achieved / peak for large GEMMs
    hbm_gbps: float
    nvlink_gbps: float        # per direction, per GPU (NVLink 4: 18 links x 25 GB/s)
    pull_gbps_per_sm: float   # bulk copies of one communication SM (ag_gemm), bytes written
    launch_us: float          # one more kernel on the stream
    barrier_us: float         # one signal round trip over NVLink
    copy_gbps: float          # HBM bytes read + written per second by a copy-like pass


# copy_gbps: the H200's device-to-device copy rate, counting bytes read plus written; the
# H100's is that scaled by its HBM (3.35 / 4.8 TB/s, the data sheets'; not measured). It is the
# rate of every pass that only moves bytes through HBM: the collectives' staging and pulls (the
# serial path) and gemm_rs / gemm_ar's zero-fill and copy-out (fused gemm_rs at P = 1 with the
# full protocol forced took pk.matmul's time plus 3 M N bytes at this rate; at the data sheet's
# HBM rate part of it stayed unexplained).
# pull_gbps_per_sm: one communication SM's bulk-copy ring (pk/comm_ops.cuh), bytes written, from
# ag_gemm forced fused at P = 1, where the comm SMs copy all of x into x_full; the H100 is
# assumed the same.
# measured: bench/results/tp_notes.md, "Measurements moved from code comments (issue 37)".
H100 = GPU("H100", 132, 989.0, 0.66, 3350.0, 450.0, 34.0, 3.0, 3.0, 3300.0 * 3350.0 / 4800.0)
H200 = GPU("H200", 132, 989.0, 0.69, 4800.0, 450.0, 34.0, 3.0, 3.0, 3300.0)

COMM_SMS_CANDIDATES = (2, 4, 8, 12, 16, 20, 24, 32)

# The fused kernels' GEMM rate against pk.matmul's, forced fused at P = 1 where nothing crosses
# ranks (bench/bench_tp.py --quick on the H200, geomean over its six shapes per op):
# ag_gemm's loader also places its A tiles and waits on row-block flags, so it multiplies slower.
# ag_gemm's (its comm SMs copying its own rows) is set to fit its shapes of about 1 ms or more
# (4096^3, where the copy outlasts the GEMM, is not a GEMM-rate question).
# measured: bench/results/tp_notes.md, "Measurements moved from code comments (issue 37)".
FUSED_EFFICIENCY = {"gemm_rs": 0.95, "ag_gemm": 0.94, "gemm_ar": 0.96}

# "auto" picks fused ag_gemm only where fused's predicted time x (1 + FUSED_MARGIN[op]) is below
# serial's (`auto_pick`). FUSED_MARGIN[op] is the model's largest error on that op's fused
# kernel time measured on the H200 with nothing crossing ranks: |measured / predicted - 1| over
# the op's P = 1 forced-fused rows of bench_tp (bench/results/<op>.jsonl, world 1, the rows
# since the kernel the model costs at P = 1 landed, those predicted at 100 us or more), each
# shape's measured time the median of its runs (one run alone moves a shape by several %).
# measured: bench/results/tp_notes.md, "Measurements moved from code comments (issue 37)".
# `python bench/check_cost_model.py` recomputes it (fused_margin) and tests/test_cost_model.py
# checks the constant against it. gemm_rs and gemm_ar, whose fused time at P > 1 is the overlap
# form fitted on the emulator's rows (TP_OVERLAP_FORM), take that form's OVERLAP_MARGIN.
FUSED_MARGIN = {"ag_gemm": 0.044}
TP_OVERLAP_FORM = ("gemm_rs", "gemm_ar")


# The share of ag_gemm's gather (T_comm) that its fused kernel does not hide at P > 1: the
# compute blocks start on their own rows and then wait, row block by row block, for the gather.
# Measured in the rank emulator (bench_emulated --comm-sms-sweep 2,4,8, the GEMM at the
# partition's measured rate) as (fused - the GEMM on the compute SMs) / T_comm: the kernel hides
# about half. Until 861c0cf the model counted all of it (1.0). Fit on the emulator's ag_gemm
# cases that check_cost_model also judges (an earlier run): not an independent check.
# measured: bench/results/emulated_notes.md, "Measurements moved from code comments (issue 37)".
GATHER_EXPOSED = 0.5

# The least time of one call of pk's collective engine at P > 1 (all_gather, reduce_scatter,
# all_reduce, all_to_all), whatever its bytes: below it the bandwidth terms of
# `collective_phases` underpredict short messages. Fitted by bench/fit_decider.py on the
# serial collectives timed alone (t_comm_us) of the TP rows of bench/results/overlap.jsonl (all
# tags), each taken to a node's time by the row's link rate. It is what the scale model
# measures; the rows point at the emulator's per-rank launch path rather than NVLink, so a real
# node may well pay less (the rows and the fit: bench/results/overlap.md, "The decider, second
# round").
COLLECTIVE_FLOOR_US = 48.5


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call runs, and what the model predicts for it."""

    mode: str
    num_comm_sms: int
    predicted_us: float
    terms: dict


_local = threading.local()

# The overrides join jit's cache key through a user context (jax >= 0.8, below pk_jax's floor).
_jit_key = jax.make_user_context(None)


@contextlib.contextmanager
def override(*, mode: str | None = None, num_comm_sms: int | None = None):
    """Forces the mode and/or num_comm_sms of the fused ops called inside the block.

    The override is part of what jit caches on: a jitted function called inside the block is
    traced for it, and traced again (or taken from the cache) outside.

    Args:
        mode: "fused", "serial", "local" (only at P = 1) or "auto".
        num_comm_sms: communication SMs of ag_gemm (1..128).

    Raises:
        ValueError: an unknown mode or a num_comm_sms out of range.
    """
    _validate(mode, num_comm_sms, "pk_jax.cost_model.override")
    prev = getattr(_local, "stack", [])
    _local.stack = prev + [(mode, num_comm_sms)]
    try:
        with _jit_key(tuple(_local.stack)):
            yield
    finally:
        _local.stack = prev


def _validate(mode, num_comm_sms, where: str) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"{where}: mode={mode!r} is not one of {', '.join(MODES)}.")
    if num_comm_sms is not None and (not isinstance(num_comm_sms, int) or
                                     not 1 <= num_comm_sms <= 128):
        raise ValueError(f"{where}: num_comm_sms={num_comm_sms!r} must be an int in 1..128.")


def overrides() -> tuple[str | None, int | None]:
    """The forced (mode, num_comm_sms) in effect here: the innermost override, else the
    environment; None where nothing is forced."""
    from pk_jax.runtime import state

    fixed = state.settings()
    mode = fixed.tp_mode or None
    try:
        sms = int(fixed.tp_comm_sms) if fixed.tp_comm_sms else None
    except ValueError:
        sms = fixed.tp_comm_sms
    _validate(mode, sms, "PK_JAX_TP_MODE / PK_JAX_TP_COMM_SMS")
    for m, s in getattr(_local, "stack", []):
        mode = m if m is not None else mode
        sms = s if s is not None else sms
    return (None if mode == "auto" else mode), sms


# The fused kernels besides the TP GEMMs that run where the decider (`choose`) or an override
# picks them (`_backend.route(..., overlap=...)`), and the setting that overrides each, fixed
# at pk.init. The ring kernels are not among them: the ring has no serial form of kernels yet
# (its serial form is the jax.lax ring), so its fused kernels run wherever they take the
# operands.
ROUTED_OVERLAP_OPS = ("ulysses_attn", "ulysses_attn_bwd", "moe_dispatch_gemm", "moe_gemm_combine")
# PK_JAX_ULYSSES_FUSED: "auto" the decider's choice per pass and shape, "0" the composed kernels
# both ways, "1" the fused forward (its backward composed), "bwd" the fused backward after the
# composed forward. PK_JAX_MOE_FUSED: "auto", "1" both fused, "0" both composed.
ULYSSES_FUSED_MODES = ("auto", "0", "1", "bwd")
MOE_FUSED_MODES = ("auto", "0", "1")
_FORCED_BY_SETTING = {
    "ulysses_attn": {"0": "serial", "1": "fused", "bwd": "serial"},
    "ulysses_attn_bwd": {"0": "serial", "1": "serial", "bwd": "fused"},
    "moe_dispatch_gemm": {"0": "serial", "1": "fused"},
    "moe_gemm_combine": {"0": "serial", "1": "fused"},
}


@contextlib.contextmanager
def override_ops(ops: tuple[str, ...], mode: str):
    """Forces `mode` ("fused" or "serial") for the calls of `ops` (ROUTED_OVERLAP_OPS) traced
    inside the block, whatever their setting says; part of what jit caches on, like
    `override`.

    Raises:
        ValueError: an op not in ROUTED_OVERLAP_OPS, or another mode.
    """
    bad = [op for op in ops if op not in ROUTED_OVERLAP_OPS]
    if bad or mode not in ("fused", "serial"):
        raise ValueError(f"pk_jax.cost_model.override_ops: ops must be among "
                         f"{', '.join(ROUTED_OVERLAP_OPS)} (got {bad or ops}) and mode 'fused' "
                         f"or 'serial' (got {mode!r}).")
    prev = getattr(_local, "ops_stack", [])
    _local.ops_stack = prev + [(tuple(ops), mode)]
    try:
        with _jit_key(("ops",) + tuple(_local.ops_stack)):
            yield
    finally:
        _local.ops_stack = prev


def overlap_override(op: str) -> str | None:
    """The forced form ("fused" or "serial") of an op of ROUTED_OVERLAP_OPS here: the innermost
    `override_ops` block naming it, else its setting (PK_JAX_ULYSSES_FUSED, PK_JAX_MOE_FUSED);
    None where the decider chooses.

    Raises:
        ValueError: a setting outside its values (ULYSSES_FUSED_MODES, MOE_FUSED_MODES).
    """
    for ops, mode in reversed(getattr(_local, "ops_stack", [])):
        if op in ops:
            return mode
    from pk_jax.runtime import state

    fixed = state.settings()
    if op.startswith("ulysses"):
        name, env, value = "ulysses_attention", "PK_JAX_ULYSSES_FUSED", fixed.ulysses_fused
        modes = ULYSSES_FUSED_MODES
        meaning = ("auto or unset: the decider's choice; 0: the composed kernels; 1: the fused "
                   "forward; bwd: the fused backward")
    else:
        name, env, value, modes = op, "PK_JAX_MOE_FUSED", fixed.moe_fused, MOE_FUSED_MODES
        meaning = "auto or unset: the decider's choice; 0: composed; 1: fused"
    if value not in modes:
        raise ValueError(f"pk.{name}: {env}={value!r} is not one of {', '.join(modes)} "
                         f"({meaning}). Set it to one of them, then call pk.shutdown() and "
                         "pk.init(mesh).")
    return _FORCED_BY_SETTING[op].get(value)


def gpu_for(device_kind: str) -> GPU:
    """The constants for a JAX device_kind string (H200, else H100)."""
    return H200 if "H200" in device_kind else H100


# The pk all_reduce runs one-shot up to this many bytes and always at P <= 2, two-shot above
# (cuda/kernels/all_reduce.cuh, ONESHOT_MAX_BYTES).
ALL_REDUCE_ONESHOT_MAX_BYTES = 512 * 1024


def collective_phases(op: str, out_bytes: float, shard_bytes: float,
                      p: int) -> list[tuple[float, float]]:
    """The serial path's collective as pk's collective engine runs it (pk/collective.cuh), phase by
    phase: (HBM bytes read + written, bytes pulled from peers) per rank.

    Every round of the engine stages its input into the symmetric workspace (a local copy: read
    x, write the workspace), meets the peers at a barrier, then pulls from every peer's workspace
    (SUM: reads the P copies of my slice, writes it; GATHER: reads and writes the P blocks); the
    two-shot all_reduce sums my slice into the workspace, meets the peers again and gathers.
    Nothing is pulled before the barrier, so the phases follow one another. Reads of a peer's
    workspace load that peer's HBM, but every rank reads its peers as much as they read it, so
    the count per rank is also what each rank's HBM serves.

    gemm_rs: reduce_scatter of the M x N partial product (out_bytes); gemm_ar: all_reduce of it;
    ag_gemm: all_gather of the M/P x K shard (shard_bytes).
    """
    if op == "gemm_rs":
        return [(2 * out_bytes, 0.0), (out_bytes + out_bytes / p, (p - 1) / p * out_bytes)]
    if op == "gemm_ar":
        if p <= 2 or out_bytes <= ALL_REDUCE_ONESHOT_MAX_BYTES:
            return [(2 * out_bytes, 0.0), ((p + 1) * out_bytes, (p - 1) * out_bytes)]
        return [(2 * out_bytes, 0.0), (out_bytes + out_bytes / p, (p - 1) / p * out_bytes),
                (2 * out_bytes, (p - 1) / p * out_bytes)]
    return [(2 * shard_bytes, 0.0), (2 * p * shard_bytes, (p - 1) * shard_bytes)]


def collective_us(op: str, out_bytes: float, shard_bytes: float, p: int, gpu: GPU) -> float:
    """Microseconds of the serial path's collective: each phase of collective_phases at the
    slower of its HBM traffic at copy_gbps and its pulls at the link rate, and at P > 1 never
    less than COLLECTIVE_FLOOR_US.

    On NVLink the pulls bind (e.g. reduce_scatter of 128 MiB at P = 8: 261 us of link after 81 us
    of staging); in the rank emulator, where a rank's link is the shared HBM, the HBM traffic
    does. Short messages take a per-call time that the bandwidth terms miss; where it comes from
    (the emulator's launch path or the engine) the rows cannot tell, so it enters as the floor
    the scale-model rows measure (bench/results/emulated_notes.md, "Measurements moved from code
    comments (issue 37)"; bench/results/overlap.md, "The decider, second round"). At P = 1
    (bench_collectives, kernels forced) a 4 KiB collective costs what XLA's own dispatch does,
    within the noise.
    """
    hbm, nvl = gpu.copy_gbps * 1e9, gpu.nvlink_gbps * 1e9
    us = sum(max(h / hbm, x / nvl) for h, x in collective_phases(op, out_bytes, shard_bytes, p)
             ) * 1e6
    return max(us, COLLECTIVE_FLOOR_US) if p > 1 else us


# The fp8 GEMM's rate against pk.matmul's (bf16), per scaling: the geometric means over
# bench_fp8.py's grid on an H100 (bench/results/fp8_notes.md), taken for the H200 too.
FP8_SPEEDUP = {"tensor": 1.7, "block": 0.89}
# The fp8 forms as `choose` names them, each with its bf16 op's model at the fp8 rates (the ops'
# kernels: pk_gemm_rs_fp8, pk_gemm_ar_fp8, pk_ag_gemm_fp8).
FP8_OPS = ("gemm_rs_fp8", "gemm_ar_fp8", "ag_gemm_fp8")
# all_gather_gemm's fp8 form at P > 1: "auto" runs the fused kernel (the comm SMs still the
# model's), a constant rule. ag_gemm's model at the fp8 rates picked right in 5 of 10 non-tied
# cases of its first validation round (decider_cases_ag_fp8.json: it predicts serial at large K,
# where the fused fp8 kernel won), always fused in 9; the rule was chosen on those rows, so the
# second round (decider_cases_ag_fp8_2.json, committed before its run) judges it.
# measured: bench/results/fp8_notes.md, "The fused fp8 all_gather_gemm".
FP8_GATHER_FUSED = True


def predict(op: str, m: int, n: int, k: int, p: int, *, mode: str, num_comm_sms: int = 0,
            itemsize: int = 2, gpu: GPU = H200, fp8: str | None = None) -> Plan:
    """The predicted time of one call in `mode` (see the module docstring for the terms);
    `fp8`: the scaling of an fp8 form, whose operands are 1 byte and output bf16."""
    if op not in OPS:
        raise ValueError(f"pk_jax.cost_model: op={op!r} is not one of {OPS}.")
    if fp8 is not None and fp8 not in FP8_SPEEDUP:
        raise ValueError(f"pk_jax.cost_model: fp8={fp8!r} for {op}: the fp8 forms are scaled by "
                         f"{tuple(FP8_SPEEDUP)}.")
    us = 1e6
    flops = 2.0 * m * n * k
    rate = gpu.peak_tflops * 1e12 * gpu.gemm_efficiency * (FP8_SPEEDUP[fp8] if fp8 else 1.0)
    hbm, nvl, copy = gpu.hbm_gbps * 1e9, gpu.nvlink_gbps * 1e9, gpu.copy_gbps * 1e9
    mp = -(-m // p)
    out_size = 2 if fp8 else itemsize
    itemsize = 1 if fp8 else itemsize
    gemm_bytes = itemsize * (m * k + k * n) + out_size * m * n
    out_bytes = out_size * m * n
    t = {"launch": 0.0, "comp": 0.0, "mem": gemm_bytes / hbm * us, "comm": 0.0,
         "non_overlap": 0.0, "sync": 0.0}
    if mode == "local" or p == 1 and mode != "fused":
        t["launch"] = gpu.launch_us
        t["comp"] = flops / rate * us
    elif mode == "serial":
        t["launch"] = 2 * gpu.launch_us
        t["comp"] = flops / rate * us
        t["non_overlap"] = collective_us(op, out_bytes, mp * k * itemsize, p, gpu)
        t["sync"] = 2 * gpu.barrier_us
    elif mode == "fused":
        c = num_comm_sms if op == "ag_gemm" else 0
        if c >= gpu.sms:  # no SM left for the GEMM (a small GPU or an emulated partition)
            return Plan(mode, c, float("inf"), dict(t))
        t["comp"] = flops / (rate * (gpu.sms - c) / gpu.sms * FUSED_EFFICIENCY[op]) * us
        if op in ("gemm_rs", "gemm_ar") and p == 1:  # direct: the epoch kernel + the GEMM
            t["launch"] = 2 * gpu.launch_us
        elif op in TP_OVERLAP_FORM:  # pk.matmul's time and the collective's, overlapped
            a, b = FUSED_OVERHEAD[op]
            t["comp"] = max(flops / rate * us, t["mem"])
            t["comm"] = collective_us(op, out_bytes, 0.0, p, gpu)
            t["non_overlap"] = a * t["comp"] + b * t["comm"]
            t["launch"] = 4 * gpu.launch_us
            t["sync"] = (4 if op == "gemm_ar" else 3) * gpu.barrier_us
        else:
            pull = max(c, 1) * gpu.pull_gbps_per_sm * 1e9
            # my shard staged for the peers and the peers' rows of the gather (P > 1 only)
            moved = p * mp * k * itemsize if p > 1 else 0
            t["comm"] = max((p - 1) * mp * k * itemsize / nvl, moved / pull) * us
            own = mp * k * itemsize  # my rows of x_full: read x, write (T_mem), copied last
            t["mem"] += 2 * own / hbm * us
            own_tail = 2 * max(0.0, own - pull * t["comp"] / us) / copy * us
            first_block = 128 * k * itemsize / (gpu.pull_gbps_per_sm * 1e9) if p > 1 else 0.0
            # NOTES: partly overlapped (GATHER_EXPOSED): the compute blocks wait on the row
            # blocks' flags; counted in full (the kernels before 861c0cf) or not at all, the
            # model picked worse on the emulator's rows (bench/results/emulated_notes.md).
            t["non_overlap"] = (first_block * us + GATHER_EXPOSED * t["comm"] if p > 1
                                else 0.0) + own_tail
            t["launch"] = 2 * gpu.launch_us
            t["sync"] = 3 * gpu.barrier_us if p > 1 else 0.0  # P = 1: barriers with myself
    else:
        raise ValueError(f"pk_jax.cost_model: mode={mode!r} is not fused, serial or local.")
    total = (t["launch"] + max(t["comp"], t["mem"], t["comm"]) + t["non_overlap"] + t["sync"])
    return Plan(mode, num_comm_sms if mode == "fused" and op == "ag_gemm" else 0, total, t)


def plan(op: str, m: int, n: int, k: int, p: int, *, itemsize: int = 2,
         gpu: GPU = H200, fp8: str | None = None) -> Plan:
    """How one call runs, after the overrides: the mode forced, else at P = 1 "local", else the
    faster of fused and serial as predicted, fused only beyond `margin(op)` (`auto_pick`).

    Args:
        op: "gemm_rs", "ag_gemm" or "gemm_ar".
        m: rows of the whole product (M; ag_gemm: P x the local rows).
        n: output columns.
        k: the contraction length each device multiplies (K/P for gemm_rs and gemm_ar).
        p: the axis size.
        itemsize: bytes per element.
        gpu: the GPU constants.
        fp8: for the fp8 forms of gemm_rs and gemm_ar, their scaling ("tensor" or "block").

    Returns:
        A Plan: mode, num_comm_sms, predicted microseconds and the terms.
    """
    mode, sms = overrides()
    if mode == "local" and p != 1:
        mode = None  # "local" exists only at P = 1; a forced local means "auto" elsewhere
    if mode is None:
        modes = ("local",) if p == 1 else ("fused", "serial")
    else:
        modes = (mode,)
    fastest = {}  # the fastest prediction per mode
    for md in modes:
        cands = (sms,) if sms is not None else COMM_SMS_CANDIDATES
        for c in (cands if md == "fused" and op == "ag_gemm" else (0,)):
            pl = predict(op, m, n, k, p, mode=md, num_comm_sms=c, itemsize=itemsize, gpu=gpu,
                         fp8=fp8)
            if md not in fastest or pl.predicted_us < fastest[md].predicted_us:
                fastest[md] = pl
    if len(modes) == 2 and op == "ag_gemm" and fp8 is not None and FP8_GATHER_FUSED:
        best = fastest["fused"]
    elif len(modes) == 2:
        best = auto_pick(op, fastest["fused"], fastest["serial"])
    else:
        best = fastest[modes[0]]
    if best.mode == "fused" and op == "ag_gemm" and best.num_comm_sms == 0:
        best = dataclasses.replace(best, num_comm_sms=sms or 8)
    return best


def margin(op: str) -> float:
    """How much faster than serial "auto" wants op's fused predicted at P > 1, as a fraction of
    fused's time: the error of the model that predicts it (FUSED_MARGIN for ag_gemm's kernel
    model, OVERLAP_MARGIN for the overlap form of the other ops)."""
    return FUSED_MARGIN.get(op, OVERLAP_MARGIN)


def auto_pick(op: str, fused: Plan, serial: Plan) -> Plan:
    """What "auto" runs given op's best fused and serial plans: fused only where it is predicted
    faster by more than `margin(op)` of its own time, else serial."""
    return fused if fused.predicted_us * (1 + margin(op)) < serial.predicted_us else serial


# ---------------------------------------------------------------------------------------------
# Sequence and expert parallelism: ring attention (forward, backward), Ulysses (forward,
# backward), the fused MoE GEMMs. The same question as the TP GEMMs' "auto": the fused kernel
# or its serial form (ring: all_gather of K/V, pk.attention per block, the merge; Ulysses:
# all_to_all, pk.attention, all_to_all; MoE: dispatch then grouped_matmul, grouped_matmul then
# combine). The serial form's two parts are predicted from the shape at the GPU's measured
# rates (`overlap_parts`); the fused kernel's time as
#
#     fused = max(t_compute, t_comm) + (a + c 2/P) t_compute + (b + d 2/P) t_comm
#
# (FUSED_OVERHEAD[op] = (a, b), PIPELINE_OVERHEAD[op] = (c, d)): what the kernel fails to hide
# of each part, split in two. (a, b) is a share that does not depend on P: the fused kernel's
# slower compute, the exchange it leaves outside the overlap (the Ulysses backward's tail pulls
# dq, dk, dv after its main kernel). (c, d) is a share that falls as 2/P (1 at P = 2): the ring
# kernels exchange in P steps and the fused Ulysses kernels in one piece per source rank, each
# overlapped with the compute on an earlier one, so what waits outside the overlap (the first
# piece in, the last piece out) is about one piece. The MoE kernels pipeline by expert, not by
# rank; their rows also hide more at larger P, and the fit gives them a 2/P share without that
# reason being established. The first two rounds' form (c = d = 0) had one share for every P,
# which turned the fused Ulysses backward and MoE dispatch + GEMM, faster at P = 4, 8, into
# serial picks. Both pairs are fitted together, >= 0 (bench/fit_decider.py).
# gemm_rs and gemm_ar at P > 1 take the flat form (their parts pk.matmul and the collective:
# `predict`). "auto" picks fused where fused x (1 + OVERLAP_MARGIN) < t_compute + t_comm. The
# shape dicts are bench/bench_overlap.py's (per device).

OVERLAP_OPS = ("ring_attn", "ring_attn_bwd", "ulysses_attn", "ulysses_attn_bwd",
               "moe_dispatch_gemm", "moe_gemm_combine")

# The kernels' rates on one H200 (bf16, head dim 128), each inside its measured range:
# pk.attention's forward, its backward alone (2.5 forwards of FLOPs), pk.grouped_matmul.
# measured: bench/results/attention_notes.md and grouped_matmul_notes.md, "Measurements moved
# from code comments (issue 37)".
ATTN_FWD_TFLOPS = 530.0
ATTN_BWD_TFLOPS = 440.0
GROUPED_TFLOPS = 600.0

# Fitted by bench/fit_decider.py, least squares on fused / serial (every coefficient >= 0) over
# every scale-model row of bench/results/overlap.jsonl (tags "overlap", "overlap-full",
# "decider-validation", "decider-validation-2"): gemm_rs and gemm_ar in the flat form, the
# ops below in the flat + 2/P form. Committed before the third round's cases
# (bench/results/decider_cases_3.json) and judged on them (bench/check_decider.py); the
# leave-one-shape-out scores: bench/results/overlap.md, "round 3".
FUSED_OVERHEAD = {"gemm_rs": (0.292, 0.049), "gemm_ar": (0.456, 0.071),
                  "ring_attn": (0.298, 1.954), "ring_attn_bwd": (0.0, 0.715),
                  "ulysses_attn": (0.456, 1.702), "ulysses_attn_bwd": (0.0, 0.0),
                  "moe_dispatch_gemm": (0.033, 0.186), "moe_gemm_combine": (0.0, 0.0)}
PIPELINE_OVERHEAD = {"ring_attn": (0.0, 0.0), "ring_attn_bwd": (0.096, 3.393),
                     "ulysses_attn": (0.0, 0.0), "ulysses_attn_bwd": (0.076, 1.251),
                     "moe_dispatch_gemm": (0.004, 0.258), "moe_gemm_combine": (0.0, 0.181)}
OVERLAP_MARGIN = 0.03


def _all_to_all_us(nbytes: float, p: int, gpu: GPU) -> float:
    """pk's all_to_all of `nbytes` per rank: staged (read, write), then 1/P pulled from each
    peer (read, write), each phase at the slower of its HBM traffic and its peer bytes, never
    less than COLLECTIVE_FLOOR_US (as `collective_us`)."""
    hbm, nvl = gpu.copy_gbps * 1e3, gpu.nvlink_gbps * 1e3  # bytes per us
    us = 2 * nbytes / hbm + max(2 * nbytes / hbm, (p - 1) / p * nbytes / nvl)
    return max(us, COLLECTIVE_FLOOR_US) if p > 1 else us


def overlap_parts(op: str, shape: dict, p: int, *, itemsize: int = 2,
                  gpu: GPU = H200) -> tuple[float, float]:
    """Microseconds of the serial form's compute and communication parts of one call of an
    OVERLAP_OPS op on one device of a P-device axis.

    shape: ring and Ulysses {"s": whole sequence, "h", "hkv" (default h), "d", "causal",
    "b" (default 1)}; MoE {"t": tokens per device, "k", "experts", "h", "hidden"}.
    """
    if op not in OVERLAP_OPS:
        raise ValueError(f"pk_jax.cost_model: op={op!r} is not one of {OVERLAP_OPS}.")
    hbm, nvl = gpu.copy_gbps * 1e3, gpu.nvlink_gbps * 1e3
    if op.startswith("moe"):
        t, k, h, f = shape["t"], shape["k"], shape["h"], shape["hidden"]
        rows = t * k  # slots sent (uniform routing keeps them all at 1.25x capacity)
        tc = 2.0 * rows * h * f / (GROUPED_TFLOPS * 1e6)
        moved = (p - 1) / p * rows * h * itemsize
        if op == "moe_dispatch_gemm":  # read x, write the slots at their experts' ranks
            local = (t + rows) * h * itemsize
        else:  # read the slots, write out
            local = (rows + t) * h * itemsize
        return tc, max(local / hbm, moved / nvl) + 2 * gpu.launch_us + 2 * gpu.barrier_us
    b, s, h, d = shape.get("b", 1), shape["s"], shape["h"], shape["d"]
    hkv = shape.get("hkv", h)
    causal = bool(shape.get("causal", False))
    sl = s // p
    bwd = op.endswith("_bwd")
    rate = (ATTN_BWD_TFLOPS if bwd else ATTN_FWD_TFLOPS) * 1e6
    flops = (10 if bwd else 4) * b * sl * s * h * d
    q_bytes, kv_bytes = b * sl * h * d * itemsize, b * sl * hkv * d * itemsize
    if op.startswith("ring"):
        # contiguous layout: the last rank sees every block, the diagonal one half-masked
        tc = flops * ((p - 0.5) / p if causal else 1.0) / rate
        shard = 2 * kv_bytes
        tm = collective_us("ag_gemm", 0.0, shard, p, gpu)
        if bwd:  # the blocks' dK / dV partials home: a reduce-scatter of P blocks
            tm += collective_us("gemm_rs", p * shard, 0.0, p, gpu)
        else:  # the merge of P partial (o, lse): read them, write o
            tc += (p + 1) * (q_bytes + b * h * sl * 4) / hbm
        return tc, tm
    tc = flops * (0.5 if causal else 1.0) / rate
    tensors = [q_bytes, kv_bytes, kv_bytes, q_bytes]  # q, k, v there; o back
    if bwd:  # q, dO, k, v, (lse, delta) there; dq, dk, dv back
        tensors = [q_bytes, q_bytes, kv_bytes, kv_bytes, 2 * b * h * sl * 4, q_bytes,
                   kv_bytes, kv_bytes]
    tm = sum(_all_to_all_us(x, p, gpu) + gpu.launch_us + gpu.barrier_us for x in tensors)
    return tc, tm


def predict_overlap(op: str, shape: dict, p: int, *, itemsize: int = 2,
                    gpu: GPU = H200) -> tuple[float, float]:
    """(fused, serial) microseconds of one call of an OVERLAP_OPS op (see above)."""
    tc, tm = overlap_parts(op, shape, p, itemsize=itemsize, gpu=gpu)
    a, b = FUSED_OVERHEAD[op]
    c, d = PIPELINE_OVERHEAD.get(op, (0.0, 0.0))
    piece = 2.0 / p
    return max(tc, tm) + (a + c * piece) * tc + (b + d * piece) * tm, tc + tm


def choose(op: str, shape: dict, p: int, *, itemsize: int = 2, gpu: GPU = H200) -> str:
    """The one fused-or-serial decision for op at P > 1: "fused" or "serial".

    Args:
        op: a TP GEMM (OPS; shape {"m", "n", "k_per_rank"}: m rows of the whole product, n
            output columns, k_per_rank the contraction each device multiplies), an fp8 form of
            one (FP8_OPS; the shape also names its "scaling") or one of OVERLAP_OPS (shape as
            `overlap_parts`).
        shape: the call's shape, per device.
        p: the axis size (> 1).
        itemsize: bytes per element.
        gpu: the GPU's constants.

    Returns:
        "fused" or "serial" (the TP GEMMs: `plan`'s mode, overrides included).
    """
    if op in OPS:
        return plan(op, shape["m"], shape["n"], shape["k_per_rank"], p, itemsize=itemsize,
                    gpu=gpu).mode
    if op in FP8_OPS:
        return plan(op.removesuffix("_fp8"), shape["m"], shape["n"], shape["k_per_rank"], p,
                    gpu=gpu, fp8=shape["scaling"]).mode
    fused, serial = predict_overlap(op, shape, p, itemsize=itemsize, gpu=gpu)
    return "fused" if fused * (1 + margin(op)) < serial else "serial"

"""moe: expert-parallel token dispatch and combine (see the README's API table), as lax references.

Experts are split over `axis_name` in contiguous blocks: rank d owns experts
[d E/P, (d+1) E/P). Every (token t, slot j) of every rank s whose expert e = expert_ids[t, j]
belongs to rank d travels to d, where the rows are grouped by local expert and, within an
expert, ordered by (source rank, token, slot). Rank d's buffer has `capacity` rows: the rows are
placed in that order, expert after expert, and every (token, slot) whose place falls at or past
`capacity` is dropped (its expert output is taken as zero in the combine) and counted in the
handle, never written out of bounds. `group_sizes` counts the rows each local expert kept, so
`pk.grouped_matmul(tokens, w, group_sizes)` runs the experts directly (rows past
sum(group_sizes) are zero).

Expert ids outside [0, E) are dropped, as the kernel drops them: such a (token, slot) goes to no
rank (dest_rank -1, position -1), writes no row, takes no place in any expert's order and counts
in no group size; it counts in its own rank's `dropped` (beside the capacity drops) and in no
rank's `received_dropped`, and contributes zero to the combine.

At P > 1 on a GPU mesh given to `pk.init` both run CUDA kernels (cuda/kernels/moe.cuh): the
dispatch exchanges per-expert counts through in-kernel signals, computes every slot's row and
pushes the token rows straight into the experts' ranks' symmetric workspaces; the combine pulls
each slot's expert output from its rank's workspace and sums the k slots in fp32. Their VJPs use
each other: the dispatch's transpose is a combine with unit weights, the combine's is a
dispatch of the weighted output gradients, one row per slot (`pk_moe_scatter`), and its weight
gradient gathers the k expert rows of each token (the combine kernel's gather mode).

Elsewhere (CPU, P = 1, or shapes the kernels do not take) the jax.lax references run:
all_gather of the tokens and the routing, then index arithmetic on every rank, with autodiff
VJPs.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table, cost_model
from pk_jax.ops import _tp, _vjp
from pk_jax.ops.grouped_matmul import grouped_matmul as pk_grouped_matmul
from pk_jax.runtime import state

# exported by pk_jax/__init__.py
__all__ = ["moe_combine", "moe_dispatch", "moe_dispatch_gemm", "moe_gemm_combine"]

# Limits of the kernels (the op table, ffi/op_table.h); outside them the reference runs.
KERNEL_MAX_PEERS = _op_table.MAX_PEERS
KERNEL_MAX_EXPERTS = _op_table.MAX_EXPERTS
KERNEL_MAX_K = _op_table.MAX_SLOTS_PER_TOKEN
KERNEL_MAX_COUNTS = _op_table.MOE_MAX_COUNTS  # signal slots for P x E counts
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


class MoeHandle(NamedTuple):
    """Where each (token, slot) of this rank went, for `moe_combine` (all int32).

    Attributes:
        dest_rank: [T, k] the rank holding the (token, slot)'s expert, -1 for an expert id
            outside [0, E).
        position: [T, k] its row in that rank's dispatched buffer, -1 when dropped.
        dropped: [1] how many of this rank's (token, slot)s were dropped: for capacity, or
            for an expert id outside [0, E).
        received_dropped: [1] how many (token, slot)s sent to this rank it dropped (for
            capacity; an id outside [0, E) is sent nowhere).
        group_sizes: [E / P] rows each of this rank's experts kept (as moe_dispatch returns).
    """

    dest_rank: jax.Array
    position: jax.Array
    dropped: jax.Array
    received_dropped: jax.Array
    group_sizes: jax.Array


def _routing(ids_all: jax.Array, num_experts: int, p: int, capacity: int):
    """Positions of every (rank, token, slot) in its destination's buffer.

    ids_all: [P, T, k] expert ids of every rank. Returns (dest [P, T, k], -1 for an id outside
    [0, E), pos [P, T, k], -1 where dropped, kept [P, T, k] bool, group_sizes [P, E/P]).
    Ids outside [0, E) are dropped as the route kernel drops them (moe.cuh: a key of their own,
    no group, no count), so they shift no valid slot's position.
    """
    e_local = num_experts // p
    flat = ids_all.reshape(-1)
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)  # invalid ids: one key past every expert
    # Index of each assignment among those of its expert, in (rank, token, slot) order.
    order = jnp.argsort(key, stable=True)
    sorted_ids = key[order]
    first = jnp.searchsorted(sorted_ids, sorted_ids, side="left")
    within_sorted = jnp.arange(n, dtype=jnp.int32) - first.astype(jnp.int32)
    within = jnp.zeros(n, jnp.int32).at[order].set(within_sorted)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    # Offsets of the experts inside their rank's buffer (experts in order, block by block).
    block_counts = counts.reshape(p, e_local)
    offsets = (jnp.cumsum(block_counts, axis=1) - block_counts).reshape(-1)
    safe = jnp.where(valid, flat, 0)
    pos = offsets[safe] + within
    kept = valid & (pos < capacity)
    group_sizes = jnp.clip(capacity - offsets.reshape(p, e_local), 0, block_counts)
    dest = jnp.where(valid, safe // e_local, -1).astype(jnp.int32)
    shape = ids_all.shape
    return (dest.reshape(shape), jnp.where(kept, pos, -1).astype(jnp.int32).reshape(shape),
            kept.reshape(shape), group_sizes.astype(jnp.int32))


def moe_dispatch(x: jax.Array, expert_ids: jax.Array, axis_name: str, *, num_experts: int,
                 capacity: int) -> tuple[jax.Array, jax.Array, MoeHandle]:
    """Sends every token row to the ranks of its k experts, grouped by local expert.

    Args:
        x: [T, H] this rank's tokens.
        expert_ids: [T, k] int32, the experts of each token's k slots, in [0, num_experts);
            a slot with an id outside that range is dropped (no row, in no group size,
            dest_rank and position -1) and counted in the handle's `dropped`.
        axis_name: the expert-parallel mesh axis (P ranks, each holding num_experts / P experts).
        num_experts: E, divisible by P.
        capacity: rows of each rank's dispatched buffer.

    Returns:
        (tokens [capacity, H] in x's dtype, grouped by local expert and within an expert by
        (source rank, token, slot), zero past sum(group_sizes); group_sizes [E / P] int32;
        the handle for `moe_combine`).

    On the CUDA path (P > 1) a peer that never arrives within pk.init's timeout_s stops the
    kernel: the error naming the op, this rank and the missing peer is printed at once, and the
    next pk call (or `pk_jax.check_errors()`) raises it as a RuntimeError.

    Raises:
        ValueError: not inside shard_map over `axis_name`, bad shapes, num_experts not
            divisible by P, capacity not a positive int; on the CUDA path, a symmetric
            workspace smaller than capacity x H x itemsize (the message names the bytes and
            pk.init(mesh, workspace_bytes=...)).
        TypeError: expert_ids not int32.
    """
    p = _checks.axis_size("moe_dispatch", axis_name)
    _check_dispatch(x, expert_ids, p, num_experts, capacity)
    if _dispatch_kernel_applies(x, expert_ids, p, num_experts, capacity, axis_name):
        _tp.check_workspace("moe_dispatch", _ffi.workspace_need(
                                "moe_dispatch", p, dtype=x.dtype, h=x.shape[1],
                                capacity=capacity),
                            f"its [{capacity}, {x.shape[1]}] rows received from every rank")
        tokens, sizes, dest, pos, dropped, received = _dispatch_k(
            x, expert_ids, axis_name, num_experts, capacity)
        return tokens, sizes, MoeHandle(dest, pos, dropped, received, sizes)
    return dispatch_reference(x, expert_ids, axis_name, num_experts=num_experts,
                              capacity=capacity)


def dispatch_reference(x: jax.Array, expert_ids: jax.Array, axis_name: str, *,
                       num_experts: int, capacity: int):
    """The jax.lax reference of `moe_dispatch` (no checks)."""
    p = jax.lax.axis_size(axis_name)
    t, k = expert_ids.shape
    me = jax.lax.axis_index(axis_name)
    ids_all = jax.lax.all_gather(expert_ids, axis_name)              # [P, T, k]
    x_all = jax.lax.all_gather(x, axis_name)                         # [P, T, H]
    dest, pos, kept, group_sizes = _routing(ids_all, num_experts, p, capacity)
    mine = kept & (dest == me)
    rows = jnp.where(mine, pos, capacity).reshape(-1)                # row `capacity`: discard
    src = jnp.broadcast_to(x_all[:, :, None, :], (p, t, k, x.shape[1])).reshape(-1, x.shape[1])
    tokens = jnp.zeros((capacity + 1, x.shape[1]), x.dtype).at[rows].set(src)[:capacity]
    dropped_mine = jnp.sum(~kept[me]).astype(jnp.int32).reshape(1)
    received_dropped = jnp.sum((dest == me) & ~kept).astype(jnp.int32).reshape(1)
    handle = MoeHandle(dest[me], pos[me], dropped_mine, received_dropped, group_sizes[me])
    return tokens, group_sizes[me], handle


def moe_combine(y: jax.Array, weights: jax.Array, handle: MoeHandle,
                axis_name: str) -> jax.Array:
    """Brings each (token, slot)'s expert output back to its token's rank and sums the slots.

    Args:
        y: [capacity, H'] this rank's expert outputs, rows as `moe_dispatch` placed them.
        weights: [T, k] the routing weights of this rank's tokens.
        handle: what `moe_dispatch` returned on this rank.
        axis_name: the same axis as the dispatch.

    Returns:
        [T, H'] in y's dtype: out[t] = sum_j weights[t, j] * y_{dest(t, j)}[position(t, j)],
        with dropped (token, slot)s contributing zero; accumulated in float32.

    Raises:
        ValueError: shapes that do not match the handle; on the CUDA path, a symmetric
            workspace smaller than capacity x H' x itemsize (the message names the bytes and
            pk.init(mesh, workspace_bytes=...)).
    """
    p = _checks.axis_size("moe_combine", axis_name)
    if y.ndim != 2 or weights.ndim != 2 or weights.shape != handle.position.shape:
        raise ValueError(
            f"pk.moe_combine: expected y [capacity, H'] and weights [T, k] matching the handle's "
            f"{tuple(handle.position.shape)}; got y {tuple(y.shape)}, weights "
            f"{tuple(weights.shape)}.")
    if _combine_kernel_applies(y, weights, p, axis_name):
        _tp.check_workspace("moe_combine", _ffi.workspace_need(
                                "moe_combine", p, dtype=y.dtype, h=y.shape[1],
                                capacity=y.shape[0]),
                            f"its [{y.shape[0]}, {y.shape[1]}] expert outputs, staged for the "
                            "tokens' ranks")
        return _combine_k(y, weights, handle.dest_rank, handle.position, handle.group_sizes,
                          axis_name)
    return combine_reference(y, weights, handle, axis_name)


def combine_reference(y: jax.Array, weights: jax.Array, handle: MoeHandle,
                      axis_name: str) -> jax.Array:
    """The jax.lax reference of `moe_combine` (no checks)."""
    y_all = jax.lax.all_gather(y, axis_name)                          # [P, capacity, H']
    p, capacity = y_all.shape[0], y.shape[0]
    dest, pos = handle.dest_rank, handle.position
    # As the pull kernel: a slot without a rank or a row in range is never read (a dropped
    # slot adds zero even where y holds inf or NaN).
    ok = (pos >= 0) & (pos < capacity) & (dest >= 0) & (dest < p)
    rows = y_all[jnp.where(ok, dest, 0), jnp.where(ok, pos, 0)].astype(jnp.float32)
    rows = jnp.where(ok[..., None], rows, 0.0)                        # [T, k, H']
    w = jnp.where(ok, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("tk,tkh->th", w, rows).astype(y.dtype)


def moe_dispatch_gemm(x: jax.Array, expert_ids: jax.Array, w1: jax.Array, axis_name: str, *,
                      num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array, MoeHandle]:
    """`moe_dispatch`, then every local expert's first GEMM on the rows it received.

    On the CUDA path, where the one decider (`pk_jax.cost_model.choose`) picks it (or with
    PK_JAX_MOE_FUSED=1, fixed at pk.init, or inside `fused_kernels()`; never with "0" or inside
    `fused_kernels(False)`), one fused kernel runs instead (cuda/kernels/moe_dispatch_gemm.cuh):
    each expert's GEMM starts as soon as every rank's rows of it have arrived (bf16/fp16, H and
    N multiples of 8, P x num_experts <= 2528).

    Args:
        x, expert_ids, axis_name, num_experts, capacity: as for `moe_dispatch`.
        w1: [E / P, H, N], this rank's experts (x's dtype, bf16 or fp16).

    Returns:
        (h [capacity, N] = grouped_matmul(tokens, w1, group_sizes), group_sizes [E / P], the
        handle).

    Raises:
        ValueError, TypeError: as `moe_dispatch` and `grouped_matmul` raise them.
    """
    p = _checks.axis_size("moe_dispatch_gemm", axis_name)
    _check_dispatch(x, expert_ids, p, num_experts, capacity)
    r = _dispatch_gemm_route(x, expert_ids, w1, p, num_experts, capacity, axis_name)
    fused = r.path == "fused"
    need = _ffi.workspace_need("moe_dispatch_gemm", p, h=x.shape[1],
                               capacity=capacity) if fused else 0
    # Chosen by the decider (not forced), a fused kernel whose workspace does not fit composes
    # instead of raising.
    if fused and (r.forced or need <= state.workspace_bytes()):
        _tp.check_workspace("moe_dispatch_gemm", need,
                            f"its [{capacity}, {x.shape[1]}] rows received from every rank")
        h, sizes, dest, pos, dropped, received = _dispatch_gemm_k(
            x, expert_ids, w1, axis_name, num_experts, capacity)
        return h, sizes, MoeHandle(dest, pos, dropped, received, sizes)
    tokens, sizes, handle = moe_dispatch(x, expert_ids, axis_name, num_experts=num_experts,
                                         capacity=capacity)
    return pk_grouped_matmul(tokens, w1, sizes), sizes, handle


def moe_gemm_combine(h: jax.Array, w2: jax.Array, weights: jax.Array, handle: MoeHandle,
                     axis_name: str) -> jax.Array:
    """Every local expert's second GEMM on its rows, then `moe_combine`.

    On the CUDA path, where the one decider (`pk_jax.cost_model.choose`) picks it (PK_JAX_MOE_FUSED
    unset or "auto", fixed at pk.init; "1" or a `fused_kernels()` block force it; "0" or
    `fused_kernels(False)` never), a fused kernel runs instead
    (cuda/kernels/moe_gemm_combine.cuh): the GEMM's epilogue stores each output row straight
    into its token's rank's symmetric workspace and the token's rank sums its k rows
    (bf16/fp16, F and H' multiples of 8); the same result as the composition, bit for bit (y
    rounded to h's dtype, summed in float32).

    Args:
        h: [capacity, F] the experts' hidden rows (as `moe_dispatch_gemm` placed them).
        w2: [E / P, F, H'], this rank's experts.
        weights, handle, axis_name: as for `moe_combine`.

    Returns:
        [T, H']: moe_combine(grouped_matmul(h, w2, handle.group_sizes), weights, handle).

    Raises:
        ValueError, TypeError: as `grouped_matmul` and `moe_combine` raise them; on the fused
            path when asked for (PK_JAX_MOE_FUSED=1, `fused_kernels()`), a symmetric workspace
            smaller than T k H' itemsize + capacity x 8 bytes (by default that composes).
    """
    p = _checks.axis_size("moe_gemm_combine", axis_name)
    r = _gemm_combine_route(h, w2, weights, handle, p, axis_name)
    if r.path == "fused":
        t, k = weights.shape
        need = _ffi.workspace_need("moe_gemm_combine", p, t=t, k=k, n=w2.shape[2],
                                   capacity=h.shape[0])
        if r.forced or need <= state.workspace_bytes():  # as in moe_dispatch_gemm
            _tp.check_workspace("moe_gemm_combine", need,
                                f"its [{t} x {k}, {w2.shape[2]}] expert rows received for its "
                                f"tokens and a [{h.shape[0]}] row map")
            return _gemm_combine_k(h, w2, weights, handle.dest_rank, handle.position,
                                   handle.group_sizes, axis_name)
    y = pk_grouped_matmul(h, w2, handle.group_sizes)
    return moe_combine(y, weights, handle, axis_name)


def _check_dispatch(x, expert_ids, p: int, num_experts, capacity) -> None:
    name = "pk.moe_dispatch"
    if x.ndim != 2:
        raise ValueError(f"{name}: x must be [T, H], got shape {tuple(x.shape)}.")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expert_ids must be [T, k] with x's T = {x.shape[0]} rows, "
                         f"got shape {tuple(expert_ids.shape)}.")
    if expert_ids.dtype != jnp.int32:
        raise TypeError(f"{name}: expert_ids must be int32, got {expert_ids.dtype}; use "
                        "expert_ids.astype(jnp.int32).")
    if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % p != 0:
        raise ValueError(f"{name}: num_experts must be a positive int divisible by the axis "
                         f"size {p}, got {num_experts!r}.")
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"{name}: capacity must be a positive int (rows of each rank's "
                         f"buffer), got {capacity!r}.")


# ---------------------------------------------------------------------------------------------
# The CUDA kernels (P > 1) and their VJPs


def _dispatch_kernel_applies(x, expert_ids, p: int, num_experts: int, capacity: int,
                             axis_name: str) -> bool:
    t, k = expert_ids.shape
    fits = (1 < p <= KERNEL_MAX_PEERS and x.dtype in KERNEL_DTYPES and 1 <= k <= KERNEL_MAX_K
            and num_experts <= KERNEL_MAX_EXPERTS and p * num_experts <= KERNEL_MAX_COUNTS
            and t * k * p <= _op_table.MAX_DIM and capacity <= _op_table.MAX_DIM)
    return _backend.route("moe_dispatch", axis_name, supported=fits).path == "kernel"


def _combine_kernel_applies(y, weights, p: int, axis_name: str) -> bool:
    t, k = weights.shape
    fits = (1 < p <= KERNEL_MAX_PEERS and y.dtype in KERNEL_DTYPES and 1 <= k <= KERNEL_MAX_K
            and t * k * p <= _op_table.MAX_DIM and y.shape[0] <= _op_table.MAX_DIM)
    return _backend.route("moe_combine", axis_name, supported=fits).path == "kernel"


def _dispatch_call(x, ids, axis_name: str, num_experts: int, capacity: int):
    """pk_moe_dispatch: (tokens, group_sizes, dest_rank, position, dropped, received_dropped)."""
    p = jax.lax.axis_size(axis_name)
    t, k = ids.shape
    i32 = jnp.int32
    results = (jax.ShapeDtypeStruct((capacity, x.shape[1]), x.dtype),
               jax.ShapeDtypeStruct((num_experts // p,), i32), jax.ShapeDtypeStruct((t, k), i32),
               jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((1,), i32),
               jax.ShapeDtypeStruct((1,), i32))
    return tuple(_ffi.call("pk_moe_dispatch", results, x, ids, _backend.rank_operand(axis_name),
                           comm_id=np.int64(state.comm_id(axis_name)),
                           num_experts=np.int64(num_experts), capacity=np.int64(capacity)))


def _scatter_call(rows, dest, pos, group_sizes, axis_name: str, capacity: int):
    """pk_moe_scatter: rows [T k, H] (one per slot) to their slots' rows, tokens [capacity, H]."""
    p = jax.lax.axis_size(axis_name)
    return _ffi.call("pk_moe_scatter", jax.ShapeDtypeStruct((capacity, rows.shape[1]),
                                                            rows.dtype),
                     rows, dest, pos, group_sizes, _backend.rank_operand(axis_name),
                     comm_id=np.int64(state.comm_id(axis_name)),
                     num_experts=np.int64(group_sizes.shape[0] * p), capacity=np.int64(capacity))


def _combine_call(y, weights, dest, pos, axis_name: str, *, gather: bool = False):
    """pk_moe_combine: [T, H'] weighted sums, or with gather=True [T, k, H'] unsummed rows."""
    t, k = dest.shape
    shape = (t * k, y.shape[1]) if gather else (t, y.shape[1])
    out = _ffi.call("pk_moe_combine", jax.ShapeDtypeStruct(shape, y.dtype), y,
                    weights.astype(jnp.float32), dest, pos, _backend.rank_operand(axis_name),
                    comm_id=np.int64(state.comm_id(axis_name)), mode=np.int64(1 if gather else 0))
    return out.reshape(t, k, y.shape[1]) if gather else out


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dispatch_k(x, ids, axis_name, num_experts, capacity):
    return _dispatch_call(x, ids, axis_name, num_experts, capacity)


def _dispatch_k_fwd(x, ids, axis_name, num_experts, capacity):
    outs = _dispatch_call(x, ids, axis_name, num_experts, capacity)
    return outs, (outs[2], outs[3], _vjp.like((0,), x.dtype, _ffi.vma(x)))


def _dispatch_k_bwd(axis_name, num_experts, capacity, res, cts):
    # tokens = D(x): every kept slot's row is a copy of x[t], so dx[t] = sum over t's kept
    # slots of dtokens at the slot's row: a combine with unit weights.
    dest, pos, x0 = res
    dtokens = cts[0]
    dx = _combine_call(dtokens, jnp.ones(pos.shape, jnp.float32), dest, pos, axis_name)
    return _vjp.fit(dx, x0), None


_dispatch_k.defvjp(_dispatch_k_fwd, _dispatch_k_bwd)


# The fused kernels (moe_dispatch_gemm.cuh: dispatch + first expert GEMM; moe_gemm_combine.cuh:
# second GEMM + combine; measured at the scale model in bench/results/overlap.md) run where
# _backend.route says "fused": the one decider (cost_model.choose) or an override
# (PK_JAX_MOE_FUSED fixed at pk.init: "1" both fused, "0" both composed; a `fused_kernels`
# block forces both either way).
FUSED_ENV = "PK_JAX_MOE_FUSED"  # state.Settings.moe_fused
FUSED_OPS = ("moe_dispatch_gemm", "moe_gemm_combine")


def fused_kernels(enabled: bool = True):
    """Runs (or, with enabled=False, never runs) the fused MoE kernels for the
    `moe_dispatch_gemm` / `moe_gemm_combine` calls traced inside the block, whatever
    PK_JAX_MOE_FUSED says (a context manager: `cost_model.override_ops` for both ops). Part of
    what jit caches on: a jitted function called inside the block is traced for it, and traced
    again (or taken from the cache) outside.
    """
    return cost_model.override_ops(FUSED_OPS, "fused" if enabled else "serial")


KERNEL_MAX_FUSED_COUNTS = _op_table.MOE_MAX_FUSED_COUNTS  # the count range's other half: arrivals


def dispatch_gemm_shape(x, expert_ids, w1, num_experts: int) -> dict:
    """The decider's shape of a moe_dispatch_gemm call (cost_model.overlap_parts)."""
    return {"t": x.shape[0], "k": expert_ids.shape[1], "experts": num_experts,
            "h": w1.shape[1], "hidden": w1.shape[2]}


def _dispatch_gemm_route(x, expert_ids, w1, p: int, num_experts: int, capacity: int,
                         axis_name: str) -> _backend.Route:
    if w1.ndim != 3:
        return _backend.Route("serial")
    el, h, n = w1.shape
    fits = (x.dtype in (jnp.bfloat16, jnp.float16) and w1.dtype == x.dtype
            and h == x.shape[1] and h % 8 == 0 and n % 8 == 0 and el * p == num_experts
            and el <= _op_table.MAX_GROUPS and p * num_experts <= KERNEL_MAX_FUSED_COUNTS
            and n <= _op_table.MAX_DIM
            and _dispatch_kernel_applies(x, expert_ids, p, num_experts, capacity, axis_name))
    return _backend.route("moe_dispatch_gemm", axis_name, supported=fits,
                          overlap=(dispatch_gemm_shape(x, expert_ids, w1, num_experts),
                                   x.dtype.itemsize))


def _fused_call(x, ids, w1, axis_name: str, num_experts: int, capacity: int):
    """pk_moe_dispatch_gemm: (h, group_sizes, dest_rank, position, dropped, received_dropped)
    (its two last results are the kernel's scratch)."""
    p = jax.lax.axis_size(axis_name)
    t, k = ids.shape
    i32 = jnp.int32
    results = (jax.ShapeDtypeStruct((capacity, w1.shape[2]), x.dtype),
               jax.ShapeDtypeStruct((num_experts // p,), i32), jax.ShapeDtypeStruct((t, k), i32),
               jax.ShapeDtypeStruct((t, k), i32), jax.ShapeDtypeStruct((1,), i32),
               jax.ShapeDtypeStruct((1,), i32), jax.ShapeDtypeStruct((t * k,), i32),
               jax.ShapeDtypeStruct((num_experts + 1,), i32))
    outs = _ffi.call("pk_moe_dispatch_gemm", results, x, ids, w1,
                     _backend.rank_operand(axis_name),
                     comm_id=np.int64(state.comm_id(axis_name)),
                     num_experts=np.int64(num_experts), capacity=np.int64(capacity))
    return tuple(outs[:6])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dispatch_gemm_k(x, ids, w1, axis_name, num_experts, capacity):
    return _fused_call(x, ids, w1, axis_name, num_experts, capacity)


def _dispatch_gemm_k_fwd(x, ids, w1, axis_name, num_experts, capacity):
    outs = _fused_call(x, ids, w1, axis_name, num_experts, capacity)
    return outs, (x, ids, w1, outs[1])


def _dispatch_gemm_k_bwd(axis_name, num_experts, capacity, res, cts):
    # The composition's VJP: the dispatch runs again for the tokens that dw1 needs (the fused
    # kernel keeps no copy of them).
    x, ids, w1, sizes = res

    def composed(x_, w_):
        tokens, _, _ = moe_dispatch(x_, ids, axis_name, num_experts=num_experts,
                                    capacity=capacity)
        return pk_grouped_matmul(tokens, w_, sizes)

    _, vjp = jax.vjp(composed, x, w1)
    dx, dw = vjp(cts[0])
    return _vjp.fit(dx, x), None, _vjp.fit(dw, w1)


_dispatch_gemm_k.defvjp(_dispatch_gemm_k_fwd, _dispatch_gemm_k_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _combine_k(y, weights, dest, pos, group_sizes, axis_name):
    return _combine_call(y, weights, dest, pos, axis_name)


def _combine_k_fwd(y, weights, dest, pos, group_sizes, axis_name):
    return (_combine_call(y, weights, dest, pos, axis_name),
            (y, weights, dest, pos, group_sizes))


def _combine_k_bwd(axis_name, res, dout):
    # out[t] = sum_j w[t, j] y_dest[pos]: dy at a slot's row = w[t, j] dout[t] (one row per
    # slot: a scatter); dw[t, j] = <dout[t], y_dest[pos]> from the gathered rows (zero when
    # dropped, as the reference's masked weights give).
    y, weights, dest, pos, group_sizes = res
    t, k = pos.shape
    w32 = weights.astype(jnp.float32)
    d32 = dout.astype(jnp.float32)
    rows = _combine_call(y, w32, dest, pos, axis_name, gather=True)
    dw = jnp.einsum("th,tkh->tk", d32, rows.astype(jnp.float32)).astype(weights.dtype)
    per_slot = (w32[:, :, None] * d32[:, None, :]).astype(y.dtype).reshape(t * k, y.shape[1])
    dy = _scatter_call(per_slot, dest, pos, group_sizes, axis_name, y.shape[0])
    return _vjp.fit(dy, y), _vjp.fit(dw, weights), None, None, None


_combine_k.defvjp(_combine_k_fwd, _combine_k_bwd)


# The fused second expert GEMM + combine (cuda/kernels/moe_gemm_combine.cuh), routed as the
# fused dispatch.


def gemm_combine_shape(weights, w2, p: int) -> dict:
    """The decider's shape of a moe_gemm_combine call (cost_model.overlap_parts)."""
    el, f, n = w2.shape
    return {"t": weights.shape[0], "k": weights.shape[1], "experts": el * p, "h": n,
            "hidden": f}


def _gemm_combine_route(h, w2, weights, handle, p: int, axis_name: str) -> _backend.Route:
    if w2.ndim != 3 or h.ndim != 2:
        return _backend.Route("serial")
    if weights.ndim != 2 or weights.shape != handle.position.shape:
        return _backend.Route("serial")  # the composition raises the shape error
    el, f, n = w2.shape
    fits = (h.dtype in (jnp.bfloat16, jnp.float16) and w2.dtype == h.dtype
            and f == h.shape[1] and f % 8 == 0 and n % 8 == 0 and f >= 8 and n >= 8
            and handle.group_sizes.shape == (el,) and el <= _op_table.MAX_GROUPS
            and n <= _op_table.MAX_DIM and _combine_kernel_applies(h, weights, p, axis_name))
    return _backend.route("moe_gemm_combine", axis_name, supported=fits,
                          overlap=(gemm_combine_shape(weights, w2, p), h.dtype.itemsize))


def _gemm_combine_call(h, w2, weights, dest, pos, group_sizes, axis_name: str):
    """pk_moe_gemm_combine: out [T, H'] = combine(grouped_matmul(h, w2, group_sizes))."""
    t = dest.shape[0]
    return _ffi.call("pk_moe_gemm_combine", jax.ShapeDtypeStruct((t, w2.shape[2]), h.dtype),
                     h, w2, weights.astype(jnp.float32), dest, pos, group_sizes,
                     _backend.rank_operand(axis_name),
                     comm_id=np.int64(state.comm_id(axis_name)))


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _gemm_combine_k(h, w2, weights, dest, pos, group_sizes, axis_name):
    return _gemm_combine_call(h, w2, weights, dest, pos, group_sizes, axis_name)


def _gemm_combine_k_fwd(h, w2, weights, dest, pos, group_sizes, axis_name):
    return (_gemm_combine_call(h, w2, weights, dest, pos, group_sizes, axis_name),
            (h, w2, weights, dest, pos, group_sizes))


def _gemm_combine_k_bwd(axis_name, res, dout):
    # The composition's VJP: the GEMM runs again for y, which the combine's weight gradient
    # needs (the fused kernel keeps no copy of it).
    h, w2, weights, dest, pos, group_sizes = res

    def composed(h_, w_, wt_):
        y = pk_grouped_matmul(h_, w_, group_sizes)
        return _combine_k(y, wt_, dest, pos, group_sizes, axis_name)

    _, vjp = jax.vjp(composed, h, w2, weights)
    dh, dw, dwt = vjp(dout)
    return (_vjp.fit(dh, h), _vjp.fit(dw, w2), _vjp.fit(dwt, weights), None, None, None)


_gemm_combine_k.defvjp(_gemm_combine_k_fwd, _gemm_combine_k_bwd)

"""The kernel-backed Ulysses attention backward in the rank emulator: the kernels
pk.ulysses_attention's VJP runs on GPUs after the fused forward (PK_JAX_ULYSSES_FUSED=1;
pk_jax/ops/ulysses_attn.py `_composed_bwd`), on the same layouts, queued one after another on
each rank's stream (after the default composed forward, which keeps the head shards, the VJP
exchanges only dO in step 1: this is an upper bound of its cost):

    1. pk all_to_all of q, dO, k, v: [B, S/P, H, D] -> [B, S, H/P, D] (split heads, gather
       the sequence in rank order), and of the stacked (lse, delta): [2, B, H, S/P] ->
       [2, B, H/P, S];
    2. the pk.attention backward (one pass: dK/dV, and dQ summed into a float32 scratch) over
       the whole sequence for the rank's head group, grouped-query heads read in place;
    3. pk all_to_all of dq, dk, dv back: [B, S, H/P, D] -> [B, S/P, H, D].

delta = rowsum(dO * O) (an XLA reduction in JAX) is an input here. When S is not a multiple
of the kernel's 128-row tile, lse and delta are padded (+inf, 0) on the host between steps 1
and 2, as XLA's pad does in JAX (the host round trip synchronizes: tests only, never timed).

`FusedUlyssesBackward` is the fused backward (op "ulysses_attn_bwd",
cuda/kernels/ulysses_attn_bwd.cuh) on the same problem: one call per rank takes the head
shards of q, k, v and lse the composed forward keeps (built here on the host, once, as step 1
lays them out: `head_shards`) with the rank's sequence shards of dO and delta, exchanges dO and
delta inside the kernel, and pulls dq, dk, dv back to sequence shards in its tail kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pk_jax.ops import ulysses_attn
from pk_jax.testing import ops
from pk_jax.testing.emulator import DTYPES, DeviceBuffer, World, np_dtype

TILE = 128
# The per-rank inputs of both backwards, in their constructors' order, as ops.ring_attn_bwd's
# case names them.
INPUTS = ("q", "k", "v", "do", "lse", "delta")


def reference_inputs(ref: ops.Case) -> list[list[np.ndarray]]:
    """qs, ks, vs, dos, lses, deltas (each a per-rank list) of ops.ring_attn_bwd's contiguous
    case `ref`, for either backward's constructor."""
    return [[x[n] for x in ref.inputs] for n in INPUTS]


def _check_heads(who: str, p: int, h: int, hkv: int) -> None:
    if h % p or hkv % p or h % hkv:
        raise ValueError(f"{who}: P = {p} must divide H = {h} and Hkv = {hkv}, and Hkv must "
                         "divide H.")


def fused_workspace_bytes(p: int, b: int, sl: int, h: int, hkv: int, d: int) -> int:
    """The symmetric workspace one ulysses_attn_bwd call needs at these per-rank shapes
    (pk_jax.ops.ulysses_attn.fused_bwd_workspace_need)."""
    return ulysses_attn.fused_bwd_workspace_need(SimpleNamespace(shape=(b, sl, h, d)),
                                                 SimpleNamespace(shape=(b, sl, hkv, d)), p)


def _all_to_all(xs, dtype: str, split_axis: int, concat_axis: int) -> ops.Case:
    """ops.all_to_all's call without its numpy expected outputs (never checked here: the
    gradients are), so large benchmark inputs cost no host-side copies."""
    p = len(xs)
    block = list(xs[0].shape)
    block[split_axis] //= p
    shape = list(block)
    shape[concat_axis] *= p
    dt = np_dtype(dtype)
    case = ops.Case("all_to_all", dtype, [{"x": np.ascontiguousarray(x, dt)} for x in xs],
                    [{"y": np.empty(shape, dt)} for _ in xs],
                    {"p0": max(1, int(np.prod(block[split_axis:]))),
                     "p1": max(1, int(np.prod(block[concat_axis:])))})
    return case


class UlyssesBackward:
    """One composed backward on every rank of `world`, ready to queue (`launch`) again and
    again; `grads(r)` reads rank r's dq, dk, dv.

    Args:
        world: the emulated ranks.
        dtype: "bfloat16" or "float16".
        qs, dos: per rank [B, S/P, H, D]; ks, vs: per rank [B, S/P, Hkv, D], P dividing Hkv.
        lses, deltas: per rank float32 [B, H, >= S/P] (the forward's lse, rowsum(dO * O));
            columns past S/P are ignored.
        causal, scale: as the forward's.
    """

    def __init__(self, world: World, dtype: str, qs, ks, vs, dos, lses, deltas, *,
                 causal: bool, scale: float):
        p = world.world
        b, sl, h, d = qs[0].shape
        hkv = ks[0].shape[2]
        _check_heads("UlyssesBackward", p, h, hkv)
        self.world, self.dtype = world, dtype
        self.shape = (b, sl, h, hkv, d)
        s = sl * p
        self.sp = -(-s // TILE) * TILE
        dt = np_dtype(dtype)
        self.ins = [ops.Call(world, _all_to_all(list(xs), dtype, 2, 1))
                    for xs in (qs, dos, ks, vs)]
        stats = [np.stack([np.asarray(lse, np.float32)[:, :, :sl],
                           np.asarray(dl, np.float32)[:, :, :sl]])
                 for lse, dl in zip(lses, deltas)]
        self.stats = ops.Call(world, _all_to_all(stats, "float32", 2, 3))
        # The way back: the attention backward writes each rank's gradients straight into the
        # all_to_all's input buffers ([B, S, H/P, D] and [B, S, Hkv/P, D]).
        self.outs = [ops.Call(world, _all_to_all([np.zeros((b, s, n // p, d), dt)] * p,
                                                 dtype, 1, 2))
                     for n in (h, hkv, hkv)]
        g = b * (h // p) * self.sp * 4
        self.padded = ([(DeviceBuffer(g), DeviceBuffer(g)) for _ in range(p)]
                       if self.sp != s else None)
        # The one-pass backward's float32 dq scratch [B, S, H/P, D], as pk.ulysses_attention's
        # backward passes it.
        self.dq_acc = [DeviceBuffer(b * s * (h // p) * d * 4) for _ in range(p)]
        self.args = []
        for r in range(p):
            y = self.stats.buffers[r]["y"].ptr
            lse_in, delta = ((y, y + b * (h // p) * s * 4) if self.padded is None
                             else self.padded[r])
            self.args.append({
                "dtype": DTYPES[dtype], "q": self.ins[0].buffers[r]["y"],
                "k": self.ins[2].buffers[r]["y"], "v": self.ins[3].buffers[r]["y"], "b": b,
                "s": s, "h": h // p, "hkv": hkv // p, "d": d, "scale": float(scale),
                "causal": int(causal), "backward": 1,
                "do": self.ins[1].buffers[r]["y"], "lse_in": lse_in, "delta": delta,
                "dq": self.outs[0].buffers[r]["x"], "dk": self.outs[1].buffers[r]["x"],
                "dv": self.outs[2].buffers[r]["x"], "dq_acc": self.dq_acc[r], "sp": self.sp})

    def _pad(self) -> None:
        b, sl, h, _, _ = self.shape
        p = self.world.world
        self.world.synchronize()
        for r, (lse, delta) in enumerate(self.padded):
            st = self.stats.buffers[r]["y"].read(np.float32, (2, b, h // p, sl * p))
            pad = ((0, 0), (0, 0), (0, self.sp - sl * p))
            lse.write(np.pad(st[0], pad, constant_values=np.inf))
            delta.write(np.pad(st[1], pad))

    def launch(self, *, delays_ns: list[int] | None = None) -> None:
        """Queues steps 1-3 on every rank's stream (no host synchronization unless S needs
        padding); delays_ns[r] holds rank r's stream before its first step."""
        self.ins[0].launch(delays_ns=delays_ns)
        for c in (*self.ins[1:], self.stats):
            c.launch()
        if self.padded is not None:
            self._pad()
        for r in range(self.world.world):
            self.world.launch("attention", r, self.args[r])
        for c in self.outs:
            c.launch()

    def launch_attention(self) -> None:
        """Step 2 alone (the head-group attention backward on every rank): the compute part
        of the composed backward, on whatever the head-shard buffers hold."""
        for r in range(self.world.world):
            self.world.launch("attention", r, self.args[r])

    def launch_comm(self) -> None:
        """Steps 1 and 3 alone (the all_to_alls there and back): the communication part of the
        composed backward (padding the statistics, where S needs it, is left out)."""
        for c in (*self.ins, self.stats, *self.outs):
            c.launch()

    def fill(self, byte: int) -> None:
        """Poisons every rank's dq, dk, dv with one byte value (0xFF: NaNs)."""
        for c in self.outs:
            for bufs in c.buffers:
                bufs["y"].fill(byte)

    def grads(self, r: int) -> dict[str, np.ndarray]:
        """Rank r's dq [B, S/P, H, D], dk and dv [B, S/P, Hkv, D] after the last call."""
        b, sl, h, hkv, d = self.shape
        dt = np_dtype(self.dtype)
        return {name: c.buffers[r]["y"].read(dt, (b, sl, n, d))
                for name, c, n in zip(("dq", "dk", "dv"), self.outs, (h, hkv, hkv))}

    def free(self) -> None:
        for c in (*self.ins, self.stats, *self.outs):
            c.free()
        for bufs in (*(self.padded or ()), self.dq_acc):
            for buf in bufs:
                buf.free()


# ---------------------------------------------------------------------------------------------
# The fused backward (op "ulysses_attn_bwd")

def head_shards(xs, p: int, head_axis: int, seq_axis: int) -> list[np.ndarray]:
    """Every rank's sequence shard -> every rank's head shard: shard r holds head group r (the
    r-th of P equal slices of `head_axis`) of every source's rows, sources in rank order along
    `seq_axis` (the composed backward's step 1, lax.all_to_all(x, head_axis, seq_axis,
    tiled=True)): q [B, S/P, H, D] -> [B, S, H/P, D] with (2, 1); lse [B, H, S/P] ->
    [B, H/P, S] with (1, 2)."""
    parts = [np.split(np.asarray(x), p, axis=head_axis) for x in xs]
    return [np.ascontiguousarray(np.concatenate([pt[r] for pt in parts], axis=seq_axis))
            for r in range(p)]


def fused_case(dtype: str, qs, ks, vs, dos, lses, deltas, *, causal: bool, scale: float,
               num_comm_sms: int = 2, expected: list[dict[str, np.ndarray]] | None = None,
               atol: float = 0.0, rtol: float = 0.0) -> ops.Case:
    """One ulysses_attn_bwd call on every rank, its launcher's fields by name.

    Args:
        dtype, qs, ks, vs, dos, lses, deltas, causal, scale: as UlyssesBackward's.
        num_comm_sms: communication blocks (the same on every rank).
        expected: per-rank dq, dk, dv to check against (default: zeros, shapes only).
        atol, rtol: the check's tolerance.

    Returns:
        The case: per rank do [B, S/P, H, D] and delta float32 [B, H, S/P] (sequence shards),
        q [B, S, H/P, D], k, v [B, S, Hkv/P, D] and lse float32 [B, H/P, SP] (head shards; SP
        = S rounded up to 128, +inf past S); outputs dq, dk, dv (sequence shards).
    """
    p = len(qs)
    b, sl, h, d = qs[0].shape
    hkv = ks[0].shape[2]
    _check_heads("fused_case", p, h, hkv)
    dt = np_dtype(dtype)
    s = sl * p
    q, k, v = (head_shards([np.asarray(x, dt) for x in xs], p, 2, 1) for xs in (qs, ks, vs))
    lse = [np.pad(x, ((0, 0), (0, 0), (0, -(-s // TILE) * TILE - s)), constant_values=np.inf)
           for x in head_shards([np.asarray(x, np.float32)[:, :, :sl] for x in lses], p, 1, 2)]
    inputs = [{"do": np.ascontiguousarray(dos[r], dt), "q": q[r], "k": k[r], "v": v[r],
               "lse": lse[r],
               "delta": np.ascontiguousarray(np.asarray(deltas[r], np.float32)[:, :, :sl])}
              for r in range(p)]
    if expected is None:
        expected = [{"dq": np.zeros((b, sl, h, d), dt), "dk": np.zeros((b, sl, hkv, d), dt),
                     "dv": np.zeros((b, sl, hkv, d), dt)} for _ in range(p)]
    params = {"b": b, "s": sl, "h": h, "hkv": hkv, "d": d, "scale": float(scale),
              "causal": int(causal), "num_comm_sms": int(num_comm_sms)}
    return ops.Case("ulysses_attn_bwd", dtype, inputs, expected, params, exact=False,
                    atol=atol, rtol=rtol)


def fused_reference(ref: ops.Case, *, num_comm_sms: int = 2) -> ops.Case:
    """ops.ring_attn_bwd's contiguous case `ref` as a ulysses_attn_bwd case: the same problem,
    its expected gradients and tolerance."""
    if ref.params.get("zigzag"):
        raise ValueError("fused_reference: Ulysses shards the sequence contiguously; the "
                         "reference must not be zigzag.")
    return fused_case(ref.dtype, *reference_inputs(ref), causal=bool(ref.params["causal"]),
                      scale=ref.params["scale"], num_comm_sms=num_comm_sms,
                      expected=ref.expected, atol=ref.atol, rtol=ref.rtol)


class FusedCall(ops.Call):
    """ops.Call of a ulysses_attn_bwd case (`fused_case`, `fused_reference`), with the
    gradients' poisoning and reading by name."""

    def fill(self, byte: int) -> None:
        """Poisons every rank's dq, dk, dv with one byte value (0xFF: NaNs)."""
        for bufs in self.buffers:
            for name in ("dq", "dk", "dv"):
                bufs[name].fill(byte)

    def grads(self, r: int) -> dict[str, np.ndarray]:
        """Rank r's dq [B, S/P, H, D], dk and dv [B, S/P, Hkv, D] after the last call."""
        return self.outputs(r)


class FusedUlyssesBackward(FusedCall):
    """The fused backward on every rank of `world`, ready to queue (`launch(delays_ns=...,
    skip=...)`: one ulysses_attn_bwd call per rank, no host synchronization) again and again;
    `grads(r)` reads rank r's dq, dk, dv, `fill(byte)` poisons them, `free()` releases the
    buffers. The head shards of q, k, v and lse are built on the host once (`fused_case`).

    Args:
        world, dtype, qs, ks, vs, dos, lses, deltas, causal, scale: as UlyssesBackward's.
        num_comm_sms: communication blocks (the same on every rank).
        poison: the byte the gradients hold before the first call.
    """

    def __init__(self, world: World, dtype: str, qs, ks, vs, dos, lses, deltas, *,
                 causal: bool, scale: float, num_comm_sms: int = 2, poison: int = 0xFF):
        super().__init__(world, fused_case(dtype, qs, ks, vs, dos, lses, deltas, causal=causal,
                                           scale=scale, num_comm_sms=num_comm_sms),
                         poison=poison)

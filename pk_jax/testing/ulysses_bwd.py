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
"""

from __future__ import annotations

import numpy as np

from pk_jax.testing import ops
from pk_jax.testing.emulator import DTYPES, DeviceBuffer, World, np_dtype

TILE = 128


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
        if h % p or hkv % p or h % hkv:
            raise ValueError(f"UlyssesBackward: P = {p} must divide H = {h} and Hkv = {hkv}, "
                             "and Hkv must divide H.")
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
                "k": self.ins[2].buffers[r]["y"], "v": self.ins[3].buffers[r]["y"], "o": 0,
                "lse": 0, "b": b, "s": s, "h": h // p, "hkv": hkv // p, "d": d,
                "scale": float(scale), "causal": int(causal), "backward": 1,
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

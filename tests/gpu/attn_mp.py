"""What tests/gpu/ring_mp.py and tests/gpu/ulysses_mp.py share (and, for its mesh and
placement, tests/gpu/tp_fp8_mp.py): one process of P on a 1-D mesh over all processes (axis
"sp" unless named), the sequence-sharded placement of inputs built alike on
every process, and the forward check (every rank's inputs from one seed, the op under
jit(shard_map), this process's shard against the float32 numpy reference; twice in a row, a
pk.all_reduce reusing the workspace in between, a straggler), and the gradient check (jax.vjp
through the op against the float32 reference gradients).
"""

from __future__ import annotations

import time


class Harness:
    """pk.init on a mesh over all processes (pk_jax.launch), and the forward check."""

    def __init__(self, target: str, axis: str = "sp"):
        import pk_jax.launch

        pk_jax.launch.initialize()
        import jax
        import numpy as np
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        import pk_jax as pk

        self.jax, self.np, self.pk = jax, np, pk
        self.NamedSharding, self.P = NamedSharding, P
        self.me, self.n = jax.process_index(), jax.process_count()
        self.mesh = jax.make_mesh((self.n,), (axis,))
        pk.init(self.mesh)
        print(f"backend {target}={pk.backend_name(target, axis)}", flush=True)
        self.seq = P(None, axis)

    def place(self, glob, spec=None):
        """The global array laid out by `spec` over the processes (default: [B, S, H, D]
        sharded along S)."""
        return self.jax.make_array_from_callback(
            glob.shape, self.NamedSharding(self.mesh, self.seq if spec is None else spec),
            lambda idx: glob[idx])

    def local(self, y):
        """This process's shard of y, as numpy."""
        shards = y.addressable_shards
        assert len(shards) == 1
        return self.np.asarray(shards[0].data)

    def jit(self, body, n_in: int, n_out: int | None = None):
        """jit(shard_map(body)) with every operand and result sequence-sharded."""
        out = self.seq if n_out is None else (self.seq,) * n_out
        return self.jax.jit(self.jax.shard_map(body, mesh=self.mesh, in_specs=(self.seq,) * n_in,
                                               out_specs=out))

    def inputs(self, rng, dtype, *shapes):
        """Per-rank float64 inputs of each shape (lists of P), and the global arrays in dtype
        (rank r's block at sequence positions r S/P ...)."""
        from pk_jax.testing import ops

        per = [[rng.standard_normal(s) for _ in range(self.n)] for s in shapes]
        dt = ops.np_dtype(dtype)
        glob = [self.np.concatenate(xs, axis=1).astype(self.np.float32).astype(dt)
                for xs in per]
        return per, glob

    def check_forward(self, f, reference, seed: int, b, sl, h, hkv, d, dtype, what: str, *,
                      calls: int = 1, between: bool = False, sleep_rank: int | None = None):
        """Runs f(q, k, v) `calls` times on new inputs and compares this process's shard of
        the output with reference(qs, ks, vs)[me] (atol = rtol = 2e-2); `between`: a
        pk.all_reduce reuses the workspace before the next call; `sleep_rank` starts 1 s late.
        """
        np, jax, pk, P = self.np, self.jax, self.pk, self.P
        rng = np.random.default_rng(seed)
        for c in range(calls):
            (qs, ks, vs), glob = self.inputs(rng, dtype, (b, sl, h, d), (b, sl, hkv, d),
                                             (b, sl, hkv, d))
            want = reference(qs, ks, vs).astype(np.float64)
            if sleep_rank == self.me:
                time.sleep(1.0)
            got = self.local(f(*(self.place(x) for x in glob))).astype(np.float64)
            where = (f"rank {self.me}: b={b} S/P={sl} h={h} hkv={hkv} d={d} {dtype} {what} "
                     f"call {c}")
            if not (np.all(np.isfinite(got)) and np.allclose(got, want, atol=2e-2, rtol=2e-2)):
                err = np.nanmax(np.abs(got - want))
                raise AssertionError(f"{where}: output differs (max error {err})")
            if between:  # a collective reuses the workspace before the next call
                full = np.full((self.n * 256, 64), 3.0, np.float32)
                junk = jax.make_array_from_callback(
                    full.shape, self.NamedSharding(self.mesh, P("sp")), full.__getitem__)
                g = jax.jit(jax.shard_map(lambda a: pk.all_reduce(a, "sp"), mesh=self.mesh,
                                          in_specs=(P("sp"),), out_specs=P("sp")))
                jax.block_until_ready(g(junk))

    def check_backward(self, op, reference, seed: int, b, sl, h, hkv, d, dtype, what: str, *,
                       calls: int = 1, sleep_rank: int | None = None):
        """Runs jax.vjp of op(q, k, v) under jit(shard_map) `calls` times on new inputs and
        cotangents, and compares this process's dq, dk, dv with reference(qs, ks, vs, dos)
        (a pk_jax.testing.ops Case: expected[me], atol, rtol); `sleep_rank` starts 1 s late."""
        np, jax = self.np, self.jax

        def body(q, k, v, do):
            _, pull = jax.vjp(op, q, k, v)
            return pull(do)

        f = self.jit(body, 4, 3)
        rng = np.random.default_rng(seed)
        for c in range(calls):
            xs, glob = self.inputs(rng, dtype, (b, sl, h, d), (b, sl, hkv, d), (b, sl, hkv, d),
                                   (b, sl, h, d))
            ref = reference(*xs)
            if sleep_rank == self.me:
                time.sleep(1.0)
            got = f(*(self.place(x) for x in glob))
            where = (f"rank {self.me}: grads b={b} S/P={sl} h={h} hkv={hkv} d={d} {dtype} "
                     f"{what} call {c}")
            for name, y in zip(("dq", "dk", "dv"), got):
                g = self.local(y).astype(np.float64)
                w = ref.expected[self.me][name].astype(np.float64)
                if not (np.all(np.isfinite(g)) and np.allclose(g, w, atol=ref.atol,
                                                               rtol=ref.rtol)):
                    err = np.nanmax(np.abs(g - w))
                    raise AssertionError(f"{where}: {name} differs (max error {err})")

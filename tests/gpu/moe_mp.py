"""pk.moe_dispatch and pk.moe_combine across P processes, through JAX (the FFI handlers, the
Python lowering and the custom VJPs, which the rank emulator does not exercise).

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/moe_mp.py

P processes share the one GPU (run_all.sh section moe runs P = 2, 4, 8). Every process builds
every rank's inputs from one seed, runs dispatch -> (x 2) -> combine under jit(shard_map) on a
1-D mesh over all processes, and compares its own shard with the numpy references of
pk_jax.testing.ops (XLA's collectives cannot run with two ranks on one GPU). Cases:

- integer tokens and quarter-integer weights (every sum exact): tokens, group sizes, the whole
  handle and the combined output compared exactly, bf16 / fp16 / fp32, uniform and skewed
  routing, generous and overflowing capacity (drops), odd T and H;
- two calls in a row with a pk.all_reduce between them reusing the symmetric workspace;
- a straggler: the last rank sleeps 1 s before its call;
- gradients of sum(out * g) with respect to x and the weights (fp32, exact): dx[t] =
  2 sum_j w[t, j] kept(t, j) g, dw[t, j] = 2 kept(t, j) <x[t], g>.

On a machine without a GPU the same script runs on CPU processes, where the ops run their
references: a check of the script itself.
"""

import time


def main() -> None:
    import pk_jax.launch

    pk_jax.launch.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pk_jax as pk
    from pk_jax.testing import ops

    me, n = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((n,), ("ep",))
    pk.init(mesh)
    print(f"backend moe_dispatch={pk.backend_name('moe_dispatch', 'ep')} "
          f"moe_combine={pk.backend_name('moe_combine', 'ep')}", flush=True)

    def place(glob: np.ndarray):
        return jax.make_array_from_callback(glob.shape, NamedSharding(mesh, P("ep")),
                                            lambda idx: glob[idx])

    def local(y) -> np.ndarray:
        shards = y.addressable_shards
        assert len(shards) == 1
        return np.asarray(shards[0].data)

    def routing(rng, t, k, experts, skew):
        if skew:
            return np.minimum(rng.zipf(1.4, (n, t, k)) - 1, experts - 1).astype(np.int32)
        return rng.integers(0, experts, (n, t, k)).astype(np.int32)

    def forward(experts, capacity):
        def body(x, e, w):
            tok, sizes, h = pk.moe_dispatch(x[0], e[0], "ep", num_experts=experts,
                                            capacity=capacity)
            out = pk.moe_combine(tok * 2, w[0], h, "ep")
            return (tok[None], sizes[None], h.dest_rank[None], h.position[None], h.dropped,
                    h.received_dropped, out[None])

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                     out_specs=(P("ep"),) * 7))

    def case(seed, t, k, experts, h, dtype, capacity_kind, *, skew=False, calls=1,
             between=False, sleep_rank=None, grads=False):
        rng = np.random.default_rng(seed)
        for c in range(calls):
            ids = routing(rng, t, k, experts, skew)
            total = n * t * k
            capacity = total + 3 if capacity_kind == "generous" else max(1, total // (2 * n))
            xs = rng.integers(-3, 4, (n, t, h)).astype(np.float64)
            weights = rng.integers(0, 5, (n, t, k)).astype(np.float32) / 4
            want = ops.moe_dispatch(list(xs), ids, dtype, num_experts=experts,
                                    capacity=capacity).expected[me]
            what = (f"rank {me}: t={t} k={k} E={experts} h={h} {dtype} {capacity_kind} "
                    f"skew={skew} call {c}")
            x = place(xs.astype(ops.np_dtype(dtype)))
            f = forward(experts, capacity)
            if sleep_rank == me:
                time.sleep(1.0)
            got = [local(v) for v in f(x, place(ids), place(weights))]
            names = ("tokens", "group_sizes", "dest", "pos", "dropped", "recv_dropped")
            for name, g in zip(names, got[:6]):
                w = want[name]
                if not np.array_equal(g.reshape(w.shape).astype(np.float64),
                                      w.astype(np.float64)):
                    raise AssertionError(f"{what}: {name} differs")
            kept = (want["pos"] >= 0).astype(np.float64)
            out = 2 * np.einsum("tk,tk,th->th", weights[me], kept, xs[me])
            out = np.asarray(out, np.float32).astype(ops.np_dtype(dtype)).astype(np.float64)
            if not np.array_equal(got[6].reshape(out.shape).astype(np.float64), out):
                raise AssertionError(f"{what}: combined output differs")
            if grads:
                gvec = (np.arange(h) % 5 - 2).astype(np.float32)

                def loss(a, e, wt, f=f, gvec=gvec):
                    return jnp.sum(f(a, e, wt)[6].astype(jnp.float32) * gvec)

                gx, gw = jax.jit(jax.grad(loss, argnums=(0, 2)))(x, place(ids), place(weights))
                want_gx = 2 * np.einsum("tk,tk->t", weights[me], kept)[:, None] * gvec
                want_gw = 2 * kept * (xs[me] @ gvec)[:, None]
                if not np.allclose(local(gx), want_gx) or not np.allclose(local(gw), want_gw):
                    raise AssertionError(f"{what}: gradients differ")
            if between:  # a collective reuses the workspace before the next call
                junk = place(np.full((n * 256, 64), 3.0, np.float32))
                g = jax.jit(jax.shard_map(lambda a: pk.all_reduce(a, "ep"), mesh=mesh,
                                          in_specs=(P("ep"),), out_specs=P("ep")))
                jax.block_until_ready(g(junk))

    t0 = time.time()
    count = 0
    for i, (t, k, e_per, h, dtype) in enumerate([(37, 2, 2, 24, "bfloat16"),
                                                 (64, 4, 4, 128, "float16"),
                                                 (13, 8, 1, 8, "float32"),
                                                 (101, 3, 3, 200, "bfloat16")]):
        for kind in ("generous", "tight"):
            for skew in (False, True):
                case(10 * i + (kind == "tight") + 2 * skew, t, k, e_per * n, h, dtype, kind,
                     skew=skew)
                count += 1
    case(91, 50, 2, 2 * n, 64, "bfloat16", "tight", calls=2, between=True)
    case(92, 50, 2, 2 * n, 64, "bfloat16", "generous", calls=2, sleep_rank=n - 1)
    case(93, 33, 4, 2 * n, 40, "float32", "generous", grads=True)
    case(94, 33, 4, 2 * n, 40, "float32", "tight", grads=True, skew=True)
    count += 4
    print(f"moe_mp OK: P={n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

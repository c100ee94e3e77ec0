"""pk.moe_dispatch_gemm's and pk.moe_gemm_combine's fused kernels (the dispatch's opt-in:
PK_JAX_MOE_FUSED=1 or a pk_jax.ops.moe.fused_kernels() block; the combine's the default, "auto")
across P processes, through JAX: the FFI handlers, the lowerings and the custom VJPs.

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/moe_fused_mp.py

Every process builds every rank's inputs from one seed and runs pk.moe_dispatch_gemm under
jit(shard_map) twice: traced inside fused_kernels(True) (the fused kernel; on a GPU its HLO must
call pk_moe_dispatch_gemm) and inside fused_kernels(False) (the
composition of pk.moe_dispatch and pk.grouped_matmul, tested by moe_mp.py and the grouped GEMM
tests); then once outside a block, where the HLO must call the kernel exactly when
PK_JAX_MOE_FUSED asks for it (by default: moe_gemm_combine's, not moe_dispatch_gemm's) and
the output must equal the composition's. Integer inputs in {-1, 0, 1}, so both are exact and
must agree bit for bit: h, the group sizes and the whole handle; then the gradients of
sum(h * g) with respect to x and w1; then two calls in a row, and a straggler (the last rank
sleeps 1 s before its call).
pk.moe_gemm_combine the same way (fused against grouped_matmul then moe_combine, on the handle
of a pk.moe_dispatch): out, then the gradients of sum(out * g) with respect to h, w2 and the
weights.
On a machine without a GPU both traces run the references (a check of the script itself).
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
    from pk_jax.ops import moe as moe_ops

    me, n = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((n,), ("ep",))
    pk.init(mesh)

    def place(glob: np.ndarray):
        return jax.make_array_from_callback(glob.shape, NamedSharding(mesh, P("ep")),
                                            lambda idx: glob[idx])

    def local(y) -> np.ndarray:
        shards = y.addressable_shards
        assert len(shards) == 1
        return np.asarray(shards[0].data)

    on_gpu = pk.backend_name("moe_dispatch", "ep") == "cuda"

    def check_path(f, args, target: str, fused: bool) -> None:
        """On a GPU, the lowered f calls the fused kernel's target exactly when fused."""
        if on_gpu:
            calls = f"@{target}(" in f.lower(*args).as_text()
            assert calls == fused, (f"rank {me}: fused={fused}, but the HLO "
                                    f"{'calls' if calls else 'does not call'} {target}")

    def run_both(fwd, grad, args, g, target, *, calls, sleep_rank, grads):
        """fwd(*args) `calls` times (the last rank first sleeping when sleep_rank) and, with
        `grads`, grad(*args, g), each traced inside fused_kernels(True) and (False): {fused:
        (this process's outputs, its gradients or None)}."""
        results = {}
        for fused in (True, False):
            with moe_ops.fused_kernels(fused):
                check_path(fwd, args, target, fused)
                outs = None
                for _ in range(calls):
                    if sleep_rank == me:
                        time.sleep(1.0)
                    outs = [local(o) for o in jax.tree.leaves(jax.block_until_ready(fwd(*args)))]
                gr = None
                if grads:
                    gr = [local(v) for v in jax.block_until_ready(grad(*args, place(g)))]
            results[fused] = (outs, gr)
        # Outside a block: PK_JAX_MOE_FUSED as set (unset: "auto", the fused combine only).
        default = moe_ops.fused_enabled(target.removeprefix("pk_"))
        check_path(fwd, args, target, default)
        outs = [local(o) for o in jax.tree.leaves(jax.block_until_ready(fwd(*args)))]
        for a, b in zip(outs, results[False][0]):
            if not np.array_equal(a.astype(np.float64), b.astype(np.float64)):
                raise AssertionError(f"rank {me}: {target} by default (fused={default}) differs "
                                     "from the composition")
        return results

    def check_equal(results, what, out_names, grad_names):
        """The fused path's outputs and gradients equal the composition's, bit for bit."""
        for names, i in ((out_names, 0), (grad_names, 1)):
            if results[True][i] is None:
                continue
            for name, a, b in zip(names, results[True][i], results[False][i]):
                if not np.array_equal(a.astype(np.float64), b.astype(np.float64)):
                    raise AssertionError(f"{what}: fused {name} differs from the composition")

    def build(experts, capacity):
        def body(x, e, w):
            h, sizes, hd = pk.moe_dispatch_gemm(x[0], e[0], w[0], "ep", num_experts=experts,
                                                capacity=capacity)
            return (h[None], sizes[None], hd.dest_rank[None], hd.position[None], hd.dropped,
                    hd.received_dropped)

        fwd = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 3,
                                    out_specs=(P("ep"),) * 6))

        def loss(x, e, w, g):
            return jnp.sum(fwd(x, e, w)[0].astype(jnp.float32) * g)

        grad = jax.jit(jax.grad(loss, argnums=(0, 2)))
        return fwd, grad

    def case(seed, t, k, experts, h, nn, dtype, capacity_kind, *, calls=1, sleep_rank=None,
             grads=False):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, experts, (n, t, k)).astype(np.int32)
        total = n * t * k
        capacity = total + 3 if capacity_kind == "generous" else max(1, total // (2 * n))
        x = rng.integers(-1, 2, (n, t, h)).astype(np.float32)
        w = rng.integers(-1, 2, (n, experts // n, h, nn)).astype(np.float32)
        g = rng.integers(-1, 2, (n, capacity, nn)).astype(np.float32)
        args = (place(x.astype(dtype)), place(ids), place(w.astype(dtype)))
        fwd, grad = build(experts, capacity)
        results = run_both(fwd, grad, args, g, "pk_moe_dispatch_gemm", calls=calls,
                           sleep_rank=sleep_rank, grads=grads)
        check_equal(results, f"P={n} rank {me} case {seed}",
                    ("h", "group_sizes", "dest", "pos", "dropped", "received_dropped"),
                    ("dx", "dw1"))

    def build_gc(experts, capacity):
        def body(x, e, hh, w, wt):
            _, _, hd = pk.moe_dispatch(x[0], e[0], "ep", num_experts=experts, capacity=capacity)
            return pk.moe_gemm_combine(hh[0], w[0], wt[0], hd, "ep")[None]

        fwd = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5,
                                    out_specs=P("ep")))

        def loss(x, e, hh, w, wt, g):
            return jnp.sum(fwd(x, e, hh, w, wt).astype(jnp.float32) * g)

        grad = jax.jit(jax.grad(loss, argnums=(2, 3, 4)))
        return fwd, grad

    def case_gc(seed, t, k, experts, h, f, dtype, capacity_kind, *, calls=1, sleep_rank=None,
                grads=False):
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, experts, (n, t, k)).astype(np.int32)
        total = n * t * k
        capacity = total + 3 if capacity_kind == "generous" else max(1, total // (2 * n))
        x = rng.integers(-1, 2, (n, t, 8)).astype(np.float32)
        hh = rng.integers(-1, 2, (n, capacity, f)).astype(np.float32)
        w = rng.integers(-1, 2, (n, experts // n, f, h)).astype(np.float32)
        wt = (rng.integers(0, 5, (n, t, k)) / 4).astype(np.float32)
        g = rng.integers(-1, 2, (n, t, h)).astype(np.float32)
        args = (place(x.astype(dtype)), place(ids), place(hh.astype(dtype)),
                place(w.astype(dtype)), place(wt))
        fwd, grad = build_gc(experts, capacity)
        results = run_both(fwd, grad, args, g, "pk_moe_gemm_combine", calls=calls,
                           sleep_rank=sleep_rank, grads=grads)
        check_equal(results, f"P={n} rank {me} gemm_combine case {seed}", ("out",),
                    ("dh", "dw2", "dweights"))

    print(f"backend moe_dispatch={pk.backend_name('moe_dispatch', 'ep')}", flush=True)
    t0 = time.time()
    count = 0
    for i, (t, k, e_per, h, nn, dtype) in enumerate([(37, 2, 2, 64, 64, "bfloat16"),
                                                     (64, 4, 4, 128, 264, "float16"),
                                                     (13, 8, 1, 256, 8, "bfloat16")]):
        for kind in ("generous", "tight"):
            case(10 * i + (kind == "tight"), t, k, e_per * n, h, nn, dtype, kind)
            count += 1
    case(91, 50, 2, 2 * n, 64, 64, "bfloat16", "tight", calls=2)
    case(92, 50, 2, 2 * n, 64, 64, "bfloat16", "generous", calls=2, sleep_rank=n - 1)
    case(93, 33, 4, 2 * n, 64, 64, "float16", "generous", grads=True)
    count += 3
    for i, (t, k, e_per, h, f, dtype) in enumerate([(37, 2, 2, 64, 64, "bfloat16"),
                                                    (64, 4, 4, 264, 128, "float16"),
                                                    (13, 8, 1, 8, 256, "bfloat16")]):
        for kind in ("generous", "tight"):
            case_gc(200 + 10 * i + (kind == "tight"), t, k, e_per * n, h, f, dtype, kind)
            count += 1
    case_gc(291, 50, 2, 2 * n, 64, 64, "bfloat16", "tight", calls=2)
    case_gc(292, 50, 2, 2 * n, 64, 64, "bfloat16", "generous", calls=2, sleep_rank=n - 1)
    case_gc(293, 33, 4, 2 * n, 64, 64, "float16", "generous", grads=True)
    count += 3
    print(f"moe_fused_mp OK: P={n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

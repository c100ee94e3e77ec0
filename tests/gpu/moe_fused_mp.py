"""pk.moe_dispatch_gemm's and pk.moe_gemm_combine's fused kernels (forced by
PK_JAX_MOE_FUSED=1 or a pk_jax.ops.moe.fused_kernels() block; by default, "auto", where the one
decider picks them) across P processes, through JAX: the FFI handlers, the lowerings and the
custom VJPs, against a numpy model of the API's contract.

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/moe_fused_mp.py

Every process builds every rank's inputs from one seed and runs pk.moe_dispatch_gemm under
jit(shard_map) three times: traced inside fused_kernels(True) (the fused kernel; on a GPU its
HLO must call pk_moe_dispatch_gemm), inside fused_kernels(False) (pk.moe_dispatch's kernel,
then pk.grouped_matmul's) and outside a block, where the HLO must call the fused kernel exactly
when PK_JAX_MOE_FUSED asks for it (as _backend.route decides for the call's
shape: under "auto", the one decider's pick).
Each run must equal the numpy model (`route` and the per-expert products below) bit for bit:
h, the group sizes and the whole handle; then the gradients of sum(h * g) with respect to x and
w1; then two calls in a row, and a straggler (the last rank sleeps 1 s before its call); and
expert ids outside [0, E) (dropped: no row, in no group, dest and position -1, counted in the
sender's `dropped`). Integer inputs in {-1, 0, 1} and weights in quarters keep every fp32 sum
exact, so each result is the model's float64 value rounded once to its dtype, as the ops
round it.
pk.moe_gemm_combine the same way (on the handle of a pk.moe_dispatch): out, then the gradients
of sum(out * g) with respect to h, w2 and the weights.
On a machine without a GPU every trace runs the references (a check of the script and of the
model).
"""

import contextlib
import time


def route(ids, experts: int, capacity: int):
    """The API's routing in numpy: rank d = e // (E / P) holds expert e; its rows are its
    experts in order, each expert's (source rank, token, slot) in order, cut at capacity.
    Returns (dest, pos [P, T, k], -1 where dropped or the id is outside [0, E); group sizes
    [P, E / P]; received_dropped [P])."""
    import numpy as np

    p = ids.shape[0]
    el = experts // p
    flat = ids.reshape(-1)
    dest, pos = np.full(flat.size, -1), np.full(flat.size, -1)
    sizes, received, fill = np.zeros((p, el), np.int64), np.zeros(p, np.int64), np.zeros(p, int)
    for e in range(experts):
        d = e // el
        for i in np.flatnonzero(flat == e):
            dest[i] = d
            if fill[d] < capacity:
                pos[i] = fill[d]
                sizes[d, e % el] += 1
            else:
                received[d] += 1
            fill[d] += 1
    return dest.reshape(ids.shape), pos.reshape(ids.shape), sizes, received


def per_expert(rows, w, sizes):
    """The grouped product in float64: group e of `rows` (consecutive, sizes[e] rows) times
    w[e]; rows past the groups zero."""
    import numpy as np

    out, off = np.zeros((rows.shape[0], w.shape[2])), 0
    for e, size in enumerate(sizes):
        out[off:off + size] = rows[off:off + size] @ w[e]
        off += size
    return out


def rounded(a, dtype):
    """a (float64, exact) rounded once to `dtype`, back as float64."""
    import numpy as np

    from pk_jax.testing.emulator import np_dtype

    return np.asarray(a, np.float32).astype(np_dtype(dtype)).astype(np.float64)


def dispatch_gemm_model(x, ids, w, g, experts, capacity, dtype):
    """({h, group_sizes, dest, pos, dropped, received_dropped} of every rank stacked, and
    (dx, dw1) of sum(h * g)), in float64."""
    import numpy as np

    p = ids.shape[0]
    dest, pos, sizes, received = route(ids, experts, capacity)
    bufs = np.zeros((p, capacity, x.shape[2]))
    for s, tt, j in zip(*np.nonzero(pos >= 0)):
        bufs[dest[s, tt, j], pos[s, tt, j]] = x[s, tt]
    h = np.stack([rounded(per_expert(bufs[d], w[d], sizes[d]), dtype) for d in range(p)])
    # d h / d bufs: g per group times w^T (zero past the groups), rounded as the dx kernel;
    # dx sums each token's kept slots' rows in fp32 (exact), rounded once.
    dtok = [rounded(per_expert(g[d], w[d].transpose(0, 2, 1), sizes[d]), dtype)
            for d in range(p)]
    dx = np.zeros(x.shape)
    for s, tt, j in zip(*np.nonzero(pos >= 0)):
        dx[s, tt] += dtok[dest[s, tt, j]][pos[s, tt, j]]
    dw = np.zeros(w.shape)
    for d in range(p):
        off = 0
        for e, size in enumerate(sizes[d]):
            dw[d, e] = bufs[d, off:off + size].T @ g[d, off:off + size]
            off += size
    outs = {"h": h, "group_sizes": sizes, "dest": dest, "pos": pos,
            "dropped": (pos < 0).sum(axis=(1, 2)), "received_dropped": received}
    return outs, (rounded(dx, dtype), rounded(dw, dtype))


def gemm_combine_model(ids, hh, w, wt, g, experts, capacity, dtype):
    """(out [P, T, H'], (dh, dw2, dweights)) of moe_gemm_combine on the routing of `ids`
    (rows of hh past the kept ones are never read), in float64."""
    import numpy as np

    p = ids.shape[0]
    dest, pos, sizes, _ = route(ids, experts, capacity)
    ys = [rounded(per_expert(hh[d], w[d], sizes[d]), dtype) for d in range(p)]
    out = np.zeros(g.shape)
    dwt = np.zeros(wt.shape)
    dys = [np.zeros((capacity, w.shape[3])) for _ in range(p)]  # one slot per kept row
    for s, tt, j in zip(*np.nonzero(pos >= 0)):
        row = ys[dest[s, tt, j]][pos[s, tt, j]]
        out[s, tt] += wt[s, tt, j] * row
        dwt[s, tt, j] = g[s, tt] @ row
        dys[dest[s, tt, j]][pos[s, tt, j]] = rounded(wt[s, tt, j] * g[s, tt], dtype)
    dh = np.stack([rounded(per_expert(dys[d], w[d].transpose(0, 2, 1), sizes[d]), dtype)
                   for d in range(p)])
    dw = np.zeros(w.shape)
    for d in range(p):
        off = 0
        for e, size in enumerate(sizes[d]):
            dw[d, e] = hh[d, off:off + size].T @ dys[d][off:off + size]
            off += size
    return rounded(out, dtype), (dh, rounded(dw, dtype), rounded(dwt, "float32"))


def main() -> None:
    import pk_jax.launch

    pk_jax.launch.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pk_jax as pk
    from pk_jax import cost_model
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

    def check_equal(got, want, what: str) -> None:
        """This process's results equal rank `me`'s of the model, bit for bit."""
        for name, a in got.items():
            b = np.asarray(want[name][me], np.float64)
            a = np.asarray(a, np.float64).reshape(b.shape)
            if not np.array_equal(a, b):
                bad = np.flatnonzero(a.ravel() != b.ravel())
                raise AssertionError(f"{what}: {name} differs from the numpy model at "
                                     f"{bad.size} elements, first {int(bad[0])}: got "
                                     f"{a.ravel()[bad[0]]}, want {b.ravel()[bad[0]]}")

    def run_all(fwd, grad, args, g, target, names, want, grad_names, want_grads, what, *,
                calls, sleep_rank, grads, shape, itemsize):
        """fwd(*args) `calls` times (the last rank first sleeping when sleep_rank) and, with
        `grads`, grad(*args, g), traced inside fused_kernels(True), (False) and outside a
        block (PK_JAX_MOE_FUSED as set: the path _backend.route takes for the decider's
        `shape` of the call: the override, else cost_model.choose); each against the model."""
        op = target.removeprefix("pk_")
        gpu = cost_model.gpu_for(jax.devices()[0].device_kind)
        default = (cost_model.overlap_override(op)
                   or cost_model.choose(op, shape, n, itemsize=itemsize, gpu=gpu)) == "fused"
        for fused in (True, False, None):
            block = moe_ops.fused_kernels(fused) if fused is not None else contextlib.nullcontext()
            with block:
                check_path(fwd, args, target, default if fused is None else fused)
                for _ in range(calls):
                    if sleep_rank == me:
                        time.sleep(1.0)
                    outs = [local(o) for o in jax.tree.leaves(jax.block_until_ready(fwd(*args)))]
                    assert len(outs) == len(names), (what, len(outs))
                    check_equal(dict(zip(names, outs)), want, f"{what} fused={fused}")
                if grads:
                    gr = [local(v) for v in jax.block_until_ready(grad(*args, place(g)))]
                    assert len(gr) == len(grad_names), (what, len(gr))
                    check_equal(dict(zip(grad_names, gr)), want_grads, f"{what} fused={fused}")

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

    def routing(rng, t, k, experts, invalid):
        ids = rng.integers(0, experts, (n, t, k)).astype(np.int32)
        if invalid:  # about a quarter of the slots outside [0, E), both sides
            bad = rng.choice(np.array([-1, -5, experts, experts + 7], np.int32), ids.shape)
            ids = np.where(rng.random(ids.shape) < 0.25, bad, ids).astype(np.int32)
        return ids

    def case(seed, t, k, experts, h, nn, dtype, capacity_kind, *, calls=1, sleep_rank=None,
             grads=False, invalid=False):
        rng = np.random.default_rng(seed)
        ids = routing(rng, t, k, experts, invalid)
        total = n * t * k
        capacity = total + 3 if capacity_kind == "generous" else max(1, total // (2 * n))
        x = rng.integers(-1, 2, (n, t, h)).astype(np.float32)
        w = rng.integers(-1, 2, (n, experts // n, h, nn)).astype(np.float32)
        g = rng.integers(-1, 2, (n, capacity, nn)).astype(np.float32)
        want, want_grads = dispatch_gemm_model(x.astype(np.float64), ids, w.astype(np.float64),
                                               g.astype(np.float64), experts, capacity, dtype)
        args = (place(x.astype(dtype)), place(ids), place(w.astype(dtype)))
        fwd, grad = build(experts, capacity)
        run_all(fwd, grad, args, g, "pk_moe_dispatch_gemm",
                ("h", "group_sizes", "dest", "pos", "dropped", "received_dropped"), want,
                ("dx", "dw1"), dict(zip(("dx", "dw1"), want_grads)),
                f"P={n} rank {me} case {seed}", calls=calls, sleep_rank=sleep_rank, grads=grads,
                shape={"t": t, "k": k, "experts": experts, "h": h, "hidden": nn},
                itemsize=np.dtype(dtype).itemsize)

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
                grads=False, invalid=False):
        rng = np.random.default_rng(seed)
        ids = routing(rng, t, k, experts, invalid)
        total = n * t * k
        capacity = total + 3 if capacity_kind == "generous" else max(1, total // (2 * n))
        x = rng.integers(-1, 2, (n, t, 8)).astype(np.float32)
        hh = rng.integers(-1, 2, (n, capacity, f)).astype(np.float32)
        w = rng.integers(-1, 2, (n, experts // n, f, h)).astype(np.float32)
        wt = (rng.integers(0, 5, (n, t, k)) / 4).astype(np.float32)
        g = rng.integers(-1, 2, (n, t, h)).astype(np.float32)
        out, want_grads = gemm_combine_model(ids, hh.astype(np.float64), w.astype(np.float64),
                                             wt.astype(np.float64), g.astype(np.float64),
                                             experts, capacity, dtype)
        args = (place(x.astype(dtype)), place(ids), place(hh.astype(dtype)),
                place(w.astype(dtype)), place(wt))
        fwd, grad = build_gc(experts, capacity)
        names = ("dh", "dw2", "dweights")
        run_all(fwd, grad, args, g, "pk_moe_gemm_combine", ("out",), {"out": out}, names,
                dict(zip(names, want_grads)), f"P={n} rank {me} gemm_combine case {seed}",
                calls=calls, sleep_rank=sleep_rank, grads=grads,
                shape={"t": t, "k": k, "experts": experts, "h": h, "hidden": f},
                itemsize=np.dtype(dtype).itemsize)

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
    case(94, 41, 3, 2 * n, 64, 64, "bfloat16", "generous", grads=True, invalid=True)
    case(95, 41, 3, 2 * n, 64, 64, "float16", "tight", invalid=True)
    count += 5
    for i, (t, k, e_per, h, f, dtype) in enumerate([(37, 2, 2, 64, 64, "bfloat16"),
                                                    (64, 4, 4, 264, 128, "float16"),
                                                    (13, 8, 1, 8, 256, "bfloat16")]):
        for kind in ("generous", "tight"):
            case_gc(200 + 10 * i + (kind == "tight"), t, k, e_per * n, h, f, dtype, kind)
            count += 1
    case_gc(291, 50, 2, 2 * n, 64, 64, "bfloat16", "tight", calls=2)
    case_gc(292, 50, 2, 2 * n, 64, 64, "bfloat16", "generous", calls=2, sleep_rank=n - 1)
    case_gc(293, 33, 4, 2 * n, 64, 64, "float16", "generous", grads=True)
    case_gc(294, 41, 3, 2 * n, 64, 64, "bfloat16", "generous", grads=True, invalid=True)
    count += 4
    print(f"moe_fused_mp OK: P={n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

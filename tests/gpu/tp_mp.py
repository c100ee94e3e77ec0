"""The fused tensor-parallel GEMM ops (gemm_rs, ag_gemm, gemm_ar) across P processes.

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/tp_mp.py

P processes share the one GPU (run_all.sh runs P = 2, 4, 8). Every rank builds every rank's
inputs from one seed (host numpy), runs the op under jit(shard_map) on a 1-D mesh over all
processes, and compares its own shard with a reference computed on the host from all ranks'
inputs (XLA's collectives cannot run with two ranks on one GPU). Cases, each in the fused mode
(forced with pk_jax.cost_model.override) unless it says otherwise:

- integer inputs in {-1, 0, 1} (every partial product and every order of the cross-rank sum
  is exact in bf16/fp16): compared bit for bit, both dtypes;
- random normal inputs: error against the float64 sum at most twice that of the same
  computation in the dtype (each rank's product by XLA, summed in the dtype) plus an atol;
- odd shard sizes (not multiples of the 128-row tile), M < P for gemm_ar, more tiles than SMs;
- ag_gemm with 1, 4 and 16 communication SMs, and its gathered x compared exactly;
- two calls in a row with different inputs, with a pk.all_reduce in between that reuses the
  symmetric workspace;
- a straggler: the last rank sleeps 1 s before its call;
- the "serial" mode (pk.matmul + the pk collective) once per op;
- gradients of a TP MLP (pk_jax.nn column + row layers, with and without sequence parallelism)
  with respect to its sharded weights, against the unsharded reference MLP on this process's
  device.

On a machine without a GPU the same script runs on CPU processes, where the ops fall back to
their references: a check of the script itself.
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
    from pk_jax import cost_model
    from pk_jax.ops import ag_gemm

    me, n = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((n,), ("x",))
    pk.init(mesh)
    print(f"backend gemm_rs={pk.backend_name('gemm_rs', 'x')} "
          f"ag_gemm={pk.backend_name('ag_gemm', 'x')} gemm_ar={pk.backend_name('gemm_ar', 'x')}",
          flush=True)

    def blocks(seed: int, shape, dtype, kind: str) -> list:
        """Every rank's block, identical in every process."""
        rng = np.random.default_rng(seed)
        if kind == "int":
            vals = [rng.integers(-1, 2, size=shape).astype(np.float64) for _ in range(n)]
        else:
            vals = [rng.standard_normal(shape) for _ in range(n)]
        return [np.asarray(v, dtype=dtype) for v in vals]

    def place(parts: list, axis: int, spec):
        glob = np.concatenate(parts, axis=axis)
        return jax.make_array_from_callback(glob.shape, NamedSharding(mesh, spec),
                                            lambda idx: glob[idx])

    def local(y) -> np.ndarray:
        shards = y.addressable_shards
        assert len(shards) == 1
        return np.asarray(shards[0].data, dtype=np.float64)

    def f64(a) -> np.ndarray:
        return np.asarray(a, dtype=np.float64)

    def sum_in_dtype(parts: list, dtype) -> np.ndarray:
        """XLA's own same-dtype path: each partial rounded to the dtype, summed in the dtype."""
        acc = np.asarray(parts[0], dtype=dtype)
        for p in parts[1:]:
            acc = np.asarray(f64(acc) + f64(np.asarray(p, dtype=dtype)), dtype=dtype)
        return f64(acc)

    def xla_dot(a, b, dtype) -> np.ndarray:
        """x @ w by XLA on this process's device, in the dtype (fp32 accumulation)."""
        return np.asarray(jax.jit(lambda u, v: u @ v)(jnp.asarray(a), jnp.asarray(b)),
                          dtype=dtype)

    def compare(got, want, what: str, *, exact: bool, xla=None, atol=0.0):
        if got.shape != want.shape:
            raise AssertionError(f"rank {me}: {what}: shape {got.shape} vs {want.shape}")
        if exact:
            if not np.array_equal(got, want):
                bad = np.argwhere(got != want)
                raise AssertionError(f"rank {me}: {what}: {len(bad)} mismatches, first "
                                     f"{bad[:3].tolist()} got {got[tuple(bad[0])]} want "
                                     f"{want[tuple(bad[0])]}")
            return
        err = np.max(np.abs(got - want))
        err_xla = np.max(np.abs(xla - want))
        if not err <= 2 * err_xla + atol:
            raise AssertionError(f"rank {me}: {what}: error {err} > 2 * {err_xla} + {atol}")

    def call(op: str, x, w, mode: str, sms=None, sleep=False):
        if op == "gemm_rs":
            fn, specs, out = (lambda a, b: pk.gemm_reduce_scatter(a, b, "x"),
                              (P(None, "x"), P("x", None)), P("x", None))
        elif op == "gemm_ar":
            fn, specs, out = (lambda a, b: pk.gemm_all_reduce(a, b, "x"),
                              (P(None, "x"), P("x", None)), P())
        else:
            fn, specs, out = (lambda a, b: ag_gemm.ag_gemm_impl(a, b, "x", return_gathered=True),
                              (P("x", None), P(None, "x")), (P(None, "x"), P("x", None)))
        with cost_model.override(mode=mode, num_comm_sms=sms):
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out))
            if sleep:
                time.sleep(1.0)
            return f(x, w)

    def case(op, rows, k, cols, dtype, kind, seed, *, mode="fused", sms=None, calls=1,
             between=False, sleep_rank=None):
        """rows: M/P (gemm_rs, ag_gemm) or M (gemm_ar); k: K/P (gemm_rs, gemm_ar) or K
        (ag_gemm); cols: N (gemm_rs, gemm_ar) or N/P (ag_gemm)."""
        for c in range(calls):
            what = (f"{op} rows={rows} k={k} cols={cols} {np.dtype(dtype).name} {kind} "
                    f"mode={mode} sms={sms} call {c}")
            if op == "ag_gemm":
                xs = blocks(seed + c, (rows, k), dtype, kind)
                ws = blocks(seed + 100 + c, (k, cols), dtype, kind)
                x, w = place(xs, 0, P("x", None)), place(ws, 1, P(None, "x"))
            else:
                m = rows * n if op == "gemm_rs" else rows
                xs = blocks(seed + c, (m, k), dtype, kind)
                ws = blocks(seed + 100 + c, (k, cols), dtype, kind)
                x, w = place(xs, 1, P(None, "x")), place(ws, 0, P("x", None))
            res = call(op, x, w, mode, sms, sleep=sleep_rank == me)
            if op == "ag_gemm":
                y, x_full = res
                xf = np.concatenate([f64(v) for v in xs], axis=0)
                compare(local(x_full), xf, what + " (gathered x)", exact=True)
                want = xf @ f64(ws[me])
                xla = f64(xla_dot(np.concatenate(xs, axis=0), ws[me], dtype))
            else:
                y = res
                parts = [f64(a) @ f64(b) for a, b in zip(xs, ws)]
                lo, hi = (me * rows, (me + 1) * rows) if op == "gemm_rs" else (0, rows)
                want = sum(parts)[lo:hi]
                if kind == "int":
                    bound = np.max(sum(np.abs(p) for p in parts))
                    assert bound < 256, f"test data too large for exact bf16 sums: {bound}"
                xla = sum_in_dtype([xla_dot(a, b, dtype) for a, b in zip(xs, ws)],
                                   dtype)[lo:hi]
            if kind == "int":
                compare(local(y), np.asarray(want, dtype=dtype).astype(np.float64), what,
                        exact=True)
            else:
                compare(local(y), want, what, exact=False, xla=xla, atol=1e-3 * np.sqrt(k * n))
            if between:  # a collective reuses the workspace before the next call
                junk = place([np.full((512, 256), 3.0, np.float32)] * n, 0, P("x", None))
                g = jax.jit(jax.shard_map(lambda a: pk.all_reduce(a, "x"), mesh=mesh,
                                          in_specs=(P("x", None),), out_specs=P("x", None)))
                jax.block_until_ready(g(junk))

    def mlp_case(sequence_parallel: bool, seed: int):
        """Gradients of a TP MLP (pk_jax.nn layers, fused ops) against the unsharded reference
        MLP computed on this process's device.

        NOTES: no XLA collective may run here (NCCL refuses two ranks on one GPU): the loss is
        reduced inside the shard_map with pk.all_reduce, and only the sharded parameters (w1, b1,
        w2) are differentiated; a replicated input's cotangent would need XLA's psum.
        """
        from pk_jax import nn as pknn

        d, hdim, s = 128, 64 * n, 40 * n
        rng = np.random.default_rng(seed)
        full = [rng.standard_normal(sh).astype(np.float32) * sc for sh, sc in
                (((s, d), 0.5), ((d, hdim), 1 / 11), ((hdim,), 0.1), ((hdim, d), 1 / 16),
                 ((d,), 0.1))]
        xs = P("x", None) if sequence_parallel else P()
        specs = (xs, P(None, "x"), P("x"), P("x", None), P())

        def local_loss(x, w1, b1, w2, b2):
            h = pknn.column_parallel_linear(x, w1, b1, axis_name="x",
                                            sequence_parallel=sequence_parallel)
            y = pknn.row_parallel_linear(jax.nn.gelu(h), w2, b2, axis_name="x",
                                         sequence_parallel=sequence_parallel)
            part = jnp.sum(y.astype(jnp.float32) ** 2)
            # Sequence-parallel rows are split over the ranks: sum the parts with pk's own
            # all-reduce. Plain TP leaves y replicated, so every rank already has the loss.
            return pk.all_reduce(part, "x") if sequence_parallel else part

        args = [jax.make_array_from_callback(a.shape, NamedSharding(mesh, sp),
                                             lambda i, a=a: a[i]) for a, sp in zip(full, specs)]
        tp = jax.shard_map(local_loss, mesh=mesh, in_specs=specs, out_specs=P())
        with cost_model.override(mode="fused"):
            val, grads = jax.jit(jax.value_and_grad(tp, argnums=(1, 2, 3)))(*args)
        dev = jax.local_devices()[0]

        def ref_loss(*a):
            return jnp.sum(pknn.reference_mlp(*a).astype(jnp.float32) ** 2)

        ref_val, ref_grads = jax.jit(jax.value_and_grad(ref_loss, argnums=(1, 2, 3)))(
            *[jax.device_put(a, dev) for a in full])
        what = f"tp mlp sequence_parallel={sequence_parallel}"
        got_val = float(np.asarray(val.addressable_shards[0].data))
        assert abs(got_val - float(ref_val)) <= 2e-2 * abs(float(ref_val)), (what, got_val,
                                                                             float(ref_val))
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            shard = g.addressable_shards[0]
            a = np.asarray(shard.data, np.float32)
            b = np.asarray(r, np.float32)[shard.index]
            err, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
            assert err <= 3e-2 * scale + 1e-3, f"rank {me}: {what}: grad {i} error {err} ({scale})"

    t0 = time.time()
    count = 0
    bf16, fp16 = jnp.bfloat16, jnp.float16
    for op in ("gemm_rs", "gemm_ar", "ag_gemm"):
        case(op, 75, 64, 72, bf16, "int", 1, calls=2, between=True)
        case(op, 200, 128, 130, fp16, "int", 2)
        case(op, 333, 512, 264, bf16, "normal", 3, calls=2)
        case(op, 1000, 64, 1032, bf16, "int", 4, sms=4)
        case(op, 130, 64, 64, bf16, "int", 5, calls=2, sleep_rank=n - 1)
        case(op, 75, 64, 72, fp16, "int", 6, mode="serial")
        count += 6
    case("gemm_ar", 5, 64, 40, bf16, "int", 7)  # M < P for P = 8: owners without rows
    case("gemm_ar", 7 * n + 3, 64, 40, fp16, "int", 8, calls=2)
    case("ag_gemm", 1000, 64, 264, bf16, "int", 9, sms=1)
    case("ag_gemm", 300, 256, 136, fp16, "normal", 10, sms=16)
    count += 4
    for sp in (True, False):
        mlp_case(sp, 11)
        count += 1
    pk.shutdown()
    print(f"tp_mp OK: P={n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

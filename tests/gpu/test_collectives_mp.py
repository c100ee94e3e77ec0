"""The four collective kernels across P processes that share one GPU.

Run by pytest (the `gpu` tests below start the launcher), or directly:

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/test_collectives_mp.py [mode]

mode "main" (default): every rank builds every rank's input from one seed, runs pk.all_reduce
(one-shot and two-shot), pk.all_gather, pk.reduce_scatter and pk.all_to_all under
jit(shard_map) on a 1-D mesh over all processes, and compares its own shard of the result
with a reference computed on the host from all ranks' inputs (XLA's collectives cannot run with
two ranks on one GPU). Cases: integer inputs (exact sums) in every dtype, x = rank, odd sizes
and sizes below one 16-byte unit, axes other than 0, two calls in a row, the input overwritten
right after a call, a straggler rank that sleeps 1 s before its call, a workspace so small that
every op runs many chunked rounds, and (P >= 4) a 2-D mesh whose two communicators are used
alternately.

mode "dead": after one good call, the last rank exits; the others call again and must fail
within PK_JAX_TIMEOUT_S + a few seconds, and the error record must name the timeout, the op and
the missing peer.
"""

import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(nproc: int, mode: str, extra_env: dict | None = None, timeout: int = 400):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", **(extra_env or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    return subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", str(nproc),
                           "--share-gpu", "--timeout", str(timeout - 20),
                           os.path.abspath(__file__), mode],
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_collectives_processes_share_one_gpu(nproc):
    out = _launch(nproc, "main")
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    for rank in range(nproc):
        assert f"[rank {rank}] collectives_mp OK" in out.stdout, out.stdout[-8000:]


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2, 4])
def test_dead_rank_times_out(nproc):
    out = _launch(nproc, "dead", {"PK_JAX_TIMEOUT_S": "5"}, timeout=200)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-3000:]
    for rank in range(nproc - 1):
        assert f"[rank {rank}] dead-rank OK" in out.stdout, out.stdout[-8000:]


# ---------------------------------------------------------------------------------------------
# What every process runs.

def _expected(op: str, xs: list, rank: int, **kw):
    """The result on `rank` of `op` over the ranks' inputs `xs` (numpy, float64/int64)."""
    import numpy as np

    p = len(xs)
    if op == "all_reduce":
        return sum(xs)
    if op == "all_gather":
        return np.concatenate(xs, axis=kw.get("axis", 0))
    if op == "reduce_scatter":
        return np.split(sum(xs), p, axis=kw.get("scatter_dimension", 0))[rank]
    if op == "all_to_all":
        return np.concatenate([np.split(x, p, axis=kw["split_axis"])[rank] for x in xs],
                              axis=kw["concat_axis"])
    raise ValueError(op)


def main(mode: str) -> None:
    import pk_jax.launch

    pk_jax.launch.initialize()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import pk_jax as pk
    from pk_jax.runtime import errors

    me, n = jax.process_index(), jax.process_count()
    DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
    ops = {"all_reduce": pk.all_reduce, "all_gather": pk.all_gather,
           "reduce_scatter": pk.reduce_scatter, "all_to_all": pk.all_to_all}

    def inputs(seed: int, shape, dtype, kind: str) -> list:
        """Every rank's input, identical in every process (host numpy)."""
        rng = np.random.default_rng(seed)
        out = []
        for r in range(n):
            if kind == "rank":
                v = np.full(shape, r + 1, np.float64)
            elif kind == "index":  # x = rank * 1000 + position: every element names its origin
                v = r * 1000 + np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) % 997
            else:
                v = rng.integers(-8, 9, size=shape).astype(np.float64)
            out.append(v)
        if np.dtype(dtype) == np.dtype(jnp.float16) or np.dtype(dtype) == np.dtype(jnp.bfloat16):
            # bf16 holds integers exactly up to 256: keep sums in range.
            out = [np.where(np.abs(v) > 200, np.mod(v, 97), v) for v in out]
        return out

    def run(mesh, axes, fn, xs_by_device: list, out_ndim: int):
        """fn under jit(shard_map) with device k's block = xs_by_device[k] (stacked on dim 0);
        returns this process's output block."""
        spec = P(axes if len(axes) > 1 else axes[0])
        glob = np.concatenate(xs_by_device, axis=0)
        arr = jax.make_array_from_callback(glob.shape, NamedSharding(mesh, spec),
                                           lambda idx: glob[idx])
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,), out_specs=spec))
        y = f(arr)
        return y, arr, f

    def local(y):
        shards = y.addressable_shards
        assert len(shards) == 1
        return np.asarray(shards[0].data.astype(jnp.float32) if shards[0].data.dtype != jnp.int32
                          else shards[0].data)

    def check(got, want, what: str):
        want = np.asarray(want)
        if got.shape != want.shape or not np.array_equal(got.astype(np.float64), want):
            bad = np.argwhere(got.astype(np.float64) != want) if got.shape == want.shape else []
            raise AssertionError(f"rank {me}: {what}: shape {got.shape} vs {want.shape}, "
                                 f"{len(bad)} mismatches, first {bad[:3].tolist() if len(bad) else ''} "
                                 f"got {got.ravel()[:8]} want {want.ravel()[:8]}")

    def case(mesh, mesh_axis, op, shape, dtype, kind, seed, *, calls=1, sleep_rank=None, **kw):
        """One op on a 1-D or 2-D mesh; device (i, j) of a 2-D mesh has block i * T + j."""
        devs = mesh.devices
        grid = devs.shape
        names = mesh.axis_names
        ai = names.index(mesh_axis)
        nd = int(np.prod(grid))
        xs_all = inputs(seed, shape, dtype, kind) if nd == n else None
        assert xs_all is not None
        blocks = [x.astype(dtype) if dtype != jnp.int32 else x.astype(np.int32) for x in xs_all]
        fn = lambda a: ops[op](a, mesh_axis, **kw)
        y = None
        for c in range(calls):
            if sleep_rank == me:
                time.sleep(1.0)
            y, arr, f = run(mesh, names, fn, [np.asarray(b) for b in blocks], len(shape))
        # Which device is mine, my group and my rank in it.
        pos = [tuple(ix) for ix in np.argwhere(np.vectorize(lambda d: d.process_index)(devs) == me)]
        assert len(pos) == 1
        pos = pos[0]
        group = []
        for r in range(grid[ai]):
            q = list(pos)
            q[ai] = r
            group.append(int(np.ravel_multi_index(q, grid)))
        xs = [np.asarray(np.asarray(blocks[k]).astype(np.float64)) for k in group]
        want = _expected(op, xs, pos[ai], **kw)
        check(local(y), want, f"{op} {dict(mesh.shape)} over {mesh_axis} shape={shape} "
              f"{np.dtype(dtype).name} {kind} {kw}")
        return y, arr, f, want

    mesh = jax.make_mesh((n,), ("x",))

    if mode == "dead":
        # NOTES: XLA's GPU compiler synchronises the processes while compiling (it shares
        # autotuning results through the key-value store), so a rank that dies before the first
        # compile hangs the others in jit, outside pk_jax. The realistic case, a rank that dies
        # between steps of a running job, is what is tested: one good call with every rank,
        # then the last rank exits and the others call the compiled function again.
        import faulthandler
        import threading

        from jax._src.distributed import global_state

        pk.init(mesh)
        xs = [v.astype(np.float32) for v in inputs(0, (64, 8), jnp.float32, "int")]
        y, arr, f = run(mesh, ("x",), lambda a: pk.all_reduce(a, "x"), xs, 2)
        check(local(y), sum(x.astype(np.float64) for x in xs), "all_reduce before the exit")
        client = global_state.client
        client.key_value_set(f"collectives_mp/dead/{me}", "1")
        for p in range(n):
            client.blocking_key_value_get(f"collectives_mp/dead/{p}", 60_000)
        if me == n - 1:
            print("dead rank exits before its second call", flush=True)
            os._exit(0)

        def watchdog():  # if the call neither returns nor raises, show where and what
            time.sleep(30)
            print(f"watchdog: still waiting after 30 s, record {errors.read()}", flush=True)
            faulthandler.dump_traceback(all_threads=True)

        threading.Thread(target=watchdog, daemon=True).start()
        t0 = time.time()
        try:
            y = f(arr)
            y.block_until_ready()
            np.asarray(y.addressable_shards[0].data)
            raise AssertionError("the op completed without the dead rank")
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever the failed launch raises
            took = time.time() - t0
            rec = errors.read()
            print(f"failed after {took:.1f} s: {type(e).__name__}: {str(e)[:160]}", flush=True)
            print(f"record {rec}: {errors.describe(rec)}", flush=True)
            assert rec[0] == 1 and rec[1] == 1 and rec[2] == me and rec[3] == n - 1, rec
            assert took < 5 + 15, took
        print("dead-rank OK", flush=True)
        os._exit(0)

    # --- main mode -----------------------------------------------------------------------
    t_start = time.time()
    pk.init(mesh)
    n_cases = 0
    for dtype in DTYPES:
        for kind in ("int", "rank"):
            for algo in ("one_shot", "two_shot"):
                case(mesh, "x", "all_reduce", (2 * n, 33), dtype, kind, 1, algorithm=algo)
                n_cases += 1
    for dtype in DTYPES + (jnp.int32,):
        case(mesh, "x", "all_gather", (3, 5), dtype, "index", 2, axis=0)
        case(mesh, "x", "all_gather", (4, 7, 3), dtype, "index", 3, axis=1)
        case(mesh, "x", "all_to_all", (2 * n, 3, n), dtype, "index", 4, split_axis=0,
             concat_axis=1)
        case(mesh, "x", "all_to_all", (2, 3 * n, 4, 8), dtype, "index", 5, split_axis=1,
             concat_axis=2)
        n_cases += 4
    for dtype in DTYPES:
        case(mesh, "x", "reduce_scatter", (n, 3), dtype, "int", 6, scatter_dimension=0)
        case(mesh, "x", "reduce_scatter", (5, 4 * n, 16), dtype, "int", 7, scatter_dimension=1)
        case(mesh, "x", "all_gather", (1,), dtype, "index", 8, axis=0)  # below one unit
        case(mesh, "x", "all_reduce", (1,), dtype, "rank", 9)
        n_cases += 4
    # Larger odd sizes with the 16-byte paths and tails; two calls in a row.
    case(mesh, "x", "all_reduce", (1000, 1001), jnp.float32, "int", 10, calls=2)
    case(mesh, "x", "all_reduce", (257, 1031), jnp.bfloat16, "int", 11, calls=2,
         algorithm="two_shot")
    case(mesh, "x", "all_gather", (333, 128), jnp.bfloat16, "index", 12, calls=2)
    case(mesh, "x", "reduce_scatter", (64 * n, 1000), jnp.float32, "int", 13, calls=2)
    case(mesh, "x", "all_to_all", (8 * n, 96, 64), jnp.float16, "index", 14, split_axis=0,
         concat_axis=1, calls=2)
    n_cases += 5
    # The input overwritten right after the call (donated to a jit that rewrites it).
    y, arr, f, want = case(mesh, "x", "all_reduce", (512, 256), jnp.float32, "int", 15)
    y2 = f(arr)
    jax.jit(lambda a: a * 0 + 12345.0, donate_argnums=0)(arr).block_until_ready()
    check(local(y2), want, "all_reduce with its input overwritten right after the call")
    # A straggler: the last rank sleeps 1 s before each of two calls.
    case(mesh, "x", "all_reduce", (300, 77), jnp.float32, "int", 16, calls=2, sleep_rank=n - 1)
    case(mesh, "x", "all_to_all", (4 * n, 40), jnp.int32, "index", 17, split_axis=0,
         concat_axis=0, sleep_rank=0)
    n_cases += 3
    pk.shutdown()

    # A workspace so small that every op runs many rounds of chunks (double buffering).
    pk.init(mesh, workspace_bytes=1 << 20)
    case(mesh, "x", "all_reduce", (1000, 517), jnp.float32, "int", 18, calls=2)
    case(mesh, "x", "all_reduce", (1000, 517), jnp.bfloat16, "int", 19, algorithm="two_shot")
    case(mesh, "x", "all_gather", (300, 257), jnp.float16, "index", 20, axis=1)
    case(mesh, "x", "reduce_scatter", (40 * n, 999), jnp.float32, "int", 21)
    case(mesh, "x", "all_to_all", (4 * n, 999), jnp.float32, "index", 22, split_axis=0,
         concat_axis=1, calls=2)
    n_cases += 5
    pk.shutdown()

    # Two communicators of a 2-D mesh, used alternately.
    if n >= 4 and n % 2 == 0:
        mesh2 = jax.make_mesh((2, n // 2), ("dp", "tp"))
        pk.init(mesh2)
        for it in range(2):
            for axis in ("tp", "dp", "tp", "dp"):
                case(mesh2, axis, "all_reduce", (8, 33), jnp.float32, "int", 30 + it)
                case(mesh2, axis, "all_gather", (4, 9), jnp.bfloat16, "index", 40 + it, axis=1)
                n_cases += 2
        pk.shutdown()

    # Several meshes at once (pk.init adds each): ops over either, interleaved, then one
    # pk.shutdown releases every communicator.
    meshes = [mesh, jax.make_mesh((n,), ("y",))]
    if n >= 4 and n % 2 == 0:
        meshes.append(jax.make_mesh((2, n // 2), ("dp", "tp")))
    for m in meshes:
        pk.init(m)
    for it in range(2):
        for m in meshes + meshes[::-1]:
            for axis in m.axis_names:
                case(m, axis, "all_reduce", (8, 33), jnp.float32, "int", 50 + it)
                case(m, axis, "all_gather", (4, 9), jnp.bfloat16, "index", 60 + it, axis=1)
                n_cases += 2
    pk.shutdown()
    from pk_jax import _ffi
    assert _ffi._pk_ffi.comm_count() == 0, "pk.shutdown left communicators"
    print(f"collectives_mp OK: P={n}, {n_cases} cases in {time.time() - t_start:.1f} s",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "main")

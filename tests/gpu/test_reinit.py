"""Executables and pk.shutdown() (issue 10 item 4). A communicator handler binds its
communicator when XLA instantiates the executable (ffi/comm_state.h); pk.shutdown unmaps that
communicator's workspaces. A function jitted before the shutdown is compiled anew after the next
pk.init (JAX's caches are cleared) and must be right; an executable kept past the shutdown must
refuse to run with a clear error, never launch kernels on the released memory."""

from __future__ import annotations

import os
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import util

import pk_jax as pk
from pk_jax import _ffi, cost_model
from pk_jax.runtime import state

pytestmark = pytest.mark.gpu


def test_jitted_ops_after_shutdown_and_init_with_another_workspace():
    mesh = util.gpu_mesh("gemm_rs", workspace_bytes=32 << 20)

    def body(x, w):
        return pk.all_reduce(x @ w, "tp"), pk.gemm_reduce_scatter(x, w, "tp")

    with cost_model.override(mode="fused"):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                  out_specs=(P(), P("tp"))))
        rng = np.random.default_rng(0)
        outs = []
        for step in range(3):
            x = jnp.asarray(rng.integers(-2, 3, (512, 256)), jnp.bfloat16)
            w = jnp.asarray(rng.integers(-2, 3, (256, 384)), jnp.bfloat16)
            want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
            for _ in range(2):  # replays of the same executable
                a, b = f(x, w)
                outs.append((np.asarray(a, np.float32), np.asarray(b, np.float32), want))
            pk.shutdown()
            pk.init(mesh, workspace_bytes=(64 << 20) * (step + 1))
    for a, b, want in outs:
        np.testing.assert_array_equal(a, want)
        np.testing.assert_array_equal(b, want)


def _ints(seed, shape):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(-2, 3, shape), jnp.bfloat16)


def _check(outs, x, w):
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # small integers: exact
    for y in outs:
        np.testing.assert_array_equal(np.asarray(y, np.float32), want)


def test_compiled_executable_kept_across_shutdown_refuses_to_run():
    """An executable kept past pk.shutdown (a jax.jit(...).lower(...).compile() object, which
    JAX's cache clearing cannot drop) bound its communicators when XLA instantiated it: after
    pk.init with another workspace size its calls fail with the error naming the fix, before
    any kernel touches the released workspaces, and the process stays usable."""
    mesh = util.gpu_mesh("gemm_rs", workspace_bytes=32 << 20)

    def body(x, w):
        return pk.all_reduce(x @ w, "tp"), pk.gemm_reduce_scatter(x, w, "tp")

    x, w = _ints(1, (512, 256)), _ints(2, (256, 384))
    with cost_model.override(mode="fused"):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()),
                                  out_specs=(P(), P("tp"))))
        compiled = f.lower(x, w).compile()
        for i in range(2):  # replays of the executable: its state's fast path
            util.poison((512, 384), jnp.bfloat16)
            _check(compiled(x + i, w), x + i, w)
        # Another registration coming and going retires only that one: the state's own
        # registration is still live, and it runs on.
        _ffi._pk_ffi.comm_register(9999, 0, 0, 1, [0x1000], [0x3000], 4096, 64, 10**9, 0x5000)
        assert _ffi._pk_ffi.comm_unregister(9999, 0)
        _check(compiled(x, w), x, w)
        pk.shutdown()
        pk.init(mesh, workspace_bytes=96 << 20)
        for _ in range(2):
            with pytest.raises(Exception, match=r"pk.shutdown\(\) released"):
                jax.block_until_ready(compiled(x, w))
        # The same jitted function compiles anew and binds the new communicators.
        for i in range(2):
            _check(f(x - i, w), x - i, w)
        _check(f.lower(x, w).compile()(x, w), x, w)
    pk.shutdown()


def test_jitted_function_survives_three_reinits_with_other_workspace_sizes():
    """Run, shut down, init with another size, run the same jitted function: correct each time
    (JAX compiles it anew after the shutdown; the new executable binds the new workspaces)."""
    x, w = _ints(3, (256, 128)), _ints(4, (128, 256))
    f = None
    for ws in (16 << 20, 80 << 20, 8 << 20):
        mesh = util.gpu_mesh("gemm_rs", workspace_bytes=ws)
        if f is None:
            f = jax.jit(jax.shard_map(lambda a, b: pk.gemm_reduce_scatter(a, b, "tp"),
                                      mesh=mesh, in_specs=(P(), P()), out_specs=P("tp")))
        with cost_model.override(mode="fused"):
            for _ in range(2):
                util.poison((256, 256), jnp.bfloat16)
                _check([f(x, w)], x, w)
        info = _ffi._pk_ffi.comm_info(state.comm_id("tp"), 0)
        assert info is not None and info["workspace_bytes"] >= ws
        pk.shutdown()


def _call_until(stop, call, args, values, failures):
    """Calls `call(*args)` in the fused mode (an override is per thread) until `stop` is set,
    eight calls dispatched before any is read; keeps each result as float32 numpy in `values`,
    each exception in `failures`."""
    with cost_model.override(mode="fused"):
        while not stop.is_set():
            pending = []
            for _ in range(8):
                try:
                    pending.append(call(*args))
                except Exception as e:  # noqa: BLE001 -- the test checks each one
                    failures.append(e)
            for y in pending:
                try:
                    values.append(np.asarray(y, np.float32))
                except Exception as e:  # noqa: BLE001
                    failures.append(e)


def test_shutdown_while_other_threads_run_pk_ops():
    """pk.shutdown() on the main thread while two threads keep calling a pk op, one through a
    jitted function and one through a compiled executable, dispatching eight calls before
    reading any (issue 39, section 2): a handler may check its communicator on XLA's thread
    after Python began the shutdown. Each call gives the exact value or an error naming
    pk.shutdown() or pk.init, never a CUDA error, a crash or a wrong value; pk.init then works
    again, cycle after cycle."""
    x, w = _ints(5, (512, 256)), _ints(6, (256, 384))
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32)  # small integers: exact
    for _ in range(6):
        mesh = util.gpu_mesh("gemm_rs", workspace_bytes=32 << 20)
        with cost_model.override(mode="fused"):
            f = jax.jit(jax.shard_map(lambda a, b: pk.gemm_reduce_scatter(a, b, "tp"),
                                      mesh=mesh, in_specs=(P(), P()), out_specs=P("tp")))
            compiled = f.lower(x, w).compile()
            _check([f(x, w), compiled(x, w)], x, w)
        stop = threading.Event()
        values, failures = ([], []), ([], [])  # of f, of compiled
        threads = [threading.Thread(target=_call_until,
                                    args=(stop, c, (x, w), values[i], failures[i]))
                   for i, c in enumerate((f, compiled))]
        for t in threads:
            t.start()
        time.sleep(0.3)
        pk.shutdown()
        time.sleep(0.3)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        for i in range(2):
            assert values[i], "no call finished before the shutdown"
            for y in values[i]:
                np.testing.assert_array_equal(y, want)
            for e in failures[i]:
                assert "pk.shutdown()" in str(e) or "pk.init" in str(e), repr(e)
        # Calls of the executable kept past the shutdown were refused with the clear error.
        assert any("pk.shutdown() released" in str(e) for e in failures[1])
    util.gpu_mesh("gemm_rs", workspace_bytes=32 << 20)
    with cost_model.override(mode="fused"):
        _check([f(x, w)], x, w)
    pk.shutdown()

"""The cost of one FFI call plus launch (pk_ping, y = x + rank on 4 floats), against a bare
jitted XLA elementwise op of the same size, both chained 100 times inside one jit.

The target: one FFI call plus launch at P=1 stays within a few us of a bare kernel launch.
Run on the GPU machine: python bench/bench_ping.py
"""

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.ops.ping import ping

CHAIN = 100


def main():
    dev = jax.devices()[:1]
    mesh = jax.make_mesh((1,), ("tp",), devices=dev, axis_types=(jax.sharding.AxisType.Auto,))
    pk.init(mesh)

    def chained(step):
        def body(x):
            for _ in range(CHAIN):
                x = step(x)
            return x
        # P("tp"): ping's output varies along the axis (it adds the rank).
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))

    ours = chained(lambda x: ping(x, "tp"))  # one FFI call (one kernel) a step
    # One XLA kernel a step: the barrier keeps XLA from fusing the chain into one kernel.
    base = chained(lambda x: jax.lax.optimization_barrier(jnp.sin(x)))
    xs = [(jax.random.normal(jax.random.key(i), (4,), jnp.float32),) for i in range(3)]
    np.testing.assert_allclose(np.asarray(jax.jit(jax.shard_map(
        lambda x: ping(x, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")))(*xs[0])),
        np.asarray(xs[0][0]))
    t_ours = common.time_us(ours, xs, iters=10, reps=15) / CHAIN
    t_base = common.time_us(base, xs, iters=10, reps=15) / CHAIN
    row = common.record(op="ping", shape={"n": 4, "chain": CHAIN}, dtype="float32", world=1,
                        processes=1, median_us=t_ours, baseline="one XLA kernel (sin) a step",
                        baseline_median_us=t_base)
    print(f"ffi call + launch: {t_ours:.2f} us/call, bare XLA kernel {t_base:.2f} us/call, "
          f"overhead {t_ours - t_base:+.2f} us, {row['ratio']:.2f}x vs XLA kernel")


if __name__ == "__main__":
    main()

"""Train a small expert-parallel mixture-of-experts MLP (flax.nnx, pk_jax.nn.flax.MoE).

    python examples/04_moe_flax.py                  # every local device (CPU: 8)
    python examples/04_moe_flax.py --experts 16 --top-k 2

Tokens and experts are split over the "ep" mesh axis: each device routes its tokens with a
top-k softmax router, `pk.moe_dispatch` sends every (token, slot) to the device holding its
expert, the experts run as grouped GEMMs (`pk.grouped_matmul`), and `pk.moe_combine` brings
the weighted outputs back. The loss is the regression error plus 0.01 x the load-balancing loss
(1.0 when the router spreads tokens evenly). On a machine without GPUs it uses 8 CPU devices and
the jax.lax references; on Hopper GPUs with the extension built, grouped_matmul runs its kernel.
"""

import os

# Before JAX starts: 8 host devices when running on CPU (ignored by GPU backends).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.nn import flax as pkn


def arguments() -> argparse.ArgumentParser:
    """The command line; every option has help text and a default (shown by --help)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--features", type=int, default=64,
                        help="token width (a multiple of 8)")
    parser.add_argument("--hidden", type=int, default=128,
                        help="each expert's hidden width (a multiple of 8)")
    parser.add_argument("--experts", type=int, default=8,
                        help="number of experts, split over the devices (a multiple of their "
                             "count)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per device")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(AxisType.Auto,))
    pk.init(mesh)
    print(f"pk_jax {pk.__version__}: {n} x {jax.devices()[0].platform} device(s), ep={n}, "
          f"{args.experts} experts (top-{args.top_k}); grouped_matmul backend: "
          f"{pk.backend_name('grouped_matmul')}")

    model = pkn.MoE(args.features, args.hidden, args.experts, top_k=args.top_k, axis_name="ep",
                    rngs=nnx.Rngs(0))
    pkn.shard(model, mesh)
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)

    kx, ka = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (n * args.tokens, args.features), jnp.float32)
    a = jax.random.normal(ka, (args.features, args.features)) / args.features ** 0.5
    target = jnp.sin(2 * x @ a)
    x, target = (jax.device_put(v, NamedSharding(mesh, P("ep"))) for v in (x, target))

    def loss_fn(params, x, target):
        def local(params, x, target):  # per device: its tokens and its experts
            y, aux = nnx.merge(graphdef, params)(x)
            err = jax.lax.pmean(jnp.mean((y.astype(jnp.float32) - target) ** 2), "ep")
            return err + 0.01 * aux, (err, aux)

        return jax.shard_map(local, mesh=mesh, in_specs=(specs, P("ep"), P("ep")),
                             out_specs=(P(), (P(), P())))(params, x, target)

    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, target):
        (_, (err, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, err, aux

    start = time.perf_counter()
    for i in range(args.steps):
        params, opt_state, err, aux = step(params, opt_state, x, target)
        print(f"step {i + 1:3d}  loss {float(err):.5f}  load balance {float(aux):.3f}")
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

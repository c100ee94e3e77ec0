"""Train a small tensor-parallel MLP (flax.nnx) whose layers run pk_jax's fused ops.

    python examples/01_tp_mlp_flax.py                       # every local device (CPU: 8)
    python examples/01_tp_mlp_flax.py --sequence-parallel   # activations sharded by sequence
    python -m pk_jax.launch -n 2 examples/01_tp_mlp_flax.py # two processes, one device each
    python examples/01_tp_mlp_flax.py --fp8 tensor          # the GEMMs in fp8 (current scaling)

Two residual ParallelMLP blocks learn a fixed random function. The parameters are global arrays
sharded over the "tp" mesh axis; the forward pass is one `jax.shard_map` in which every layer
works on its local shard (column layer, then gelu, then row layer with its GEMM+all-reduce, or
AG+GEMM / GEMM+RS with --sequence-parallel). With --fp8 the layers' GEMMs follow the fp8
training recipe (pk_jax.nn.fp8_matmul: e4m3 forward with this step's scales, per tensor or per
block, dgrad and wgrad in bf16) and their collectives run apart in bf16; the loss curve stays
close to bf16's (tests/test_examples.py holds it to that). On a machine without GPUs it uses 8
CPU devices and the jax.lax references of the ops; on Hopper GPUs with the extension built, the
CUDA kernels.
"""

import os

# Before JAX starts: 8 host devices when running on CPU (ignored by GPU backends).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse
import time

import pk_jax.launch

pk_jax.launch.initialize()  # joins a multi-process job under pk_jax.launch; else nothing

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax.nn import flax as pkn


class Model(nnx.Module):
    """Two residual tensor-parallel MLP blocks."""

    def __init__(self, features: int, hidden: int, *, sequence_parallel: bool,
                 fp8: str | None = None, rngs: nnx.Rngs):
        self.blocks = nnx.List([pkn.ParallelMLP(features, hidden, fp8=fp8,
                                                sequence_parallel=sequence_parallel, rngs=rngs)
                                for _ in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = x + block(x).astype(x.dtype)
        return x


def arguments() -> argparse.ArgumentParser:
    """The command line; every option has help text and a default (shown by --help)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--features", type=int, default=64,
                        help="model width (a multiple of 8)")
    parser.add_argument("--hidden", type=int, default=256,
                        help="hidden width of each MLP (a multiple of 8 x the device count)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (rows)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="activations sharded by sequence (AG+GEMM and GEMM+RS) instead of "
                             "replicated (GEMM+all-reduce)")
    parser.add_argument("--fp8", choices=("none", "tensor", "block"), default="none",
                        help="the GEMMs in fp8 by pk_jax.nn.fp8_matmul, scaled per tensor or per "
                             "block (1x128 activations, 128x128 weights); none: bf16")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("tp",))
    pk.init(mesh)
    sp = args.sequence_parallel
    fp8 = None if args.fp8 == "none" else args.fp8
    ops = ("ag_gemm", "gemm_rs") if sp else ("matmul", "gemm_ar")
    if fp8 is not None:  # fp8 GEMMs, then the collective apart
        ops = ("all_gather", "matmul", "reduce_scatter") if sp else ("matmul", "all_reduce")
    backends = ", ".join(f"{op}={pk.backend_name(op, 'tp')}" for op in ops)
    print(f"pk_jax {pk.__version__}: {n} x {jax.devices()[0].platform} device(s) "
          f"in {jax.process_count()} process(es), tp={n}, "
          f"{'sequence' if sp else 'tensor'}-parallel MLP, GEMMs in "
          f"{'fp8 (' + fp8 + ' scaling)' if fp8 else 'bf16'}; backends: {backends}")

    model = Model(args.features, args.hidden, sequence_parallel=sp, fp8=fp8, rngs=nnx.Rngs(0))
    pkn.shard(model, mesh)
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)
    x_spec = P("tp") if sp else P()  # [S, B, D]: the sequence split over tp, or replicated

    def forward(params, x):
        def local(params, x):  # per device: the layers hold their shards here
            return nnx.merge(graphdef, params)(x)

        return jax.shard_map(local, mesh=mesh, in_specs=(specs, x_spec),
                             out_specs=x_spec)(params, x)

    kx, ka = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.seq, args.batch, args.features), jnp.float32)
    a = jax.random.normal(ka, (args.features, args.features)) / args.features ** 0.5
    target = jnp.sin(2 * x @ a)
    x, target = (jax.device_put(v, NamedSharding(mesh, x_spec)) for v in (x, target))

    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, target):
        def loss_fn(params):
            y = forward(params, x).astype(jnp.float32)
            return jnp.mean((y - target) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, x, target)
        print(f"step {i + 1:3d}  loss {float(loss):.5f}")
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()

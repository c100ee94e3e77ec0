"""Tensor-parallel layers for flax.nnx: ColumnParallelLinear, RowParallelLinear, ParallelMLP.

The layers are created with the full logical weights and annotate each `nnx.Param` with its
sharding (`out_sharding` metadata). `shard(model, mesh)` places every parameter on the mesh
(each device keeps its slice); `partition_specs(params)` gives the in_specs for the
`jax.shard_map` around the step function, inside which the layers see and use their local
shards. See `pk_jax.nn` for the two modes and a full example; `examples/01_tp_mlp_flax.py`
trains one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pk_jax import nn as _nn
from pk_jax._optional import require

nnx = require("flax.nnx", "pk_jax.nn.flax", "nn")

Initializer = Callable[..., jax.Array]
default_kernel_init = jax.nn.initializers.lecun_normal()
default_bias_init = jax.nn.initializers.zeros


def _param(value: jax.Array, sharding: tuple) -> nnx.Param:
    """An nnx.Param annotated with its sharding. It is placed on the mesh at creation (flax's
    eager sharding) when a mesh is set (`jax.set_mesh(mesh)`); otherwise it stays one array on
    the default device until `shard(model, mesh)`."""
    eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
    return nnx.Param(value, out_sharding=sharding, eager_sharding=eager)


class ColumnParallelLinear(nnx.Module):
    """`y = x @ w + b` with `w: [in, out]` split by columns over `axis_name`.

    Inside shard_map each device holds `kernel: [in, out/P]` and `bias: [out/P]` and returns its
    column block of `y`. Plain mode: `x` replicated, `[..., in]` -> `[..., out/P]`.
    Sequence-parallel: `x` sharded by its first dimension, `[S/P, ..., in]` -> `[S, ..., out/P]`
    (all-gather fused into the GEMM).

    Args:
        in_features: K, a multiple of 8.
        out_features: N, a multiple of P.
        axis_name: the tensor-parallel mesh axis.
        sequence_parallel: activations sharded by their first dimension (see `pk_jax.nn`).
        use_bias: whether to add a bias.
        dtype: compute dtype, bf16 or fp16.
        param_dtype: dtype of the stored parameters.
        kernel_init, bias_init: initialisers of the FULL weight [in, out] and bias [out].
        rngs: the nnx.Rngs whose `params` stream initialises the weights.
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = _nn.DEFAULT_AXIS,
                 sequence_parallel: bool = False, use_bias: bool = True,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        self.dtype = _nn.check_dtype("flax.ColumnParallelLinear", dtype)
        self.kernel = _param(kernel_init(rngs.params(), (in_features, out_features),
                                         param_dtype), (None, axis_name))
        self.bias = (_param(bias_init(rngs.params(), (out_features,), param_dtype),
                            (axis_name,)) if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
        _nn.check_local_shape("ColumnParallelLinear", "kernel", w,
                              (self.in_features, self.out_features), 1, self.axis_name)
        b = None if self.bias is None else self.bias[...]
        return _nn.column_parallel_linear(x, w, b, axis_name=self.axis_name,
                                          sequence_parallel=self.sequence_parallel,
                                          dtype=self.dtype)


class RowParallelLinear(nnx.Module):
    """`y = h @ w + b` with `w: [in, out]` split by rows over `axis_name`.

    Inside shard_map each device holds `kernel: [in/P, out]` and the whole `bias: [out]`, takes
    its column block `h: [..., in/P]` and the partial products are summed over the axis: plain
    mode all-reduces (`[..., out]`, replicated); sequence-parallel reduce-scatters the first
    dimension (`[S/P, ..., out]`). The bias is added once, after the reduction.

    Args: as for `ColumnParallelLinear` (here `in_features` must be a multiple of 8 * P).
    """

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = _nn.DEFAULT_AXIS,
                 sequence_parallel: bool = False, use_bias: bool = True,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        self.dtype = _nn.check_dtype("flax.RowParallelLinear", dtype)
        self.kernel = _param(kernel_init(rngs.params(), (in_features, out_features),
                                         param_dtype), (axis_name, None))
        self.bias = (_param(bias_init(rngs.params(), (out_features,), param_dtype),
                            (None,)) if use_bias else None)

    def __call__(self, h: jax.Array) -> jax.Array:
        w = self.kernel[...]
        _nn.check_local_shape("RowParallelLinear", "kernel", w,
                              (self.in_features, self.out_features), 0, self.axis_name)
        b = None if self.bias is None else self.bias[...]
        return _nn.row_parallel_linear(h, w, b, axis_name=self.axis_name,
                                       sequence_parallel=self.sequence_parallel,
                                       dtype=self.dtype)


class ParallelMLP(nnx.Module):
    """Megatron's MLP block: ColumnParallelLinear -> activation -> RowParallelLinear.

    `[..., features] -> [..., features]`; the hidden activation stays sharded over the axis
    (`[..., hidden/P]` per device) and only the row layer communicates (plus the column layer's
    all-gather in sequence-parallel mode, where input and output are `[S/P, ..., features]`).

    Args:
        features: model width (K of the first layer, N of the second), a multiple of 8.
        hidden: hidden width, a multiple of 8 * P.
        activation: applied between the layers (default `jax.nn.gelu`).
        other arguments: as for `ColumnParallelLinear`, shared by both layers.
    """

    def __init__(self, features: int, hidden: int, *, axis_name: str = _nn.DEFAULT_AXIS,
                 sequence_parallel: bool = False, use_bias: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        common = {"axis_name": axis_name, "sequence_parallel": sequence_parallel,
                  "use_bias": use_bias, "dtype": dtype, "param_dtype": param_dtype,
                  "kernel_init": kernel_init, "bias_init": bias_init, "rngs": rngs}
        self.activation = activation
        self.up = ColumnParallelLinear(features, hidden, **common)
        self.down = RowParallelLinear(hidden, features, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.activation(self.up(x)))

    def full_weights(self) -> dict[str, jax.Array | None]:
        """The logical (global) weights w1, b1, w2, b2; call outside shard_map. With them,
        `pk_jax.nn.reference_mlp` computes the same function on one device."""
        return {"w1": self.up.kernel[...],
                "b1": None if self.up.bias is None else self.up.bias[...],
                "w2": self.down.kernel[...],
                "b2": None if self.down.bias is None else self.down.bias[...]}


def partition_specs(tree: Any) -> Any:
    """The PartitionSpecs of a model's parameters, for the in_specs of `jax.shard_map`.

    Args:
        tree: an `nnx.State` (e.g. from `nnx.split(model)`), or a Module.

    Returns:
        The same structure with a PartitionSpec per parameter (P() for unannotated ones).
    """
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    return nnx.get_partition_spec(tree)


def shard(model: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Places every parameter of `model` on `mesh` by its sharding annotation, in place.

    Each device then stores its own slice of each logical weight. Returns `model`.
    """
    state = nnx.state(model)
    specs = partition_specs(state)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, specs)
    nnx.update(model, placed)
    return model


__all__ = ["ColumnParallelLinear", "ParallelMLP", "RowParallelLinear", "partition_specs",
           "shard"]

"""Tensor-parallel layers for Equinox: ColumnParallelLinear, RowParallelLinear, ParallelMLP.

The layers are created with the full logical weights (from one key). `shard(model, mesh)` places
every array on the mesh (each device keeps its slice); `partition_specs(params)` gives the
in_specs for the `jax.shard_map` around the step function, inside which the layers see and use
their local shards::

    model = pkq.shard(pkq.ParallelMLP(256, 1024, key=key), mesh)
    params, static = eqx.partition(model, eqx.is_array)
    specs = pkq.partition_specs(params)
    f = jax.shard_map(lambda p, x: eqx.combine(p, static)(x), mesh=mesh,
                      in_specs=(specs, P()), out_specs=P())

Weights are stored `[in, out]` (the pk_jax GEMM layout), not Equinox's `[out, in]`. See
`pk_jax.nn` for the two modes; `examples/02_tp_mlp_equinox.py` trains one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pk_jax import nn as _nn
from pk_jax._optional import require

eqx = require("equinox", "pk_jax.nn.equinox", "nn")

Initializer = Callable[..., jax.Array]
default_kernel_init = jax.nn.initializers.lecun_normal()
default_bias_init = jax.nn.initializers.zeros


class _ParallelLinear(eqx.Module):
    """What ColumnParallelLinear and RowParallelLinear share: their fields, checks and call;
    `_COLUMN` says which dimension of the weight is split over `axis_name`."""

    _COLUMN: ClassVar[bool]
    weight: jax.Array
    bias: jax.Array | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    fp8: str | None = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, *, key: jax.Array,
                 axis_name: str = _nn.DEFAULT_AXIS, sequence_parallel: bool = False,
                 use_bias: bool = True, dtype: Any = jnp.bfloat16, fp8: str | None = None,
                 param_dtype: Any = jnp.float32, kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init):
        name = f"equinox.{type(self).__name__}"
        wkey, bkey = jax.random.split(key)
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        _nn.check_linear(name, in_features, out_features, axis_name, column=self._COLUMN)
        self.dtype = _nn.check_dtype(name, dtype)
        self.fp8 = _nn.check_fp8(name, fp8)
        self.weight = kernel_init(wkey, (in_features, out_features), param_dtype)
        self.bias = bias_init(bkey, (out_features,), param_dtype) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        _nn.check_local_shape(type(self).__name__, "weight", self.weight,
                              (self.in_features, self.out_features), int(self._COLUMN),
                              self.axis_name)
        linear = _nn.column_parallel_linear if self._COLUMN else _nn.row_parallel_linear
        return linear(x, self.weight, self.bias, axis_name=self.axis_name,
                      sequence_parallel=self.sequence_parallel, dtype=self.dtype, fp8=self.fp8)

    def partition_spec(self) -> _ParallelLinear:
        """This layer with a PartitionSpec in place of each array."""
        if self._COLUMN:
            return _with_specs(self, P(None, self.axis_name), P(self.axis_name))
        return _with_specs(self, P(self.axis_name, None), P(None))


class ColumnParallelLinear(_ParallelLinear):
    """`y = x @ weight + bias` with `weight: [in, out]` split by columns over `axis_name`.

    Inside shard_map each device holds `weight: [in, out/P]` and `bias: [out/P]` and returns its
    column block of `y`. Plain mode: `x` replicated, `[..., in]` -> `[..., out/P]`.
    Sequence-parallel: `x` sharded by its first dimension, `[S/P, ..., in]` -> `[S, ..., out/P]`.

    Args:
        in_features: K, a multiple of 8.
        out_features: N, a multiple of P.
        key: PRNG key for the FULL weight [in, out] (and bias).
        axis_name: the tensor-parallel mesh axis.
        sequence_parallel: activations sharded by their first dimension (see `pk_jax.nn`).
        use_bias: whether to add a bias.
        dtype: compute dtype, bf16 or fp16.
        fp8: None, or "tensor" / "block": the GEMM by the fp8 training recipe
            (`pk_jax.nn.fp8_matmul`, current scaling with that granularity; see
            `pk_jax.nn.column_parallel_linear`).
        param_dtype: dtype of the stored parameters.
        kernel_init: initialiser `(key, shape, dtype) -> array` of the FULL weight.
        bias_init: initialiser `(key, shape, dtype) -> array` of the FULL bias.
    """

    _COLUMN = True


class RowParallelLinear(_ParallelLinear):
    """`y = h @ weight + bias` with `weight: [in, out]` split by rows over `axis_name`.

    Inside shard_map each device holds `weight: [in/P, out]` and the whole `bias: [out]`, takes
    its column block `h: [..., in/P]`, and the partial products are summed over the axis: plain
    mode all-reduces (`[..., out]`, replicated); sequence-parallel reduce-scatters the first
    dimension (`[S/P, ..., out]`). The bias is added once, after the reduction.

    Args:
        in_features: K, a multiple of 8 * P (each device's rows are the GEMM's K).
        out_features: N.

    The other arguments are those of `ColumnParallelLinear`.
    """

    _COLUMN = False


class ParallelMLP(eqx.Module):
    """Megatron's MLP block: ColumnParallelLinear -> activation -> RowParallelLinear.

    `[..., features] -> [..., features]`; the hidden activation stays sharded over the axis and
    only the row layer communicates (plus the column layer's all-gather in sequence-parallel
    mode, where input and output are `[S/P, ..., features]`).

    Args:
        features: model width, a multiple of 8.
        hidden: hidden width, a multiple of 8 * P.
        key: PRNG key for both layers.
        activation: applied between the layers (default `jax.nn.gelu`).

    The other arguments are those of `ColumnParallelLinear`, shared by both layers.
    """

    up: ColumnParallelLinear
    down: RowParallelLinear
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __init__(self, features: int, hidden: int, *, key: jax.Array,
                 axis_name: str = _nn.DEFAULT_AXIS, sequence_parallel: bool = False,
                 use_bias: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 dtype: Any = jnp.bfloat16, fp8: str | None = None,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init):
        k1, k2 = jax.random.split(key)
        _nn.check_mlp("equinox.ParallelMLP", features, hidden, axis_name)
        common = {"axis_name": axis_name, "sequence_parallel": sequence_parallel,
                  "use_bias": use_bias, "dtype": dtype, "fp8": fp8,
                  "param_dtype": param_dtype,
                  "kernel_init": kernel_init, "bias_init": bias_init}
        self.activation = activation
        self.up = ColumnParallelLinear(features, hidden, key=k1, **common)
        self.down = RowParallelLinear(hidden, features, key=k2, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.activation(self.up(x)))

    def full_weights(self) -> dict[str, jax.Array | None]:
        """The logical (global) weights w1, b1, w2, b2; call outside shard_map. With them,
        `pk_jax.nn.reference_mlp` computes the same function on one device."""
        return {"w1": self.up.weight, "b1": self.up.bias,
                "w2": self.down.weight, "b2": self.down.bias}


class ParallelAttention(eqx.Module):
    """Multi-head attention with tensor-parallel projections and sequence-parallel attention
    (see `pk_jax.nn.flax.ParallelAttention`, the same block, with the same masks:
    `block(x, segment_ids=..., query_seq_lengths=..., key_value_seq_lengths=...)`).

    Args:
        key: PRNG key for the four projections.

    The other arguments are those of `pk_jax.nn.flax.ParallelAttention`.
    """

    q: ColumnParallelLinear
    k: ColumnParallelLinear
    v: ColumnParallelLinear
    o: RowParallelLinear
    head_dim: int = eqx.field(static=True)
    seq_axis: str = eqx.field(static=True)
    kind: str = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    layout: str = eqx.field(static=True)
    local_window_size: tuple[int, int] | None = eqx.field(static=True)
    logits_soft_cap: float | None = eqx.field(static=True)

    def __init__(self, features: int, num_heads: int, *, key: jax.Array,
                 num_kv_heads: int | None = None, axis_name: str = _nn.DEFAULT_AXIS,
                 seq_axis: str = "sp", attention: str = "ring", causal: bool = True,
                 layout: str = "contiguous",
                 local_window_size: int | tuple[int, int] | None = None,
                 logits_soft_cap: float | None = None, use_bias: bool = False,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init):
        from pk_jax.nn import _attn

        kv = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = _attn.check_heads("equinox.ParallelAttention", features, num_heads, kv,
                                          attention, axis_name=axis_name, seq_axis=seq_axis)
        self.seq_axis, self.kind, self.causal, self.layout = seq_axis, attention, causal, layout
        self.local_window_size, self.logits_soft_cap = _attn.check_masks(
            "equinox.ParallelAttention", local_window_size, logits_soft_cap)
        common = {"axis_name": axis_name, "use_bias": use_bias, "dtype": dtype,
                  "param_dtype": param_dtype, "kernel_init": kernel_init,
                  "bias_init": bias_init}
        kq, kk, kv_, ko = jax.random.split(key, 4)
        self.q = ColumnParallelLinear(features, num_heads * self.head_dim, key=kq, **common)
        self.k = ColumnParallelLinear(features, kv * self.head_dim, key=kk, **common)
        self.v = ColumnParallelLinear(features, kv * self.head_dim, key=kv_, **common)
        self.o = RowParallelLinear(num_heads * self.head_dim, features, key=ko, **common)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                 query_seq_lengths: jax.Array | None = None,
                 key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
        """x [B, S/Psp, features] -> [B, S/Psp, features]; segment ids [B, S/Psp] (laid out
        like x), lengths [B]."""
        from pk_jax.nn import _attn

        return _attn.forward(self, x, segment_ids=segment_ids,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths)


class MoE(eqx.Module):
    """An expert-parallel mixture-of-experts MLP (see `pk_jax.nn.flax.MoE`, the same block).

    Inside shard_map over `axis_name` each device holds its tokens `[..., features]` and
    `num_experts / P` experts; the router `[features, E]` is replicated. Returns
    `(y, aux_loss)`.

    Args:
        key: PRNG key for the router and the experts.

    The other arguments are those of `pk_jax.nn.flax.MoE`.
    """

    router: jax.Array
    w1: jax.Array
    w2: jax.Array
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    capacity_factor: float = eqx.field(static=True)
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)

    def __init__(self, features: int, hidden: int, num_experts: int, *, key: jax.Array,
                 top_k: int = 2, axis_name: str = _nn.DEFAULT_AXIS,
                 capacity_factor: float = 1.25,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32):
        from pk_jax.nn import _moe

        _moe.check_sizes("equinox.MoE", features, hidden, num_experts, top_k, axis_name)
        k0, k1, k2 = jax.random.split(key, 3)
        self.router = default_kernel_init(k0, (features, num_experts), param_dtype)
        self.w1 = _moe.expert_init(k1, (num_experts, features, hidden), param_dtype)
        self.w2 = _moe.expert_init(k2, (num_experts, hidden, features), param_dtype)
        self.num_experts, self.top_k, self.axis_name = num_experts, top_k, axis_name
        self.capacity_factor, self.activation = capacity_factor, activation
        self.dtype = _nn.check_dtype("equinox.MoE", dtype)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        from pk_jax.nn import _moe

        full1 = (self.num_experts, self.router.shape[0], self.w1.shape[-1])
        _moe.check_experts("equinox.MoE", self.w1, full1, self.axis_name)
        _moe.check_experts("equinox.MoE", self.w2, (full1[0], full1[2], full1[1]),
                           self.axis_name)
        return _moe.moe_mlp(x, self.router, self.w1, self.w2, axis_name=self.axis_name,
                            num_experts=self.num_experts, top_k=self.top_k,
                            capacity_factor=self.capacity_factor, activation=self.activation,
                            dtype=self.dtype)

    def partition_spec(self) -> MoE:
        """This block with a PartitionSpec in place of each array (experts split over the
        axis, the router replicated)."""
        return eqx.tree_at(lambda m: (m.router, m.w1, m.w2), self,
                           (P(), P(self.axis_name), P(self.axis_name)))


_LAYERS = (ColumnParallelLinear, RowParallelLinear, MoE)


def _with_specs(layer, weight_spec: P, bias_spec: P):
    bias = None if layer.bias is None else bias_spec
    return eqx.tree_at(lambda m: (m.weight, m.bias), layer, (weight_spec, bias),
                       is_leaf=lambda x: x is None)


def partition_specs(tree: Any) -> Any:
    """The PartitionSpecs of a model's arrays, for the in_specs of `jax.shard_map`.

    Args:
        tree: a model or any pytree holding the layers (e.g. `eqx.partition(model,
            eqx.is_array)[0]`); arrays outside the parallel layers are replicated (P()).

    Returns:
        The same structure with a PartitionSpec in place of each array (non-array leaves,
        which shard_map cannot take, become None: partition them out first).
    """
    def spec(node):
        if isinstance(node, _LAYERS):
            return node.partition_spec()
        return P() if eqx.is_array(node) else None

    return jax.tree.map(spec, tree, is_leaf=lambda n: isinstance(n, _LAYERS))


def shard(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """`tree` with every array placed on `mesh` by its partition spec (each device then stores
    its own slice of each logical weight)."""
    params, static = eqx.partition(tree, eqx.is_array)
    specs = partition_specs(params)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    return eqx.combine(placed, static)


__all__ = ["ColumnParallelLinear", "MoE", "ParallelAttention", "ParallelMLP", "RowParallelLinear",
           "partition_specs", "shard"]

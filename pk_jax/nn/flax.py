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


class _ParallelLinear(nnx.Module):
    """What ColumnParallelLinear and RowParallelLinear share: their arguments, checks and
    call; `_COLUMN` says which dimension of the weight is split over `axis_name`."""

    _COLUMN: bool

    def __init__(self, in_features: int, out_features: int, *, axis_name: str = _nn.DEFAULT_AXIS,
                 sequence_parallel: bool = False, use_bias: bool = True,
                 dtype: Any = jnp.bfloat16, fp8: str | None = None,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        name = f"flax.{type(self).__name__}"
        self.in_features, self.out_features = in_features, out_features
        self.axis_name, self.sequence_parallel = axis_name, sequence_parallel
        _nn.check_linear(name, in_features, out_features, axis_name, column=self._COLUMN)
        self.dtype = _nn.check_dtype(name, dtype)
        self.fp8 = _nn.check_fp8(name, fp8)
        kernel_spec, bias_spec = (((None, axis_name), (axis_name,)) if self._COLUMN
                                  else ((axis_name, None), (None,)))
        self.kernel = _param(kernel_init(rngs.params(), (in_features, out_features),
                                         param_dtype), kernel_spec)
        self.bias = (_param(bias_init(rngs.params(), (out_features,), param_dtype), bias_spec)
                     if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.kernel[...]
        _nn.check_local_shape(type(self).__name__, "kernel", w,
                              (self.in_features, self.out_features), int(self._COLUMN),
                              self.axis_name)
        b = None if self.bias is None else self.bias[...]
        linear = _nn.column_parallel_linear if self._COLUMN else _nn.row_parallel_linear
        return linear(x, w, b, axis_name=self.axis_name,
                      sequence_parallel=self.sequence_parallel, dtype=self.dtype, fp8=self.fp8)


class ColumnParallelLinear(_ParallelLinear):
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
        fp8: None, or "tensor" / "block": the GEMM by the fp8 training recipe
            (`pk_jax.nn.fp8_matmul`, current scaling with that granularity; see
            `pk_jax.nn.column_parallel_linear`).
        param_dtype: dtype of the stored parameters.
        kernel_init: initialiser of the FULL weight [in, out].
        bias_init: initialiser of the FULL bias [out].
        rngs: the nnx.Rngs whose `params` stream initialises the weights.
    """

    _COLUMN = True


class RowParallelLinear(_ParallelLinear):
    """`y = h @ w + b` with `w: [in, out]` split by rows over `axis_name`.

    Inside shard_map each device holds `kernel: [in/P, out]` and the whole `bias: [out]`, takes
    its column block `h: [..., in/P]` and the partial products are summed over the axis: plain
    mode all-reduces (`[..., out]`, replicated); sequence-parallel reduce-scatters the first
    dimension (`[S/P, ..., out]`). The bias is added once, after the reduction.

    Args:
        in_features: K, a multiple of 8 * P (each device's rows are the GEMM's K).
        out_features: N.

    The other arguments are those of `ColumnParallelLinear`.
    """

    _COLUMN = False


class ParallelMLP(nnx.Module):
    """Megatron's MLP block: ColumnParallelLinear -> activation -> RowParallelLinear.

    `[..., features] -> [..., features]`; the hidden activation stays sharded over the axis
    (`[..., hidden/P]` per device) and only the row layer communicates (plus the column layer's
    all-gather in sequence-parallel mode, where input and output are `[S/P, ..., features]`).

    Args:
        features: model width (K of the first layer, N of the second), a multiple of 8.
        hidden: hidden width, a multiple of 8 * P.
        activation: applied between the layers (default `jax.nn.gelu`).

    The other arguments are those of `ColumnParallelLinear`, shared by both layers.
    """

    def __init__(self, features: int, hidden: int, *, axis_name: str = _nn.DEFAULT_AXIS,
                 sequence_parallel: bool = False, use_bias: bool = True,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 dtype: Any = jnp.bfloat16, fp8: str | None = None,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        _nn.check_mlp("flax.ParallelMLP", features, hidden, axis_name)
        common = {"axis_name": axis_name, "sequence_parallel": sequence_parallel,
                  "use_bias": use_bias, "dtype": dtype, "fp8": fp8,
                  "param_dtype": param_dtype,
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


class MoE(nnx.Module):
    """An expert-parallel mixture-of-experts MLP: top-k router, token dispatch to the experts'
    ranks, expert MLPs on grouped GEMMs, weighted combine back (`pk_jax.nn._moe.moe_mlp`).

    Inside shard_map over `axis_name`, each device holds its tokens `[..., features]` and
    `num_experts / P` experts (`w1: [E/P, features, hidden]`, `w2: [E/P, hidden, features]`);
    the router `[features, E]` is replicated. Returns `(y, aux_loss)`: y like x, aux_loss the
    Switch Transformer load-balancing loss (1.0 when balanced), the same on every device.

    Args:
        features: model width H, a multiple of 8.
        hidden: expert hidden width, a multiple of 8.
        num_experts: E, a multiple of P.
        top_k: experts per token.
        capacity_factor: each device's dispatch buffer holds this many times the (token, slot)s
            it receives on average; the excess is dropped (contributes zero).
        activation: between the expert GEMMs (default `jax.nn.gelu`).
        axis_name: the expert-parallel mesh axis (experts split over it).

    The other arguments are those of `ColumnParallelLinear`.
    """

    def __init__(self, features: int, hidden: int, num_experts: int, *, top_k: int = 2,
                 axis_name: str = _nn.DEFAULT_AXIS, capacity_factor: float = 1.25,
                 activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
                 dtype: Any = jnp.bfloat16, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        from pk_jax.nn import _moe

        _moe.check_sizes("flax.MoE", features, hidden, num_experts, top_k, axis_name)
        self.features, self.hidden, self.num_experts = features, hidden, num_experts
        self.top_k, self.axis_name, self.capacity_factor = top_k, axis_name, capacity_factor
        self.activation = activation
        self.dtype = _nn.check_dtype("flax.MoE", dtype)
        self.router = _param(default_kernel_init(rngs.params(), (features, num_experts),
                                                 param_dtype), (None, None))
        self.w1 = _param(_moe.expert_init(rngs.params(), (num_experts, features, hidden),
                                          param_dtype), (axis_name, None, None))
        self.w2 = _param(_moe.expert_init(rngs.params(), (num_experts, hidden, features),
                                          param_dtype), (axis_name, None, None))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        from pk_jax.nn import _moe

        w1, w2 = self.w1[...], self.w2[...]
        _moe.check_experts("flax.MoE", w1, (self.num_experts, self.features, self.hidden),
                           self.axis_name)
        _moe.check_experts("flax.MoE", w2, (self.num_experts, self.hidden, self.features),
                           self.axis_name)
        return _moe.moe_mlp(x, self.router[...], w1, w2, axis_name=self.axis_name,
                            num_experts=self.num_experts, top_k=self.top_k,
                            capacity_factor=self.capacity_factor, activation=self.activation,
                            dtype=self.dtype)


class ParallelAttention(nnx.Module):
    """Multi-head attention with tensor-parallel projections and sequence-parallel attention.

    Inside shard_map, x is `[B, S/Psp, features]`: its sequence split over `seq_axis` and
    replicated over `axis_name`. Q, K and V are ColumnParallelLinear layers over `axis_name`
    (each device computes its `num_heads / Ptp` query heads and `num_kv_heads / Ptp` K/V heads),
    attention runs over the whole sequence with `pk.ring_attention` or `pk.ulysses_attention`
    over `seq_axis`, and the output projection is a RowParallelLinear (GEMM + all-reduce over
    `axis_name`). Either axis may have size 1.

    Masks: `local_window_size` and `logits_soft_cap` are the block's (static); segment ids
    (packed documents) and sequence lengths (padding) are the call's: `block(x,
    segment_ids=ids)` with `ids` int32 [B, S/Psp], this device's ids laid out like x's
    sequence, and `query_seq_lengths` / `key_value_seq_lengths` int32 [B] (the whole
    sequence's lengths, replicated). They go to `pk.ring_attention` / `pk.ulysses_attention`,
    whose reference runs wherever a mask is given (no kernel takes masks yet).

    Args:
        features: model width, divisible by num_heads.
        num_heads: query heads, divisible by the size of `axis_name` (and, for Ulysses, by
            it times the size of `seq_axis`).
        num_kv_heads: K/V heads (grouped-query attention), dividing num_heads; default
            num_heads.
        axis_name: the tensor-parallel axis (heads).
        seq_axis: the sequence-parallel axis.
        attention: "ring" or "ulysses".
        causal: causal masking over global positions.
        layout: ring only: "contiguous" or "zigzag" (see `pk.zigzag_indices`).
        local_window_size: (left, right) or an int, static: sliding-window attention over
            global positions (as in `jax.nn.dot_product_attention`); None: no window.
        logits_soft_cap: a float c > 0: logits x become c * tanh(x / c); None: no cap.
        use_bias: as for the linear layers.
        dtype: as for the linear layers.
        param_dtype: as for the linear layers.
        kernel_init: as for the linear layers.
        bias_init: as for the linear layers.
        rngs: as for the linear layers.
    """

    def __init__(self, features: int, num_heads: int, *, num_kv_heads: int | None = None,
                 axis_name: str = _nn.DEFAULT_AXIS, seq_axis: str = "sp",
                 attention: str = "ring", causal: bool = True, layout: str = "contiguous",
                 local_window_size: int | tuple[int, int] | None = None,
                 logits_soft_cap: float | None = None,
                 use_bias: bool = False, dtype: Any = jnp.bfloat16,
                 param_dtype: Any = jnp.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, rngs: nnx.Rngs):
        from pk_jax.nn import _attn

        kv = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = _attn.check_heads("flax.ParallelAttention", features, num_heads, kv,
                                          attention, axis_name=axis_name, seq_axis=seq_axis)
        self.seq_axis, self.kind, self.causal, self.layout = seq_axis, attention, causal, layout
        self.local_window_size, self.logits_soft_cap = _attn.check_masks(
            "flax.ParallelAttention", local_window_size, logits_soft_cap)
        common = {"axis_name": axis_name, "use_bias": use_bias, "dtype": dtype,
                  "param_dtype": param_dtype, "kernel_init": kernel_init,
                  "bias_init": bias_init, "rngs": rngs}
        self.q = ColumnParallelLinear(features, num_heads * self.head_dim, **common)
        self.k = ColumnParallelLinear(features, kv * self.head_dim, **common)
        self.v = ColumnParallelLinear(features, kv * self.head_dim, **common)
        self.o = RowParallelLinear(num_heads * self.head_dim, features, **common)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                 query_seq_lengths: jax.Array | None = None,
                 key_value_seq_lengths: jax.Array | None = None) -> jax.Array:
        """x [B, S/Psp, features] -> [B, S/Psp, features]; the masks as in the class
        docstring."""
        from pk_jax.nn import _attn

        return _attn.forward(self, x, segment_ids=segment_ids,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths)


__all__ = ["ColumnParallelLinear", "MoE", "ParallelAttention", "ParallelMLP", "RowParallelLinear",
           "partition_specs", "shard"]

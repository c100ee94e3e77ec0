"""Tensor-parallel layers (Megatron naming) built on pk_jax's fused ops.

Framework modules: `pk_jax.nn.flax` (flax.nnx) and `pk_jax.nn.equinox` (Equinox), each with
`ColumnParallelLinear`, `RowParallelLinear` and `ParallelMLP`. This module holds what they
share: the functional forms of the three layers and an unsharded reference MLP for tests.

How the layers are used
=======================

A layer is created once, outside any transform, with the FULL logical weights of the layer
(`w: [K, N]`, initialised from one key), and declares how each weight is split over the
tensor-parallel mesh axis (default `"tp"`, of size P):

=========================  ==================  ========================  ===================
layer                      weight              shard per device          bias
=========================  ==================  ========================  ===================
ColumnParallelLinear       [K, N]              [K, N/P]   P(None, tp)    [N/P]  P(tp)
RowParallelLinear          [K, N]              [K/P, N]   P(tp, None)    [N]    P() (replicated)
=========================  ==================  ========================  ===================

The user's step function is `jax.shard_map`-ped over the mesh, with the layers' partition specs
(`partition_specs(model)` in either framework module) as the in_specs of the parameters. Inside
the shard_map every device sees only its shard, so the layers hold their LOCAL weights there and
call pk_jax's per-device ops on them. Outside, the parameters are ordinary global `jax.Array`s
sharded with `NamedSharding`s: each device stores only its slice of the one logical weight,
optimisers (optax) update them like any array, and the global arrays are exactly the weights of
the equivalent unsharded model (`reference_mlp` computes that model).

Two modes, picked per layer with `sequence_parallel`:

- Plain tensor parallelism (default). Activations between blocks are replicated over the axis.
  Column: `x @ w_local` (`pk.matmul`; its VJP all-reduces dx, Megatron's "f"). Row:
  `pk.gemm_all_reduce(h_local, w_local)`: the output is replicated again.
- Sequence parallelism (`sequence_parallel=True`). Activations between blocks are sharded by
  their FIRST dimension (use the sequence-first layout `[S, B, D]`, as Megatron does). Column:
  `pk.all_gather_gemm(x_rows, w_local)` gathers the rows while it multiplies; row:
  `pk.gemm_reduce_scatter(h, w_local)` reduces and scatters the rows back. The first dimension
  of a block's input is then S/P per device, and the MLP's output has the same sharding.

The row layer adds its bias once, after the reduction. Matmuls run in `dtype` (bf16 or fp16,
fp32 accumulation), parameters are kept in `param_dtype` (default fp32) and cast on use.

Gradients can be taken outside the shard_map (as in the examples: `jax.grad` of a function
that calls it) or inside it. Inside, keep shard_map's default `check_vma=True`: the varying-axes
types are what make JAX and pk_jax's VJPs sum the gradient of a replicated input over the axis
(Megatron's "f" and "g" operators). With `check_vma=False`, gradients taken inside the
shard_map are wrong for replicated values, as they are for any `jax.lax` code there.

Parameters never need per-rank initialisation: one key initialises each full weight, and
`shard` (or flax's eager sharding under `jax.set_mesh(mesh)`) gives every device its slice. To
avoid materialising a large weight on one device, build the model under `jax.jit` with the
shardings as `out_shardings`.

Example (flax.nnx; Equinox is the same with `eqx.partition`/`eqx.combine`)::

    import jax, jax.numpy as jnp, pk_jax as pk
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from pk_jax.nn import flax as pkn

    mesh = jax.make_mesh((8,), ("tp",))
    pk.init(mesh)
    model = pkn.ParallelMLP(256, 1024, rngs=nnx.Rngs(0))   # full logical weights
    pkn.shard(model, mesh)                                  # each device keeps its shard
    graphdef, params = nnx.split(model)
    specs = pkn.partition_specs(params)

    @jax.jit
    def forward(params, x):
        def local(params, x):                               # per device: local shards
            return nnx.merge(graphdef, params)(x)
        return jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=P())(params, x)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pk_jax as pk
from pk_jax import _checks
from pk_jax.nn._fp8 import (
    fp8_all_gather_gemm,
    fp8_gemm_all_reduce,
    fp8_gemm_reduce_scatter,
    fp8_matmul,
)
from pk_jax.runtime import state

DEFAULT_AXIS = "tp"


def check_dtype(layer: str, dtype: Any) -> Any:
    """The compute dtype of a layer: bf16 or fp16 (pk_jax's GEMMs take nothing else)."""
    dt = np.dtype(dtype)
    if dt not in _checks.MATMUL_DTYPES_NP:
        raise TypeError(
            f"pk_jax.nn.{layer}: dtype={dt.name} is not supported; the tensor-parallel GEMMs run "
            "in bfloat16 or float16 (with fp32 accumulation). Pass dtype=jnp.bfloat16 and keep "
            "fp32 parameters with param_dtype=jnp.float32."
        )
    return dt


def known_axis_size(axis_name: str) -> int | None:
    """The size of mesh axis `axis_name` where it is known when a layer is built: the mesh set
    with `jax.set_mesh`, else the meshes given to `pk.init` when they agree on it; None when
    neither has the axis (the layer's first call checks it then, at trace time)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and axis_name in mesh.axis_names:
        return int(mesh.shape[axis_name])
    sizes = {int(m.shape[axis_name]) for m in state.meshes() if axis_name in m.axis_names}
    return sizes.pop() if len(sizes) == 1 else None


def check_split(layer: str, arg: str, value: int, axis_name: str | None, p: int | None, *,
                unit: int = 1, what: str = "") -> None:
    """Checks that argument `arg` of `layer` splits over `axis_name` (size `p`) into pieces
    that are multiples of `unit`.

    Args:
        layer: the layer, e.g. "flax.ColumnParallelLinear".
        arg: the argument's name, e.g. "out_features".
        value: its value.
        axis_name: the mesh axis it is split over; None: not split (only `unit` applies).
        p: the axis size; None where it is not known yet (only `unit` applies then).
        unit: what each device's piece must be a multiple of (8 for a GEMM's K: 16-byte rows).
        what: what the argument is, for the message.

    Raises:
        ValueError: it does not split; the message names the argument and values that do.
    """
    need = unit * (p or 1)
    if value > 0 and value % need == 0:
        return
    down = value // need * need
    fits = " or ".join(str(v) for v in (down, down + need) if v > 0)
    where = (f"is split over axis {axis_name!r} of size {p}" if p and axis_name else "")
    piece = (f"each device's piece of it must be a multiple of {unit} (16-byte rows for the "
             f"GEMMs)" if unit > 1 and p and p > 1 else
             f"it must be a multiple of {unit} (16-byte rows for the GEMMs)" if unit > 1 else
             "")
    reason = ", and ".join(r for r in (where, piece) if r)
    raise ValueError(
        f"pk_jax.nn.{layer}: {arg}={value}{f' ({what})' if what else ''} {reason}, so it must "
        f"be a positive multiple of {need}. Pick e.g. {fits}.")


def check_linear(layer: str, in_features: int, out_features: int, axis_name: str, *,
                 column: bool) -> None:
    """A parallel linear layer's sizes, checked when it is built: K a multiple of 8 per device,
    and the split dimension (out_features of a column layer, in_features of a row layer)
    divisible by the axis size where it is known then (`known_axis_size`)."""
    p = known_axis_size(axis_name)
    if column:
        check_split(layer, "in_features", in_features, None, None, unit=8, what="the GEMM's K")
        check_split(layer, "out_features", out_features, axis_name, p,
                    what="the weight's columns, split over the axis")
    else:
        check_split(layer, "in_features", in_features, axis_name, p, unit=8,
                    what="the weight's rows, split over the axis: the GEMM's K")
        check_split(layer, "out_features", out_features, None, None)


def check_mlp(layer: str, features: int, hidden: int, axis_name: str) -> None:
    """A ParallelMLP's sizes, checked when it is built and named as its own arguments."""
    check_split(layer, "features", features, None, None, unit=8, what="the first GEMM's K")
    check_split(layer, "hidden", hidden, axis_name, known_axis_size(axis_name), unit=8,
                what="the hidden units, split over the axis: the second GEMM's K")


def check_local_shape(layer: str, name: str, w: jax.Array, full: tuple[int, int], dim: int,
                      axis_name: str) -> int:
    """Checks that `w` is this device's shard of a [K, N] weight split along `dim`.

    Returns:
        P, the size of `axis_name`.
    """
    p = _checks.axis_size(f"nn.{layer}", axis_name)
    want = list(full)
    check_split(layer, f"{'in' if dim == 0 else 'out'}_features", full[dim], axis_name, p,
                unit=8 if dim == 0 else 1, what=f"{name} dimension {dim}")
    want[dim] //= p
    if tuple(w.shape) != tuple(want):
        hint = ("It holds the FULL weight: pass the model's partition specs "
                "(partition_specs(params)) as the shard_map in_specs of the parameters."
                if tuple(w.shape) == tuple(full) and p > 1 else
                f"Its partition spec must split dimension {dim} over {axis_name!r}.")
        raise ValueError(
            f"pk.nn.{layer}: inside shard_map, {name} should be this device's shard of shape "
            f"{tuple(want)} (full {tuple(full)}, split over {axis_name!r} of size {p}), but has "
            f"shape {tuple(w.shape)}. {hint}"
        )
    return p


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


FP8_SCALINGS = (None, "tensor", "block")


def check_fp8(layer: str, fp8: str | None) -> str | None:
    """The layers' `fp8` argument: None (bf16/fp16 GEMMs), "tensor" or "block" (the fp8
    recipe, `fp8_matmul`, with that scaling)."""
    if fp8 not in FP8_SCALINGS:
        raise ValueError(f"pk.nn.{layer}: fp8 must be None, 'tensor' or 'block' (the scaling "
                         f"of pk_jax.nn.fp8_matmul), got {fp8!r}.")
    return fp8


def column_parallel_linear(x: jax.Array, w: jax.Array, b: jax.Array | None, *, axis_name: str,
                           sequence_parallel: bool = False,
                           dtype: Any = jnp.bfloat16, fp8: str | None = None) -> jax.Array:
    """The column-parallel linear layer on local shards (call inside shard_map).

    Args:
        x: plain mode: [..., K], replicated over `axis_name`. Sequence-parallel: [S/P, ..., K],
            this device's block of the first dimension.
        w: [K, N/P], this device's column block of the weight.
        b: [N/P] or None.
        axis_name: the tensor-parallel mesh axis.
        sequence_parallel: whether `x` is sharded by its first dimension.
        dtype: the compute dtype (bf16 or fp16).
        fp8: None, or "tensor" / "block": the GEMM by the fp8 recipe (`fp8_matmul`: fp8
            forward with current scaling, dgrad and wgrad in `dtype`); with sequence_parallel
            `fp8_all_gather_gemm` (the rows gathered in fp8 with their scales, then the fp8
            GEMM; the backward gathers them again in `dtype`). K a multiple of 16.

    Returns:
        plain: [..., N/P]; sequence-parallel: [S, ..., N/P] (the first dimension gathered).
    """
    lead = x.shape[:-1]
    x2, w = _rows(x.astype(dtype)), w.astype(dtype)
    if sequence_parallel:
        p = jax.lax.axis_size(axis_name)
        if fp8 is None:
            y = pk.all_gather_gemm(x2, w, axis_name)
        else:
            y = fp8_all_gather_gemm(x2, w, axis_name, scaling=fp8)
        y = y.reshape(p * lead[0], *lead[1:], y.shape[-1])
    elif fp8 is None:
        y = pk.matmul(x2, w).reshape(*lead, w.shape[-1])
    else:
        y = fp8_matmul(x2, w, scaling=fp8).reshape(*lead, w.shape[-1])
    return y if b is None else y + b.astype(dtype)


def row_parallel_linear(h: jax.Array, w: jax.Array, b: jax.Array | None, *, axis_name: str,
                        sequence_parallel: bool = False, dtype: Any = jnp.bfloat16,
                        fp8: str | None = None) -> jax.Array:
    """The row-parallel linear layer on local shards (call inside shard_map).

    Args:
        h: [..., K/P] (this device's column block of the hidden activation); sequence-parallel:
            [S, ..., K/P] with S divisible by P.
        w: [K/P, N], this device's row block of the weight.
        b: [N] (replicated) or None; added once, after the reduction over `axis_name`.
        axis_name: the tensor-parallel mesh axis.
        sequence_parallel: reduce-scatter the first dimension instead of all-reducing.
        dtype: the compute dtype (bf16 or fp16).
        fp8: None, or "tensor" / "block": the GEMM and its reduction by the fp8 recipe
            (`fp8_gemm_all_reduce` / `fp8_gemm_reduce_scatter`: fp8 forward, fused where the
            cost model picks it, the backward in `dtype`; K/P a multiple of 16).

    Returns:
        plain: [..., N], replicated; sequence-parallel: [S/P, ..., N], this device's block.
    """
    lead = h.shape[:-1]
    h2, w = _rows(h.astype(dtype)), w.astype(dtype)
    if sequence_parallel:
        p = jax.lax.axis_size(axis_name)
        if not lead or lead[0] % p:
            raise ValueError(
                f"pk.nn.RowParallelLinear: with sequence_parallel=True the first dimension of "
                f"the input is reduce-scattered over {axis_name!r} of size {p}, but the input "
                f"has shape {tuple(h.shape)}. Make its first dimension (the sequence, in the "
                f"[S, B, D] layout) a multiple of {p}."
            )
        if fp8 is None:
            y = pk.gemm_reduce_scatter(h2, w, axis_name)
        else:
            y = fp8_gemm_reduce_scatter(h2, w, axis_name, scaling=fp8)
        y = y.reshape(lead[0] // p, *lead[1:], y.shape[-1])
    elif fp8 is None:
        y = pk.gemm_all_reduce(h2, w, axis_name).reshape(*lead, w.shape[-1])
    else:
        y = fp8_gemm_all_reduce(h2, w, axis_name, scaling=fp8).reshape(*lead, w.shape[-1])
    return y if b is None else y + b.astype(dtype)


def reference_mlp(x: jax.Array, w1: jax.Array, b1: jax.Array | None, w2: jax.Array,
                  b2: jax.Array | None, *, activation: Callable = jax.nn.gelu,
                  dtype: Any = jnp.bfloat16) -> jax.Array:
    """The unsharded MLP that a ParallelMLP with these FULL weights computes (for tests).

    `activation(x @ w1 + b1) @ w2 + b2` in `dtype` with fp32 accumulation, on one device.
    """
    def dense(a, w, b):
        y = jnp.dot(a.astype(dtype), w.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)
        return y if b is None else y + b.astype(dtype)

    return dense(activation(dense(x, w1, b1)), w2, b2)


__all__ = ["DEFAULT_AXIS", "column_parallel_linear", "fp8_all_gather_gemm", "fp8_gemm_all_reduce",
           "fp8_gemm_reduce_scatter", "fp8_matmul", "reference_mlp", "row_parallel_linear"]

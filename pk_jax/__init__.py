"""pk_jax: ParallelKittens for JAX.

Fused multi-GPU compute+communication kernels for Hopper, called inside `jax.shard_map` like
`jax.lax` collectives. Without the CUDA extension, or off sm_90 GPUs, every op runs its
`jax.lax` reference.
"""

from pk_jax import _profile
from pk_jax._backend import backend_name
from pk_jax._ffi import HAS_CUDA
from pk_jax.ops.ag_gemm import all_gather_gemm
from pk_jax.ops.all_gather import all_gather
from pk_jax.ops.all_reduce import all_reduce
from pk_jax.ops.all_to_all import all_to_all
from pk_jax.ops.attention import SegmentIds, attention
from pk_jax.ops.gemm_ar import gemm_all_reduce
from pk_jax.ops.gemm_rs import gemm_reduce_scatter
from pk_jax.ops.grouped_matmul import grouped_matmul
from pk_jax.ops.matmul import matmul
from pk_jax.ops.moe import moe_combine, moe_dispatch, moe_dispatch_gemm, moe_gemm_combine
from pk_jax.ops.reduce_scatter import reduce_scatter
from pk_jax.ops.ring_attn import ring_attention, zigzag_indices
from pk_jax.ops.ulysses_attn import ulysses_attention
from pk_jax.runtime.errors import check_errors
from pk_jax.runtime.state import init, shutdown

__version__ = "0.1.0"

# Every op under its own name in profiler traces (pk_jax/_profile.py).
all_gather_gemm = _profile.named(all_gather_gemm)
all_gather = _profile.named(all_gather)
all_reduce = _profile.named(all_reduce)
all_to_all = _profile.named(all_to_all)
gemm_all_reduce = _profile.named(gemm_all_reduce)
gemm_reduce_scatter = _profile.named(gemm_reduce_scatter)
matmul = _profile.named(matmul)
reduce_scatter = _profile.named(reduce_scatter)
ring_attention = _profile.named(ring_attention)
ulysses_attention = _profile.named(ulysses_attention)
attention = _profile.named(attention)
grouped_matmul = _profile.named(grouped_matmul)
moe_dispatch = _profile.named(moe_dispatch)
moe_combine = _profile.named(moe_combine)
moe_dispatch_gemm = _profile.named(moe_dispatch_gemm)
moe_gemm_combine = _profile.named(moe_gemm_combine)
zigzag_indices = _profile.named(zigzag_indices)

__all__ = [
    "HAS_CUDA",
    "SegmentIds",
    "__version__",
    "all_gather",
    "all_gather_gemm",
    "all_reduce",
    "all_to_all",
    "attention",
    "backend_name",
    "check_errors",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "grouped_matmul",
    "init",
    "matmul",
    "moe_combine",
    "moe_dispatch",
    "moe_dispatch_gemm",
    "moe_gemm_combine",
    "reduce_scatter",
    "ring_attention",
    "shutdown",
    "ulysses_attention",
    "zigzag_indices",
]

"""pk_jax: ParallelKittens for JAX.

Fused multi-GPU compute+communication kernels for Hopper, called inside `jax.shard_map` like
`jax.lax` collectives. Without the CUDA extension, or off sm_90 GPUs, every op runs its
`jax.lax` reference.
"""

from pk_jax._ffi import HAS_CUDA
from pk_jax._backend import backend_name
from pk_jax.runtime.state import init, shutdown
from pk_jax.ops.all_reduce import all_reduce
from pk_jax.ops.all_gather import all_gather
from pk_jax.ops.reduce_scatter import reduce_scatter
from pk_jax.ops.all_to_all import all_to_all

__version__ = "0.1.0"

__all__ = [
    "HAS_CUDA",
    "__version__",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "backend_name",
    "init",
    "reduce_scatter",
    "shutdown",
]

"""pk_jax: ParallelKittens for JAX.

Fused multi-GPU compute+communication kernels for Hopper, called inside `jax.shard_map` like
`jax.lax` collectives. Without the CUDA extension, or off sm_90 GPUs, every op runs its
`jax.lax` reference.
"""

import importlib as _importlib
import inspect as _inspect
import pkgutil as _pkgutil

from pk_jax import _profile
from pk_jax import ops as _ops
from pk_jax._backend import backend_name
from pk_jax._ffi import HAS_CUDA
from pk_jax.runtime.errors import check_errors
from pk_jax.runtime.state import init, shutdown

__version__ = "0.1.0"


def _export_ops() -> list[str]:
    """Exports every name in the `__all__` of each public op module (pk_jax/ops/<stem>.py, no
    leading underscore), its functions each under its own name in profiler traces
    (pk_jax/_profile.py). A new op module is exported by listing its names there."""
    names = []
    for info in sorted(_pkgutil.iter_modules(_ops.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = _importlib.import_module(f"{_ops.__name__}.{info.name}")
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            globals()[name] = _profile.named(value) if _inspect.isfunction(value) else value
            names.append(name)
    return names


__all__ = ["HAS_CUDA", "__version__", "backend_name", "check_errors", "init", "shutdown"]
__all__.extend(_export_ops())

"""Loading the CUDA extension and registering its FFI targets with XLA.

`HAS_CUDA` is True when the compiled module `pk_jax._pk_ffi` imports; pk_jax works without it,
every op then lowers to its `jax.lax` reference.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import pathlib
import threading

import jax
import numpy as np

MODULE = "pk_jax._pk_ffi"
BUILD_HINT = ("To build it, reinstall on a machine with nvcc (CUDA 12.4 or newer): "
              "`PK_JAX_CUDA=ON pip install -v --no-build-isolation \".[cuda]\"` from a checkout, "
              "or `PK_JAX_CUDA=ON make setup`.")


def _import_error(e: ImportError) -> ImportError:
    """What the failed import of the extension means, and how to fix it.

    `from pk_jax import _pk_ffi` inside the package's own import reports a missing module as a
    "partially initialized module ... (most likely due to a circular import)", which it is not;
    the module is imported by its full name, and a missing one is said to be missing.
    """
    if getattr(e, "name", None) == MODULE and not list(
            pathlib.Path(__file__).parent.glob("_pk_ffi*")):
        return ImportError(f"the CUDA extension {MODULE} is not installed (a pure-Python "
                           f"install: every op runs its jax.lax reference). {BUILD_HINT}")
    return ImportError(f"the CUDA extension {MODULE} is there but does not import ({e}). It was "
                       "most likely built for another Python, jaxlib or CUDA; rebuild it. "
                       f"{BUILD_HINT}")


try:
    _pk_ffi = importlib.import_module(MODULE)
    HAS_CUDA = True
    IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pure-Python install, or a module built for another Python/jaxlib
    _pk_ffi = None
    HAS_CUDA = False
    IMPORT_ERROR = _import_error(e)
    IMPORT_ERROR.__cause__ = e



@functools.cache
def driver_problem() -> str:
    """Why the NVIDIA driver (libcuda.so.1) cannot be loaded in this process; "" when it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return str(e)
    return ""


def require_driver(what: str) -> None:
    """Raises a RuntimeError that says what to do when `what` needs a GPU and no driver loads.

    Without it the first driver call fails with cuda-python's bare "Failed to dlopen
    libcuda.so.1", which names neither the cause nor the fix.

    Args:
        what: what needs the driver, e.g. "pk_jax.testing.World".

    Raises:
        RuntimeError: libcuda.so.1 does not load here.
    """
    problem = driver_problem()
    if problem:
        built = "The CUDA extension is built, but t" if HAS_CUDA else "T"
        raise RuntimeError(
            f"pk_jax: {what} needs an NVIDIA GPU and its driver, and this machine has no "
            f"driver: libcuda.so.1 does not load ({problem}). {built}he kernels run only on "
            "Hopper GPUs. Run this on a GPU machine; elsewhere every op runs its jax.lax "
            "reference (on a mesh of CPU devices, or anywhere with PK_JAX_BACKEND=reference).")


_lock = threading.Lock()
_registered_platforms: set[str] = set()


# The communicator handlers' per-executable state (ffi/comm_state.h), registered with XLA before
# the handlers that use it.
COMM_STATE_TYPE = "pk_jax.CommState"


def registrations() -> list[tuple[str, str, object]]:
    """(target, platform, handler) for every handler in the module; empty without it.

    handler is the execute stage's capsule, or for the handlers that use a communicator the
    dict of their stages ({"instantiate": capsule, "execute": capsule}): XLA runs the
    instantiate stage once per executable and it binds the communicator then.
    """
    return list(_pk_ffi.registrations()) if HAS_CUDA else []


def workspace_need(op: str, world: int, **sizes: int) -> int:
    """Bytes of symmetric workspace per device one call of FFI op `op` needs at `world` ranks.

    The op's launch function checks the communicator's workspace against the same C++ function
    (ffi/launch.h `WorkspaceNeed`), so the trace-time check and the launch agree. `sizes` are
    the call's launch fields by name (`_pk_ffi.op_fields()`); those left out read 0; `dtype`
    may be given as a dtype. Only on the kernel path, which needs the extension.
    """
    if "dtype" in sizes:
        from pk_jax import _op_table

        sizes["dtype"] = _op_table.DTYPES[np.dtype(sizes["dtype"]).name]
    return int(_pk_ffi.workspace_need(op, sizes, world))


def targets(platform: str = "CUDA") -> set[str]:
    """Names of the FFI targets the module provides for `platform` ("CUDA" or "cpu")."""
    return {name for name, plat, _ in registrations() if plat == platform}


def register(platform: str) -> bool:
    """Registers every handler of `platform` with XLA, once per process.

    Returns whether the module had any handler for that platform.
    """
    if not HAS_CUDA:
        return False
    with _lock:
        if platform not in _registered_platforms:
            regs = [r for r in registrations() if r[1] == platform]
            if any(isinstance(handler, dict) for _, _, handler in regs):
                _register_comm_state(platform)
            for name, plat, handler in regs:
                jax.ffi.register_ffi_target(name, handler, platform=plat, api_version=1)
            _registered_platforms.add(platform)
    return bool(targets(platform))


def _register_comm_state(platform: str) -> None:
    """Registers the communicator handlers' state type, whose id XLA assigns."""
    type_ = _pk_ffi.comm_state_type()
    if hasattr(jax.ffi, "register_ffi_type"):
        jax.ffi.register_ffi_type(COMM_STATE_TYPE, type_, platform=platform)
    else:  # jax before register_ffi_type: the id alone (the state is then never deleted)
        jax.ffi.register_ffi_type_id(COMM_STATE_TYPE, type_["type_id"], platform=platform)


def vma(x) -> frozenset:
    """The mesh axes along which `x` varies inside shard_map (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def _pcast_to(x, axes: frozenset):
    missing = tuple(sorted(axes - vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def call(target: str, results, *args, out_vma: frozenset | None = None, **attributes):
    """`jax.ffi.ffi_call(target, results)(*args, **attributes)` inside shard_map.

    Operands are cast to the union of their varying axes (the FFI call's typing rule wants them
    equal), and the results are typed as varying along `out_vma` (default: that union). Callers
    wrap this in a custom VJP, so the casts never reach autodiff.

    Args:
        target: the FFI target name, pk_<stem>.
        results: a ShapeDtypeStruct or a sequence of them.
        *args: the operands.
        out_vma: the varying axes of the results.
        **attributes: static attributes passed to the handler.
    """
    union = frozenset().union(*(vma(a) for a in args))
    args = [_pcast_to(a, union) for a in args]
    single = not isinstance(results, (list, tuple))
    plain = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in ([results] if single else results)]
    outs = jax.ffi.ffi_call(target, plain)(*args, **attributes)
    axes = union if out_vma is None else frozenset(out_vma)
    outs = [_pcast_to(o, axes) for o in outs]
    return outs[0] if single else outs

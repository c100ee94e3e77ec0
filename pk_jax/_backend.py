"""How each op call runs: decided once, at trace time, in `route`; everything below obeys.

`route(stem, axis_name, ...)` returns a `Route` whose `path` is one of
- "reference": the `jax.lax` reference;
- "kernel": the op's CUDA kernel (collectives, matmul, grouped_matmul, attention, ...);
- "local": a tensor-parallel GEMM over a 1-device axis, i.e. pk.matmul alone;
- "serial": pk.matmul, then the pk collective (the cost model predicts no gain from overlap);
- "fused": the overlapped kernel (with `num_comm_sms` for ag_gemm, and for the fused Ulysses
  and MoE kernels, `cost_model.ROUTED_OVERLAP_OPS`, in their place: see `overlap` below).
The ops call `route` once and never re-decide; the C++ handlers execute what they are given.

A kernel can run when all of these hold (`use_kernel`): the extension is built (`HAS_CUDA`),
the mesh given to `pk.init` is on sm_90 GPUs, the op has a registered FFI target, the axis lies
on one host, and `PK_JAX_BACKEND` is not `reference`. Otherwise the reference runs: silently on
CPU, where that is the design, and with one warning per reason on a GPU, where the user
expected kernels. Over a 1-device axis a collective is the identity, which the reference gives
XLA as a no-op (unless PK_JAX_SINGLE_DEVICE_KERNELS=1). Between "local", "serial" and "fused"
the cost model chooses (pk_jax/cost_model.py; `PK_JAX_TP_MODE` and `cost_model.override` force
one), and between "fused" and "serial" for the fused Ulysses and MoE kernels too
(`PK_JAX_ULYSSES_FUSED`, `PK_JAX_MOE_FUSED`, `cost_model.override_ops` force one).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _ffi, cost_model
from pk_jax.runtime import state

BACKENDS = ("auto", "reference", "cuda")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TP_GEMMS = ("gemm_rs", "ag_gemm", "gemm_ar")
# The fp8 forms of the TP GEMMs: routed as their bf16 ops, with the fp8 rates (cost_model).
TP_GEMMS_FP8 = cost_model.FP8_OPS
# all_gather_gemm's fp8 form: "local" (P = 1: the fp8 GEMM), "serial" (the pk all_gather of the
# fp8 rows and their scales, then the fp8 GEMM) or "fused" (pk_ag_gemm_fp8), as cost_model.plan
# picks (cost_model.FP8_GATHER_FUSED).
GATHER_GEMM_FP8 = "ag_gemm_fp8"
_warned: set[str] = set()


def requested() -> str:
    """The backend asked for with PK_JAX_BACKEND (auto, reference or cuda), fixed at pk.init."""
    value = state.settings().backend
    if value not in BACKENDS:
        raise ValueError(f"PK_JAX_BACKEND={value!r} is not one of {', '.join(BACKENDS)}. Set "
                         "it to one of those (or unset it) before pk.init.")
    return value


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"pk_jax: {message} Falling back to the jax.lax reference.", stacklevel=4)


def _fallback(key: str, message: str, *, warn: bool) -> bool:
    if requested() == "cuda":
        raise ValueError(f"pk_jax: PK_JAX_BACKEND=cuda, but {message} Unset PK_JAX_BACKEND to "
                         "fall back to the jax.lax reference.")
    if warn:
        _warn_once(key, message)
    return False


def _platform(devices) -> str:
    return devices[0].platform


def all_hopper(devices) -> bool:
    return all(d.platform == "gpu" and getattr(d, "compute_capability", "") == "9.0"
               for d in devices)


def use_kernel(stem: str, axis_name: str | None = None) -> bool:
    """Whether op `stem` (e.g. "gemm_rs") can run its CUDA kernel in the current trace: the
    platform half of `route`, which makes the decision."""
    if requested() == "reference":
        return False
    mesh = state.mesh_for(axis_name) if axis_name is not None else state.mesh_or_none()
    if mesh is not None:
        devices = list(mesh.devices.flat)
    elif axis_name is None:  # a local op (matmul) needs no pk.init: the default devices
        devices = jax.devices()
    else:
        return False
    platform = _platform(devices)
    if platform != "gpu":
        return _fallback("platform", f"the mesh is on {platform}, not on GPUs.", warn=False)
    if not _ffi.HAS_CUDA:
        return _fallback("no-ext", f"the CUDA extension is not built ({_ffi.IMPORT_ERROR}); "
                         "reinstall with nvcc on the PATH or PK_JAX_CUDA=ON.", warn=True)
    if not all_hopper(devices):
        return _fallback("arch", "the kernels need sm_90 (Hopper) GPUs and this mesh has "
                         f"{sorted({d.device_kind for d in devices})}.", warn=True)
    if f"pk_{stem}" not in _ffi.targets("CUDA"):
        return _fallback(f"target-{stem}", f"op {stem} has no CUDA kernel in this build.",
                         warn=False)
    if axis_name is not None and not state.axis_on_one_host(axis_name):
        return _fallback(f"hosts-{axis_name}", f"axis {axis_name!r} spans several hosts, "
                         "outside one NVLink domain.", warn=True)
    _ffi.register("CUDA")
    return True


def require_kernel(stem: str, who: str, axis_name: str | None = None) -> None:
    """For a private entry that runs `stem`'s kernel whatever the router would pick: raises
    RuntimeError naming `who` (e.g. "pk.matmul: the fp8 kernel (pk_matmul_fp8)") unless the
    kernel can run in this trace; `use_kernel` also registers the extension's handlers."""
    if not use_kernel(stem, axis_name):
        gpus = "sm_90 GPUs" if axis_name is not None else "an sm_90 GPU"
        raise RuntimeError(f"{who} cannot run here: it needs {gpus} and the pk_jax extension "
                           "built with it.")


@dataclasses.dataclass(frozen=True)
class Route:
    """How one call runs (see the module docstring); num_comm_sms for fused ag_gemm; forced:
    an override, not the decider, chose between fused and serial."""

    path: str
    num_comm_sms: int = 0
    forced: bool = False


REFERENCE = Route("reference")


def _gpu() -> cost_model.GPU:
    mesh = state.mesh_or_none()
    kind = next(iter(mesh.devices.flat)).device_kind if mesh is not None else ""
    return cost_model.gpu_for(kind)


def route(stem: str, axis_name: str | None = None, *, supported: bool = True,
          gemm: tuple[int, int, int, object] | None = None,
          overlap: tuple[dict, int] | None = None, fp8: str | None = None) -> Route:
    """The one decision of how a call of op `stem` runs, made at trace time.

    Args:
        stem: the op ("gemm_rs", "all_reduce", "matmul", ...).
        axis_name: the mesh axis of a cross-device op; None for a local op.
        supported: whether the kernel takes these operands (shapes, dtypes); False routes to
            the reference.
        gemm: for the TP GEMMs, (M, N, K, dtype) of the call: M the rows of the whole product,
            K the contraction each device multiplies; the cost model chooses local, serial or
            fused from them.
        fp8: for the fp8 forms of the TP GEMMs (TP_GEMMS_FP8 and all_gather_gemm's,
            GATHER_GEMM_FP8), their scaling ("tensor" or "block"); `gemm`'s dtype is then not
            read. For GATHER_GEMM_FP8, `supported` says whether the fused kernel takes the
            operands (the serial form takes every checked call).
        overlap: for a fused kernel of cost_model.ROUTED_OVERLAP_OPS over a P > 1 axis, (shape,
            itemsize) of the call (shape per device, cost_model.overlap_parts' keys): the route
            is "fused" where its override (`cost_model.overlap_override`) or else the decider
            (`cost_model.choose`) picks the fused kernel and it can run (`supported` and
            `use_kernel`), else "serial": the op's serial form, whose parts (pk.attention,
            pk.all_to_all, pk.moe_dispatch, pk.grouped_matmul, ...) route themselves.

    Returns:
        A Route; the op follows its `path` and nothing below re-decides.
    """
    if overlap is not None:
        shape, itemsize = overlap
        forced = cost_model.overlap_override(stem)
        if not supported or not use_kernel(stem, axis_name):
            return Route("serial", forced=forced is not None)
        p = jax.lax.axis_size(axis_name)
        mode = forced or cost_model.choose(stem, shape, p, itemsize=itemsize, gpu=_gpu())
        return Route(mode, forced=forced is not None)
    if stem == GATHER_GEMM_FP8:
        p = jax.lax.axis_size(axis_name)
        if not use_kernel("matmul_fp8", axis_name):
            return REFERENCE
        m, n, k, _ = gemm
        pl = cost_model.plan("ag_gemm", m, n, k, p, gpu=_gpu(), fp8=fp8)
        if pl.mode == "fused" and supported and use_kernel(stem, axis_name):
            return Route("fused", pl.num_comm_sms)
        if p == 1:
            return Route("local")
        return Route("serial") if use_kernel("all_gather", axis_name) else REFERENCE
    if not supported or not use_kernel(stem, axis_name):
        return REFERENCE
    p = jax.lax.axis_size(axis_name) if axis_name is not None else 1
    if stem in COLLECTIVES:
        if p == 1 and state.settings().single_device_kernels != "1":
            return REFERENCE  # the identity: XLA's no-op beats any kernel
        return Route("kernel")
    if stem in TP_GEMMS:
        m, n, k, dtype = gemm
        pl = cost_model.plan(stem, m, n, k, p, itemsize=np.dtype(dtype).itemsize, gpu=_gpu())
        return Route(pl.mode, pl.num_comm_sms)
    if stem in TP_GEMMS_FP8:
        m, n, k, _ = gemm
        return Route(cost_model.plan(stem.removesuffix("_fp8"), m, n, k, p, gpu=_gpu(),
                                     fp8=fp8).mode)
    return Route("kernel")


# The public ops (pk.<name>) and the stem of the kernel each runs where kernels run
# (ulysses_attention: its default, the pk.attention kernels between two all_to_alls).
OP_STEMS = {
    "all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
    "all_to_all": "all_to_all", "matmul": "matmul", "gemm_reduce_scatter": "gemm_rs",
    "all_gather_gemm": "ag_gemm", "gemm_all_reduce": "gemm_ar", "attention": "attention",
    "ring_attention": "ring_attn", "ulysses_attention": "attention",
    "grouped_matmul": "grouped_matmul", "moe_dispatch": "moe_dispatch",
    "moe_combine": "moe_combine", "moe_dispatch_gemm": "moe_dispatch_gemm",
    "moe_gemm_combine": "moe_gemm_combine",
}
# The short stems (HOUSE_STYLE's names, used by the examples and benchmarks) stay accepted.
_STEM_ALIASES = frozenset(OP_STEMS.values()) | {"ulysses_attn"}


def backend_name(op: str = "matmul", axis_name: str | None = None) -> str:
    """What op `op` would run now: "cuda" (its kernel) or "reference" (the jax.lax reference).

    For examples and logs; the ops decide each call at trace time, and a call whose operands
    the kernel does not take still runs the reference.

    Args:
        op: a public op name, e.g. "gemm_reduce_scatter", "attention" (or its stem, e.g.
            "gemm_rs").
        axis_name: the mesh axis of a cross-device op; None for a local op (matmul,
            grouped_matmul, attention).

    Returns:
        "cuda" or "reference".

    Raises:
        TypeError: `op` not a str.
        ValueError: an unknown op (the message lists the known ones).
    """
    if not isinstance(op, str):
        raise TypeError(f"pk.backend_name: op must be an op name (str), got {op!r}.")
    stem = OP_STEMS.get(op, op if op in _STEM_ALIASES else None)
    if stem is None:
        raise ValueError(f"pk.backend_name: unknown op {op!r}; the ops are "
                         f"{', '.join(sorted(OP_STEMS))}.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return "cuda" if use_kernel(stem, axis_name) else "reference"
        except ValueError:
            return "reference"


def rank_operand(axis_name: str) -> jax.Array:
    """This device's index along `axis_name`, as the int32[1] operand the handlers take."""
    return jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)

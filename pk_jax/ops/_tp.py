"""Shared trace-time helpers of the fused tensor-parallel GEMM lowerings (gemm_rs, ag_gemm,
gemm_ar): the N padding TMA needs, the workspace check, and the fp8 forms' checks and call.
Which path a call takes is decided in one place, `pk_jax._backend.route`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pk_jax import _backend, _checks, _ffi, _op_table
from pk_jax import fp8 as _fp8
from pk_jax.ops import _vjp, all_reduce, reduce_scatter
from pk_jax.ops import matmul as _mm
from pk_jax.runtime import state


def pad_n(w: jax.Array) -> tuple[jax.Array, int]:
    """w with its columns padded to a multiple of 8 (16-byte TMA rows), and the padded N."""
    n = w.shape[1]
    n_pad = -(-n // 8) * 8
    if n_pad != n:
        w = jnp.pad(w, ((0, 0), (0, n_pad - n)))
    return w, n_pad


def check_workspace(name: str, need: int, what: str) -> None:
    """Raises ValueError when the symmetric workspace cannot hold `need` bytes."""
    have = state.workspace_bytes()
    if need > have:
        mib = -(-need // (1 << 20))
        raise ValueError(
            f"pk.{name}: this call needs {need} bytes of symmetric workspace per device for "
            f"{what}, and pk.init was given {have}. Call pk.init(mesh, "
            f"workspace_bytes={mib << 20}) (or more), or use smaller shards.")


# ---------------------------------------------------------------------------------------------
# The TP GEMMs in fp8: gemm_reduce_scatter and gemm_all_reduce with fp8 operands (`fp8_op`),
# routed as the bf16 forms are (local, serial or the fused kernels pk_gemm_rs_fp8 /
# pk_gemm_ar_fp8 of cuda/kernels/gemm_rs_fp8.cuh; entries gemm_rs._fp8_kernel and
# gemm_ar._fp8_kernel run the fused kernels whatever the route).


def no_scales(name: str, x, x_scale, w_scale) -> None:
    """The 16-bit forms take no scales: a TypeError naming them if given."""
    if x_scale is not None or w_scale is not None:
        raise TypeError(f"pk.{name}: x_scale and w_scale are for fp8 operands (pk_jax.fp8), and "
                        f"x is {x.dtype}; leave them out.")


def fp8_op(name: str, stem: str, reference, x, w, x_scale, w_scale,
           axis_name: str) -> jax.Array:
    """gemm_reduce_scatter (stem "gemm_rs_fp8") or gemm_all_reduce ("gemm_ar_fp8") of checked
    fp8 operands (`check_fp8`), as `_backend.route` decides it: "local" (P = 1: the fp8 GEMM,
    the collective XLA's no-op), "serial" (the fp8 GEMM into bf16, then the pk collective),
    "fused" (the fused fp8 kernels) or "reference" (`reference(x, w, x_scale, w_scale,
    axis_name)`, the op's fp8_reference). Its gradient is the reference's."""
    m, k, n = x.shape[0], x.shape[1], w.shape[1]
    scaling = "block" if x_scale.ndim == 2 or w_scale.ndim == 2 else "tensor"
    r = _backend.route(stem, axis_name, gemm=(m, n, k, None), fp8=scaling)
    ref = functools.partial(reference, axis_name=axis_name)
    if r.path == "reference":
        return ref(x, w, x_scale, w_scale)
    forward = functools.partial(_fp8_forward, name=name, stem=stem, path=r.path,
                                axis_name=axis_name)
    return _vjp.with_reference_grad(forward, ref, x, w, x_scale, w_scale)


def _fp8_forward(x, w, x_scale, w_scale, *, name: str, stem: str, path: str, axis_name: str):
    p = jax.lax.axis_size(axis_name)
    rs = stem == "gemm_rs_fp8"
    if path == "fused":
        return fp8_call(name, "pk_" + stem, x, w, x_scale, w_scale, axis_name, p,
                        x.shape[0] // p if rs else x.shape[0], "kn")
    y = _mm._fp8_kernel(x, w, x_scale, w_scale, jnp.bfloat16)
    if path == "local":  # the collective over one device: XLA's no-op, the reference's type
        return (jax.lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True) if rs
                else jax.lax.psum(y, axis_name))
    if rs:
        return reduce_scatter.kernel(y, axis_name, 0)
    return all_reduce.kernel(y, axis_name, 0)


def check_fp8(name: str, x, w, x_scale, w_scale, w_layout: str, *, rows: str = "M",
              depth: str = "K/P") -> tuple[int, int, int]:
    """The fp8 TP GEMMs' trace-time checks of one rank's operands.

    x [M, K/P] and w [K/P, N] ("kn") or wt [N, K/P] ("nk"), both fp8 (either format), K/P a
    multiple of 16; x_scale and w_scale float32, this rank's (each rank quantized its own
    shard): scalars, or pk.matmul's blockwise shapes of the shard ([M, ceil(K/P / 128)] and
    [ceil(K/P / 128), ceil(N / 128)]; a scalar one beside a blockwise one is broadcast to its
    blocks, as pk.matmul does). `rows` and `depth` name x's dimensions in the messages
    (all_gather_gemm: "M/P" and "K"). Returns (rows, depth, N)."""
    formats = ", ".join(np.dtype(d).name for d in _fp8.FORMATS)
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"pk.{name}: w_layout must be 'kn' (w [{depth}, N]) or 'nk' (w "
                         f"transposed, [N, {depth}]), got {w_layout!r}.")
    _checks.ndim_is(name, "x", x, 2)
    _checks.ndim_is(name, "w", w, 2)
    for arg, a in (("x", x), ("w", w)):
        if not _fp8.is_fp8(a.dtype):
            raise TypeError(f"pk.{name}: x and w must be fp8 ({formats}); {arg} is {a.dtype}. "
                            "Quantize it with pk_jax.fp8.quantize.")
    m, k = x.shape
    n, wk = (w.shape[1], w.shape[0]) if w_layout == "kn" else w.shape
    if wk != k:
        want = f"[{depth}, N]" if w_layout == "kn" else f"[N, {depth}] (w_layout='nk')"
        raise ValueError(f"pk.{name}: contraction dimensions differ: x has shape {x.shape} and w "
                         f"has shape {w.shape}. w must be {want} for x [{rows}, {depth}].")
    _checks.divisible(name, f"{depth} (x.shape[1])", k, 16,
                      "fp8 rows need 16-byte strides: pad K with zeros in x and w.")
    for arg, scale, role, shape in (("x_scale", x_scale, "x", (m, k)),
                                    ("w_scale", w_scale, "w", (k, n))):
        block = _fp8.block_shape(role, shape)
        if scale is None or getattr(scale, "dtype", None) != jnp.float32:
            got = "None" if scale is None else getattr(scale, "dtype", type(scale).__name__)
            raise TypeError(f"pk.{name}: {arg} must be float32, a scalar or {list(block)} "
                            f"(this device's scales, pk_jax.fp8.quantize), got {got}.")
        if scale.shape not in ((), block):
            raise ValueError(f"pk.{name}: {arg} must be a scalar or {list(block)} (blockwise, "
                             f"of this device's {role} {list(shape)}), got shape "
                             f"{list(scale.shape)}.")
    if max(m, -(-n // 8) * 8, k) > _op_table.MAX_DIM:
        raise ValueError(f"pk.{name}: the fp8 kernels index sizes in int32; {rows}, N and {depth} "
                         f"must be at most {_op_table.MAX_DIM}.")
    return m, k, n


def fp8_call(name: str, target: str, x, w, x_scale, w_scale, axis_name: str, p: int,
             rows: int, w_layout: str) -> jax.Array:
    """Calls `target` (pk_gemm_rs_fp8 or pk_gemm_ar_fp8) on checked operands (check_fp8): w
    transposed to wt [N8, K/P] unless given so (fp8 wgmma reads B K-major) and N padded to
    N8, a multiple of 8, with zero rows; y bf16 [rows, N] (`rows`: M / P or M).

    The result varies along every axis an operand varies along; gemm_rs_fp8's also along
    axis_name (each device its rows: _ffi.call's default once the rank operand is passed),
    gemm_ar_fp8's not (like psum, the same sum on every device)."""
    stem = target.removeprefix("pk_")
    _backend.require_kernel(stem, f"pk.{name}: the fused fp8 kernel ({target})", axis_name)
    m = x.shape[0]
    x, wt, xs, ws, blockwise, n = _mm.fp8_operands(x, w, x_scale, w_scale, w_layout=w_layout)
    n8 = wt.shape[0]
    check_workspace(name, _ffi.workspace_need(stem, p, m=m, n=n8),
                    f"its [{_owner_rows(stem, m, p)}, {n8}] bf16 accumulation buffer")
    out_vma = None
    if stem == "gemm_ar_fp8":
        out_vma = (_ffi.vma(x) | _ffi.vma(wt) | _ffi.vma(xs) | _ffi.vma(ws)) - {axis_name}
    y = _ffi.call(target, jax.ShapeDtypeStruct((rows, n8), jnp.bfloat16), x, wt, xs, ws,
                  _backend.rank_operand(axis_name), out_vma=out_vma,
                  comm_id=np.int64(state.comm_id(axis_name)),
                  config=np.int64(_mm.fp8_tile_config(m, n8, blockwise)),
                  group_m=np.int64(_mm._GROUP_M))
    return y[:, :n] if n8 != n else y


def _owner_rows(stem: str, m: int, p: int) -> int:
    return -(-m // p) if stem == "gemm_ar_fp8" else m // p

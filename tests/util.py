"""Helpers shared by the tests: meshes of host devices and running a function under
jit(shard_map(...))."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import pk_jax as pk

WORLD_SIZES = (1, 2, 3, 4, 8)
FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MATMUL_DTYPES = (jnp.bfloat16, jnp.float16)


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...], *, explicit: bool = True):
    """A mesh of host devices; explicit axes (jax.make_mesh's default) or Auto axes."""
    n = int(np.prod(shape))
    types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
    return jax.make_mesh(shape, names, devices=jax.devices("cpu")[:n], axis_types=types)


def run(fn, mesh, in_specs, out_specs, *args, check_vma: bool = True, init: bool = True):
    """Runs fn under jit(shard_map) on `mesh`, placing the args with their in_specs first."""
    if init:
        pk.init(mesh)
    in_specs = tuple(in_specs)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
    f = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                      check_vma=check_vma)
    return jax.jit(f)(*placed)


def rand(key, shape, dtype, *, integer: bool = False):
    """Random normal values, or small integers (exact sums) when `integer`."""
    if integer:
        return jax.random.randint(key, shape, -4, 5).astype(dtype)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def tol(dtype) -> dict:
    """assert_allclose tolerances for a result computed in `dtype`."""
    return {jnp.dtype(jnp.bfloat16): {"rtol": 2e-2, "atol": 2e-2},
            jnp.dtype(jnp.float16): {"rtol": 2e-3, "atol": 2e-3},
            jnp.dtype(jnp.float32): {"rtol": 1e-5, "atol": 1e-5}}.get(jnp.dtype(dtype),
                                                                     {"rtol": 0, "atol": 0})


def assert_close(actual, expected, dtype=None):
    dtype = dtype or actual.dtype
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                               **tol(dtype))


def product(*axes):
    return list(itertools.product(*axes))


__all__ = [
    "FLOAT_DTYPES",
    "MATMUL_DTYPES",
    "WORLD_SIZES",
    "P",
    "assert_close",
    "assert_same",
    "check_grads_sharded",
    "collective_vjp_test",
    "cpu_mesh",
    "product",
    "rand",
    "run",
    "small_ints",
    "tol",
    "tp_blocks_sum_model",
    "vjp_both",
    "vjp_equals_model",
]


def small_ints(key, shape, dtype, *, lo: int = -2, hi: int = 2):
    """Integers in [lo, hi]: products and sums of a few dozen of them stay exact in bf16."""
    return jax.random.randint(key, shape, lo, hi + 1).astype(dtype)


def vjp_both(fn, ref, mesh, in_specs, out_spec, args, dy, *, check_vma: bool = True,
             init: bool = True):
    """Runs fn and ref with their VJPs in one jit(shard_map) and returns both results.

    The cotangent `dy` is placed with `out_spec` (and cast to the output's varying axes). Inside
    the trace it asserts that fn's output and cotangents have the varying axes of ref's, and
    that each cotangent has the varying axes of its primal.

    Returns:
        ((y, *grads) of fn, (y, *grads) of ref), as global arrays.
    """
    from pk_jax import _ffi
    from pk_jax.ops import _vjp

    n = len(args)

    def body(*a):
        xs, g = a[:n], a[n]
        y, pull = jax.vjp(fn, *xs)
        yr, pullr = jax.vjp(ref, *xs)
        assert _ffi.vma(y) == _ffi.vma(yr), (_ffi.vma(y), _ffi.vma(yr))
        assert y.dtype == yr.dtype and y.shape == yr.shape, (y, yr)
        grads = pull(_vjp.vary(g.astype(y.dtype), _ffi.vma(y)))
        gradsr = pullr(_vjp.vary(g.astype(yr.dtype), _ffi.vma(yr)))
        for x, d, dr in zip(xs, grads, gradsr):
            assert _ffi.vma(d) == _ffi.vma(dr) == _ffi.vma(x), (_ffi.vma(d), _ffi.vma(dr),
                                                                _ffi.vma(x))
            assert d.dtype == x.dtype and d.shape == x.shape, (d, x)
        return (y, *grads, yr, *gradsr)

    specs = tuple(in_specs)
    outs = run(body, mesh, specs + (out_spec,), (out_spec, *specs) * 2, *args, dy,
               check_vma=check_vma, init=init)
    return outs[:n + 1], outs[n + 1:]


def vjp_equals_model(fn, lax_formula, mesh, in_specs, out_spec, args, dy, want, *,
                     check_vma: bool = True) -> None:
    """fn's value and VJP under jit(shard_map) equal `want` = (y, *grads), global arrays of an
    independent numpy model, bit for bit; so do those of `lax_formula`, the same op written in
    plain jax.lax (no pk code), whose varying axes fn's must match (vjp_both checks them).

    NOTES: with check_vma=False JAX transposes each collective device by device (psum's
    transpose is psum, and an input replicated by its in_spec takes device 0's cotangent), so
    the gradients are not the global function's derivative that the model gives: there fn's
    gradients are compared with JAX's AD of `lax_formula` only (the values with the model)."""
    ours, lax_ = vjp_both(fn, lax_formula, mesh, in_specs, out_spec, args, dy,
                          check_vma=check_vma)
    if not check_vma:
        want = (want[0],) + (None,) * (len(want) - 1)
    names = ["y"] + [f"grad {i}" for i in range(len(args))]
    assert len(ours) == len(lax_) == len(want) == len(names)
    for name, a, b, w in zip(names, ours, lax_, want):
        if w is None:
            assert_same(a, b)
            continue
        assert a.shape == np.shape(w), (name, a.shape, np.shape(w))
        assert_same(a, w)
        assert_same(b, w)


def collective_vjp_test(kinds, case, keys, fn, lax_formula, model):
    """A pytest test (assign it to a test_ name) of a collective's value and VJP against its
    numpy model, through vjp_equals_model: every kind with check_vma on and off on explicit
    axes, "2d" on Auto axes, and the kernel path (its custom VJP, lax stand-ins for the FFI
    calls) on explicit axes. case(kind) gives (mesh, in_spec, out_spec, x shape, y shape),
    model(kind, x, dy) the global (y, dx) in numpy."""
    import pytest

    both = list(itertools.product(kinds, (True, False)))
    params = ([(k, c, True, "reference") for k, c in both]
              + [("2d", c, False, "reference") for c in (True, False)]
              + [(k, c, True, "kernel") for k, c in both])

    @pytest.mark.parametrize("kind,check_vma,explicit,path", params)
    def test(monkeypatch, kind, check_vma, explicit, path):
        if path == "kernel":
            stand_in_kernels(monkeypatch)
        mesh, in_spec, out_spec, xs, ys = case(kind)
        if not explicit:
            mesh = cpu_mesh(mesh.devices.shape, mesh.axis_names, explicit=False)
        x, dy = small_ints(keys[0], xs, jnp.float32), small_ints(keys[1], ys, jnp.float32)
        vjp_equals_model(fn, lax_formula, mesh, (in_spec,), out_spec, (x,), dy,
                         model(kind, x, dy), check_vma=check_vma)

    return test


def tp_blocks_sum_model(kind, x, dy):
    """(y, dx) in numpy of a sum over the 4 tp row blocks of x (all_reduce to a replicated
    output, or reduce_scatter: rank r keeps rows r of the sum, so globally y is the sum): a
    replicated x ("invariant") gives 4 x; every block gets the cotangent back."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    if kind == "invariant":
        return 4 * x, 4 * dy
    return x.reshape(4, -1, x.shape[1]).sum(0), np.tile(dy, (4, 1))


def assert_same(actual, expected):
    """Bit-for-bit equality (as float32 for bf16/fp16)."""
    if jnp.issubdtype(actual.dtype, jnp.floating):
        actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


def check_grads_sharded(fn, mesh, in_specs, out_spec, args, *, check_vma: bool = True):
    """jax.test_util.check_grads (reverse mode, order 1) of jit(shard_map(fn)) on global args."""
    from jax.sharding import NamedSharding
    from jax.test_util import check_grads

    pk.init(mesh)
    in_specs = tuple(in_specs)
    shardings = [NamedSharding(mesh, s) for s in in_specs]
    g = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                              check_vma=check_vma))

    def f(*a):  # check_grads perturbs the inputs with unsharded arrays: place them again
        return g(*(jax.device_put(x, s) for x, s in zip(a, shardings)))

    check_grads(f, args, order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def grads_match_from_outside_shard_map(op, reference, case, keys, *, check_vma: bool):
    """jax.grad of a global loss through jit(shard_map(op)), whose transpose traces op's custom
    VJP, equals the same through `reference` bit for bit. case: (mesh, in_specs, out_spec, x
    shape, w shape, ...) of a TP GEMM over axis "tp"; keys: two PRNG keys for x and w."""
    mesh, in_specs, out_spec, xs, ws = case[:5]
    x, w = rand(keys[0], xs, jnp.float32), rand(keys[1], ws, jnp.float32)
    pk.init(mesh)
    x, w = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), in_specs))
    grads = []
    for fn in (op, reference):
        g = jax.shard_map(lambda a, b, fn=fn: fn(a, b, "tp"), mesh=mesh, in_specs=in_specs,
                          out_specs=out_spec, check_vma=check_vma)
        grads.append(jax.jit(jax.grad(lambda a, b, g=g: jnp.sum(jnp.sin(g(a, b))), (0, 1)))(x, w))
    for a, b in zip(*grads):
        assert_same(a, b)


def assert_error_within_xla(actual, xla_same_dtype, exact, *, atol: float = 1e-3):
    """The project's tolerance: max |actual - exact| <= 2 * max |xla - exact| + atol, where `xla` is
    XLA's own computation in the same dtype and `exact` a float64/float32 result."""
    exact = np.asarray(exact, np.float64)
    err = np.max(np.abs(np.asarray(actual, np.float64) - exact))
    err_xla = np.max(np.abs(np.asarray(xla_same_dtype, np.float64) - exact))
    assert err <= 2 * err_xla + atol, f"error {err} > 2 * {err_xla} (XLA's) + {atol}"


def gpu_mesh(stem: str, workspace_bytes: int | None = None):
    """A 1-device ("tp",) mesh on the first GPU, pk.init'ed; asserts op `stem` runs its kernel."""
    mesh = jax.make_mesh((1,), ("tp",), devices=jax.devices("gpu")[:1])
    pk.init(mesh, workspace_bytes=workspace_bytes)
    assert pk.backend_name(stem, "tp") == "cuda"
    return mesh


def poison(shape, dtype) -> None:
    """Fills fresh device memory of this size with NaN, so that an output the kernel forgets to
    write shows up (XLA is likely to hand the same memory to the next call's output)."""
    jax.block_until_ready(jnp.full(shape, jnp.nan, dtype))


def run_twice(f, out_shape, out_dtype, *args):
    """Two calls in a row of f(*args), each after poisoning fresh memory of the output's size:
    the first output fully written (no NaN), the second bit for bit the first; returns it as
    float64."""
    outs = []
    for _ in range(2):
        poison(out_shape, out_dtype)
        outs.append(np.asarray(jax.block_until_ready(f(*args)), np.float64))
    assert not np.isnan(outs[0]).any(), "output not fully written"
    np.testing.assert_array_equal(outs[0], outs[1])
    return outs[0]


def check_gemm_p1(call, exact_fn, shape, dtype, *, integers: bool) -> None:
    """Two calls in a row of a P = 1 GEMM op on the GPU, y = call(x, w) or (y, gathered x):
    random normal inputs within XLA's error, or small integers exactly (fp32 sums of integers
    are exact, and their one rounding to the dtype matches numpy's). A gathered x must be x."""
    m, k, n = shape
    for i in range(2):  # the second call finds the epochs, flags and buffers of the first
        if integers:
            kx, kw = jax.random.split(jax.random.key(7 + i))
            x, w = small_ints(kx, (m, k), dtype), small_ints(kw, (k, n), dtype)
        else:
            kx, kw = jax.random.split(jax.random.key(100 * i + k))
            x, w = rand(kx, (m, k), dtype), rand(kw, (k, n), dtype)
        out = call(x, w)
        y, gathered = out if isinstance(out, tuple) else (out, None)
        if gathered is not None:
            assert_same(gathered, x)
        if integers:
            assert_same(y, jnp.asarray(exact_fn(x, w)).astype(dtype))
            continue
        assert y.shape == (m, n) and y.dtype == dtype
        assert not bool(jnp.any(jnp.isnan(y))), "output not fully written"
        xla = jax.jit(lambda a, b: a @ b)(x, w)
        assert_error_within_xla(y, xla, exact_fn(x, w), atol=1e-3 * np.sqrt(k))


def stand_in_kernels(monkeypatch) -> list[dict]:
    """Makes the collectives take their CUDA path on CPU, with `jax.lax` stand-ins for the FFI
    calls: pk_jax's own wiring (kernel choice, custom VJPs, varying-axes typing, the comm id
    each call passes) then runs and can be checked. The stand-in finds the axis to reduce over
    from the comm_id attribute alone, as a handler does.

    Returns:
        A list that receives {"target", "comm_id", "axis", **attributes} per FFI call traced.
    """
    from pk_jax import _backend, _ffi
    from pk_jax.runtime import state

    calls: list[dict] = []

    def axis_of(comm_id: int) -> str:
        names = [key[-1] for key, cid in state._comm_ids.items() if cid == comm_id]
        assert len(names) == 1, f"comm_id {comm_id} names {names}"
        return names[0]

    def fake_call(target, results, *args, out_vma=None, **attrs):
        if target == "pk_matmul":  # local: no communicator; varies as its operands do
            calls.append({"target": target})
            x, w = args[:2]
            return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(results.dtype)
        axis = axis_of(int(attrs["comm_id"]))
        calls.append({"target": target, "axis": axis, **{k: int(v) for k, v in attrs.items()}})
        if target == "pk_ag_gemm_fp8":
            return _stand_in_ag_gemm_fp8(args, results, axis)
        x, shape = args[0], results.shape
        dim = next((i for i, (a, b) in enumerate(zip(x.shape, shape)) if a != b), 0)
        if target == "pk_all_reduce":
            y = jax.lax.psum(x, axis)
        elif target == "pk_all_gather":
            y = jax.lax.all_gather(x, axis, axis=dim, tiled=True)
        elif target == "pk_reduce_scatter":
            y = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
        elif target == "pk_all_to_all":  # split where the result shrinks, concat where it grows
            split = next(i for i, (a, b) in enumerate(zip(x.shape, shape)) if a > b)
            concat = next(i for i, (a, b) in enumerate(zip(x.shape, shape)) if a < b)
            y = jax.lax.all_to_all(x, axis, split, concat, tiled=True)
        else:
            raise NotImplementedError(target)
        assert y.shape == shape, (target, y.shape, shape)
        if out_vma is not None:
            y = _ffi._pcast_to(y, frozenset(out_vma))
        return y

    monkeypatch.setattr(_ffi, "call", fake_call)
    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    return calls


def _stand_in_ag_gemm_fp8(args, results, axis: str):
    """pk_ag_gemm_fp8 (ffi/ag_gemm_fp8.cu) from its operands as the handler takes them: x
    [Mp, K] fp8, wt [N8, K], x and w scales (scalars, or blockwise x's transposed [KB, >= Mp]
    and w's [KB, >= NB]); returns (y, x_full, xs_full) with the results' shapes, y from the
    gathered rows dequantized by their owners' scales."""
    from pk_jax.ops import matmul

    x, wt, xs, ws = args[:4]
    mp = x.shape[0]
    x_full = jax.lax.all_gather(x, axis, axis=0, tiled=True)
    if xs.ndim == 2:
        xs_full = jax.lax.all_gather(xs[:, :mp], axis, axis=1, tiled=True)
        nb = -(-wt.shape[0] // 128)
        y = matmul.fp8_reference(x_full, wt.T, xs_full.T, ws[:, :nb], jnp.bfloat16)
    else:
        xs_full = jax.lax.all_gather(xs.reshape(1), axis, axis=0, tiled=True)
        rows = jnp.repeat(xs_full, mp)[:, None] * x_full.astype(jnp.float32)
        y = (jnp.dot(rows, wt.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
             * ws).astype(jnp.bfloat16)
    out = (y, x_full, xs_full)
    for a, want in zip(out, results):
        assert a.shape == want.shape and a.dtype == want.dtype, (a.shape, want)
    return out


def _stand_in_masks(call: dict, attrs: dict, extra, b: int, s: int) -> dict:
    """The masks of a pk_attention call from its attributes and its operands after the pass's
    own (ffi/attention.cu: q_len, kv_len [B] int32 and, with segments, q_seg, kv_seg [B, SP],
    q_info, kv_info [B, SP / 64, 4]), checked as the handler checks them, as keyword arguments
    of the blockwise reference (masks, window, softcap); records them in `call` ("masked",
    "window", "soft_cap", "segments", "q_len", "kv_len", "q_seg", "kv_seg": the traced
    operands)."""
    from pk_jax.ops import _attention

    masked = int(attrs.get("masked", 0))
    call["masked"] = masked
    if not masked:
        assert not extra, "an unmasked pk_attention call takes no mask operands"
        return {"masks": _attention.NO_MASKS, "window": None, "softcap": None}
    segments = int(attrs["segments"])
    sp = -(-s // 128) * 128
    want = [(b,), (b,)] + ([(b, sp), (b, sp), (b, sp // 64, 4), (b, sp // 64, 4)]
                           if segments else [])
    assert [tuple(x.shape) for x in extra] == want and all(x.dtype == jnp.int32 for x in extra)
    left, right = int(attrs["window_left"]), int(attrs["window_right"])
    assert 0 <= left <= s and 0 <= right <= s
    cap = float(attrs["soft_cap"])
    q_seg, kv_seg = (extra[2][:, :s], extra[3][:, :s]) if segments else (None, None)
    call.update(window=(left, right), soft_cap=cap, segments=segments, q_len=extra[0],
                kv_len=extra[1], q_seg=q_seg, kv_seg=kv_seg)
    return {"masks": _attention.Masks(q_seg, kv_seg, extra[0], extra[1]),
            "window": (left, right), "softcap": cap if cap > 0 else None}


def stand_in_attention_call(calls, results, *args, **attrs):
    """What a pk_attention FFI call returns, from the blockwise reference, K/V heads read in
    place (GQA); appends {"target", "backward", "h", "hkv", "s", "scale", "causal"} (and "sp"
    for the backward) to `calls`.

    Forward (backward=0; q, k, v): o in q's dtype and lse float32 [B, H, S]. Backward
    (backward=1; q, k, v, do, lse, delta with lse and delta [B, H, SP], padded past S with
    +inf and 0): dq, dk, dv in the operands' dtypes and the float32 dq scratch."""
    from pk_jax.ops import _attention

    q, k, v = args[:3]
    b, s, h, d = q.shape
    hkv = k.shape[2]
    scale, causal = float(attrs["scale"]), bool(attrs["causal"])
    call = {"target": "pk_attention", "backward": int(attrs["backward"]), "h": h, "hkv": hkv,
            "s": s, "scale": scale, "causal": int(causal)}
    calls.append(call)
    own = 6 if call["backward"] else 3
    mkw = _stand_in_masks(call, attrs, args[own:], b, s)
    kr, vr = _attention.repeat_kv(q, k, v)
    if not call["backward"]:
        out, res = _attention._masked_forward(q, kr, vr, mkw["masks"], scale, causal,
                                              mkw["window"], mkw["softcap"])
        lse = res[4].transpose(0, 2, 1)
        assert out.shape == results[0].shape and lse.shape == results[1].shape == (b, h, s)
        return out.astype(results[0].dtype), lse
    do, lse, delta = args[3:6]
    sp = call["sp"] = lse.shape[2]
    assert sp % 128 == 0 and s <= sp < s + 128 and delta.shape == lse.shape == (b, h, sp)
    assert do.dtype == q.dtype and lse.dtype == delta.dtype == jnp.float32
    dq, dk, dv = _attention.blockwise_grads(
        q, kr, vr, do.astype(jnp.float32), lse[:, :, :s].transpose(0, 2, 1),
        delta[:, :, :s].transpose(0, 2, 1), scale=scale, causal=causal, **mkw)
    dk, dv = (g.reshape(b, s, hkv, h // hkv, d).sum(axis=3) for g in (dk, dv))
    out = [g.astype(r.dtype) for g, r in zip((dq, dk, dv), results)]
    assert all(g.shape == r.shape for g, r in zip(out, results))
    # The one-pass kernel's fourth result: its float32 dq scratch (not used by the caller).
    assert len(results) == 4 and results[3].shape == q.shape and results[3].dtype == jnp.float32
    return out + [jnp.zeros(q.shape, jnp.float32)]


def stand_in_attention(monkeypatch) -> list[dict]:
    """stand_in_kernels plus `stand_in_attention_call` for pk_attention (the pk.attention
    kernels' forward and backward); other targets go to stand_in_kernels' stand-ins.

    Returns:
        The list of traced calls, as stand_in_kernels'.
    """
    from pk_jax import _ffi

    calls = stand_in_kernels(monkeypatch)
    inner = _ffi.call

    def fake(target, results, *args, out_vma=None, **attrs):
        if target == "pk_attention":
            return stand_in_attention_call(calls, results, *args, **attrs)
        return inner(target, results, *args, out_vma=out_vma, **attrs)

    monkeypatch.setattr(_ffi, "call", fake)
    return calls

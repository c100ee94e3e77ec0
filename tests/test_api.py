"""The public API as a whole: every op has its test file, every FFI target its test and
benchmark, and the package imports and registers cleanly."""

import inspect
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import pk_jax as pk
from pk_jax import _ffi, _op_table

ROOT = pathlib.Path(__file__).resolve().parent.parent
PUBLIC_OPS = {  # the API table of README.md
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "matmul",
    "gemm_reduce_scatter", "all_gather_gemm", "gemm_all_reduce", "ring_attention",
    "ulysses_attention", "grouped_matmul", "moe_dispatch", "moe_combine",
    "moe_dispatch_gemm", "moe_gemm_combine", "attention",
}


def _ops():
    for name in pk.__all__:
        obj = getattr(pk, name)
        if inspect.isfunction(obj) and obj.__module__.startswith("pk_jax.ops."):
            yield name, obj.__module__.rsplit(".", 1)[1]


def test_every_design_op_is_exported():
    assert PUBLIC_OPS <= {name for name, _ in _ops()}


@pytest.mark.parametrize("name,stem", sorted(_ops()))
def test_every_op_has_a_test_file_that_calls_it(name, stem):
    path = ROOT / "tests" / f"test_{stem}.py"
    assert path.exists(), f"pk.{name} (pk_jax/ops/{stem}.py) has no {path.name}"
    assert name in path.read_text(), f"{path.name} never calls pk.{name}"


@pytest.mark.parametrize("name,stem", sorted(_ops()))
def test_every_op_has_a_docstring_with_raises(name, stem):
    doc = getattr(pk, name).__doc__ or ""
    assert "Args:" in doc and "Returns:" in doc and "Raises:" in doc, name


# Each target's files carry the name of its op family (the op table: pk_jax/ops/moe.py,
# ffi/moe.cu for moe_scatter, ...).
FILE_STEM = {name: op["family"] for name, op in _op_table.OPS.items()}


@pytest.mark.needs_ext
def test_every_ffi_target_has_a_test_and_a_benchmark():
    stems = {FILE_STEM.get(name.removeprefix("pk_"), name.removeprefix("pk_"))
             for name, _, _ in _ffi.registrations()}
    assert "ping" in stems
    for stem in stems:
        assert (ROOT / "tests" / f"test_{stem}.py").exists(), f"pk_{stem} has no test file"
        assert (ROOT / "bench" / f"bench_{stem}.py").exists(), f"pk_{stem} has no benchmark"


@pytest.mark.needs_ext
def test_every_cuda_target_has_a_kernel_and_a_handler_file():
    for name in _ffi.targets("CUDA"):
        stem = FILE_STEM.get(name.removeprefix("pk_"), name.removeprefix("pk_"))
        assert (ROOT / "ffi" / f"{stem}.cu").exists(), name
        assert (ROOT / "cuda" / "kernels" / f"{stem}.cuh").exists(), name


def test_import_without_mesh_and_backend_names():
    assert pk.backend_name() == "reference"
    assert isinstance(pk.HAS_CUDA, bool)


def test_backend_name_takes_the_public_op_names():
    """Every public op name (and the short stems, e.g. "gemm_rs"), on CPU: "reference"; an
    unknown name raises, listing the known ones."""
    from pk_jax import _backend

    assert set(_backend.OP_STEMS) == PUBLIC_OPS
    pk.init(jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2]))
    for name in sorted(PUBLIC_OPS) + ["gemm_rs", "ag_gemm", "gemm_ar", "ring_attn"]:
        assert pk.backend_name(name) == "reference", name
        assert pk.backend_name(name, "tp") == "reference", name
    for bad in ("gemm_reduce", "reference", "", "pk_matmul", "Attention"):
        with pytest.raises(ValueError, match=f"unknown op {bad!r}; the ops are all_gather, "
                                             "all_gather_gemm, .*gemm_reduce_scatter"):
            pk.backend_name(bad)
    with pytest.raises(TypeError, match="op must be an op name"):
        pk.backend_name(None)


@pytest.mark.needs_ext
def test_backend_name_stems_are_ffi_targets():
    from pk_jax import _backend

    targets = _ffi.targets("CUDA")
    for name, stem in _backend.OP_STEMS.items():
        assert f"pk_{stem}" in targets, (name, stem)


def test_backend_env_is_checked(monkeypatch):
    monkeypatch.setenv("PK_JAX_BACKEND", "fast")
    with pytest.raises(ValueError, match="PK_JAX_BACKEND"):
        from pk_jax import _backend
        _backend.requested()


@pytest.mark.parametrize("env,size,want", [("0", 1, False), ("1", 1, True), ("0", 2, True)])
def test_collectives_skip_the_kernel_on_a_one_device_axis(monkeypatch, env, size, want):
    from pk_jax import _backend
    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    monkeypatch.setenv("PK_JAX_SINGLE_DEVICE_KERNELS", env)
    mesh = jax.make_mesh((size,), ("x",), devices=jax.devices()[:size],
                         axis_types=(jax.sharding.AxisType.Auto,))
    got = []
    jax.shard_map(lambda a: got.append(_backend.route("all_reduce", "x").path) or a,
                  mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.zeros(size))
    assert got == ["kernel" if want else "reference"]

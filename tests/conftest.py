"""pytest setup: 8 host devices for the CPU tests, and the only place where tests are skipped."""

import importlib.metadata
import os
import pathlib

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# The GPU tests run the collective kernels on one GPU too (where users get XLA's no-op).
os.environ.setdefault("PK_JAX_SINGLE_DEVICE_KERNELS", "1")

import jax
import pytest

import pk_jax


def _hopper_gpus() -> list:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return []
    return [d for d in gpus if getattr(d, "compute_capability", "") == "9.0"]


HAS_HOPPER = bool(_hopper_gpus()) and pk_jax.HAS_CUDA

ALLOW_NO_EXTENSION = "PK_JAX_TEST_WITHOUT_EXTENSION"


def built_extensions(package_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compiled pk_jax modules that exist but are not the package under test: in the installed
    distribution (when the tests import another copy, e.g. the source tree) and under build/."""
    found = []
    try:
        dist = importlib.metadata.distribution("pk_jax")
        for f in dist.files or ():
            if f.name.startswith("_pk_ffi") and f.suffix in (".so", ".pyd"):
                path = pathlib.Path(dist.locate_file(f)).resolve()
                if path.exists() and path.parent != package_dir:
                    found.append(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    found += sorted((package_dir.parent / "build").glob("*/**/_pk_ffi*.so"))
    found += sorted(package_dir.glob("_pk_ffi*.so"))  # there, but it did not import
    return found


def extension_problem(has_cuda: bool, package_dir: pathlib.Path, import_error) -> str:
    """Why this run would test pk_jax without its extension while one is built ("" if not)."""
    if has_cuda or os.environ.get(ALLOW_NO_EXTENSION) == "1":
        return ""
    built = built_extensions(package_dir)
    if not built:
        return ""
    return (
        f"the tests import pk_jax from {package_dir}, which has no working CUDA extension "
        f"({import_error}), but a built one exists: {built[0]}. Run the installed build with "
        "`.venv/bin/pytest tests` (or `make test`) instead of `python -m pytest` from the "
        "repository root, which puts the source tree first; or reinstall (`make setup`). Set "
        f"{ALLOW_NO_EXTENSION}=1 to test the pure-Python package anyway."
    )


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an sm_90 GPU and the pk_jax CUDA extension")
    skip_ext = pytest.mark.skip(reason="needs the compiled pk_jax extension")
    for item in items:
        if "gpu" in item.keywords and not HAS_HOPPER:
            item.add_marker(skip_gpu)
        if "needs_ext" in item.keywords and not pk_jax.HAS_CUDA:
            item.add_marker(skip_ext)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_ext: needs the compiled extension (any platform)")
    problem = extension_problem(pk_jax.HAS_CUDA, pathlib.Path(pk_jax.__file__).resolve().parent,
                                pk_jax._ffi.IMPORT_ERROR)
    if problem:
        raise pytest.UsageError(f"pk_jax tests: {problem}")


@pytest.fixture(autouse=True)
def _fresh_pk_state():
    """Every test starts and ends without a mesh registered with pk_jax."""
    pk_jax.shutdown()
    yield
    pk_jax.shutdown()
